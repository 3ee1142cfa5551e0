"""V-shape schedules: two stages per rank folded as a V, so rank 0 holds the first and last stage.

With p ranks and n_stages = 2p, rank r holds stage r (the "down" leg) and stage 2p-1-r (the "up"
leg). A micro-batch's forward runs down ranks 0..p-1, stays on rank p-1 for the turn from stage
p-1 to stage p, and climbs back to rank 0; its backward retraces the V. Because the loss and the
first stage share rank 0, the first backward starts as soon as the last forward ends, which is
what lets ZB-V fill the warm-up and cool-down with useful work.

Every generator here first builds the schedule for enough micro-batches that all its phases are
full, then drops the actions of micro-batches >= m. Dropping whole micro-batches cannot create a
deadlock: every wait among the kept actions is a wait the full schedule already had (dataflow
waits stay within a micro-batch, and a rank's order among kept actions is unchanged).
"""

from __future__ import annotations

from collections import Counter

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.schedule import Schedule

__all__ = ["RankOps", "check_v_args", "v_placement"]


def check_v_args(name: str, p: int, m: int, v: int) -> None:
    """Reject counts outside the V: p >= 1 ranks, m >= 1 micro-batches, v = 2 stages per rank.

    Raises:
        ValueError: naming the broken constraint and the fix.
    """
    if v != 2:
        raise ValueError(
            f"{name} places two stages per rank as a V (stages_per_rank=2), got "
            f"stages_per_rank={v}; use stages_per_rank=2, or interleaved-1f1b for other values"
        )
    if p < 1 or m < 1:
        raise ValueError(
            f"{name} needs at least 1 rank and 1 micro-batch, got n_ranks={p}, "
            f"n_microbatches={m}"
        )


def v_placement(p: int) -> list[int]:
    """``placement[stage]`` for the V: stage s < p on rank s, stage s >= p on rank 2p-1-s."""
    return [s if s < p else 2 * p - 1 - s for s in range(2 * p)]


class RankOps:
    """One rank's action list under construction; it hands out micro-batch indices in order.

    Each call takes the next micro-batch of its stage, so the F's, the B-or-I's and the W's of
    every stage come out in increasing mb order by construction. ``w`` finishes the oldest I
    still waiting for its W (of the given stage, or of any stage).
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: Counter[tuple[int, str]] = Counter()
        self._pending: list[Action] = []  # I's whose W is still to come, oldest first

    def _take(self, stage: int, kind: str) -> int:
        mb = self._next[(stage, kind)]
        self._next[(stage, kind)] += 1
        return mb

    def f(self, stage: int) -> None:
        self.actions.append(Action(stage, Op.F, self._take(stage, "F")))

    def b(self, stage: int) -> None:
        self.actions.append(Action(stage, Op.B, self._take(stage, "G")))

    def i(self, stage: int) -> None:
        action = Action(stage, Op.I, self._take(stage, "G"))
        self.actions.append(action)
        self._pending.append(action)

    def w(self, stage: int | None = None) -> None:
        k = next(k for k, a in enumerate(self._pending) if stage in (None, a.stage))
        done = self._pending.pop(k)
        self.actions.append(Action(done.stage, Op.W, done.mb))

    def below(self, m: int) -> list[Action]:
        """The actions of micro-batches 0..m-1, in list order."""
        return [a for a in self.actions if a.mb < m]


def zbv(p: int, m: int, v: int = 2) -> Schedule:
    """ZB-V (Qi et al.): zero-bubble V-shape schedule with split backward (ops F, I, W).

    Each rank warms up with forwards of its down stage, starts the up stage's I+W as soon as
    the first micro-batch turns round on rank 0's loss, runs ``F0 I0 W0 F1 I1 W1`` steadily,
    and in the cool-down runs I's first and W's last so the tail fills with weight gradients.

    Constraints: v = 2; any p >= 1 and m >= 1. The schedule is built for max(m, 2p-1)
    micro-batches and the extra ones are dropped, which keeps it deadlock-free.
    Bubble: with per-stage costs F = I = W and no communication time, every rank's span
    (first start to last end) is exactly its 6m busy units once m >= 2p-1: bubble rate 0.
    For m < 2p-1 the longest span is 4m + 4p - 2 units of F, i.e. 2(2p-1-m) idle.
    Memory: at most 2p stage-activations per rank (the same as 1F1B's p micro-batches of a
    whole rank's layers) for any split of an activation between I and W.

    Cites: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024) and "Pipeline
    Parallelism with Controllable Memory" (NeurIPS 2024).

    Raises:
        ValueError: if ``v != 2``, ``p < 1`` or ``m < 1``.
    """
    check_v_args("zbv", p, m, v)
    n = max(m, 2 * p - 1)
    lists = [_zbv_rank(p, n, r).below(m) for r in range(p)]
    return Schedule.from_lists("zbv", m, v_placement(p), lists)


def _zbv_rank(p: int, n: int, r: int) -> RankOps:
    # Requires n >= 2p-1 so that every phase count is non-negative.
    down, up = r, 2 * p - 1 - r
    ops = RankOps()
    for _ in range(2 * (p - r) - 1):  # warm-up: nF0 (fill the way down to the turn)
        ops.f(down)
    for _ in range(r):  # warm-up: n(F1 F0)
        ops.f(up)
        ops.f(down)
    for _ in range(p - r):  # warm-up: n(F1 I1 W1) (first backwards come back from the loss)
        ops.f(up)
        ops.i(up)
        ops.w(up)
    for _ in range(n - (2 * p - r - 1)):  # steady: n(F0 I0 W0 F1 I1 W1)
        for stage in (down, up):
            ops.f(stage)
            ops.i(stage)
            ops.w(stage)
    for _ in range(p - r - 1):  # steady, forwards of the down stage done: n(I0 W0 F1 I1 W1)
        ops.i(down)
        ops.w(down)
        ops.f(up)
        ops.i(up)
        ops.w(up)
    _zbv_cooldown(ops, p, r)
    return ops


def _zbv_cooldown(ops: RankOps, p: int, r: int) -> None:
    down, up = r, 2 * p - 1 - r
    for _ in range(r):  # cool-down: n(I0 I1) (W's wait; I's are on the critical path)
        ops.i(down)
        ops.i(up)
    for _ in range(p - r):  # cool-down: n(I0 W0)
        ops.i(down)
        ops.w(down)
    for _ in range(r):  # cool-down: nW1
        ops.w(up)
    for _ in range(r):  # cool-down: nW0
        ops.w(down)


register(ScheduleKind("zbv", "zero-bubble V-shape, split backward, 2 stages per rank (ZB-V)", 2,
                      zbv))
