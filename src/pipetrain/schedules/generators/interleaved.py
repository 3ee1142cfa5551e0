"""Interleaved schedules: each rank holds v stages (r, r+p, ...), so fill and drain shrink v-fold.

Stage s lives on rank ``s mod p``. A micro-batch therefore loops around the ranks v times, and
the forwards of one rank are issued in *rounds*: a round of g >= p micro-batches goes through the
rank's first stage, then its second stage, and so on; the backwards walk the same rounds with
the stages in reverse. Rounds of at least p micro-batches keep the loop busy: by the time rank 0
has sent g micro-batches into its first stage, the first of them is back from rank p-1 and ready
for rank 0's second stage.

Here ``i`` is a micro-batch, ``j`` a stage, ``k`` a rank-local unit (one (stage, mb) pair), as
in the rest of pipetrain. Costs f and b below are per *stage*, i.e. 1/v of a rank's layers.
"""

from __future__ import annotations

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.generators.zerobubble import split_backward_list
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []  # public entry points: make_schedule("interleaved-1f1b" | "interleaved-zb")

# One rank-local unit of work: (stage, mb).
Unit = tuple[int, int]


def _require_counts(name: str, p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(
            f"{name} needs n_ranks >= 1 and n_microbatches >= 1, got n_ranks={p}, "
            f"n_microbatches={m}"
        )


def _require_interleaved(name: str, p: int, m: int, v: int, fallback: str) -> None:
    _require_counts(name, p, m)
    if v < 2:
        raise ValueError(
            f"{name} needs stages_per_rank >= 2, got {v}; use {fallback} for one stage per rank"
        )


def _rounds(p: int, m: int) -> list[int]:
    """Micro-batch round sizes: all >= p (the largest first), or one round of m when m < p.

    ``m // p`` rounds share the m micro-batches; the remainder goes one by one to the earliest
    rounds, so the warm-up (which covers the first round) bounds the memory for the whole step.

    >>> _rounds(4, 8), _rounds(4, 11), _rounds(4, 3)
    ([4, 4], [6, 5], [3])
    """
    if m < p:
        return [m]
    n_rounds = m // p
    base, extra = divmod(m, n_rounds)
    return [base + (1 if k < extra else 0) for k in range(n_rounds)]


def _unit_order(p: int, v: int, rank: int, sizes: list[int], *, backward: bool) -> list[Unit]:
    """The order in which ``rank`` visits its (stage, mb) units, round by round.

    Forward: in each round, the rank's stages in increasing order, each over the round's
    micro-batches in increasing order. Backward: the same with the stages in decreasing order.
    Every stage thus sees its micro-batches in increasing order, in both directions.
    """
    order: list[Unit] = []
    first = 0
    for size in sizes:
        for n in range(v):
            local = v - 1 - n if backward else n  # the rank's local stage index
            order += [(local * p + rank, first + i) for i in range(size)]
        first += size
    return order


def _warmup(p: int, m: int, v: int, rank: int, first_round: int) -> int:
    # The rank's last stage sees micro-batch 0 after its first v-1 stages went through the
    # whole first round; 2 more per rank below the last keep the steady state free of waits
    # (Narayanan et al.).
    return min((v - 1) * first_round + 2 * (p - 1 - rank), m * v)


def interleaved_1f1b(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
    Clusters Using Megatron-LM", SC 2021): 1F1B over v stages per rank, stage s on rank s mod p.

    Rank r warms up with ``(v-1)*g + 2*(p-1-r)`` forwards (g: the first round's size, see
    ``_rounds``), then alternates one forward and one backward, then drains its backwards.

    Constraints: v >= 2; any m >= 1. Megatron and torch ask for m to be a multiple of p (torch:
    of its number of rounds); here the remainder is spread over the first rounds, so every round
    still has at least p micro-batches and no rank waits in the steady state.
    Bubble (comm = 0, per-stage costs f and b): for m >= p the makespan is
    ``m*v*(f+b) + (p-1)*(f+b)``, i.e. the 1F1B bubble (p-1)(F+B) of whole-rank costs divided
    by v; for m < p it is ``(v*p + m - 1)*(f+b)`` (each loop around the ranks waits for p units).
    Memory: rank r holds at most ``(v-1)*g + 2*(p-1-r) + 1`` stage activations (capped at m*v),
    about (1 + 1/v) times 1F1B's p whole-rank micro-batches on rank 0 when g = p; a larger
    first round (m not a multiple of p) raises this by (v-1) stage activations per extra
    micro-batch.

    Raises:
        ValueError: for v < 2 (use ``1f1b``) or non-positive counts.

    Example:
        >>> s = interleaved_1f1b(2, 4, 2)
        >>> [str(a) for a in s.actions[1][:4]]
        ['1F0', '1F1', '3F0', '3B0']
    """
    _require_interleaved("interleaved-1f1b", p, m, v, "1f1b")
    sizes = _rounds(p, m)
    lists = []
    for r in range(p):
        fwd = _actions(_unit_order(p, v, r, sizes, backward=False), Op.F)
        bwd = _actions(_unit_order(p, v, r, sizes, backward=True), Op.B)
        warmup = _warmup(p, m, v, r, sizes[0])
        acts = fwd[:warmup]  # warm-up: nF
        for k in range(m * v - warmup):  # steady: 1F1B
            acts += [fwd[warmup + k], bwd[k]]
        acts += bwd[m * v - warmup:]  # cool-down: nB
        lists.append(acts)
    return Schedule.from_lists("interleaved-1f1b", m, _placement(p, v), lists)


def interleaved_zb(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B with the backward split into I and W, and the
    W's placed as in ZB-H1 (Qi et al., "Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024;
    torch calls its variant ScheduleInterleavedZeroBubble).

    F's and I's run in :func:`interleaved_1f1b`'s order and warm-up; rank r then holds its
    first r W's back and fills the cool-down with them. W's of a stage run in mb order.

    Constraints: v >= 2; any m >= 1.
    Bubble (comm = 0, per-stage costs f, i, w): for m >= p the makespan is
    ``m*v*(f+i+w) + (p-1)*(f+i-w)`` exactly when ``w <= min(f, i)``, against interleaved
    1F1B's ``m*v*(f+i+w) + (p-1)*(f+i+w)``; with a slower W or m < p it is larger, though on
    the tested grid never above interleaved 1F1B's with b = i + w.
    Memory: rank r holds at most ``(v-1)*g + 2*(p-1) - r + 1`` stage activations until their
    W's (capped at m*v), so the peak (rank 0) is interleaved 1F1B's.

    Raises:
        ValueError: for v < 2 (use ``zb-h1``) or non-positive counts.

    Example:
        >>> [str(a) for a in interleaved_zb(2, 2, 2).actions[1]][:6]
        ['1F0', '1F1', '3F0', '3I0', '3F1', '3I1']
    """
    _require_interleaved("interleaved-zb", p, m, v, "zb-h1")
    sizes = _rounds(p, m)
    lists = []
    for r in range(p):
        fwd = _actions(_unit_order(p, v, r, sizes, backward=False), Op.F)
        bwd = _unit_order(p, v, r, sizes, backward=True)
        warmup = _warmup(p, m, v, r, sizes[0])
        lists.append(split_backward_list(fwd, _actions(bwd, Op.I), _actions(bwd, Op.W),
                                         warmup, defer=r))
    return Schedule.from_lists("interleaved-zb", m, _placement(p, v), lists)


def _actions(units: list[Unit], op: Op) -> list[Action]:
    return [Action(j, op, i) for j, i in units]


def _placement(p: int, v: int) -> list[int]:
    return [j % p for j in range(p * v)]


register(ScheduleKind(
    "interleaved-1f1b", "1F1B over v stages per rank placed round-robin (Megatron interleaved)",
    2, interleaved_1f1b,
))
register(ScheduleKind(
    "interleaved-zb", "interleaved 1F1B with split backward, W's deferred as in ZB-H1", 2,
    interleaved_zb,
))
