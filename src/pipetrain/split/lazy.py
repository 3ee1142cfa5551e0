"""Lazy layers: build or materialise only this rank's layers, deterministically per layer.

A model too big for one process is described, not built: as a list of :class:`LayerSpec`
(a class and its arguments) or as modules created on the ``meta`` device. The pipeline then
materialises only the layers of its own stages. Each layer is initialised under its own seed,
``seed * 1_000_003 + index``, so a rank's parameters equal those of the whole model built with
:func:`build_layers` (or :func:`materialize` on every layer) from the same seed, whatever the
number of ranks or stages.

An ordinary module cut by capture (``split_points=``) has no layer list to number, so its
parts are initialised by name instead (:class:`NamedInit`): every submodule with
``reset_parameters()`` runs it under a seed made from its qualified name in the model, and a
parameter shared by several submodules (a tied embedding and head) takes the value its first
owner gives it, on every rank that holds it. A Hugging Face model is initialised through its
own ``_init_weights(module)`` instead, which also fills buffers such as rotary tables.
``Pipeline(meta_model, split_points=...,
init_seed=s)`` materialises each rank's stages this way (:mod:`pipetrain.split.layers`); the
single-device reference is ``NamedInit(meta_model, s).materialize(meta_model, device)``.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from pipetrain.runtime.torch_private import buffers_dict, parameters_dict

__all__ = ["LayerSpec", "NamedInit", "build_layers", "materialize"]


def layer_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


@dataclass(frozen=True)
class LayerSpec:
    """A layer described by its factory and arguments: ``LayerSpec(nn.Linear, 512, 512)``."""

    factory: Callable[..., nn.Module]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, factory: Callable[..., nn.Module], *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "factory", factory)
        object.__setattr__(self, "args", args)
        object.__setattr__(self, "kwargs", kwargs)

    def build(self, index: int, seed: int, device: torch.device | str = "cpu") -> nn.Module:
        """The layer at position ``index``, initialised under its per-layer seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, index))
            with torch.device(device):
                layer = self.factory(*self.args, **self.kwargs)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"LayerSpec factory {self.factory!r} returned a "
                            f"{type(layer).__name__}, not an nn.Module")
        return layer


def is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def materialize(layer: nn.Module, index: int, seed: int,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a ``meta`` layer real storage on ``device`` and initialise it under its seed.

    Every submodule with ``reset_parameters()`` is re-initialised, in module order.

    Raises:
        ValueError: when a parameter is left uninitialised (no ``reset_parameters`` covers it).
    """
    layer = layer.to_empty(device=device)
    covered: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, index))
        for module in layer.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
                covered.update(id(p) for p in module.parameters())
    missing = [n for n, p in layer.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(f"layer {index}: parameters {missing} were built on the meta device but "
                         "no reset_parameters() initialises them; give their module a "
                         "reset_parameters() or use LayerSpec")
    return layer


def build_layers(layers: Sequence[nn.Module | LayerSpec], seed: int,
                 device: torch.device | str = "cpu") -> list[nn.Module]:
    """The whole model as the pipeline would build it: the single-device reference."""
    return [build_layer(layer, i, seed, device) for i, layer in enumerate(layers)]


def build_layer(layer: nn.Module | LayerSpec, index: int, seed: int,
            device: torch.device | str) -> nn.Module:
    """A real module for ``layer``: built from a spec, materialised from meta, or as given."""
    if isinstance(layer, LayerSpec):
        return layer.build(index, seed, device)
    if is_meta(layer):
        return materialize(layer, index, seed, device)
    return layer


def name_seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + zlib.crc32(name.encode())


class NamedInit:
    """Materialise parts of a ``meta`` model so they equal the whole model built at once.

    Args:
        model: the model, built on the ``meta`` device (parts may share its submodules, as
            the stages of :func:`pipetrain.split.trace.split_model` do).
        seed: the initialisation seed.

    ``NamedInit(model, seed).materialize(model, device)`` builds the whole model (the
    single-device reference); ``materialize(part, device)`` builds any part, with the same
    values. Parameters keep their sharing within the process (one tensor for a tied weight).
    """

    def __init__(self, model: nn.Module, seed: int) -> None:
        self.model, self.seed = model, seed
        holders: dict[int, list[tuple[str, str]]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False):
                holders.setdefault(id(p), []).append((path, pname))
        self._alive: list[torch.Tensor] = list(model.parameters())  # ids stay theirs
        self.owner = {pid: paths[0] for pid, paths in holders.items() if len(paths) > 1}
        """Shared meta parameters -> (first owning module, its name there)."""
        self._held = {pid: paths[0] for pid, paths in holders.items()}
        """Meta parameters -> (the first module holding it directly, its name there)."""
        self._real: dict[int, torch.Tensor] = {}  # meta id -> the real one in this process
        self._meta_of: dict[int, int] = {}  # real id -> meta id
        hf_init = getattr(model, "_init_weights", None)
        self._hf_init: Callable[[nn.Module], None] | None = (
            hf_init if callable(hf_init) and hasattr(model, "config") else None)
        """A Hugging Face model initialises each module through the model's own
        ``_init_weights(module)`` (parameters and buffers such as rotary tables); others run
        each module's ``reset_parameters()``."""
        self._init_of: dict[int, Callable[[nn.Module], None]] = {}
        """Per module of a Hugging Face model: the ``_init_weights`` of the nearest model that
        holds it (itself included), as transformers initialises a composite model (an
        image-text model's CLIP tower by CLIP's own, which sets its position ids)."""
        if self._hf_init is not None:
            self._owners(model, self._hf_init)

    def materialize(self, part: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
        """Give ``part``'s meta parameters real, deterministic values on ``device``; in place.

        ``part``'s module paths must be the model's own (the whole model, or a stage of
        :func:`~pipetrain.split.trace.split_model`). Each model module at one of those paths whose
        ``reset_parameters()`` covers a parameter of ``part`` runs it, in the model's module
        order, under the seed of its path, also when capture copied only its parameters into a
        bare container (a module whose ``forward`` was captured through); its other parameters
        then become real too. Buffers still on ``meta`` get storage; only an initialiser gives
        them values. A Hugging Face model (one with ``config`` and ``_init_weights``) runs
        ``model._init_weights(module)`` instead, for every module whose parameters or buffers
        ``part`` holds, children before parents as ``model.apply`` does.

        Raises:
            ValueError: when a parameter is left uninitialised (no ``reset_parameters``).
        """
        wanted = {id(t) for t in (*part.parameters(), *part.buffers()) if t.is_meta}
        fresh = self._swap(part, torch.device(device))
        covered: set[int] = set()
        for path, module in self._resetters(part):
            if any(id(t) in wanted or self._meta_of.get(id(t)) in wanted
                   for t in self._initialised(module)):
                fresh |= self._swap(module, torch.device(device))
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(name_seed(self.seed, path))
                    self._reset(module)
                covered.update(id(p) for p in module.parameters())
        if self._hf_init is not None:
            covered |= self._direct(part, fresh - covered, self._hf_init)
        missing = [n for n, p in part.named_parameters() if id(p) in fresh - covered]
        if missing:
            raise ValueError(f"parameters {missing} were built on the meta device but no "
                             "reset_parameters() initialises them; give their module a "
                             "reset_parameters() or build the model for real")
        for p in part.parameters():  # a later holder's reset may have overwritten a shared one
            if self._meta_of.get(id(p)) in self.owner:
                with torch.no_grad():
                    p.copy_(self._owner_value(self._meta_of[id(p)], p.device))
        return part

    def _direct(self, part: nn.Module, left: set[int],
                init: Callable[[nn.Module], None]) -> set[int]:
        """Initialise the parameters among ``left`` (ids of ``part``'s real ones) that a model
        module holds directly but ``part`` holds in a container standing for none of the
        model's (:class:`~pipetrain.split.prefix_meta.Holder`: LLaVA-NeXT's ``image_newline``
        in an image-text model's prefix). Each module's ``_init_weights`` runs, under the seed of
        its path, on a stand-in holding only those parameters, so the whole module (its
        children, the language model among them) is never made real; the ids initialised."""
        done: set[int] = set()
        by_owner: dict[str, dict[str, nn.Parameter]] = {}
        for p in part.parameters():
            if id(p) in left and self._meta_of.get(id(p)) in self._held:
                path, name = self._held[self._meta_of[id(p)]]
                by_owner.setdefault(path, {})[name] = p
        for path, params in by_owner.items():
            module = self.model.get_submodule(path)
            stand = copy.copy(module)  # the same class and config, none of its tensors
            stand.__dict__.update(_parameters=dict(params), _buffers={}, _modules={})
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(name_seed(self.seed, path))
                self._init_of.get(id(module), init)(stand)
            done |= {id(p) for p in params.values()}
        return done

    def _initialised(self, module: nn.Module) -> list[torch.Tensor]:
        """What initialising ``module`` writes: its parameters (and buffers, for HF models)."""
        if self._hf_init is None:
            return list(module.parameters())
        return [*module.parameters(), *module.buffers()]

    def _owners(self, module: nn.Module, init: Callable[[nn.Module], None]) -> None:
        own = getattr(module, "_init_weights", None)
        if callable(own) and hasattr(module, "config"):
            init = own
        self._init_of[id(module)] = init
        for child in module.children():
            self._owners(child, init)

    def _reset(self, module: nn.Module) -> None:
        if self._hf_init is not None:
            self._init_of.get(id(module), self._hf_init)(module)
        else:
            module.reset_parameters()  # type: ignore[operator]

    def origin(self, p: torch.Tensor) -> int:
        """``id`` of the meta Parameter that ``p`` was made from here (``id(p)`` for others)."""
        return self._meta_of.get(id(p), id(p))

    def _resetters(self, part: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model's modules with ``reset_parameters()`` that ``part``'s modules stand for.

        A part's module stands for the model's module at its path when it is that module, or a
        bare container torch.fx made at that path (a plain ``nn.Module``, or the root of a
        ``GraphModule``) to hold what tracing copied from it.
        """
        own = dict(part.named_modules())
        found = []
        for path, module in self._model_order():
            mine = own.get(path)
            stands_for = mine is module or (
                mine is not None and (type(mine) is nn.Module or isinstance(mine, fx.GraphModule)))
            if stands_for and (self._hf_init is not None
                               or callable(getattr(module, "reset_parameters", None))):
                found.append((path, module))
        return found

    def _model_order(self) -> list[tuple[str, nn.Module]]:
        """The model's modules in the order their initialisers run: ``named_modules`` order,
        or for a Hugging Face model children before parents, as ``model.apply`` visits them
        (a parent's ``_init_weights`` may re-initialise its children's weights)."""
        if self._hf_init is None:
            return list(self.model.named_modules())
        order: list[tuple[str, nn.Module]] = []

        def visit(path: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                visit(f"{path}.{name}" if path else name, child)
            order.append((path, module))

        visit("", self.model)
        return order

    def _swap(self, part: nn.Module, device: torch.device) -> set[int]:
        """Replace meta parameters and buffers by real empty ones (one per meta tensor, shared
        by every module holding it); the ids of the new parameters."""
        fresh: set[int] = set()
        for module in part.modules():
            for name, p in list(parameters_dict(module).items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in self._real:
                    real = nn.Parameter(torch.empty_like(p, device=device),
                                        requires_grad=p.requires_grad)
                    self._keep(p, real)
                    fresh.add(id(real))
                parameters_dict(module)[name] = self._real[id(p)]  # type: ignore[assignment]
            for name, b in list(buffers_dict(module).items()):
                if b is not None and b.is_meta:
                    if id(b) not in self._real:
                        self._keep(b, torch.empty_like(b, device=device))
                    buffers_dict(module)[name] = self._real[id(b)]
        return fresh

    def _keep(self, meta: torch.Tensor, real: torch.Tensor) -> None:
        self._real[id(meta)], self._meta_of[id(real)] = real, id(meta)
        self._alive.append(meta)  # its id stays its own while the mapping lives

    def _owner_value(self, meta_id: int, device: torch.device) -> torch.Tensor:
        """A shared parameter as its first owner initialises it (built alone, then dropped)."""
        path, pname = self.owner[meta_id]
        alone = copy.deepcopy(self.model.get_submodule(path)).to_empty(device=device)
        if self._hf_init is None and not callable(getattr(alone, "reset_parameters", None)):
            raise ValueError(f"parameter {path}.{pname} is shared by several modules but its "
                             f"first owner {path!r} has no reset_parameters() to initialise it")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(name_seed(self.seed, path))
            self._reset(alone)
        return alone.get_parameter(pname).detach()
