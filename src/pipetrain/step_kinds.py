"""Step kinds: what a training, an eval, a decoding and an asynchronous step each do their own way.

The stepper (:mod:`pipetrain.stepper`) runs every step the same way::

    kind.begin ─► the receives posted (kind.tag's plans) ─► kind.prepare (micro-batches)
         ─► kind.executor runs the rank's action list (kind.modal layers in eval mode)
         ─► kind.after_run ─► kind.finish (the end of the step: loss and times)
         ─► kind.gives_grads? the step's gradients merged, tied, handed to the hooks

and a kind says, for its mode only, which executor runs it, how its batch becomes
micro-batches, and how it ends. :class:`~pipetrain.pipeline.Pipeline` makes the kind of each
call: ``step`` a :class:`TrainStep` (an asynchronous schedule's :class:`WindowStep`),
``eval_step`` an :class:`EvalStep`, ``decode`` a :class:`DecodeStep`, ``drain`` a
:class:`WindowStep` that drains.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.async_steps import AsyncSteps
from pipetrain.runtime.executor import Executor, GradsReady, StepData, TokenFeedback
from pipetrain.runtime.step_end import StepTimes, exchange, total_loss
from pipetrain.runtime.transport.comm import P2P
from pipetrain.schedules.schedule import Schedule

__all__ = ["StepHooks", "StepKind", "TrainStep", "EvalStep", "DecodeStep", "WindowStep"]

Tag = Schedule | str | None
"""Which executor's message plans a step uses: None (the pipeline's own), ``"eval"`` (the eval
graph's), a Schedule (a decoding run's or an asynchronous phase's)."""
Prepare = Callable[[StepData, Container[int], Any, Any, bool], None]
""":meth:`pipetrain.stepper.Feed.prepare`: the batch split into a step's micro-batches."""


@dataclass(frozen=True)
class StepHooks:
    """What the caller of a step asks of it beside its inputs."""

    on_grads_ready: GradsReady | None = None
    """Called with each stage whose gradients are final (``Pipeline.step``)."""
    keep_outputs: bool = False
    """Merge and return the last stage's outputs."""


class StepKind:
    """A synchronous step of ``executor``: the batch split by the feed, the step ended by the
    end-of-step exchange (:mod:`pipetrain.runtime.step_end`). Subclasses change what their
    mode does differently."""

    train = False
    """Whether the step runs backward (and leaves gradients)."""
    window = False
    """Whether the step ends without waiting for its peers (an asynchronous schedule's)."""
    loop: TokenFeedback | None = None
    """A decoding run's token feedback."""

    def __init__(self, executor: Executor, tag: Tag = None) -> None:
        self.executor, self.tag = executor, tag

    @property
    def schedule(self) -> Schedule:
        return self.executor.schedule

    def kept_plans(self, plans: dict[Any, Any]) -> dict[Any, Any]:
        """The message plans worth keeping once this kind's are made."""
        return plans

    def begin(self, data: StepData) -> None:
        """Before anything of the step runs."""

    def prepare(self, feed: Prepare, data: StepData, hosted: Container[int], inputs: Any,
                targets: Any) -> None:
        """``data``'s micro-batches of the caller's batch (the feed's split)."""
        feed(data, hosted, inputs, targets, True)

    def modal(self) -> list[nn.Module]:
        """The layers put in eval mode while the step runs."""
        return []

    def after_run(self, data: StepData) -> None:
        """Once every action of the step ran on this process."""

    def finish(self, transport: P2P | None, rank: int, data: StepData,
               own: Sequence[tuple[int, Any]]) -> tuple[torch.Tensor | None, StepTimes]:
        """The step's loss (on every rank) and its measured times."""
        if transport is None:
            return total_loss(data), StepTimes(self.schedule, data.train, own, data.times)
        return exchange(transport, self.schedule, rank, data, own)

    def gives_grads(self) -> bool:
        """Whether the step leaves gradients to merge and hand to the hooks."""
        return self.train

    def previous_loss(self) -> torch.Tensor | None:
        """The loss of the step before, where a kind's loss comes a step late."""
        return None


class TrainStep(StepKind):
    """Forward and backward of every micro-batch (``Pipeline.step``)."""

    train = True


class EvalStep(StepKind):
    """Forward only (``Pipeline.eval_step``): the training graph's executor or the eval
    graph's (``tag="eval"``), with ``layers`` in eval mode while it runs; ``draws``: whether
    its stages carry random streams."""

    def __init__(self, executor: Executor, tag: Tag, layers: list[nn.Module],
                 draws: bool) -> None:
        super().__init__(executor, tag)
        self.layers, self.draws = layers, draws

    def prepare(self, feed: Prepare, data: StepData, hosted: Container[int], inputs: Any,
                targets: Any) -> None:
        feed(data, hosted, inputs, targets, self.draws)

    def modal(self) -> list[nn.Module]:
        return self.layers


def _given(data: StepData, inputs: Any, m: int) -> None:
    """Stage 0's micro-batches as the caller gives them, no targets, weight 1 each."""
    data.inputs, data.targets, data.weights = inputs, [None] * m, [1.0] * m


class DecodeStep(StepKind):
    """A decoding schedule (``Pipeline.decode``): forward only, the inputs given per
    micro-batch, the last stage's tokens fed back through ``loop``, with ``layers`` in eval
    mode while it runs."""

    def __init__(self, executor: Executor, loop: TokenFeedback, layers: list[nn.Module]
                 ) -> None:
        super().__init__(executor, executor.schedule)
        self.loop, self.layers = loop, layers

    def modal(self) -> list[nn.Module]:
        return self.layers

    def kept_plans(self, plans: dict[Any, Any]) -> dict[Any, Any]:
        """One decoding schedule's plans kept at a time."""
        return {k: v for k, v in plans.items() if not isinstance(k[1], Schedule)}

    def prepare(self, feed: Prepare, data: StepData, hosted: Container[int], inputs: Any,
                targets: Any) -> None:
        _given(data, inputs, self.schedule.n_microbatches)


class WindowStep(StepKind):
    """An asynchronous schedule's step (:mod:`pipetrain.runtime.async_steps`): the phase the
    window is in (fill, steady, or ``drain``), ended without waiting for the peers; its loss
    is the last stage's, the step before's everywhere."""

    train = True
    window = True

    def __init__(self, steps: AsyncSteps, drain: bool) -> None:
        executor = steps.executor(steps.phase(drain))
        super().__init__(executor, executor.schedule)
        self.steps, self.drain = steps, drain

    def begin(self, data: StepData) -> None:
        self.steps.begin(data)

    def prepare(self, feed: Prepare, data: StepData, hosted: Container[int], inputs: Any,
                targets: Any) -> None:
        if self.drain:
            _given(data, inputs, self.schedule.n_microbatches)
        else:
            feed(data, hosted, inputs, targets, True)

    def after_run(self, data: StepData) -> None:
        self.steps.end(data, self.drain)

    def finish(self, transport: P2P | None, rank: int, data: StepData,
               own: Sequence[tuple[int, Any]]) -> tuple[torch.Tensor | None, StepTimes]:
        return self.steps.finish(transport, self.schedule, data, own)

    def gives_grads(self) -> bool:
        """Not a first step's: its backwards finish no micro-batch yet."""
        return self.steps.versions.gave_grads

    def previous_loss(self) -> torch.Tensor | None:
        return self.steps.previous_loss
