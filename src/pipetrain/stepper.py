"""Stepper: one step of a pipeline on this rank, from the caller's batch to its result or failure.

    run ──► the step's receives posted (each peer's plan, kept per executor)
        ──► the batch split into micro-batches (:class:`Feed`)
        ──► executor.run: every action of the rank's list
        ──► the end of the step: the exchange, copied and tied gradients, deferred hooks
        ──► StepResult
    any error ──► stages cleared, peers told (ABORT), the pipeline marked broken for good

:class:`pipetrain.pipeline.Pipeline` builds one and picks, for each call, the executor that
runs it (training, eval graph, decoding, an asynchronous window's phase).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PipelineError
from pipetrain.result import StepResult
from pipetrain.runtime import microbatch
from pipetrain.runtime import rng as rng_streams
from pipetrain.runtime.async_steps import Windows
from pipetrain.runtime.executor import Executor, GradsReady, StepData, TokenFeedback, message_plans
from pipetrain.runtime.step_end import StepTimes, ending_keys, exchange, total_loss
from pipetrain.runtime.failure.watchdog import Watchdog, diagnosed
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.tied import LocalCopies, TiedGrads
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.receipts import Proofs, delivery_proofs
from pipetrain.runtime.transport.receiver import PeerFailed
from pipetrain.runtime.transport.wire import OPS
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.eval_graph import eval_mode
from pipetrain.split.trace import TracedSplit

__all__: list[str] = []

Tag = Schedule | str | None  # which executor's plans: None (training), "eval", a Schedule


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
                except ValueError as e:
                    raise ValueError(f"{where}, stage 0: {e}") from None
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
    """Runs a pipeline's steps on this rank (see the module); counts them, keeps each
    executor's message plans, and once a step failed refuses every later one."""

    feed: Feed
    stages: dict[int, Stage]
    executor: Executor  # the pipeline's own: its deferred hooks run at the end of a step
    transport: P2P | None
    windows: Windows | None
    watchdog: Watchdog | None
    copies: LocalCopies
    tied_grads: TiedGrads | None
    count: int = 0
    broken: str | None = None
    closed: bool = False
    plans: dict[tuple[bool, Tag], dict[int, list[tuple[int, int, int, int]]]] = field(
        default_factory=dict)
    proofs: dict[tuple[bool, Tag], Proofs] = field(default_factory=dict)
    """Per executor, the sends that each received message proves done."""

    def run(self, executor: Executor, schedule: Schedule, tag: Tag, inputs: Any, targets: Any,
            *, train: bool, keep_outputs: bool, on_grads_ready: GradsReady | None,
            number: int | None, loop: TokenFeedback | None, drain: bool, modal: list[nn.Module],
            draws_in_eval: bool = True) -> StepResult:
        """One step of ``executor``, running ``schedule`` (``loop``: a decoding run's;
        ``modal``: the layers put in eval mode while it runs; ``draws_in_eval``: see
        :meth:`Feed.prepare`)."""
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
        data = StepData(step, [], [], [], keep_outputs, train, on_grads_ready, loop=loop)
        if train and self.windows is not None:
            self.windows.begin(data)
        if self.transport is not None:
            self._start(self.transport, data, executor, schedule, tag)
        try:
            self.copies.refresh()
            if loop is None and not drain:
                self.feed.prepare(data, self.stages, inputs, targets, draws_in_eval)
            else:
                data.inputs, data.targets = inputs, [None] * schedule.n_microbatches
                data.weights = [1.0] * schedule.n_microbatches
            with eval_mode(modal):  # a layer list: eval() while it runs
                executor.run(data)
            if train and self.windows is not None:
                self.windows.end(data, drain)
            loss, times = self._finish(data, executor, schedule)
        except BaseException as e:
            error = diagnosed(e, self.watchdog)  # a timeout names the rank holding all up
            if self.watchdog is not None:
                self.watchdog.failed(error)
            self._fail(step, error, data.done_sent, executor)
            if error is e:
                raise
            raise error from e
        previous = None if self.windows is None or not train else self.windows.previous_loss
        outputs = None
        if keep_outputs and data.outputs:
            outputs = microbatch.merge([data.outputs[i] for i in sorted(data.outputs)],
                                       self.feed.split_dim)
        return StepResult(loss, outputs, times, previous)

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

    def _start(self, transport: P2P, data: StepData, executor: Executor, schedule: Schedule,
               tag: Tag) -> None:
        """Post the step's first receive from each peer, by the plan of ``executor``."""
        rank, train = self.feed.rank, data.train
        key = (train, tag)
        if key not in self.plans:  # per peer, what it sends this rank in a step
            if data.loop is not None:  # one decoding schedule kept at a time
                self.plans = {k: v for k, v in self.plans.items()
                              if not isinstance(k[1], Schedule)}
            self.plans[key] = message_plans(schedule, rank, train, executor.routes)
            self.proofs[key] = delivery_proofs(schedule, rank, train, executor.routes) \
                if self.windows is None else {}  # a window's routes repeat: sends wait a step
        carry = None if self.windows is None else (self.windows.previous,
                                                   self.feed.schedule.n_microbatches)
        window = train and self.windows is not None
        transport.start_step(data.step, self.plans[key],
                             ending_keys(schedule, rank, data.step, window), self.proofs[key],
                             carry)

    def _finish(self, data: StepData, executor: Executor, schedule: Schedule
                ) -> tuple[torch.Tensor | None, StepTimes]:
        rank = self.feed.rank
        own = executor.executed(data.train)
        if self.transport is None and self.windows is not None and data.train:
            loss, times = self.windows.finish(None, schedule, data, own)
        elif self.transport is None:
            loss, times = total_loss(data), StepTimes(schedule, data.train, own, data.times)
        else:
            window = data.train and self.windows is not None  # the peers whose message it takes
            executor.activity.waiting("the end-of-step exchange", tuple(
                ending_keys(schedule, rank, data.step, window)), data.step)
            loss, times = exchange(self.transport, schedule, rank, data, own) if \
                self.windows is None or not data.train else \
                self.windows.finish(self.transport, schedule, data, own)
            executor.activity.idle()
        if data.train and self.windows is not None and not self.windows.versions.gave_grads:
            return loss, times  # a first asynchronous step: no gradients yet
        if data.train:
            self.copies.merge_grads()
        if data.train and self.tied_grads is not None:
            self.tied_grads.all_reduce()
        if data.train and self.executor.deferred:
            self.executor.grads_ready(rank, None, self.executor.deferred, data)
        return loss, times

    def _fail(self, step: int, error: BaseException, done_sent: bool, executor: Executor
              ) -> None:
        for stage in self.stages.values():
            stage.clear()
        if self.windows is not None:
            self.windows.versions.restore()
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
