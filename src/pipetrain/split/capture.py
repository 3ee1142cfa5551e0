"""Capture: record a model's ``forward`` once with torch.export, as one graph of ATen ops.

``torch.export.export(model, args, kwargs, strict=False)`` runs ``forward`` on fake tensors
and records every tensor operation it reaches, whatever Python code reaches it: keyword
arguments and ``**kwargs``, Hugging Face's mask builders, ``torch.ones(t, t)`` with ``t`` from a
shape, ``ModelOutput`` dataclasses. :func:`capture` asks for every dimension of every tensor
argument to stay symbolic where the code allows (``Dim.AUTO``), so one capture serves every
batch size and sequence length; a dimension the code decides on is fixed, and
:meth:`Captured.leaves` names it when a later input differs. ``dynamic=False`` captures at the
example's shapes instead: every dimension is fixed, and export does no symbolic shape
reasoning (which made GPT ``small``'s export 2.8x longer: ``docs/own-model.md``;
``pipetrain train --hf`` captures at fixed shapes: its flags fix them).

What this module returns is the graph of ``ExportedProgram.module()``: parameters and buffers
are ``get_attr`` nodes under the model's own names (the model's own tensors, a tied weight
under each of its names), buffers that ``forward`` updates are updated in place (BatchNorm's
running statistics), and every node keeps the ``nn_module_stack`` that
:mod:`pipetrain.split.trace` cuts by. Export's own input guards and shape assertions are dropped:
:meth:`Captured.leaves` checks the inputs instead, with errors that name the argument.

The graph is an ``torch.fx.Graph`` because that is what torch.export produces; nothing here
traces with ``torch.fx.Tracer``, so there is one capture path.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim, ShapesCollection

from pipetrain.errors import PartitionError
from pipetrain.runtime.launch import RANK_MODULES
from pipetrain.runtime.torch_private import EXPORT_ASSERTS, GUARDS_FN, aten_to_copy, pytree
from pipetrain.split import capture_reuse
from pipetrain.split.inputs import Packed
from pipetrain.split.lazy import is_meta

__all__ = ["Captured", "capture", "move_graph"]

RECALL = capture_reuse.Recall()
"""This process's captures, by what each depends on."""
_DROPPED = {*EXPORT_ASSERTS, "aten.sym_constrain_range_for_size.default"}


@dataclass(frozen=True)
class Leaf:
    """One flattened input of the captured ``forward``: where it comes from, what it must be."""

    path: str
    """Where the value sits in the call, as ``input_ids`` or ``kwargs['mask']``."""
    constant: Any
    """The captured value of a non-tensor input (fixed at capture), else None."""
    static: tuple[tuple[int, int], ...]
    """A tensor's dimensions that the capture fixed: (dim, size)."""
    tensor: bool


@dataclass(frozen=True)
class Captured:
    """A model's ``forward`` recorded once, and the layout of its inputs and outputs."""

    graph: fx.Graph
    """The ATen graph: placeholders (one per flattened input), then the ops, then the output
    (the flattened outputs)."""
    attrs: dict[str, Any]
    """Every ``get_attr`` target -> its value: the model's Parameters and buffers (the very
    objects), and what export made (tensor constants, subgraphs of higher-order ops)."""
    signature: inspect.Signature
    """The signature of ``model.forward``."""
    in_spec: pytree.TreeSpec
    """The structure of ``(args, kwargs)`` at capture."""
    out_spec: pytree.TreeSpec
    """The structure of the model's output (a ``ModelOutput``, a dict, a tensor, ...)."""
    inputs: tuple[Leaf, ...]
    """One per placeholder, in order."""
    given: tuple[str, ...]
    """The ``forward`` arguments the example gave, in order (the others keep defaults)."""
    seconds: float
    """How long torch.export took."""
    dynamic: bool = True
    """Whether the capture asked for symbolic dimensions (else every one is fixed)."""

    def pack(self, *args: Any, **kwargs: Any) -> Packed:
        """Stage 0's payload for ``model(*args, **kwargs)``: argument name -> value.

        Arguments that are not given are left out, so they keep their defaults.

        Raises:
            TypeError: if the arguments do not fit ``forward``.
        """
        return Packed(self.signature.bind(*args, **kwargs).arguments)

    def leaves(self, payload: dict[str, Any]) -> list[Any]:
        """The flattened inputs of the graph for stage 0's ``payload``, checked.

        Raises:
            ValueError: for arguments other than those captured, a plain value other than the
                captured one, or a tensor dimension other than one the capture fixed.
        """
        bound = inspect.BoundArguments(self.signature, payload)
        flat, spec = pytree.tree_flatten((bound.args, bound.kwargs))
        if spec != self.in_spec:
            raise ValueError(
                f"the model was captured with the arguments {list(self.given)} but this step "
                f"gives {list(payload)} (or the same names with another structure); pass the "
                "same arguments as example_inputs, or capture again with these")
        for leaf, value in zip(self.inputs, flat):
            _check_leaf(leaf, value, self.dynamic)
        return flat

    def output(self, flat: list[Any]) -> Any:
        """The model's output, rebuilt from the graph's flattened output."""
        return pytree.tree_unflatten(flat, self.out_spec)


def _check_leaf(leaf: Leaf, value: Any, dynamic: bool) -> None:
    if not leaf.tensor:
        if value != leaf.constant or type(value) is not type(leaf.constant):
            raise ValueError(
                f"{leaf.path} was {leaf.constant!r} when the model was captured and is fixed "
                f"in the captured graph; this step gives {value!r}. Plain (non-tensor) "
                "arguments are constants of the capture: pass the same value, or a tensor")
        return
    for dim, size in leaf.static:
        if value.dim() > dim and value.shape[dim] == size:
            continue
        if not dynamic:
            raise ValueError(
                f"dimension {dim} of {leaf.path} was fixed at {size} when the model was "
                f"captured (at fixed shapes: dynamic=False), but this step gives shape "
                f"{tuple(value.shape)}; give every step example_inputs' shapes, or capture "
                "with dynamic=True")
        raise ValueError(
            f"dimension {dim} of {leaf.path} was fixed at {size} when the model was "
            f"captured (forward makes a decision on it, or the example had size 1 there), "
            f"but this step gives shape {tuple(value.shape)}; give example_inputs the "
            "shapes the run will use (size >= 2 where a size changes), or keep it fixed")


def capture(model: nn.Module, example: tuple[Any, ...] | dict[str, Any],
            dynamic: bool = True) -> Captured:
    """Record ``model.forward`` on ``example`` (positional tuple or keyword dict); ``dynamic``:
    every input dimension symbolic where the code allows, else all fixed (see the module).

    A model on the ``meta`` device is captured on meta copies of the example's tensors, and a
    model wholly on one other device (a GPU) on copies there: an example made on the CPU
    fits a model moved to the GPU. A model of a structure this process captured before on
    inputs of the same shapes reuses that capture, with its own parameters and buffers
    (:mod:`pipetrain.split.capture_reuse`).

    Raises:
        PartitionError: when the example does not fit ``forward`` or torch.export cannot
            capture it; the message shows the user's source line and what to do.
    """
    signature = inspect.signature(model.forward)
    example = on_model_device(model, example)
    bound = _bind(signature, example)
    k = capture_reuse.key(model, example, dynamic)
    kept = RECALL.get(k, model)
    if kept is not None:
        return kept  # type: ignore[no-any-return]
    captured = _capture(model, signature, bound, dynamic)
    RECALL.put(k, captured, model)
    return captured


def on_model_device(model: nn.Module, example: Any) -> Any:
    """``example`` with its tensors on ``model``'s device: ``meta`` for a model with meta
    tensors (no values to run on), else the one device all its tensors are on (an example
    made on the CPU fits a model moved to a GPU); unchanged for a model on several devices."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    meta = torch.device("meta")
    device = meta if meta in devices else devices.pop() if len(devices) == 1 else None
    if device is None:
        return example
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), example)


def _capture(model: nn.Module, signature: inspect.Signature, bound: inspect.BoundArguments,
             dynamic: bool = True) -> Captured:
    program, seconds = export(model, bound, dynamic)
    return from_program(program, model, signature, bound, seconds, dynamic=dynamic)


def export(model: nn.Module, bound: inspect.BoundArguments, dynamic: bool = True
           ) -> tuple[torch.export.ExportedProgram, float]:
    """torch.export of ``model`` on ``bound`` (``dynamic``: every dimension symbolic where the
    code allows; else at ``bound``'s shapes), and the seconds it took."""
    import time

    _import_torch_parts()
    start = time.perf_counter()
    try:
        with _no_cache(model):
            program = torch.export.export(model, bound.args, bound.kwargs, strict=False,
                                          dynamic_shapes=_auto_dims(model, bound) if dynamic
                                          else None)
    except Exception as e:
        raise PartitionError(_explain(model, e)) from e
    return program, time.perf_counter() - start


@contextlib.contextmanager
def _no_cache(model: nn.Module) -> Iterator[None]:
    """Hugging Face configs with ``use_cache`` off while ``model`` is captured (a pipeline
    passes no KV cache from one step to the next; a returned cache is no tensor to send),
    as they were after."""
    configs: dict[int, Any] = {id(c): c for m in model.modules()
                               for c in [getattr(m, "config", None)]
                               if getattr(c, "use_cache", None) is True}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _import_torch_parts() -> None:
    """Import what an export imports lazily (torch's dynamo, its export tracer, symbolic
    shapes), once per process, on a thread of its own: torch keeps the stack of the call that
    first imports them alive after the import (a frame outlives it), and from a caller's
    stack that would hold the caller's objects (the pipeline being built, its stages) for
    good. ``tests/test_lifetime.py`` checks a captured pipeline is freed when dropped."""
    if all(name in sys.modules for name in RANK_MODULES):
        return
    thread = threading.Thread(target=lambda: [importlib.import_module(m) for m in RANK_MODULES],
                              name="pipetrain-import")
    thread.start()
    thread.join()


def from_program(program: torch.export.ExportedProgram, model: nn.Module,
                 signature: inspect.Signature, bound: inspect.BoundArguments, seconds: float,
                 named: dict[str, str] | None = None, dynamic: bool = True) -> Captured:
    """The capture of ``model`` that ``program`` (its export on ``bound``, ``dynamic`` or at
    fixed shapes) records; ``named``: the ``get_attr`` targets to read from ``model`` by
    another name (a program exported elsewhere: its tensors are stand-ins)."""
    module = program.module()
    graph = module.graph
    for sub in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        _clean(sub.graph)
        if sub is not module:
            sub.recompile()
    _use_own_names(graph, model)
    attrs = {str(n.target): _attr(module, str(n.target)) for n in graph.nodes
             if n.op == "get_attr" and _has_attr(module, str(n.target))}
    attrs.update({str(n.target): _attr(model, str(n.target)) for n in graph.nodes
                  if n.op == "get_attr" and str(n.target) not in attrs})
    attrs.update({target: _attr(model, held) for target, held in (named or {}).items()})
    if is_meta(model):
        _check_constants(model, graph, attrs)
    flat, in_spec = pytree.tree_flatten_with_path((bound.args, bound.kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(flat):  # export's own layout changed: fail loudly
        raise RuntimeError(f"internal: {len(placeholders)} graph inputs for {len(flat)} "
                           "flattened arguments")
    leaves = tuple(_leaf(signature, path, value, node)
                   for (path, value), node in zip(flat, placeholders))
    return Captured(graph, attrs, signature, in_spec, program.call_spec.out_spec, leaves,
                    tuple(bound.arguments), seconds, dynamic)


def _bind(signature: inspect.Signature, example: Any) -> inspect.BoundArguments:
    if not isinstance(example, (tuple, dict)):
        raise PartitionError("example_inputs must be a tuple (positional arguments) or a dict "
                             f"(keyword arguments) of forward, got {type(example).__name__}")
    try:
        return (signature.bind(*example) if isinstance(example, tuple)
                else signature.bind(**example))
    except TypeError as e:
        raise PartitionError(f"example_inputs do not fit forward{signature}: {e}") from e


def _auto_dims(model: nn.Module, bound: inspect.BoundArguments) -> Any:
    """Every dimension of every tensor argument symbolic where the code allows."""
    shapes = ShapesCollection()  # type: ignore[no-untyped-call]
    for t in pytree.tree_leaves((bound.args, bound.kwargs)):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            shapes[t] = {d: Dim.AUTO for d in range(t.dim())}
    return shapes.dynamic_shapes(model, bound.args, bound.kwargs)  # type: ignore[no-untyped-call]


def move_graph(module: nn.Module, device: torch.device) -> None:
    """Point the device constants of a stage's graph at ``device``, in place.

    Capture records the device of tensors that ``forward`` creates (``torch.arange(n,
    device=x.device)``) as constants: the model's device at capture (``meta`` for a model
    described, not built). A stage materialised or moved elsewhere must create them there.

    Code that picks a kernel by device picked ``meta``'s: transformers' grouped experts count
    tokens per expert with ``histc`` of integers off CPU, which CPU's ``histc`` lacks, so on CPU
    such a count reads the integers as floats (exact for expert ids).
    """
    def retarget(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value != device else value

    for graph_module in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        changed = device.type == "cpu" and _float_histc(graph_module.graph)
        for node in graph_module.graph.nodes:
            args = fx.node.map_aggregate(node.args, retarget)
            kwargs = fx.node.map_aggregate(node.kwargs, retarget)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            graph_module.recompile()


def _float_histc(graph: fx.Graph) -> bool:
    """Cast the integer input of each ``histc`` to float32 (CPU has no integer ``histc``)."""
    changed = False
    for node in [n for n in graph.nodes if n.target is torch.ops.aten.histc.default]:
        x = node.args[0]
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            with graph.inserting_before(node):
                cast = graph.call_function(aten_to_copy, (x,), {"dtype": torch.float32})
            cast.meta = {**node.meta, "val": val.float()}  # in the same module's call
            node.args = (cast, *node.args[1:])
            changed = True
    return changed


def _clean(graph: fx.Graph) -> None:
    """Drop export's guard call and shape assertions (inputs are checked by ``leaves``)."""
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == GUARDS_FN or str(
                node.target) in _DROPPED:
            graph.erase_node(node)
    graph.eliminate_dead_code()  # keeps in-place updates (impure nodes)
    graph.lint()


def _use_own_names(graph: fx.Graph, model: nn.Module) -> None:
    """A tensor the model holds under several names (a tied weight) is read under the name of
    the module that uses it: export reads it under one name everywhere."""
    names: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        try:
            held = names.get(id(_attr(model, str(node.target))), [])
        except AttributeError:  # export's own (a constant, a subgraph)
            continue
        for user in list(node.users) if len(held) > 1 else []:
            stack = {str(v[0]) for v in (user.meta.get("nn_module_stack") or {}).values()}
            own = [n for n in held if n.rpartition(".")[0] in stack]
            if own and own[-1] != node.target:
                with graph.inserting_before(user):
                    user.replace_input_with(node, graph.get_attr(own[-1]))
        if not node.users:
            graph.erase_node(node)


def _check_constants(model: nn.Module, graph: fx.Graph, attrs: dict[str, Any]) -> None:
    """A model captured on ``meta`` must not make tensor constants in ``forward``.

    ``x[..., [-2]]`` or ``torch.tensor([1, 2])`` in ``forward`` becomes a constant of the
    graph; on ``meta`` it has a shape but no values, and materialised it would hold garbage
    (an index of 139788151627072). Raises PartitionError naming the line.
    """
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    lost = [name for name, t in attrs.items()
            if isinstance(t, torch.Tensor) and t.is_meta and id(t) not in own]
    if not lost:
        return
    users = [u for n in graph.nodes if n.op == "get_attr" and str(n.target) in lost
             for u in n.users]
    where = "; ".join(dict.fromkeys(_last_frame(u) for u in users)) or "in forward"
    raise PartitionError(
        f"{type(model).__name__}.forward makes a tensor from Python values ({where}): a "
        "constant of the captured graph, whose values a capture on the meta device cannot "
        "know (materialised, it would hold garbage). Build the model with real tensors, or "
        "write that line without a tensor made from a list or number (a slice "
        "x[..., -2:-1] instead of x[..., [-2]])")


def _last_frame(node: fx.Node) -> str:
    """``file:line (`code`)`` of the user's line that made ``node``, from export's trace."""
    lines = [x.strip() for x in (node.meta.get("stack_trace") or "").strip().splitlines()]
    if len(lines) < 2 or not lines[-2].startswith("File "):
        return lines[-1] if lines else ""
    place = lines[-2].split(", in ")[0].replace('File "', "").replace('", line ', ":")
    return f"{place} (`{lines[-1]}`)"


def _has_attr(module: nn.Module, target: str) -> bool:
    try:
        _attr(module, target)
    except AttributeError:
        return False
    return True


def _attr(module: nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _leaf(signature: inspect.Signature, path: Any, value: Any, node: fx.Node) -> Leaf:
    where = _describe(signature, path)
    if not isinstance(value, torch.Tensor):
        return Leaf(where, value, (), False)
    fake = node.meta.get("val")
    shape = fake.shape if isinstance(fake, torch.Tensor) else value.shape
    static = tuple((d, int(s)) for d, s in enumerate(shape) if not isinstance(s, torch.SymInt))
    return Leaf(where, None, static, True)


def _describe(signature: inspect.Signature, path: Any) -> str:
    """``input_ids``, ``kwargs['mask']``, ``args[1]``: a flattened input's place in the call."""
    text = pytree.keystr(path)  # "[1]['input_ids']" for kwargs, "[0][2]" for args
    if text.startswith("[0]"):
        rest = text[3:]
        index = int(rest[1:rest.index("]")])
        params = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        name = params[index].name if index < len(params) else f"args[{index}]"
        return name + rest[rest.index("]") + 1:]
    rest = text[3:]
    key = rest[2:rest.index("]") - 1]
    return key + rest[rest.index("]") + 1:]


def _explain(model: nn.Module, e: BaseException) -> str:
    """Why torch.export failed, where in the user's code, and what to do."""
    text = f"{type(e).__name__}: {e}".strip()
    first = text.splitlines()[0] if text else ""
    hint = ("Capture runs forward once on fake tensors (torch.export, non-strict), so Python "
            "control flow on tensor values (if/while on a tensor, .item(), .tolist(), len() of "
            "a data-dependent result) cannot be recorded. Alternatives: make the branch depend "
            "on a plain argument fixed in example_inputs, write it with torch.where or "
            "torch.cond, or give Pipeline an explicit layer list (nn.Sequential) with "
            "balance=[...]")
    if "pytree" in text and "output" in text:
        hint = ("forward returns an object torch.export cannot flatten (for Hugging Face "
                "models, a KV cache: build the config with use_cache=False, or pass "
                "use_cache=False in example_inputs); register it with "
                "torch.utils._pytree.register_pytree_node, or return tensors, tuples, lists, "
                "dicts or dataclasses of them")
    return (f"torch.export could not capture {type(model).__name__}.forward"
            f"{_user_frame(e)}: {first}\n{hint}")


def _user_frame(e: BaseException) -> str:
    """`` at file:line (`code`)`` of the innermost frame outside torch and pipetrain."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frames = [f for f in traceback.extract_tb(e.__traceback__)  # "<string>": generated code
              if not f.filename.startswith(skip) and not f.filename.startswith("<")]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
