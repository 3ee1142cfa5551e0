"""StepResult: what one step of a pipeline returns on every rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from pipetrain.runtime.step_end import StepTimes
from pipetrain.schedules.timeline import Timeline

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one step returns on every rank."""

    loss: torch.Tensor | None
    """The batch loss (sum of the weighted micro-batch losses); None without targets."""
    outputs: Any
    """Merged model outputs, on the rank(s) holding the last stage, when asked for."""
    times: StepTimes | Timeline = field(repr=False)
    """The measured action times, as recorded (read ``timeline``). An asynchronous
    schedule's step has only this rank's (its peers' come a step late), a drain everyone's."""
    previous_loss: torch.Tensor | None = None
    """An asynchronous schedule (``pipedream-2bw``): the loss of the step before, on every
    rank. Its ranks do not wait for each other at the end of a step, so ``loss`` is there only
    on the rank holding the last stage (and in local mode)."""
    gave_grads: bool = True
    """Whether the step left gradients in ``.grad`` for an optimizer step: False for an eval
    or decoding step, and for an asynchronous schedule's first step (its backwards finish no
    micro-batch yet; each later step gives the gradients of the step before)."""

    @cached_property
    def timeline(self) -> Timeline:
        """Measured start/end (seconds, wall clock) of every action of every rank."""
        return self.times if isinstance(self.times, Timeline) else self.times.timeline()

    @property
    def bubble_fraction(self) -> float:
        """Measured 1 - busy / (ranks x makespan) of this step."""
        return self.timeline.bubble_fraction
