"""zb-auto: Zero Bubble's automatic schedule search, one stage per rank, under a memory limit.

Qi et al. ("Zero Bubble Pipeline Parallelism", ICLR 2024, arXiv 2401.10241, section 3.1)
build their ZB-1p and ZB-2p schedules with a heuristic that plays the ranks forward in
simulated time, with the profiled op costs and the communication delay, deciding each rank's
next ops as it goes. This module re-implements that heuristic (v = 1, stage = rank):

    # warm-up:   every rank runs F for micro-batch 0; then, last rank to first, each rank
    #            adds forwards while its memory allows and its first I has not yet arrived
    #            (estimated from the ranks after it); a rank adds fewer than the one before
    #            it, so rank r stays at least one F ahead of rank r+1
    # steady:    one round per micro-batch: F on every rank still owed one (first to last),
    #            then I on every rank (last to first). Before each F or I a rank runs W's:
    #            - as many as the memory limit needs to admit the F,
    #            - every W that ends before the F's or I's input arrives,
    #            - one more W into a remaining shorter gap, if waiting that gap would make
    #              this rank's accumulated idle time the largest of all ranks
    #            rank 0 runs all its pending W's before each I once its forwards are done
    # cool-down: the W's still pending, one after another

Four yes/no knobs tune it. Every distinct variant is played out and the one with the
shortest longest-rank span (the paper's bubble-rate cost) wins; ties go to the shorter
makespan, then to the earlier variant. The first three are the paper's grid; the last is
ours and lowers a few of its ZB-2p bubbles (by up to 0.0005 of the step on Table 5's rows):

    fill_warmup    stop adding warm-up F's only when one more would end after the first I's
                   input arrives (otherwise as soon as the rank's clock has reached it)
    yield_to_next  a rank two or more F's ahead of the next may skip this round's F, when
                   the F (with the W's it needs for room) would delay its next I and the
                   idle time saved would not lift the largest accumulated idle time
    fill_small     also put a W into a gap shorter than W that would not raise that maximum
    one_more       each rank but the last takes one warm-up F beyond the estimate, memory
                   permitting (the estimate ignores that forwards wait for their input)

Times follow :mod:`pipetrain.schedules.simulator` (an op starts when its rank is free and its input
has arrived, ``comm`` after it was produced on the neighbouring rank), so the chosen lists
simulate exactly as planned. Memory is counted in the simulator's units: F takes 1 unit when
it starts, I frees ``1 - w_share``, W frees ``w_share``; no rank ever holds more than
``memory_limit`` (compared with a 1e-9 tolerance, for fractional shares). With the paper's
M_W = M_B / 2 (``w_share = 0.5``), ZB-1p is ``memory_limit = p`` and ZB-2p is ``2p``.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, Target, register
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs

__all__ = ["zb_auto", "zb_auto_search"]

_EPS = 1e-9  # tolerance of the memory comparison (sums of fractional shares are inexact)
F, I, W = 0, 1, 2  # noqa: E741  (op codes in a plan; the k-th X on a rank is X of mb k)
_OPS = (Op.F, Op.I, Op.W)


@dataclass(frozen=True)
class _Knobs:
    fill_warmup: bool
    yield_to_next: bool
    fill_small: bool
    one_more: bool


# The paper's usual winners first, so that the bound set by the first prunes the rest early.
_VARIANTS = tuple(_Knobs(*flags) for flags in itertools.product(
    (True, False), (True, False), (False, True), (False, True)))


@dataclass(frozen=True)
class _Problem:
    """What every variant is planned against: counts, per-rank costs, comm and memory."""

    p: int
    m: int
    cost: tuple[tuple[float, float, float], ...]  # per rank (= stage): F, I, W
    comm: float
    limit: float
    w_share: float


class _Plan:
    """One variant being played: each rank's op codes, clock, counts and idle time."""

    def __init__(self, pb: _Problem, knobs: _Knobs) -> None:
        self.pb, self.knobs = pb, knobs
        self.done = [[0, 0, 0] for _ in range(pb.p)]  # per rank: F's, I's, W's placed
        self.free = [0.0] * pb.p  # when the rank's last op ends
        self.first = [0.0] * pb.p  # when its first F starts
        self.idle = [0.0] * pb.p  # its waiting since its first F
        self.max_idle = 0.0
        self.left = [pb.m * sum(c) for c in pb.cost]  # busy time still to place, per rank
        self.f_end = [[0.0] * pb.m for _ in range(pb.p)]
        self.i_end = [[0.0] * pb.m for _ in range(pb.p)]
        self.codes: list[list[int]] = [[] for _ in range(pb.p)]

    def held(self, r: int) -> float:
        """Units rank r holds: F's awaiting their I, and W's share of I's awaiting their W."""
        n, ws = self.done[r], self.pb.w_share
        return n[F] - n[I] * (1.0 - ws) - n[W] * ws

    def fits_f(self, held: float) -> bool:
        return held + 1.0 <= self.pb.limit + _EPS

    def pending_w(self, r: int) -> int:
        return self.done[r][I] - self.done[r][W]

    def ready(self, r: int, op: int) -> float:
        """When the input of rank r's next ``op`` arrives (0.0: it has none off the rank)."""
        pb, k = self.pb, self.done[r][op]
        if op == F and r > 0:
            return self.f_end[r - 1][k] + pb.comm
        if op == I and r < pb.p - 1:
            return self.i_end[r + 1][k] + pb.comm
        return 0.0

    def put(self, r: int, op: int) -> None:
        """Append rank r's next ``op``, timed as the simulator times it."""
        done, free = self.done[r], self.free[r]
        k = done[op]
        start = free
        if op == F:
            if r > 0:
                start = max(free, self.f_end[r - 1][k] + self.pb.comm)
        elif op == I and r < self.pb.p - 1:
            start = max(free, self.i_end[r + 1][k] + self.pb.comm)
        if done[F] == 0:
            self.first[r] = start
        elif start > free:
            self.idle[r] += start - free
            if self.idle[r] > self.max_idle:
                self.max_idle = self.idle[r]
        cost = self.pb.cost[r][op]
        end = self.free[r] = start + cost
        self.left[r] -= cost
        if op == F:
            self.f_end[r][k] = end
        elif op == I:
            self.i_end[r][k] = end
        done[op] = k + 1
        self.codes[r].append(op)

    def span_bound(self) -> float:
        """A lower bound on the longest rank span this variant can still end with."""
        return max(free - first + left
                   for free, first, left in zip(self.free, self.first, self.left, strict=True))

    def raises_max_idle(self, r: int, gap: float) -> bool:
        """Whether idling ``gap`` more would put rank r's idle time above every rank's."""
        return gap > self.max_idle - self.idle[r]

    def fill(self, r: int, until: float) -> None:
        """W's into rank r's gap before an input that arrives at ``until``."""
        w = self.pb.cost[r][W]
        while self.pending_w(r) and self.free[r] + w <= until:
            self.put(r, W)
        gap = until - self.free[r]
        if self.pending_w(r) and gap > 0 and (self.knobs.fill_small
                                              or self.raises_max_idle(r, gap)):
            self.put(r, W)

    def make_room(self, r: int) -> None:
        """W's until one more F fits the limit (enough always: see ``_warmup``)."""
        while not self.fits_f(self.held(r)) and self.pending_w(r):
            self.put(r, W)

    def actions(self) -> list[list[Action]]:
        """Each rank's op codes as actions of its stage."""
        lists = []
        for r, codes in enumerate(self.codes):
            seen = [0, 0, 0]
            acts = []
            for op in codes:
                acts.append(Action(r, _OPS[op], seen[op]))
                seen[op] += 1
            lists.append(acts)
        return lists


def _warmup(plan: _Plan) -> list[int]:
    """Place micro-batch 0's F on every rank; return how many more F's each rank takes."""
    pb, kn = plan.pb, plan.knobs
    for r in range(pb.p):
        plan.put(r, F)
    extra = [0] * pb.p
    arrive = plan.f_end[-1][0] + pb.cost[-1][I]  # estimated end of I0 on the rank after r
    for r in range(pb.p - 2, -1, -1):
        clock, held, until = plan.free[r], plan.held(r), arrive + pb.comm
        while 1 + extra[r] < pb.m and plan.fits_f(held):
            f = pb.cost[r][F]
            if (clock + f > until) if kn.fill_warmup else (clock >= until):
                break
            clock, held, extra[r] = clock + f, held + 1.0, extra[r] + 1
        arrive = max(clock, until) + pb.cost[r][I]
        if kn.one_more and 1 + extra[r] < pb.m and plan.fits_f(held):
            extra[r] += 1
    for r in range(1, pb.p):  # fewer than rank r-1 adds, unless both take all m
        while 0 < extra[r] >= extra[r - 1] and 1 + extra[r - 1] < pb.m:
            extra[r] -= 1
    return extra


def _finish_warmup(plan: _Plan, extra: list[int]) -> None:
    """Place the extra warm-up F's, then micro-batch 0's I on every rank (last to first)."""
    for r, n in enumerate(extra):
        for _ in range(n):
            plan.put(r, F)
    for r in range(plan.pb.p - 1, -1, -1):
        plan.put(r, I)
    # Every rank now holds at most limit - 1 F's awaiting their I, and a round adds at most
    # one F for each I, so once its W's have run one more F always fits (make_room).


def _wants_f(plan: _Plan, r: int) -> bool:
    """Whether rank r would issue an F this round, before the later ranks' choices."""
    pb, done = plan.pb, plan.done
    if done[r][F] >= pb.m:
        return False
    if not plan.knobs.yield_to_next or r == pb.p - 1 or done[r][F] < done[r + 1][F] + 2:
        return True
    nxt = pb.cost[r + 1]
    i_due = plan.free[r + 1] + nxt[F] + nxt[I] + pb.comm  # its next I's input, estimated
    if plan.free[r] >= i_due:
        return False  # already late for that I: do not delay it more
    held, w_time, w_left = plan.held(r), 0.0, plan.pending_w(r)
    while not plan.fits_f(held) and w_left:
        held, w_time, w_left = held - pb.w_share, w_time + pb.cost[r][W], w_left - 1
    if plan.free[r] + pb.cost[r][F] + w_time <= i_due:
        return True  # the F (and its room) ends before that input arrives
    return plan.raises_max_idle(r, i_due - plan.free[r])


def _round(plan: _Plan) -> None:
    """One micro-batch's step: F on the ranks that issue one, then I on every rank."""
    pb = plan.pb
    want = [_wants_f(plan, r) for r in range(pb.p)]
    for r in range(pb.p - 2, -1, -1):  # a rank that skips holds back the ranks before it
        want[r] = want[r] and want[r + 1]
    for r in range(pb.p):
        if want[r]:
            plan.make_room(r)
            if r > 0:
                plan.fill(r, plan.ready(r, F))
            plan.put(r, F)
    for r in range(pb.p - 1, -1, -1):
        if r < pb.p - 1:
            plan.fill(r, plan.ready(r, I))
        if r == 0 and plan.done[0][F] == pb.m:
            while plan.pending_w(0):
                plan.put(0, W)
        plan.put(r, I)


def _finish(plan: _Plan, extra: list[int], bound: float) -> tuple[float, float] | None:
    """Play the rest of the variant; return its (longest rank span, makespan), or None as
    soon as its span must exceed ``bound``."""
    _finish_warmup(plan, extra)
    for k in range(1, plan.pb.m):
        _round(plan)
        if k % 4 == 0 and plan.span_bound() > bound:
            return None
    for r in range(plan.pb.p):
        while plan.pending_w(r):
            plan.put(r, W)
    span = max(end - start for start, end in zip(plan.first, plan.free, strict=True))
    return span, max(plan.free) - min(plan.first)


@functools.lru_cache(maxsize=64)
def _search(pb: _Problem) -> Schedule:
    """The best of the distinct variants (two with the same warm-up and steady knobs match)."""
    best: _Plan | None = None
    best_score = (math.inf, math.inf)
    seen: set[tuple[tuple[int, ...], bool, bool]] = set()
    for knobs in _VARIANTS:
        plan = _Plan(pb, knobs)
        extra = _warmup(plan)
        key = (tuple(extra), knobs.yield_to_next, knobs.fill_small)
        if key in seen:
            continue
        seen.add(key)
        score = _finish(plan, extra, best_score[0] * (1 + 1e-9))
        if score is not None and score < best_score:
            best, best_score = plan, score
    assert best is not None  # the first variant always plays
    return Schedule.from_lists("zb-auto", pb.m, range(pb.p), best.actions())


def _problem(p: int, m: int, v: int, target: Target) -> _Problem:
    """Check the arguments and resolve the target's defaults (limit p, unit costs)."""
    if p < 1 or m < 1:
        raise ValueError(f"zb-auto needs n_ranks >= 1 and n_microbatches >= 1, got "
                         f"n_ranks={p}, n_microbatches={m}")
    if v != 1:
        raise ValueError(f"zb-auto places one stage per rank (stages_per_rank=1), got "
                         f"stages_per_rank={v}; use interleaved-zb for several stages per rank")
    limit = float(p) if target.memory_limit is None else float(target.memory_limit)
    if not limit >= 1.0:  # also catches NaN
        raise ValueError(f"zb-auto: memory_limit must be at least 1 stage-activation (an F "
                         f"holds its unit until its I, whatever the w_share), got {limit!r}; "
                         f"raise it (p = {p} units is 1F1B's peak)")
    if not (math.isfinite(target.comm) and target.comm >= 0):
        raise ValueError(f"zb-auto: comm must be a finite number >= 0, got {target.comm!r}")
    if not 0.0 <= target.w_share <= 1.0:
        raise ValueError(f"zb-auto: w_share must be in [0, 1], got {target.w_share!r}")
    costs = Costs() if target.costs is None else target.costs
    if costs.n_stages not in (None, p):
        raise ValueError(f"zb-auto: costs give {costs.n_stages} per-stage values for {p} "
                         "stages (one per rank); give one value per rank, or one for all")
    cost = tuple((costs.of(Op.F, r), costs.of(Op.I, r), costs.of(Op.W, r)) for r in range(p))
    return _Problem(p, m, cost, float(target.comm), limit, float(target.w_share))


def zb_auto_search(p: int, m: int, v: int, target: Target) -> Schedule:
    """ZB-auto (Qi et al., ICLR 2024, section 3.1) fitted to ``target``'s costs and memory.

    Plays each distinct variant of the module's heuristic with ``target.costs`` (per stage
    allowed), ``target.comm`` and ``target.w_share``, and returns the one whose longest rank
    span (first start to last end, the paper's bubble-rate cost) is shortest. Deterministic;
    the last 64 searches are cached.

    Constraints: v = 1; p, m >= 1; ``target.memory_limit`` >= 1 stage-activation (None: p);
    per-stage costs need one value per rank; comm >= 0; w_share in [0, 1].
    Bubble: with Table 9's profiled costs and ``w_share = 0.5``, Table 5's ZB-1p at
    ``memory_limit = p`` exactly, and ZB-2p at ``2p`` or up to 0.0005 below. At unit costs it
    is no worse than ZB-H1 at limit p and ZB-H2 at 2p-1 (w_share 0, 0.5 and 1 tested).
    Memory: every rank's peak in :func:`pipetrain.schedules.simulator.simulate` (F +1 at its start,
    I frees ``1 - w_share``, W frees ``w_share``) is at most ``memory_limit`` (+1e-9).

    Raises:
        ValueError: for v != 1, counts below 1, a limit below 1, a negative or infinite
            comm, w_share outside [0, 1], or per-stage costs not of length p.
    """
    return _search(_problem(p, m, v, target))


def zb_auto(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-auto for default targets: unit costs, no comm, ``w_share = 1``, limit p units.

    At ``w_share = 1`` (I frees nothing: an activation lives until its W) p units are p
    micro-batches in flight, the peak of 1F1B and ZB-H1, and the bubble is at most ZB-H1's:
    a makespan of ``m*(F+I+W) + (p-1)*(F+I-W)`` for m >= p. Equals
    ``zb_auto_search(p, m, v, Target())``; see there for the constraints.

    Raises:
        ValueError: for v != 1 or counts below 1.

    Example:
        >>> [str(a) for a in zb_auto(2, 2).actions[0]]
        ['0F0', '0F1', '0I0', '0W0', '0I1', '0W1']
    """
    return zb_auto_search(p, m, v, Target())


register(ScheduleKind("zb-auto", "Zero Bubble's automatic search under a memory limit "
                      "(ZB-1p at limit p, ZB-2p at 2p)", 1, zb_auto, zb_auto_search))
