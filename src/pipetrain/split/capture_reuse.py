"""Capture reuse: a capture reused for another model of the same structure, in the same process.

torch.export takes seconds per model, and a process often captures the same model again: a
script that builds a pipeline per schedule, a test that builds one per case, every rank of a
local run. :func:`key` describes what a capture depends on: the model's class, every module's
class, training flag and plain attributes (as ``repr``: a config, a dropout probability, a
hook's function), every parameter's and buffer's name, shape, dtype, device and which names
share one tensor, the example's structure, shapes and plain values, the grad mode and
default dtype, and the context-parallel groups bound
(:func:`pipetrain.runtime.sequence.state`: their exchanges and masks are in the graph). Two
models with the same key run the same ATen ops on inputs of the same shapes, so the graph of
one serves the other, its parameters read from the other by name.

A tensor kept as a plain attribute (not a parameter or buffer) may be baked into the graph
as a constant: its identity is part of the key, so it never matches another model's. What
the cache keeps holds no model's tensors: a copy of the graph without the module export made
(which holds them), and export's own constants.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any

import torch
from torch import fx, nn

from pipetrain.runtime import sequence
from pipetrain.runtime.torch_private import MODULE_DICTS, pytree

__all__: list[str] = []

SIZE = 8
"""Captures kept, the most recently used first out."""
_MODULE_STATE = {*MODULE_DICTS, "training"}


def key(model: nn.Module, example: Any, dynamic: bool = True) -> Hashable:
    """What the capture of ``model`` on ``example`` depends on (see the module docstring);
    ``dynamic``: whether its dimensions are symbolic (a capture at fixed shapes serves no other
    request)."""
    modules = tuple((name, type(m).__module__, type(m).__qualname__, m.training, _plain(m))
                    for name, m in model.named_modules(remove_duplicate=False))
    first: dict[int, str] = {}
    tensors = tuple((name, tuple(t.shape), str(t.dtype), t.device.type, t.requires_grad,
                     first.setdefault(id(t), name))
                    for name, t in (*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)))
    flat, spec = pytree.tree_flatten(example)
    inputs = tuple((tuple(v.shape), str(v.dtype), v.device.type) if isinstance(v, torch.Tensor)
                   else (type(v).__qualname__, repr(v)) for v in flat)
    state = (torch.is_grad_enabled(), str(torch.get_default_dtype()), sequence.state())
    return (modules, tensors, str(spec), inputs, state, dynamic)


def _plain(module: nn.Module) -> tuple[tuple[str, str], ...]:
    """A module's own attributes other than its parameters, buffers and children, as text; a
    tensor by identity."""
    return tuple(sorted((k, f"tensor@{id(v)}" if isinstance(v, torch.Tensor) else repr(v))
                        for k, v in vars(module).items() if k not in _MODULE_STATE))


def names_by_id(model: nn.Module) -> dict[int, str]:
    """``id`` of each of ``model``'s parameters and buffers -> its first name."""
    return {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}


class Recall:
    """The captures of this process by :func:`key`, at most :data:`SIZE` of them."""

    def __init__(self) -> None:
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, k: Hashable, model: nn.Module) -> Any:
        """The capture kept under ``k``, its parameters and buffers read from ``model``; None
        when none is kept."""
        kept = self._kept.get(k)
        if kept is None:
            return None
        self._kept.move_to_end(k)
        attrs = {t: _own(model, v.name, None) if isinstance(v, _Named) else _own(model, t, v)
                 for t, v in kept.attrs.items()}
        return dataclasses.replace(kept, attrs=attrs, seconds=0.0)

    def put(self, k: Hashable, captured: Any, model: nn.Module) -> None:
        """Keep ``captured`` (a :class:`~pipetrain.split.capture.Captured` of ``model``)
        without ``model``'s tensors."""
        owned = names_by_id(model)
        attrs = {t: (None if owned[id(v)] == t else _Named(owned[id(v)])) if id(v) in owned
                 else v for t, v in captured.attrs.items()}
        self._kept[k] = dataclasses.replace(captured, graph=_detached(captured.graph),
                                            attrs=attrs)
        while len(self._kept) > SIZE:
            self._kept.popitem(last=False)

    def clear(self) -> None:
        self._kept.clear()


@dataclasses.dataclass(frozen=True)
class _Named:
    """A model tensor that the graph reads under another target than its name: a buffer that
    ``forward`` reaches through a plain object (a KV cache), which export lifts as a constant."""

    name: str


def _own(model: nn.Module, target: str, kept: Any) -> Any:
    value: Any = model
    try:
        for part in target.split("."):
            value = getattr(value, part)
    except AttributeError:
        if kept is None:
            raise RuntimeError(f"internal: a recalled capture reads {target!r}, which the "
                               "model lacks") from None
        return kept  # export's own (a constant, a subgraph)
    return value


def _detached(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (nodes, names and meta) that no module owns."""
    copy = fx.Graph()
    out = copy.graph_copy(graph, {})
    copy.output(out)
    return copy
