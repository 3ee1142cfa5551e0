"""Dataflow: which action waits for which, and one dependency-respecting walk of a schedule.

The rules, shared by the validator, the simulator and the runtime's local mode:

    F(s, mb)    waits for F(s-1, mb)                      (activation from the previous stage)
    B/I(s, mb)  waits for F(s, mb) and B/I(s+1, mb)       (gradient from the next stage)
    W(s, mb)    waits for I(s, mb)
    F(0, mb)    of a decoding schedule, also waits for F(last, mb - lag) (its fed-back token)

A rank executes its list strictly in order; sends never block (the runtime buffers every
message it receives), so the only way to deadlock is a cycle of these waits.

In one step of an asynchronous window (:meth:`Schedule.phase`), a wait on a micro-batch
below 0 that no action of the lists produces was met in the step before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []

# What an action produces, as a key others wait on: ("F" | "G" | "W", stage, mb).
# "G" is the gradient w.r.t. the stage input, produced by B or by I.
Key = tuple[str, int, int]


def produces(action: Action) -> Key:
    kind = "F" if action.op is Op.F else ("W" if action.op is Op.W else "G")
    return (kind, action.stage, action.mb)


def needs(action: Action, n_stages: int, schedule: Schedule | None = None) -> list[Key]:
    """The keys ``action`` waits for (possibly produced on another rank); ``schedule`` adds
    its decoding feedback (:attr:`Schedule.feedback`)."""
    s, mb = action.stage, action.mb
    if action.op is Op.F:
        fed = None if schedule is None else schedule.fed_back(action)
        if fed is not None:
            return [produces(fed)]
        return [("F", s - 1, mb)] if s > 0 else []
    if action.op is Op.W:
        return [("G", s, mb)]
    deps = [("F", s, mb)]
    if s < n_stages - 1:
        deps.append(("G", s + 1, mb))
    return deps


@dataclass(frozen=True)
class Walk:
    """Result of walking a schedule: start/end per (rank, step), and where it got stuck."""

    order: tuple[tuple[int, int], ...]  # (rank, step) in the order they became runnable
    start: dict[tuple[int, int], float]
    end: dict[tuple[int, int], float]
    stuck: tuple[int, ...]  # next step index of every rank when no rank could proceed
    complete: bool


def walk(
    schedule: Schedule,
    duration: Callable[[int, Action], float] = lambda rank, action: 0.0,
    comm: float = 0.0,
) -> Walk:
    """Run every rank's list as early as its dependencies allow.

    Args:
        schedule: the schedule to walk.
        duration: ``duration(rank, action)`` -> how long the action takes.
        comm: time added to every dependency that crosses ranks.

    Returns:
        A :class:`Walk`; ``complete`` is False when the lists deadlock (or wait for an action
        no rank ever runs), in which case ``stuck`` tells where each rank stopped.
    """
    n_stages = schedule.n_stages
    ready: dict[Key, tuple[float, int]] = {}  # key -> (end time, rank that produced it)
    if schedule.update is not None:  # what the step before produced: met from the start
        produced = {produces(a) for acts in schedule.actions for a in acts}
        ready.update({k: (0.0, -1) for acts in schedule.actions for a in acts
                      for k in needs(a, n_stages) if k[2] < 0 and k not in produced})
    pos = [0] * schedule.n_ranks
    free = [0.0] * schedule.n_ranks
    start: dict[tuple[int, int], float] = {}
    end: dict[tuple[int, int], float] = {}
    order: list[tuple[int, int]] = []
    progressed = True
    while progressed:
        progressed = False
        for rank, acts in enumerate(schedule.actions):
            while pos[rank] < len(acts):
                action = acts[pos[rank]]
                deps = needs(action, n_stages, schedule)
                if any(d not in ready for d in deps):
                    break
                t = free[rank]
                for d in deps:
                    t_dep, r_dep = ready[d]
                    t = max(t, t_dep + (comm if r_dep != rank else 0.0))
                key = (rank, pos[rank])
                start[key], end[key] = t, t + duration(rank, action)
                free[rank] = end[key]
                ready.setdefault(produces(action), (end[key], rank))
                order.append(key)
                pos[rank] += 1
                progressed = True
    complete = all(pos[r] == len(a) for r, a in enumerate(schedule.actions))
    return Walk(tuple(order), start, end, tuple(pos), complete)


def versions_alive(schedule: Schedule) -> list[list[int]]:
    """Per rank, after each of its actions: how many weight versions one of its stages keeps
    at most, the newest its forwards used and those of micro-batches forwarded and not yet
    finished (B, or W after I). A schedule without versions keeps one."""
    out: list[list[int]] = []
    for acts in schedule.actions:
        flight: dict[int, dict[int, int]] = {}  # stage -> mb -> version
        newest: dict[int, int] = {}
        counts = []
        for a in acts:
            held = flight.setdefault(a.stage, {})
            if a.op is Op.F:
                held[a.mb] = a.version or 0
                newest[a.stage] = max(newest.get(a.stage, 0), a.version or 0)
            elif a.op is Op.B or a.op is Op.W:
                held.pop(a.mb, None)
            counts.append(max(len(set(f.values()) | {newest.get(st, 0)})
                              for st, f in flight.items()))
        out.append(counts)
    return out
