"""Precision: autocast around the pipeline's compute, and the dynamic loss scale of fp16.

Every stage's forward (and its recomputation) runs on the thread that calls
``Pipeline.step``, so one autocast context around the step covers all of them; parameters,
gradients and optimizer state stay fp32. With fp16 the loss is multiplied by a scale inside
the loss function (so every backward works on scaled values), the averaged gradients are
divided by it before clipping, and the scale halves on an overflow and doubles after
``growth_interval`` clean steps. Scales are powers of two, so scaling and unscaling are exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.torch_private import foreach_mul_

__all__ = ["PRECISIONS", "autocast", "LossScale"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}
"""The ``--precision`` choices and the autocast dtype of each (None: no autocast)."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The context to run the pipeline's steps in for ``precision``.

    Raises:
        ValueError: for a precision not in :data:`PRECISIONS`.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


class LossScale:
    """The fp16 loss scale (a constant 1 when disabled).

    Args:
        enabled: False for fp32/bf16: the scale stays 1 and nothing is multiplied.
        init: the first scale.
        growth_interval: clean steps after which the scale doubles.

    Example::

        scale = LossScale(enabled=True)
        pipe = Pipeline(layers, "1f1b", 8, scale.wrap(lm_loss))
        result = pipe.step(x, y)           # gradients of loss * scale.value
        scale.unscale_(params)             # gradients of the loss
        scale.update(overflow=False)
    """

    def __init__(self, enabled: bool, *, init: float = 2.0**16,
                 growth_interval: int = 2000) -> None:
        self.enabled, self.growth_interval = enabled, growth_interval
        self.value = init if enabled else 1.0
        self.clean_steps = 0

    def wrap(self, loss_fn: Callable[[Any, Any], torch.Tensor]
             ) -> Callable[[Any, Any], torch.Tensor]:
        """``loss_fn`` multiplied by the current scale (read at every call)."""
        def scaled(outputs: Any, targets: Any) -> torch.Tensor:
            loss = loss_fn(outputs, targets)
            return loss * self.value if self.enabled else loss
        return scaled

    def unscale_(self, params: Iterable[nn.Parameter], value: float | None = None) -> None:
        """Divide the gradients by the scale (exact: the scale is a power of two); ``value``:
        the scale they were made with, where that was an earlier one (PipeDream-2BW's
        gradients are a step older than the current scale)."""
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            foreach_mul_(grads, 1.0 / (self.value if value is None else value))

    def unscale_loss(self, loss: float, value: float | None = None) -> float:
        return loss / (self.value if value is None else value) if self.enabled else loss

    def update(self, overflow: bool) -> None:
        """After a step: halve on overflow, double after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if overflow:
            self.value, self.clean_steps = max(self.value / 2.0, 1.0), 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.value, self.clean_steps = self.value * 2.0, 0

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "clean_steps": float(self.clean_steps)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.enabled:
            self.value = float(state["value"])
            self.clean_steps = int(state["clean_steps"])
