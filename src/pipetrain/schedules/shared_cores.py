"""Shared cores: a schedule's timeline when its ranks share fewer cores than there are ranks.

On a CPU, ``n`` ranks of one thread each on ``cores`` cores compute at full speed only while at
most ``cores`` of them are busy; with ``k > cores`` busy ranks, each advances at ``cores / k`` of
its speed (the scheduler's fair share: processor sharing). A pipeline's bubble is then not all
lost: while some ranks wait, the others run faster. GPUs, one rank each, share nothing.

:func:`shared_walk` is :func:`pipetrain.schedules.dataflow.walk` under that rule: an
action's duration is its work at full speed, and it ends when that work is done at the rates
it met::

    cores = 1; two ranks, one action of work 2 each, rank 1's inputs arrive at time 1:
    rank 0  [ full: 1 ][ half: 1 of work ]              ends at 3
    rank 1             [ half: 1 of work ][ full: 1 ]   ends at 4
            0          1                  3          4

:func:`unshare` is the inverse, for calibration: a measured span's work is its duration times
the mean rate over it, where the rate at each instant follows from how many ranks were busy.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from itertools import accumulate

from pipetrain.schedules.action import Action
from pipetrain.schedules.dataflow import Key, Walk, needs, produces
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.timeline import Span, Timeline

__all__ = ["shared_walk", "unshare"]

_EPS = 1e-12


def rate(busy: int, cores: float) -> float:
    """How fast each of ``busy`` ranks computes on ``cores`` cores (1.0: full speed)."""
    return 1.0 if busy <= cores else cores / busy


def shared_walk(schedule: Schedule, duration: Callable[[int, Action], float], comm: float,
                cores: float) -> Walk:
    """Every rank's list as early as its dependencies allow, the busy ranks sharing ``cores``.

    Raises:
        ValueError: for ``cores`` that is not a positive number.
    """
    if not (isinstance(cores, (int, float)) and math.isfinite(cores) and cores > 0):
        raise ValueError(f"cores must be a positive number, got {cores!r}")
    walker = _Walker(schedule, duration, comm)
    t = 0.0
    while True:
        walker.start_ready(t)
        step = walker.next_event(t, cores)
        if step is None:
            return walker.result()
        t = walker.advance(t, step, cores)


class _Walker:
    """The state of one shared walk: which rank runs what, and how much work it has left."""

    def __init__(self, schedule: Schedule, duration: Callable[[int, Action], float],
                 comm: float) -> None:
        self.schedule, self.duration, self.comm = schedule, duration, comm
        self.ready: dict[Key, tuple[float, int]] = {}  # key -> (end time, rank that made it)
        self.pos = [0] * schedule.n_ranks
        self.left: dict[int, float] = {}  # running rank -> work left
        self.free = [0.0] * schedule.n_ranks
        self.start: dict[tuple[int, int], float] = {}
        self.end: dict[tuple[int, int], float] = {}
        self.order: list[tuple[int, int]] = []

    def ready_at(self, rank: int) -> float | None:
        """When ``rank``'s next action can start; None: idle for now (done, or inputs unknown)."""
        acts = self.schedule.actions[rank]
        if rank in self.left or self.pos[rank] == len(acts):
            return None
        t = self.free[rank]
        for dep in needs(acts[self.pos[rank]], self.schedule.n_stages, self.schedule):
            if dep not in self.ready:
                return None
            t_dep, r_dep = self.ready[dep]
            t = max(t, t_dep + (self.comm if r_dep != rank else 0.0))
        return t

    def start_ready(self, t: float) -> None:
        """Start every action that can start by ``t``; zero-work ones end at once."""
        started = True
        while started:
            started = False
            for rank in range(self.schedule.n_ranks):
                at = self.ready_at(rank)
                if at is not None and at <= t + _EPS:
                    key = (rank, self.pos[rank])
                    self.start[key] = t
                    self.order.append(key)
                    self.left[rank] = self.duration(rank, self.schedule.actions[rank][key[1]])
                    if self.left[rank] <= 0.0:
                        self.finish(rank, t)
                    started = True

    def next_event(self, t: float, cores: float) -> float | None:
        """Time from ``t`` to the next end or start; None when nothing more can happen."""
        gaps = [w / rate(len(self.left), cores) for w in self.left.values()]
        gaps += [at - t for at in map(self.ready_at, range(self.schedule.n_ranks))
                 if at is not None]
        return min(gaps, default=None)

    def advance(self, t: float, step: float, cores: float) -> float:
        speed = rate(len(self.left), cores)
        for rank in list(self.left):
            self.left[rank] -= step * speed
            if self.left[rank] <= _EPS * (1.0 + t):
                self.finish(rank, t + step)
        return t + step

    def finish(self, rank: int, t: float) -> None:
        key = (rank, self.pos[rank])
        self.end[key] = t
        self.free[rank] = t
        self.ready.setdefault(produces(self.schedule.actions[rank][key[1]]), (t, rank))
        del self.left[rank]
        self.pos[rank] += 1

    def result(self) -> Walk:
        complete = all(p == len(a) for p, a in zip(self.pos, self.schedule.actions))
        return Walk(tuple(self.order), self.start, self.end, tuple(self.pos), complete)


def unshare(timeline: Timeline, cores: float) -> Timeline:
    """``timeline`` with each span's duration replaced by its work at full speed.

    A span's work is the integral over it of ``rate(k, cores)``, ``k`` the ranks busy at each
    instant (spans of the same timeline covering it). Starts are kept.

    Example:
        >>> from pipetrain.schedules.action import Action
        >>> a = Action.parse("0F0")
        >>> t = Timeline(2, (Span(0, a, 0.0, 2.0), Span(1, a, 1.0, 2.0)))
        >>> [s.duration for s in unshare(t, 1.0).spans]  # 1 alone + 1 at half speed
        [1.5, 0.5]
    """
    marks = sorted({x for s in timeline.spans for x in (s.start, s.end)})
    busy = [0] * len(marks)
    for s in timeline.spans:
        lo, hi = bisect.bisect_left(marks, s.start), bisect.bisect_left(marks, s.end)
        for j in range(lo, hi):
            busy[j] += 1
    pieces = [rate(busy[j], cores) * (marks[j + 1] - marks[j]) for j in range(len(marks) - 1)]
    done = [0.0, *accumulate(pieces)]  # full-speed work up to each mark
    index = {x: j for j, x in enumerate(marks)}
    spans = tuple(Span(s.rank, s.action, s.start, s.start + done[index[s.end]]
                       - done[index[s.start]]) for s in timeline.spans)
    return Timeline(timeline.n_ranks, spans, timeline.unit)
