"""Looped BFS: breadth-first pipelining over looped stages, all micro-batches stage by stage.

Stage s lives on rank ``s mod p`` as in the interleaved schedules, so a micro-batch loops around
the ranks v times. Where interleaved 1F1B goes depth-first (a round of micro-batches climbs into
the next stage as soon as it can, and backwards start early), breadth-first pipelining
(Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023; torch's ``ScheduleLoopedBFS``)
runs all m micro-batches through a rank's first stage, then all through its second, and so on;
the backward walks the stages in reverse, again all micro-batches at once::

    rank r:   F(r, 0..m-1)  F(r+p, 0..m-1)  ...  B(r+(v-1)p, ..)  ...  B(r+p, ..)  B(r, ..)

It is GPipe with looped stages: the fill and drain shrink v-fold for m >= p, at GPipe's memory
(every micro-batch of every stage alive at the turn from forward to backward).
"""

from __future__ import annotations

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []  # public entry point: make_schedule("looped-bfs", p, m, v)


def looped_bfs(p: int, m: int, v: int = 2) -> Schedule:
    """Looped BFS: per rank, every micro-batch's F stage by stage, then every B in reverse.

    Constraints: any p >= 1, m >= 1, v >= 1 (v = 1 is GPipe).
    Bubble (comm = 0, per-stage costs F and B): for m >= p each stage pass of the loop waits
    only for the fill of its first micro-batch, so the makespan is
    ``v*m*(F+B) + (p-1)*(F+B)``: GPipe's (p-1)(F+B) fill and drain, with stages v times
    smaller than GPipe's. For m < p each micro-batch waits for nothing but its own path through
    the p*v stages, and the makespan is that path plus the m-1 that follow: ``(p*v+m-1)*(F+B)``.
    Memory: every rank holds all v*m stage-activations at the turn (GPipe's m micro-batches
    of a rank's layers).

    Raises:
        ValueError: for non-positive counts.

    Example:
        >>> [str(a) for a in looped_bfs(2, 2).actions[0]]
        ['0F0', '0F1', '2F0', '2F1', '2B0', '2B1', '0B0', '0B1']
    """
    for label, value in (("n_ranks", p), ("n_microbatches", m), ("stages_per_rank", v)):
        if value < 1:
            raise ValueError(f"looped-bfs needs {label} >= 1, got {value}")
    lists = []
    for rank in range(p):
        stages = [rank + k * p for k in range(v)]
        forwards = [Action(s, Op.F, i) for s in stages for i in range(m)]
        backwards = [Action(s, Op.B, i) for s in reversed(stages) for i in range(m)]
        lists.append(forwards + backwards)
    return Schedule.from_lists("looped-bfs", m, [s % p for s in range(p * v)], lists)


register(ScheduleKind("looped-bfs", "breadth-first over looped stages, every micro-batch a "
                      "stage at a time (Looped BFS)", 2, looped_bfs))
