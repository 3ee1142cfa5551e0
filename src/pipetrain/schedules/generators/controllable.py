"""Controllable-memory V schedules: V-Half and V-Min, less activation memory for some bubble.

Both use the V placement of :mod:`pipetrain.schedules.generators.vshape` (rank r holds stage r, the
down leg, and stage 2p-1-r, the up leg) and split backward (F, I, W). They are built from a
*building block*: the F's and I's of one micro-batch on every rank, each at a fixed slot
(one slot = one pass at F = I = W). The block repeats every 6 slots, one copy per micro-batch,
and each rank's four passes fall on four different residues mod 6, so copies never collide and
the two free slots of every 6 take the W's. V-Min's block for p = 4 (``F0``/``I0`` the down
stage, ``F1``/``I1`` the up stage; the numbers are slots)::

    slot    0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
    rank 0  F0                   F1 I1                   I0
    rank 1     F0             F1       I1             I0
    rank 2        F0       F1             I1       I0
    rank 3           F0 F1                   I1 I0

A stage's activation lives from its F to its W, so a rank holds about the sum of its two
lifespans over 6 activations: V-Min's lifespans add up to about 4p slots, V-Half's (whose
forward and backward go down the V two slots per rank) to about 6p, against ZB-V's 12p.

Repeating the block leaves holes in the warm-up and cool-down. They are squeezed out by running
the block greedily, one pass per slot on every rank, under a memory cap (the published one):
a rank runs its next F or I in block order once its inputs are ready and memory allows; else the
W of its oldest I; else a later F that still leaves room for every F it overtakes; else, in the
warm-up (before its down stage's first I) or the cool-down (once the last micro-batch has
entered stage 0), a later ready I. Holding I's to block order in between keeps the steady state
on the block, which keeps the bubble small when F, I and W take different times.

As the block in its own order never needs more than the cap, whichever rank holds the earliest
unrun block pass can always run it or a W, so the squeeze cannot get stuck, and each rank's list
is the order of a valid execution of the dataflow.
"""

from __future__ import annotations

from collections.abc import Callable

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import Key, needs, produces
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.generators.vshape import check_v_args, v_placement
from pipetrain.schedules.schedule import Schedule

__all__ = ["v_half", "v_min"]

Block = Callable[[int, int], tuple[tuple[Action, int], ...]]
"""(p, rank) -> the rank's F's and I's of micro-batch 0, each with its slot in the block."""


def v_min(p: int, m: int, v: int = 2) -> Schedule:
    """V-Min (Qi et al.): V-shape split-backward schedule with about a third of 1F1B's memory.

    Each micro-batch's forward goes down and back up the V one slot per rank, its backward
    follows one slot behind (three when p is a multiple of 3, so the block repeats without
    collisions), and the block repeats every 6 slots; the warm-up and cool-down are squeezed
    greedily under the memory cap (module docstring).

    Constraints: v = 2; any p >= 1 and m >= 1.
    Bubble: with per-stage costs F = I = W and no communication time, the longest rank span is
    the 6m busy units plus 4p-5 when p = 3k+1 and 4p-7 otherwise (0 for p = 1), once
    m >= (p+7)//3: two thirds of 1F1B's 6(p-1), less 1 or 3 units.
    Memory: at most 2*((p+4)//3) stage-activations per rank, i.e. (p+4)//3 micro-batches of a
    rank's two stages against ZB-V's p, even with every activation kept until its W
    (``w_share = 1``, hence for any w_share); at w_share = 1 the busiest rank holds exactly
    that once m >= p.

    Cites: Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024,
    arXiv 2405.15362).

    Raises:
        ValueError: if ``v != 2``, ``p < 1`` or ``m < 1``.
    """
    check_v_args("v-min", p, m, v)
    return _schedule("v-min", p, m, _v_min_block, 2 * ((p + 4) // 3))


def v_half(p: int, m: int, v: int = 2) -> Schedule:
    """V-Half (Qi et al.): V-shape split-backward schedule with about half of 1F1B's memory.

    Each micro-batch's forward goes down the V two slots per rank and back up one per rank;
    its backward starts on rank 0 one slot after the forward returns (four when p is even, so
    the block repeats without collisions), goes down two slots per rank, turns in two, and
    climbs one per rank. The block repeats every 6 slots; the warm-up and cool-down are
    squeezed greedily under the memory cap (module docstring).

    Constraints: v = 2; any p >= 1 and m >= 1.
    Bubble: with per-stage costs F = I = W and no communication time, the longest rank span is
    the 6m busy units plus 3p-4 for odd p and 3p-7 for even p >= 4 (0 for p = 1, 1 for p = 2),
    once m >= (p+3)//2: half of 1F1B's 6(p-1), less 1 or 4 units.
    Memory: at most 2*((p+2)//2) stage-activations per rank, i.e. (p+2)//2 micro-batches of a
    rank's two stages against ZB-V's p, even with every activation kept until its W
    (``w_share = 1``, hence for any w_share); at w_share = 1 the busiest rank holds exactly
    that once m >= p.

    Cites: Qi, Wan, Amar, Lin, "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024,
    arXiv 2405.15362).

    Raises:
        ValueError: if ``v != 2``, ``p < 1`` or ``m < 1``.
    """
    check_v_args("v-half", p, m, v)
    return _schedule("v-half", p, m, _v_half_block, 2 * ((p + 2) // 2))


def _v_min_block(p: int, r: int) -> tuple[tuple[Action, int], ...]:
    gap = 2 if p % 3 == 0 else 0  # keeps I1 - F0 = 2p + gap off a multiple of 6
    down, up = r, 2 * p - 1 - r
    return ((Action(down, Op.F, 0), r), (Action(up, Op.F, 0), 2 * p - 1 - r),
            (Action(up, Op.I, 0), 2 * p + gap + r), (Action(down, Op.I, 0), 4 * p - 1 + gap - r))


def _v_half_block(p: int, r: int) -> tuple[tuple[Action, int], ...]:
    gap = 3 if p % 2 == 0 else 0  # keeps I0 - F1 = 3p + gap off a multiple of 6
    down, up = r, 2 * p - 1 - r
    return ((Action(down, Op.F, 0), 2 * r), (Action(up, Op.F, 0), 3 * p - 2 - r),
            (Action(up, Op.I, 0), 3 * p - 1 + gap + 2 * r),
            (Action(down, Op.I, 0), 6 * p - 2 + gap - r))


def _block_order(block: Block, p: int, r: int, m: int) -> list[Action]:
    """Rank ``r``'s F's and I's for micro-batches 0..m-1 in slot order, the block every 6 slots."""
    slots = [(slot + 6 * mb, Action(a.stage, a.op, mb))
             for a, slot in block(p, r) for mb in range(m)]
    return [a for _, a in sorted(slots, key=lambda x: x[0])]


def _schedule(name: str, p: int, m: int, block: Block, cap: int) -> Schedule:
    ranks = [_Rank(_block_order(block, p, r, m), cap, r) for r in range(p)]
    done: set[Key] = set()
    while any(rank.busy for rank in ranks):
        cooling = produces(Action(0, Op.F, m - 1)) in done  # the last F has entered stage 0
        ran = [a for a in (rank.step(done, 2 * p, cooling) for rank in ranks) if a is not None]
        if not ran:  # unreachable: the earliest unrun block pass can always run (docstring)
            raise AssertionError(f"{name} squeeze stuck at p={p}, m={m}")
        done.update(produces(a) for a in ran)
    return Schedule.from_lists(name, m, v_placement(p), [rank.actions for rank in ranks])


class _Rank:
    """One rank during the squeeze: its unrun F's and I's in block order, and its memory."""

    def __init__(self, todo: list[Action], cap: int, down: int) -> None:
        self.todo = todo
        self.cap = cap
        self.down = down  # the rank's down stage; until its first I, the rank is warming up
        self.warming = True
        self.actions: list[Action] = []
        self.waiting: list[Action] = []  # I's whose W has not run, oldest first
        self.alive = 0  # F's run whose W has not

    @property
    def busy(self) -> bool:
        return bool(self.todo or self.waiting)

    def step(self, done: set[Key], n_stages: int, cooling: bool) -> Action | None:
        """Run this slot's pass (see the module docstring) and return it; None stays idle."""
        def ready(a: Action) -> bool:
            return all(key in done for key in needs(a, n_stages))

        if self.todo and ready(self.todo[0]) and (
                self.todo[0].op is Op.I or self.alive < self.cap):
            return self._run(0)
        if self.waiting:
            i = self.waiting.pop(0)
            self.alive -= 1
            self.actions.append(Action(i.stage, Op.W, i.mb))
            return self.actions[-1]
        k = self._early_forward(ready)
        if k is None and (self.warming or cooling):
            k = self._early_input_grad(ready, done)
        return None if k is None else self._run(k)

    def _early_forward(self, ready: Callable[[Action], bool]) -> int | None:
        # A later F may go first if memory still has room for each F it overtakes.
        overtaken = 0
        for k, a in enumerate(self.todo):
            if a.op is not Op.F:
                continue
            if self.alive + 1 + overtaken > self.cap:
                return None
            if ready(a):
                return k
            overtaken += 1
        return None

    def _early_input_grad(self, ready: Callable[[Action], bool], done: set[Key]) -> int | None:
        # Only an I whose F has run can be ready; alive - len(waiting) of them are left.
        left = self.alive - len(self.waiting)
        for k, a in enumerate(self.todo):
            if left == 0:
                return None
            if a.op is Op.I and produces(Action(a.stage, Op.F, a.mb)) in done:
                if ready(a):
                    return k
                left -= 1
        return None

    def _run(self, k: int) -> Action:
        a = self.todo.pop(k)
        if a.op is Op.F:
            self.alive += 1
        else:
            self.waiting.append(a)
            self.warming = self.warming and a.stage != self.down
        self.actions.append(a)
        return a


register(ScheduleKind("v-half", "V-shape, split backward, about half of ZB-V's memory and half "
                      "of 1F1B's bubble (V-Half)", 2, v_half))
register(ScheduleKind("v-min", "V-shape, split backward, about a third of ZB-V's memory and two "
                      "thirds of 1F1B's bubble (V-Min)", 2, v_min))
