"""Bare executor: the floor any runtime can reach on this machine for a calibrated schedule.

It runs one rank's action list of a pipetrain schedule with nothing but the calibrated
benchmark's sleeps and one-element gloo messages: no autograd, no model, no framework. Every
receive of the step is posted at its start (so a message moves as soon as it is sent); each
action waits for the message it needs, sleeps what the calibrated layers of its stage would
sleep (one spinning sleep per layer, as they do), and posts the message a later stage needs::

    post every receive of the step
    for each action of this rank:   wait for its message (if its input lives on another rank)
                                    sleep layer by layer
                                    isend (if the consumer lives on another rank)
    wait every send

What remains between its step time and the simulator's makespan is the machine's own cost of
waking a sleeping thread and of moving a message between processes: the efficiency no runtime
can beat here. ``calibrated.py`` runs it next to both libraries (column ``bare eff``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import pipetrain.schedules as ps

_SPIN = 0.0003  # as calibrated.py: sleep until this close to the deadline, then spin
_TAG = 1 << 20  # above the tags of the pipelines sharing the process group


def spin_sleep(seconds: float) -> None:
    """Sleep ``seconds``, ending on time: a plain sleep until the last 0.3 ms, then a spin."""
    t0 = time.perf_counter()
    if seconds <= 0:
        return
    if seconds > _SPIN:
        time.sleep(seconds - _SPIN)
    while time.perf_counter() - t0 < seconds:
        time.sleep(0)


def layer_sleeps(op: str, stage: int, k: int, f: float, i: float, w: float) -> list[float]:
    """The sleeps the calibrated benchmark's ``k`` layers of ``stage`` run for ``op``.

    Stage 0's input needs no gradient: its I sleeps nothing and its W (or B) sleeps the W of
    every layer and the I of all but the first, like the sleep layers in both libraries.
    """
    if op == "F":
        return [f] * k
    first = stage == 0
    i_part = [i] * (k - 1 if first else k)
    if op == "I":
        return [] if first else i_part
    if op == "W":
        return [w] * k + (i_part if first else [])
    return i_part + [w] * k  # B


def _tag(kind: int, stage: int, mb: int) -> int:
    return _TAG + (kind * 256 + stage) * 65536 + mb


class BareRunner:
    """One rank of the bare executor for one schedule; ``step()`` returns its op spans."""

    order: list[list[str]] | None = None  # it runs pipetrain's order

    def __init__(self, schedule: ps.Schedule, rank: int, layers: int,
                 f: float, i: float, w: float) -> None:
        self.schedule, self.rank = schedule, rank
        self.k = layers // schedule.n_stages
        self.costs = (f, i, w)

    def _peer(self, stage: int) -> int | None:
        """The rank of ``stage`` when it exists and is another rank's, else None."""
        if 0 <= stage < self.schedule.n_stages and self.schedule.rank_of(stage) != self.rank:
            return self.schedule.rank_of(stage)
        return None

    def _links(self, op: str, s: int) -> tuple[int, int | None, int, int | None]:
        """(message kind, rank it comes from, stage it goes to, rank it goes to) of an action:
        F takes an activation (kind 0) from stage s - 1 and passes one to s + 1; B and I take a
        gradient (kind 1) from s + 1 and pass one to s - 1; W has none. A rank is None when
        the stage does not exist or is this rank's own."""
        if op == "W":
            return 0, None, s, None
        kind, before, after = (0, s - 1, s + 1) if op == "F" else (1, s + 1, s - 1)
        return kind, self._peer(before), after, self._peer(after)

    def step(self) -> Callable[[], list[tuple[str, int, float, float]]]:
        spans: list[tuple[str, int, float, float]] = []
        sends: list[Any] = []
        out = torch.zeros(1)
        acts = self.schedule.actions[self.rank]
        posted = {}  # every receive of the step (buffer, work), posted up front: the data moves
        #              at send time
        for n, a in enumerate(acts):
            kind, src, _, _ = self._links(a.op.value, a.stage)
            if src is not None:
                buf = torch.zeros(1)
                posted[n] = (buf, dist.irecv(buf, src=src, tag=_tag(kind, a.stage, a.mb)))
        for n, action in enumerate(acts):
            op, s, mb = action.op.value, action.stage, action.mb
            if n in posted:
                posted[n][1].wait()
            start = time.time()
            for seconds in layer_sleeps(op, s, self.k, *self.costs):
                spin_sleep(seconds)
            end = time.time()
            kind, _, to, dst = self._links(op, s)
            if dst is not None:
                sends.append(dist.isend(out, dst=dst, tag=_tag(kind, to, mb)))
            spans.append((op, s, start, end))
        for work in sends:
            work.wait()
        return lambda: spans

    def check(self, spans: list[tuple[str, int, float, float]]
              ) -> tuple[int, dict[str, list[float]]]:
        """Time inside each op beyond its sleeps (no sleep can be misplaced here)."""
        extra: dict[str, list[float]] = {}
        for op, s, a, b in spans:
            extra.setdefault(op, []).append(b - a - sum(layer_sleeps(op, s, self.k,
                                                                     *self.costs)))
        return 0, extra
