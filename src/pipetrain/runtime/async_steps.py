"""Async steps: an asynchronous schedule's steps, each one window of a pipeline never flushed.

The first step runs the window's ``fill`` phase (no earlier micro-batches to finish), every
later one the window itself, and ``drain`` the backward actions that finish the last step's
micro-batches (:meth:`~pipetrain.schedules.schedule.Schedule.phase`). The three executors share
the weight versions (:mod:`pipetrain.runtime.versions`) and the hand-offs between stages of this
process, so a gradient one step sends for the next waits there. A stage's gradients are final
only at the end of a step (those of the step before), so every stage's ``on_grads_ready`` is
called then; under PipeDream, after each of the stage's B, before its optimizer steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.executor import Executor, StepData
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.step_end import StepTimes, exchange_window, total_loss
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.routes import Routes
from pipetrain.runtime.versions import Versions
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []


class AsyncSteps:
    """The phases, versions and step count of an asynchronous schedule on one process."""

    def __init__(self, schedule: Schedule, stages: dict[int, Stage], hosted: Sequence[int],
                 transport: P2P | None, linked: dict[int, set[int]], routes: Routes,
                 optimizers: dict[int, torch.optim.Optimizer] | None = None) -> None:
        self.versions = Versions(stages, optimizers)
        self._build = (stages, hosted, transport, linked, routes)
        self.steady = self._executor(schedule, None)
        self.phases: dict[str, Executor] = {"steady": self.steady}
        self.filled = False  # a step ran since the last drain (or ever)
        self.refilling = False  # the next step runs a saved step's fill again (restore)
        self.version = 0  # the weight version of the next step's forwards
        self.previous = -1  # the number of the last step run
        self.owed: int | None = None  # the step whose peers' end-of-step messages are owed
        self.previous_loss: torch.Tensor | None = None  # the loss of the step before
        self._loss: torch.Tensor | None = None  # local mode: the last step's

    def _executor(self, schedule: Schedule, like: Executor | None) -> Executor:
        stages, hosted, transport, linked, routes = self._build
        executor = Executor(schedule, stages, hosted, transport, linked, set(stages),
                            routes=routes, versions=self.versions,
                            local=None if like is None else like._local)
        if like is not None:
            executor.activity = like.activity  # what the watchdog reads
        return executor

    @property
    def in_flight(self) -> bool:
        """Whether micro-batches of an earlier step are still to be finished, on some rank
        (the same answer on every rank: a last stage finishes its own within the step)."""
        return self.filled

    def phase(self, drain: bool) -> str:
        return "drain" if drain else "steady" if self.in_flight else "fill"

    def executor(self, which: str) -> Executor:
        """The executor of phase ``which`` (made at its first use)."""
        if which not in self.phases:
            self.phases[which] = self._executor(self.steady.schedule.phase(which), self.steady)
        return self.phases[which]

    def state(self, names: dict[int, str]) -> dict[str, Any]:
        """PipeDream-2BW between steps: the version the last step's micro-batches in flight
        run on (this process's stages, by parameter name, from ``names``: ``id(P)`` to name),
        with the step counters.

        Raises:
            ValueError: under PipeDream, or with nothing in flight.
        """
        if self.steady.schedule.update != "2bw" or not self.filled:
            raise ValueError("in_flight_state() is for pipedream-2bw between steps, with "
                             "micro-batches in flight (after a step, before a drain)")
        version = self.version - 1
        return {"version": version, "previous": self.previous,
                "weights": {names[i]: t.detach() for i, t in
                            self.versions.leaves.get(version, {}).items()}}

    def restore(self, state: dict[str, Any], params: dict[str, nn.Parameter]) -> None:
        """Take :meth:`state` back into a pipeline with nothing in flight: the next step runs
        the saved step's fill again on the saved version (:meth:`Pipeline.refill`)."""
        if self.filled:
            raise ValueError("refill() needs a pipeline with nothing in flight: a new one, or "
                             "one after drain()")
        weights = state["weights"]
        missing = [n for n in params if n not in weights]
        if missing:
            raise ValueError(f"the in-flight state lacks {missing[:4]}: it was saved on "
                             "another layout or rank; refill on the one that saved it")
        self.version, self.previous = int(state["version"]), int(state["previous"])
        self.versions.leaves[self.version] = {
            id(p): nn.Parameter(weights[n].detach().to(p.device, p.dtype).clone())
            for n, p in params.items()}
        self.refilling = True

    def begin(self, data: StepData) -> None:
        data.previous, data.version = self.previous, self.version

    def end(self, data: StepData, drain: bool) -> None:
        """After a step (``drain``: the drain) ran everywhere here: P holds the step's version
        and the gradients of the step before (:meth:`Versions.end_step`)."""
        self.versions.end_step(data.version, keep=self.refilling)
        self.filled, self.refilling = not drain, False
        self.previous = data.step
        self.version += self.steady.schedule.versions_per_step

    def finish(self, transport: P2P | None, schedule: Schedule, data: StepData,
               own: Sequence[tuple[int, Any]]) -> tuple[torch.Tensor | None, StepTimes]:
        """The loss of the step ``schedule`` (a phase) ran, where this process computed it,
        and its times; the loss of the step before in :attr:`previous_loss`
        (:func:`~pipetrain.runtime.step_end.exchange_window`)."""
        drain = "drain" in self.phases and schedule is self.phases["drain"].schedule
        if transport is None:
            loss = total_loss(data)
            self.previous_loss, self._loss = self._loss, loss
            return loss, StepTimes(schedule, True, own, data.times)
        loss, before, times = exchange_window(
            transport, schedule, transport.rank, data, own, self.owed, drain)
        self.owed = None if drain else data.step
        last = schedule.rank_of(schedule.n_stages - 1) == transport.rank
        self.previous_loss, self._loss = (self._loss, loss) if last else (before, None)
        return loss, times
