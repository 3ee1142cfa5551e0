"""Recompute: layers whose saved activations F drops and a replay rebuilds right before backward.

A stage's layers run in segments, maximal runs of consecutive layers that are all recomputed or
all not. During F a recomputed segment runs with autograd recording, but every tensor autograd
saves for the backward is replaced by its position in the segment's save order (a saved-tensor
hook), so of the segment's activations only its input stays alive. Before the stage's backward
(the runtime asks before it waits for the gradient) the segment runs again from that input
under the RNG state F saw, and the tensors saved this time are what the graph of F unpacks::

    F:        x ─► [segment: saves t0 t1 t2, keeps 0 1 2] ─► y      graph of F, outputs sent on
    replay:   x ─► [segment: saves t0' t1' t2', kept in order]       its outputs are discarded
    B, or I then W:  the graph of F unpacks 0 1 2 ─► t0' t1' t2'      (bitwise t0 t1 t2)

The same graph serves B, or I and later W, so a split backward still recomputes once; the
replayed tensors go with the micro-batch, and the micro-batch's last backward (B, or W) drops
each one as autograd takes it. A segment must save the same number of tensors both
times (a forward that takes another path when replayed is reported, not silently mixed).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__: list[str] = []

Policy = str | Collection[int] | tuple[str, int]
"""``"never"``, ``"always"``, ``"except_last"``, a collection of stage indices, or
``("every", k)``: the layers whose index in the layer list is a multiple of k."""
_NAMED = ("always", "except_last", "never")


def layer_flags(policy: Policy, balance: Sequence[int]) -> list[bool]:
    """One recompute flag per layer of the model, for stages of ``balance`` layers each.

    Raises:
        ValueError: for an unknown policy, stage indices out of range, or ``k < 1``.
    """
    n_stages, n_layers = len(balance), sum(balance)
    stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
    if isinstance(policy, tuple) and len(policy) == 2 and isinstance(policy[0], str):
        how, k = policy
        if how != "every" or not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"a per-layer recompute policy is ('every', k) with an int k >= 1, "
                             f"got {policy!r}")
        return [i % k == 0 for i in range(n_layers)]
    if isinstance(policy, str):
        if policy not in _NAMED:
            raise ValueError(f"recompute must be one of {list(_NAMED)}, a collection of stage "
                             f"indices or ('every', k), got {policy!r}")
        stages = {"always": set(range(n_stages)), "except_last": set(range(n_stages - 1)),
                  "never": set()}[policy]
    else:
        stages = set(policy)
        bad = sorted(s for s in stages if not (isinstance(s, int) and 0 <= s < n_stages))
        if bad:
            raise ValueError(f"recompute names stages {bad}, but stages are 0..{n_stages - 1}")
    return [stage_of[i] in stages for i in range(n_layers)]


@dataclass(frozen=True)
class Segment:
    """Consecutive layers of a stage that are all recomputed, or all not."""

    layers: tuple[nn.Module, ...]
    recompute: bool

    def run(self, x: Any) -> Any:
        for layer in self.layers:  # as nn.Sequential runs them
            x = layer(x)
        return x


def segments(layers: Sequence[nn.Module], recompute: Sequence[bool]) -> list[Segment]:
    """Split ``layers`` into maximal runs with the same recompute flag."""
    out: list[Segment] = []
    for layer, flag in zip(layers, recompute):
        if out and out[-1].recompute == flag:
            out[-1] = Segment((*out[-1].layers, layer), flag)
        else:
            out.append(Segment((layer,), flag))
    return out


class Replay:
    """One recomputed segment for one micro-batch: its input, the RNG state, the saved tensors."""

    def __init__(self, segment: Segment, inputs: Any, device: torch.device) -> None:
        self.segment, self.inputs, self.device = segment, inputs, device
        self.rng = _rng_state(device)
        self.count = 0
        self.saved: list[torch.Tensor | None] | None = None
        self.last_use = False
        """Set before the micro-batch's last backward: each tensor is dropped here as it is
        handed to autograd, which frees it once its node ran (instead of at the micro-batch's
        end: ZB-H1/H2's stage 0, whose W runs its whole backward, kept them all until then).
        A layer's backward may then read each saved tensor once, as under
        ``torch.utils.checkpoint``'s non-reentrant variant."""

    def forward(self, x: Any) -> Any:
        """F of the segment, keeping positions instead of the tensors autograd saves."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.segment.run(x)

    def replay(self) -> None:
        """Run the segment again from its input (once) and keep what autograd saves."""
        if self.saved is not None:
            return
        saved: list[torch.Tensor] = []
        with torch.random.fork_rng(devices=_cuda_of(self.device)), torch.enable_grad(), \
                _kept([b for layer in self.segment.layers for b in layer.buffers()]):
            _set_rng_state(self.device, self.rng)
            with torch.autograd.graph.saved_tensors_hooks(_keeper(saved), _unused):
                self.segment.run(_again(self.inputs))
        if len(saved) != self.count:
            raise RuntimeError(
                f"the recomputed layers saved {self.count} tensors for backward in F but "
                f"{len(saved)} when replayed; recomputation needs layers whose forward takes "
                "the same path every time (turn recompute off for them)")
        self.saved, self.inputs = list(saved), None

    def _pack(self, _: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def _unpack(self, position: int) -> torch.Tensor:
        if self.saved is None:
            raise RuntimeError("internal: a recomputed layer's graph was used before its replay")
        t = self.saved[position]
        if t is None:
            raise RuntimeError(
                "a recomputed layer read one of its saved tensors twice in its last backward "
                "(a custom autograd Function reading ctx.saved_tensors more than once?); the "
                "replay frees each saved tensor as it is read: read ctx.saved_tensors once in "
                "backward, or do not recompute that layer")
        if self.last_use:
            self.saved[position] = None
        return t


@contextmanager
def _kept(buffers: list[torch.Tensor]) -> Iterator[None]:
    """``buffers`` as they were before the block, whatever it does to them: F updated them
    once already (BatchNorm's running statistics, counters; their kernels update them in
    place without a version bump, so every buffer is kept), and a replay must not again."""
    before = [b.detach().clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, before):
                b.copy_(value)


def _keeper(saved: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    def pack(t: torch.Tensor) -> None:
        # detached: a kept tensor must not hold the replay's own graph, whose saved-tensor
        # hooks hold this closure (a cycle through C++ that Python's gc cannot free)
        saved.append(t.detach())
    return pack


def _unused(_: None) -> torch.Tensor:
    raise RuntimeError("internal: the replay's own graph was used for backward")


def _again(obj: Any) -> Any:
    """``obj`` with every tensor detached from F's graph, requiring grad as before."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().requires_grad_(obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        items = [_again(x) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _again(v) for k, v in obj.items()}
    return obj


def _cuda_of(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
