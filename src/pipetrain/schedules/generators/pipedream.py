"""PipeDream-2BW and PipeDream: the flush-less 1F1B window, with weight versions per stage.

PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML
2021) never flushes the pipeline. Each step is one steady-state window of 1F1B: stage ``s``
runs, for ``j = 0 .. m-1``, the forward of the step's micro-batch ``j`` and then the backward
of micro-batch ``j - d`` (``d = p - 1 - s``: how many micro-batches are in flight above it);
``j - d < 0`` is the previous step's micro-batch ``m + j - d``. Every forward of step ``t``
uses weight version ``t`` and every backward the version its forward used, so a stage holds
two versions at once: the step's, and the previous step's while its last micro-batches
finish. The update after step ``t`` makes version ``t + 1`` from version ``t`` with the
gradients of step ``t - 1``, which are complete by then:

    W(t+1) = W(t) - lr * grad f(W(t-1))

Written as data, the window's actions name their versions relative to the step (``0F3@0``,
``0B-1@-1``); :meth:`Schedule.unroll` writes ``k`` steps and the drain as one flushed
schedule with absolute micro-batches and versions, which is what the validator walks and the
simulator times (:mod:`pipetrain.schedules.steady_state`).

PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019) runs the same window with weight stashing: a stage updates its weights after every
backward, with that micro-batch's gradient, taken on the version its forward used (stashed
until then), applied to the newest. So the forward of a stage's micro-batch ``n`` uses version
``n - d`` of the stage (one version per backward done before it; below 0, the first), its
backward the same, and the stage keeps the versions of the micro-batches in flight: ``d + 1``.
Written relative to the step's first micro-batch: ``0F3@0`` at ``d = 3``, ``0B-3@-6``.
"""

from __future__ import annotations

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []


def pipedream_2bw(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream-2BW's window for ``p`` ranks and ``m`` micro-batches per step.

    Constraints: v = 1; m >= p (the previous step's micro-batches finish within the step,
    so two weight versions suffice).
    Bubble: none in the steady state (each rank alternates F and B without waiting); the first
    step fills the pipeline and :meth:`pipetrain.Pipeline.drain` empties it.
    Memory: rank r holds p - r micro-batches' activations, as 1F1B, and two weight versions.
    """
    if v != 1:
        raise ValueError(f"pipedream places one stage per rank (stages_per_rank=1), got "
                         f"stages_per_rank={v}")
    if m < p:
        raise ValueError(f"pipedream needs at least as many micro-batches as ranks (m >= "
                         f"p), got m={m} for p={p}: the previous step's micro-batches must "
                         "finish within a step for two weight versions to suffice")
    lists = []
    for r in range(p):
        lag = p - 1 - r
        acts = []
        for j in range(m):
            acts.append(Action(r, Op.F, j, 0))
            acts.append(Action(r, Op.B, j - lag, 0 if j >= lag else -1))
        lists.append(acts)
    return Schedule.from_lists("pipedream-2bw", m, range(p), lists, update="2bw")


def pipedream(p: int, m: int, v: int = 1) -> Schedule:
    """PipeDream's window (weight stashing, an update after every backward).

    Constraints: v = 1; m >= p (as 2BW's window).
    Bubble: none in the steady state; the first step fills the pipeline.
    Memory: rank r holds p - r micro-batches' activations, as 1F1B, and p - r weight versions.
    """
    window = pipedream_2bw(p, m, v)
    lists = [[Action(a.stage, a.op, a.mb, a.mb - (p - 1 - r)) for a in acts]
             for r, acts in enumerate(window.actions)]
    return Schedule.from_lists("pipedream", m, range(p), lists, update="stash")


register(ScheduleKind("pipedream", "1F1B without a flush, an update after every backward on "
                      "the weights its forward used (PipeDream, weight stashing; asynchronous)",
                      1, pipedream, update="stash"))
register(ScheduleKind("pipedream-2bw", "1F1B without a flush, two weight versions, the update "
                      "delayed one step (PipeDream-2BW; asynchronous)", 1, pipedream_2bw,
                      update="2bw"))
