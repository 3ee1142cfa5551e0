"""Profile: per layer, the time of F, I and W on a sample micro-batch and its memory.

``profile_layers`` runs the layers in sequence like ``nn.Sequential`` (an optional loss lands on
the last layer, so a heavy head counts), times each layer's forward, input-gradient and
weight-gradient backward separately (the split of :mod:`pipetrain.runtime.backward`), and counts its
parameter bytes (a shared parameter once, on its first layer), activation bytes (the unique
storages autograd saves, plus its output) and the bytes a split backward's I keeps until W (the
unique storages of the gradients I leaves for W, read off the same split, so it costs no extra
run). Gradients, buffers and the RNG are restored after.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.backward import backward_input
from pipetrain.runtime.dtensors import local_shard
from pipetrain.runtime.transport.payload import flatten, unflatten

__all__ = ["LayerCost", "profile_layers", "same_work"]

LossFn = Callable[[Any, Any], torch.Tensor]
REUSE_SAMPLES = 3
"""With ``reuse``: how many of the layers that do the same work are measured (one layer's
times swing by up to a quarter between runs on a shared CPU; the median of three, less)."""


@dataclass(frozen=True)
class LayerCost:
    """One layer on one micro-batch: seconds of F, I, W, and bytes held."""

    f: float
    i: float
    w: float
    param_bytes: int
    """Parameters first seen in this layer, trainable and frozen (a shared one counts once)."""
    activation_bytes: int
    """Tensors autograd saves for backward plus the output, excluding inputs and parameters."""
    frozen_bytes: int = 0
    """The part of ``param_bytes`` that needs no gradient (no grads or optimizer state)."""
    i_held_bytes: int = 0
    """Gradients a split backward's I keeps until W: those at the cut between the input and
    weight paths, the layer's output gradient among them when a weight's op is the layer's
    last (so a ``Linear`` keeps its output gradient). 0 for a layer without trainable weights.
    Measured as in a later stage; a stage 0 fed data runs no I (see
    :mod:`pipetrain.split.balance`)."""
    largest_grad_bytes: int = 0
    """The largest trainable parameter first seen in this layer: a backward makes its gradient
    whole before adding it to ``.grad``, and a per-tensor AdamW step (CPU) makes two
    temporaries of its size."""

    @property
    def b(self) -> float:
        return self.i + self.w


# -- profiling -----------------------------------------------------------------------------


def profile_layers(
    layers: Sequence[nn.Module], sample_input: Any, *, loss_fn: LossFn | None = None,
    sample_target: Any = None, repeats: int = 3, reuse: bool = False,
) -> list[LayerCost]:
    """Measure each layer, run in sequence like ``nn.Sequential`` on one sample micro-batch.

    Each layer's F, I (:func:`pipetrain.runtime.backward.backward_input`) and W (``WeightWork.run``)
    run separately with an all-ones output gradient; times are the median of ``repeats`` runs
    after one warm-up. With ``loss_fn``, the last layer's F and backward include the loss.
    Gradients, buffers and the CPU random state are restored afterwards. With ``reuse``, the
    layers that do the same work (:func:`same_work`: a transformer's identical blocks) are
    measured only :data:`REUSE_SAMPLES` times; the others take those measurements' median
    times, and only run their forward, for the next input.

    Raises:
        ValueError: for ``repeats < 1``, no layers, or ``loss_fn`` without ``sample_target``.

    Example:
        >>> costs = profile_layers([nn.Linear(4, 4), nn.Tanh()], torch.randn(2, 4))
        >>> costs[0].param_bytes
        80
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    if loss_fn is not None and sample_target is None:
        raise ValueError("loss_fn is given but sample_target is None; pass both or neither")
    owned = param_owners(layers)
    result, x = [], sample_input
    samples: dict[Hashable, list[LayerCost]] = {}
    with torch.random.fork_rng(devices=[]), _restored(layers):
        for j, layer in enumerate(layers):
            head = loss_fn if j == len(layers) - 1 else None
            key = same_work(layer, owned[j], x, head is not None) if reuse else j
            if len(samples.setdefault(key, [])) >= REUSE_SAMPLES:
                result.append(key)
                x = _forward(layer, unflatten(*_leaves(x)), None, None)[0]
                continue
            times, (act, held), x = _profile_one(layer, x, head, sample_target, repeats)
            frozen = [p for p in owned[j] if not p.requires_grad]
            trainable = [param_bytes([p]) for p in owned[j] if p.requires_grad]
            samples[key].append(LayerCost(*times, param_bytes(owned[j]), act,
                                          param_bytes(frozen), held, max(trainable, default=0)))
            result.append(samples[key][-1])
    typical = {key: _median(costs) for key, costs in samples.items() if costs}
    return [typical[c] if not isinstance(c, LayerCost) else c for c in result]


def _median(costs: list[LayerCost]) -> LayerCost:
    """The first of ``costs`` with the median of their times (a layer's bytes do not vary)."""
    return replace(costs[0], **{op: statistics.median(getattr(c, op) for c in costs)
                                for op in ("f", "i", "w")})


def same_work(layer: nn.Module, owned: Sequence[nn.Parameter], x: Any,
              head: bool) -> Hashable:
    """What decides a layer's costs: its class and printed structure (a GraphModule's code
    too), the shapes, dtypes and ``requires_grad`` of the parameters it owns and of all its
    parameters and buffers, its input's, and whether the loss follows it."""
    def shapes(tensors: Iterable[torch.Tensor]) -> tuple[Hashable, ...]:
        return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)

    code = layer.code if isinstance(layer, torch.fx.GraphModule) else ""
    return (type(layer), repr(layer), code, shapes(owned), shapes(layer.parameters()),
            shapes(layer.buffers()), shapes(flatten(x)[0]), head)


def _profile_one(layer: nn.Module, x: Any, head: LossFn | None, target: Any,
                 repeats: int) -> tuple[tuple[float, float, float], tuple[int, int], Any]:
    leaves, spec = _leaves(x)
    params = list(layer.parameters())
    runs, out, act, kept = [], None, 0, 0
    for k in range(repeats + 1):
        t0 = _now(leaves)
        with _saved_bytes(k == 0) as saved:  # the warm-up, untimed
            out, flat = _forward(layer, unflatten(leaves, spec), head, target)
        if k == 0:  # inputs are the previous layer's outputs; weights are no activations
            held = storages(params) | storages(leaves)
            act = sum(b for ptr, b in (saved | storages(flat)).items() if ptr not in held)
        t1 = _now(flat)
        grads = [torch.ones_like(t) if t.requires_grad else None for t in flat]
        _, work = backward_input(flat, grads, leaves)
        t2 = _now(leaves)
        if k == 0:  # what W will read: the gradients I saved at the cut, and W-only roots'
            weights = storages(params)
            grads_kept = storages([g for group in work.groups for g in group[1]])
            kept = sum(b for ptr, b in grads_kept.items() if ptr not in weights)
        work.run()
        runs.append((t1 - t0, t2 - t1, _now(params) - t2))
    f, i, w = (statistics.median(r[n] for r in runs[1:]) for n in range(3))
    return (f, i, w), (act, kept), out


def _leaves(x: Any) -> tuple[list[torch.Tensor], Any]:
    """``x``'s tensors detached, floating ones needing grad as they did, and its structure."""
    tensors, spec = flatten(x)
    return [t.detach().requires_grad_(t.requires_grad and t.is_floating_point())
            for t in tensors], spec


def _forward(layer: nn.Module, x: Any, head: LossFn | None,
             target: Any) -> tuple[Any, list[torch.Tensor]]:
    with torch.enable_grad():
        out = layer(x)
        if head is not None:
            return out, [head(out, target)]
    return out, flatten(out)[0]


@contextmanager
def _saved_bytes(enabled: bool) -> Iterator[dict[Storage, int]]:
    # The storage (device and address -> bytes) of every tensor autograd saves in the block.
    seen: dict[Storage, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.update(storages([t]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if enabled else nullcontext():
        yield seen


Storage = tuple[str, int]
"""A storage's device and address: what distinct tensors (views, ties) share."""


def storages(tensors: Iterable[torch.Tensor]) -> dict[Storage, int]:
    """The bytes of each distinct storage behind ``tensors`` (a sharded DTensor's: its local
    shard's); tensors without a plain storage (sparse, nested, meta) are not counted."""
    return {(str(t.device), t.untyped_storage().data_ptr()): t.untyped_storage().nbytes()
            for t in map(local_shard, tensors)
            if t.layout == torch.strided and not t.is_nested and t.device.type != "meta"}


def param_bytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _now(tensors: Sequence[torch.Tensor]) -> float:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock
    return time.perf_counter()


def param_owners(layers: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    seen: set[int] = set()
    owned = []
    for layer in layers:
        mine = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


@contextmanager
def _restored(layers: Sequence[nn.Module]) -> Iterator[None]:
    # W accumulates into .grad in place and forwards update buffers (BatchNorm statistics).
    params = {id(p): p for layer in layers for p in layer.parameters()}
    grads = {k: p.grad for k, p in params.items()}
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    for p in params.values():
        p.grad = None
    try:
        yield
    finally:
        for k, p in params.items():
            p.grad = grads[k]
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


