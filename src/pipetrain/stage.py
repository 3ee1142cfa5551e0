"""Stage: one model part on one rank, running F, B, I and W for one micro-batch at a time.

A stage keeps, per micro-batch in flight, the leaf tensors it received (their gradients go back
to the previous stage), its outputs (the roots of its backward), and after I the deferred
weight work. Its layers run like ``nn.Sequential``: each layer gets the previous one's output.

With ``recompute=True`` (GPipe's re-materialisation) F keeps only the stage input: it runs with
autograd recording but every tensor autograd would save is dropped, so the outputs still know
which of them need gradients. Right before the backward (the runtime calls
:meth:`Stage.prepare_backward` before it waits for the gradient) the forward runs again from the
kept input under the same RNG state, and B, or I then W, use that graph: one recomputation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipetrain.backward import WeightWork, backward_full, backward_input
from pipetrain.payload import flatten, unflatten

__all__: list[str] = []

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class _InFlight:
    inputs: list[torch.Tensor]  # leaves; the ones requiring grad get gradients sent back
    outputs: list[torch.Tensor] = field(default_factory=list)
    weight: WeightWork | None = None
    replay: tuple[Any, Any, float, Any] | None = None  # (spec, target, weight, rng) to recompute


class Stage:
    """Layers ``first_layer .. first_layer+len(layers)-1`` of the model, as stage ``index``."""

    def __init__(self, index: int, layers: Sequence[nn.Module], *, is_last: bool,
                 loss_fn: LossFn | None, device: torch.device, recompute: bool = False) -> None:
        self.index, self.is_last, self.loss_fn, self.device = index, is_last, loss_fn, device
        self.recompute = recompute
        self.module = nn.Sequential(*layers)
        self._flight: dict[int, _InFlight] = {}

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def forward(self, mb: int, tensors: list[torch.Tensor], spec: Any,
                requires_grad: Sequence[bool], target: Any = None, weight: float = 1.0,
                track: bool = True) -> tuple[list[torch.Tensor], Any, Any]:
        """F: run the layers on one micro-batch.

        Returns ``(flat outputs, spec, raw output)``; on the last stage the flat outputs are
        ``[weighted loss]`` and the raw output is the model output (for ``outputs=``).
        """
        leaves = [_leaf(t, rg and track, self.device) for t, rg in zip(tensors, requires_grad)]
        if not (track and self.recompute):
            flat, out_spec, out = self._run(leaves, spec, target, weight, track)
            if track:
                self._flight[mb] = _InFlight(leaves, flat)
            return flat, out_spec, out
        rng = _rng_state(self.device)
        with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
            flat, out_spec, out = self._run(leaves, spec, target, weight, True)
        self._flight[mb] = _InFlight(leaves, replay=(spec, target, weight, rng))
        return flat, out_spec, out

    def _run(self, leaves: list[torch.Tensor], spec: Any, target: Any, weight: float,
             track: bool) -> tuple[list[torch.Tensor], Any, Any]:
        with torch.set_grad_enabled(track):
            out = self.module(unflatten(leaves, spec))
            if self.is_last and self.loss_fn is not None and target is not None:
                loss = self.loss_fn(out, _to_device(target, self.device)) * weight
                return [loss], None, out
            flat, out_spec = flatten(out)
            return flat, out_spec, out

    def prepare_backward(self, mb: int) -> None:
        """Recompute the forward of ``mb`` if F dropped its activations (no-op otherwise)."""
        state = self._flight.get(mb)
        if state is None or state.replay is None:
            return
        spec, target, weight, rng = state.replay
        with torch.random.fork_rng(devices=_cuda_of(self.device)):
            _set_rng_state(self.device, rng)
            state.outputs = self._run(state.inputs, spec, target, weight, True)[0]
        state.replay = None

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None] | None,
                 split: bool) -> list[torch.Tensor | None]:
        """B (``split=False``) or I (``split=True``): gradients w.r.t. this stage's inputs."""
        self.prepare_backward(mb)
        state = self._flight[mb]
        out_grads: Sequence[torch.Tensor | None] = grads if grads is not None else [None] * len(
            state.outputs)
        if split:
            got, state.weight = backward_input(state.outputs, out_grads, state.inputs,
                                               self.parameters())
        else:
            got = backward_full(state.outputs, out_grads, state.inputs)
        state.outputs = []
        result = [g if x.requires_grad else None for g, x in zip(got, state.inputs)]
        if not split:
            del self._flight[mb]
        return result

    def weight(self, mb: int) -> None:
        """W: the weight gradients deferred by I."""
        state = self._flight.pop(mb)
        if state.weight is not None:
            state.weight.run()

    def clear(self) -> None:
        self._flight.clear()


def _drop(t: torch.Tensor) -> None:
    return None  # F under recomputation keeps nothing for backward


def _dropped(_: None) -> torch.Tensor:
    raise RuntimeError("internal: a recomputed stage's first graph was used for backward")


def _cuda_of(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _to_device(obj: Any, device: torch.device) -> Any:
    tensors, spec = flatten(obj)
    return unflatten([t.to(device) for t in tensors], spec)


def _leaf(t: torch.Tensor, requires_grad: bool, device: torch.device) -> torch.Tensor:
    t = t.detach()
    if t.device != device:
        t = t.to(device)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t
