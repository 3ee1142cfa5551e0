"""Layers: what a Pipeline cuts into stages, and how each rank makes only its own layers real.

A pipeline's layers are a layer list (an ``nn.Sequential`` or a list of modules and
:class:`~pipetrain.split.lazy.LayerSpec` s) or the stages of a traced model (``split_points=``).
Either may be described instead of built (specs, or modules created under
``torch.device("meta")``), and then a rank builds only the layers of the stages it hosts:

* a spec is built, and a meta layer of a list materialised, under its per-layer seed
  (:mod:`pipetrain.split.lazy`);
* a traced meta model is materialised by name (:class:`~pipetrain.split.lazy.NamedInit`), so each
  hosted parameter equals the same parameter of ``NamedInit(model, seed).materialize(model)``,
  the whole model built at once, and a tied weight is one Parameter again on a rank holding
  both its stages.

Two things depend on the identity of the model's Parameters, which materialising replaces, so
they are read before it: which parameters several stages share
(:func:`~pipetrain.runtime.tied.find_tied`)
and each parameter's name in the model (:meth:`Layers.names`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.split.capture import move_graph, on_model_device
from pipetrain.split.lazy import LayerSpec, NamedInit, build_layer, is_meta
from pipetrain.split.partition import named_layers
from pipetrain.split.prefix import Prefixed
from pipetrain.split.trace import TracedSplit

__all__: list[str] = []

Layer = tuple[str, nn.Module | LayerSpec]


class Layers:
    """The named layers of a pipeline and how a rank builds those of its own stages.

    Args:
        model: what ``Pipeline`` was given.
        traced: its traced stages, when ``split_points=`` was given.
        seed: the initialisation seed (``init_seed``).
    """

    def __init__(self, model: Any, traced: TracedSplit | None, seed: int) -> None:
        self.seed, self.traced = seed, traced is not None
        self._kept: set[str] = set()
        self.items: list[Layer] = (named_layers(model) if traced is None
                                   else [("", stage) for stage in traced.stages])
        self.by_name = NamedInit(model, seed) if traced is not None and is_meta(model) else None
        if traced is None:
            _check_meta_sharing(self.items)
        self._names = _first_names(self.items)  # before any Parameter is replaced
        if traced is not None:  # a tied weight under the name model.named_parameters() gives
            self._names.update({id(p): n for n, p in model.named_parameters()})
        self._buffers: dict[int, str] = {}  # a traced model's own buffers (not export's)
        self.persistent: set[str] | None = None
        if traced is not None:
            self._buffers = {id(b): n for n, b in model.named_buffers(remove_duplicate=False)}
            self.persistent = {n for n in model.state_dict(keep_vars=True)
                               if n in self._buffers.values()}
        # the keys are ids: keep their Parameters alive so that no new one reuses an id
        self._alive = [p for _, m in self.items if isinstance(m, nn.Module)
                       for p in m.parameters()] + ([] if traced is None else list(model.buffers()))

    def release(self) -> None:
        """Drop the references to every layer once the stages are built (names stay known)."""
        self.items, self._alive = [], []

    def build(self, layer: nn.Module | LayerSpec, index: int, device: torch.device) -> nn.Module:
        """``layer`` (at ``index``) as a real module on ``device``."""
        built: nn.Module
        if self.by_name is not None and isinstance(layer, Prefixed) and is_meta(layer):
            for part in (layer.prefix, layer.stage):  # each holds modules at the model's paths
                self.by_name.materialize(part, device)
            built = layer.to(device)
        elif self.by_name is not None and isinstance(layer, nn.Module) and is_meta(layer):
            built = self.by_name.materialize(layer, device).to(device)  # real buffers too
        else:
            built = build_layer(layer, index, self.seed, device).to(device)
        if self.traced:  # tensors the graph creates are created on the stage's device
            move_graph(built, device)
        return built

    def names(self, layers: Sequence[Layer]) -> dict[int, str]:
        """``id`` of each Parameter in ``layers`` -> its name in the model (first holder's)."""
        origin = self.by_name.origin if self.by_name is not None else id
        return {id(p): self._names[origin(p)] for _, m in layers if isinstance(m, nn.Module)
                for p in m.parameters() if origin(p) in self._names}


    def buffer_names(self, layers: Sequence[Layer]) -> dict[int, str]:
        """``id`` of each buffer of ``layers`` -> its name in the model.

        A layer list names them by layer (``"3.running_mean"``); a traced model's stages hold
        the model's own buffers under the model's names, and the tensor constants export made
        (which are not the model's, and are left out).
        """
        origin = self.by_name.origin if self.by_name is not None else id
        names: dict[int, str] = {}
        for layer_name, m in layers:
            if not isinstance(m, nn.Module):
                continue
            kept = set(m.state_dict(keep_vars=True)) if self.persistent is None else set()
            for bname, b in m.named_buffers(remove_duplicate=False):
                if self.persistent is not None:
                    if origin(b) in self._buffers:
                        names.setdefault(id(b), self._buffers[origin(b)])
                else:
                    name = f"{layer_name}.{bname}" if layer_name else bname
                    names.setdefault(id(b), name)
                    if bname in kept:
                        self._kept.add(name)
        return names

    def is_persistent(self, name: str) -> bool:
        """Whether buffer ``name`` belongs in a state dict (not a non-persistent one)."""
        return name in self._kept if self.persistent is None else name in self.persistent


def profiling_sample(modules: Sequence[nn.Module], mode: Any, sample: Any) -> Any:
    """The micro-batch a balance mode profiles ``modules`` on: None for meta layers.

    Meta layers have no values to run, so they are balanced by parameter bytes only.

    Raises:
        PartitionError: for meta layers under a mode other than ``"params"``.
    """
    meta = [i for i, m in enumerate(modules) if is_meta(m)]
    if not meta:
        return sample
    if mode != "params":
        raise PartitionError(
            f"balance={mode!r} profiles each layer by running it, but layers {meta[:8]} are on "
            "the meta device (no values to run); use balance='params' (parameter bytes, which "
            "meta layers have), an explicit balance=[...] or split_points=[...], or profile a "
            "smaller real model and pass its plan's balance")
    return None


def trace_stages(model: Any, split_points: Sequence[str] | str, example_inputs: Any,
                 balance: Any, n_stages: int, share: Any = None, dynamic: bool = True,
                 seed: int = 0, given: Any = None) -> TracedSplit:
    """The traced stages for ``Pipeline(model, split_points=..., example_inputs=...)``;
    ``share``: the pipeline's process group, whose rank 0 exports the model for all
    (:mod:`pipetrain.split.shared_capture`; None: this process captures); ``dynamic``: as
    :func:`~pipetrain.split.capture.capture`; ``seed`` (``init_seed``) and ``given`` (the
    example as the user gave it, before it was put on the model's device): what an
    image-text model on ``meta`` needs to run its vision prefix for real.

    Raises:
        TypeError: without one ``nn.Module`` and ``example_inputs``.
        PartitionError: for split points that do not make ``n_stages`` stages.
    """
    from pipetrain.split.autosplit import cut_points
    from pipetrain.split.capture import capture
    from pipetrain.split.check import check_capture
    from pipetrain.split.prefix import vision_prefix
    from pipetrain.split.shared_capture import capture_shared
    from pipetrain.split.trace import split_model, with_prefix

    if not isinstance(model, nn.Module):  # example_inputs= given: PipelineConfig
        raise TypeError("split_points= needs the model as one nn.Module (to cut a layer "
                        "list, leave split_points out)")
    if isinstance(split_points, str) and split_points != "auto":
        raise PartitionError(f"split_points={split_points!r}: give a list of module names, "
                             "or 'auto'")
    if split_points != "auto" and balance is None and len(split_points) + 1 != n_stages:
        raise PartitionError(f"{split_points!r} makes {len(split_points) + 1} stages but the "
                             f"schedule has {n_stages} (ranks x stages per rank); give "
                             f"{n_stages - 1} split points, or more with a balance= that "
                             "groups them, or 'auto'")
    if split_points != "auto" and len(split_points) + 1 < n_stages:
        raise PartitionError(f"{split_points!r} makes {len(split_points) + 1} units, fewer "
                             f"than the schedule's {n_stages} stages; give at least "
                             f"{n_stages - 1} split points")
    real = example_inputs if given is None or not is_meta(model) else given
    prefix = vision_prefix(model, real, seed)  # an image-text model: from its text on
    example = example_inputs if prefix is None else on_model_device(model, prefix.captured_with)
    captured = capture(model, example, dynamic) if share is None else \
        capture_shared(model, example, share, dynamic)
    if split_points == "auto":  # one small stage per unit; the balancer groups them
        split_points = cut_points(model, example, captured=captured)
    split = split_model(model, split_points, example, captured=captured)
    split = split if prefix is None else with_prefix(split, prefix, model)
    check_capture(model, split, example_inputs)
    return split


def packed(traced: TracedSplit, example: Any) -> Any:
    """Stage 0's payload for ``example_inputs`` (a tuple or dict of ``forward``'s arguments)."""
    return traced.pack(*example) if isinstance(example, tuple) else traced.pack(**example)


def _first_names(layers: Sequence[Layer]) -> dict[int, str]:
    """``id`` of each Parameter -> its name under the first layer holding it."""
    names: dict[int, str] = {}
    for layer_name, m in layers:
        if isinstance(m, nn.Module):
            for pname, p in m.named_parameters():
                names.setdefault(id(p), f"{layer_name}.{pname}" if layer_name else pname)
    return names


def _check_meta_sharing(layers: Sequence[Layer]) -> None:
    """A meta Parameter shared by two layers of a list would come apart, layer by layer.

    Raises:
        ValueError: naming the layers and the parameter.
    """
    holder: dict[int, tuple[str, str]] = {}
    for layer_name, m in layers:
        if not isinstance(m, nn.Module) or not is_meta(m):
            continue
        for pname, p in m.named_parameters():
            first = holder.setdefault(id(p), (layer_name, pname))
            if first[0] != layer_name:
                raise ValueError(
                    f"meta layers {first[0]!r} and {layer_name!r} share the parameter "
                    f"{first[0]}.{first[1]} (a tied weight); a layer list is materialised layer "
                    "by layer, which would untie it. Build the model as one nn.Module on the "
                    "meta device and give Pipeline split_points= (it materialises by name and "
                    "keeps ties), or build the layers for real")
