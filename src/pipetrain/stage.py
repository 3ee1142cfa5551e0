"""Stage: one model part on one rank, running F, B, I and W for one micro-batch at a time.

A stage keeps, per micro-batch in flight, the leaf tensors it received (their gradients go back
to the previous stage), its outputs (the roots of its backward), and after I the deferred
weight work. Its layers run like ``nn.Sequential``: each layer gets the previous one's output.
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


class Stage:
    """Layers ``first_layer .. first_layer+len(layers)-1`` of the model, as stage ``index``."""

    def __init__(self, index: int, layers: Sequence[nn.Module], *, is_last: bool,
                 loss_fn: LossFn | None, device: torch.device) -> None:
        self.index, self.is_last, self.loss_fn, self.device = index, is_last, loss_fn, device
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
        with torch.set_grad_enabled(track):
            out = self.module(unflatten(leaves, spec))
            if self.is_last and self.loss_fn is not None and target is not None:
                loss = self.loss_fn(out, _to_device(target, self.device)) * weight
                flat, out_spec = [loss], None
            else:
                flat, out_spec = flatten(out)
        if track:
            self._flight[mb] = _InFlight(leaves, flat)
        return flat, out_spec, out

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None] | None,
                 split: bool) -> list[torch.Tensor | None]:
        """B (``split=False``) or I (``split=True``): gradients w.r.t. this stage's inputs."""
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

    def pending(self) -> list[int]:
        """Micro-batches whose backward has not finished (should be empty after a step)."""
        return sorted(self._flight)

    def clear(self) -> None:
        self._flight.clear()


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
