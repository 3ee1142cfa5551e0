"""Stepper: one step of a pipeline on this rank, from the caller's batch to its result or failure.

    run(kind, inputs, targets, hooks, number)
        ──► the step's receives posted (each peer's plan, kept per kind)
        ──► the batch split into micro-batches (:class:`Feed`, as the kind says)
        ──► kind.executor.run: every action of the rank's list
        ──► the end of the step (the kind's): the exchange; then, if it gave gradients,
            copied and tied gradients and deferred hooks
        ──► StepResult
    any error ──► stages cleared, peers told (ABORT), the pipeline marked broken for good

What differs between a training, an eval, a decoding and an asynchronous step is the kind's
(:mod:`pipetrain.step_kinds`); :class:`pipetrain.pipeline.Pipeline` builds one stepper and
makes the kind of each call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch

from pipetrain.errors import PipelineError
from pipetrain.result import StepResult
from pipetrain.runtime import microbatch
from pipetrain.runtime import rng as rng_streams
from pipetrain.runtime.executor import Executor, StepData, message_plans
from pipetrain.runtime.failure.watchdog import Watchdog, diagnosed
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.step_end import StepTimes, ending_keys
from pipetrain.runtime.tied import LocalCopies, TiedGrads
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.receipts import Proofs, delivery_proofs
from pipetrain.runtime.transport.receiver import PeerFailed
from pipetrain.runtime.transport.wire import OPS
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.eval_graph import eval_mode
from pipetrain.split.trace import TracedSplit
from pipetrain.step_kinds import StepHooks, StepKind, Tag

__all__: list[str] = []


@dataclass(frozen=True)
class Feed:
    """How a step's batch becomes micro-batches on this rank: stage 0's inputs, the last
    stage's targets and each micro-batch's loss weight."""

    rank: int
    schedule: Schedule
    traced: TracedSplit | None
    rng: bool
    device: torch.device
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    split_dim: int
    loss_reduction: str

    def prepare(self, data: StepData, hosted: Container[int], inputs: Any, targets: Any,
                draws_in_eval: bool) -> None:
        """Split the batch into ``data``'s micro-batches (``draws_in_eval``: whether the
        stages an eval step runs carry random streams)."""
        m = self.schedule.n_microbatches
        first, last = 0, self.schedule.n_stages - 1
        where = f"[rank {self.rank}] step {data.step}"
        if first in hosted:
            if inputs is None:
                raise ValueError(f"{where}: this rank holds stage 0 and needs inputs, got None")
            if self.traced is not None:
                try:
                    inputs = self.traced.payload(inputs)
                    data.inputs = self.traced.split(inputs, m, self.split_dim)
                except ValueError as e:
                    raise ValueError(f"{where}, stage 0: {e}") from None
            else:
                data.inputs = microbatch.split(inputs, m, self.split_dim)
            if self.rng and (data.train or draws_in_eval):
                base = rng_streams.draw_base()
                data.rng = [rng_streams.start(base, i, self.device) for i in range(m)]
        data.targets, data.weights = [None] * m, [1.0] * m
        if last in hosted and self.loss_fn is not None:
            if targets is None and data.train:
                raise ValueError(f"{where}: this rank holds the last stage {last} and computes "
                                 "the loss, so it needs targets, got None")
            if targets is not None:
                data.targets = microbatch.split(targets, m, self.split_dim)
                total = microbatch.batch_size(targets, self.split_dim)
                sizes = microbatch.sizes(total, m)
                if self.loss_reduction == "mean":
                    data.weights = [n / total for n in sizes]


@dataclass
class Stepper:
    """Runs a pipeline's steps on this rank (see the module); counts them, keeps each kind's
    message plans, and once a step failed refuses every later one.

    ``carry``: an asynchronous schedule's (step before, m), whose message streams go on from
    one step to the next (sends then wait a step, so no receipt proves them done);
    ``on_failure``: what a failed step undoes beyond the stages' activations (its weight
    versions)."""

    feed: Feed
    stages: dict[int, Stage]
    executor: Executor  # the pipeline's own: its deferred hooks run at the end of a step
    transport: P2P | None
    watchdog: Watchdog | None
    copies: LocalCopies
    tied_grads: TiedGrads | None
    carry: Callable[[], tuple[int, int]] | None = None
    on_failure: Callable[[], None] | None = None
    running: Executor | None = None
    """The executor of the step in progress (None between steps)."""
    count: int = 0
    broken: str | None = None
    closed: bool = False
    plans: dict[tuple[bool, Tag], dict[int, list[tuple[int, int, int, int]]]] = field(
        default_factory=dict)
    proofs: dict[tuple[bool, Tag], Proofs] = field(default_factory=dict)
    """Per executor, the sends that each received message proves done."""

    def run(self, kind: StepKind, inputs: Any, targets: Any, hooks: StepHooks,
            number: int | None) -> StepResult:
        """One step of ``kind`` on the caller's batch (``number``: the caller's step number,
        default the count of earlier steps)."""
        step = self._number(number)
        data = StepData(step, [], [], [], hooks.keep_outputs, kind.train, hooks.on_grads_ready,
                        loop=kind.loop)
        kind.begin(data)
        if self.transport is not None:
            self._start(self.transport, data, kind)
        try:
            self.copies.refresh()
            kind.prepare(self.feed.prepare, data, self.stages, inputs, targets)
            self.running = kind.executor
            try:
                with eval_mode(kind.modal()):  # a layer list: eval() while it runs
                    kind.executor.run(data)
            finally:
                self.running = None
            kind.after_run(data)
            loss, times = self._finish(data, kind)
        except BaseException as e:
            error = diagnosed(e, self.watchdog)  # a timeout names the rank holding all up
            if self.watchdog is not None:
                self.watchdog.failed(error)
            self._fail(step, error, data.done_sent, kind.executor)
            if error is e:
                raise
            raise error from e
        outputs = None
        if hooks.keep_outputs and data.outputs:
            outputs = microbatch.merge([data.outputs[i] for i in sorted(data.outputs)],
                                       self.feed.split_dim)
        return StepResult(loss, outputs, times, kind.previous_loss(),
                          kind.gives_grads())

    def _number(self, number: int | None) -> int:
        """The step's number; refuses a closed or broken pipeline."""
        rank = self.feed.rank
        if self.closed:
            raise PipelineError(f"[rank {rank}] this pipeline was closed (Pipeline.close, or the "
                                "end of its with block): build a new one to run more steps")
        if self.broken is not None:
            raise PipelineError(f"[rank {rank}] this pipeline failed earlier and cannot run "
                                f"again: {self.broken}")
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise TypeError(f"step must be an int (the caller's step number), got {number!r}")
        step = self.count if number is None else number
        self.count += 1
        return step

    def close(self) -> None:
        """End what the pipeline started on this rank: its watchdog's thread, its transport
        (the last sends, its own groups) and the activations its stages hold; once only."""
        if self.closed:
            return
        self.closed = True
        if self.watchdog is not None:
            self.watchdog.close()
        if self.transport is not None and self.transport.carried() and self.broken is None:
            warnings.warn(f"[rank {self.feed.rank}] a {self.feed.schedule.name} pipeline ended "
                          "without drain(): its last step's sends stay in flight, with their "
                          "connections, until the process exits (call pipe.drain() after the "
                          "last step)", RuntimeWarning, stacklevel=2)
        if self.transport is not None:
            self.transport.close()
        for stage in self.stages.values():
            stage.clear()

    def _start(self, transport: P2P, data: StepData, kind: StepKind) -> None:
        """Post the step's first receive from each peer, by the plan of ``kind``."""
        rank, schedule = self.feed.rank, kind.schedule
        key = (data.train, kind.tag)
        if key not in self.plans:  # per peer, what it sends this rank in a step
            self.plans = kind.kept_plans(self.plans)
            self.plans[key] = message_plans(schedule, rank, data.train, kind.executor.routes)
            self.proofs[key] = {} if self.carry is not None else delivery_proofs(
                schedule, rank, data.train, kind.executor.routes)
        carry = None if self.carry is None else self.carry()
        transport.start_step(data.step, self.plans[key],
                             ending_keys(schedule, rank, data.step, kind.window),
                             self.proofs[key], carry)

    def _finish(self, data: StepData, kind: StepKind
                ) -> tuple[torch.Tensor | None, StepTimes]:
        rank, executor = self.feed.rank, kind.executor
        own = executor.executed(data.train)
        if self.transport is None:
            loss, times = kind.finish(None, rank, data, own)
        else:
            executor.activity.waiting("the end-of-step exchange", tuple(
                ending_keys(kind.schedule, rank, data.step, kind.window)), data.step)
            loss, times = kind.finish(self.transport, rank, data, own)
            executor.activity.idle()
        if not kind.gives_grads():
            return loss, times
        self.copies.merge_grads()
        if self.tied_grads is not None:
            self.tied_grads.all_reduce()
        if self.executor.deferred:
            self.executor.grads_ready(rank, None, self.executor.deferred, data)
        return loss, times

    def _fail(self, step: int, error: BaseException, done_sent: bool, executor: Executor
              ) -> None:
        for stage in self.stages.values():
            stage.clear()
        if self.on_failure is not None:
            self.on_failure()
        self.broken = f"{type(error).__name__}: {error}"
        if self.transport is None:
            return
        self.transport.discard()
        if done_sent:  # every peer has (or gets) this rank's end-of-step message: it is done
            return
        current = executor.current
        where = (current[1].stage, current[1].mb, OPS.index(current[1].op.value)
                 ) if current else (-1, -1, 0)
        self.transport.abort(step, *where, f"{type(error).__name__}: {error}",
                             relay=isinstance(error, PeerFailed))
