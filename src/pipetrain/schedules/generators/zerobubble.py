"""Zero-bubble schedules: the backward split into I (input gradient) and W (weight gradient).

Only I is on the critical path: the previous stage waits for it. W waits for nobody, so a
schedule can defer it into the gaps where 1F1B idles. Both handcrafted schedules of Qi et al.
("Zero Bubble (Almost) Pipeline Parallelism", ICLR 2024) follow the same three phases on every
rank r, and differ only in how many forwards they issue before the first I and how many W's
they hold back:

    # warm-up:   nF
    # steady:    1F 1I, plus 1W once `defer` I's are ahead of the W's
    # cool-down: 1I 1W for the last I's, then the deferred W's

Every rank then keeps the same number of micro-batches in flight (forward done, W not yet):
warm-up + 1 + defer. Here ``i`` is a micro-batch and, with one stage per rank, stage = rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []  # public entry points: make_schedule("zb-h1" | "zb-h2")


def _require_one_stage(name: str, p: int, m: int, v: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(
            f"{name} needs n_ranks >= 1 and n_microbatches >= 1, got n_ranks={p}, "
            f"n_microbatches={m}"
        )
    if v != 1:
        raise ValueError(
            f"{name} places one stage per rank (stages_per_rank=1), got stages_per_rank={v}; "
            "use interleaved-zb (or interleaved-1f1b) for several stages per rank"
        )


def split_backward_list(
    fwd: Sequence[Action], ins: Sequence[Action], ws: Sequence[Action], warmup: int, defer: int,
) -> list[Action]:
    """One rank's list from its F's, I's and W's, each given in the order they must run.

    ``warmup`` forwards first; in the steady phase each I is followed by a W once ``defer``
    I's are ahead of the W's; each cool-down I is followed by a W; the deferred W's end it.
    Shared with the interleaved schedules, whose units are (stage, mb) pairs.
    """
    n = len(fwd)
    warmup = min(warmup, n)
    acts = list(fwd[:warmup])  # warm-up: nF
    n_w = 0  # W's issued so far
    for k in range(n - warmup):  # steady: 1F 1I (+1W)
        acts += [fwd[warmup + k], ins[k]]
        if k >= defer:
            acts.append(ws[n_w])
            n_w += 1
    for k in range(n - warmup, n):  # cool-down: 1I 1W
        acts += [ins[k], ws[n_w]]
        n_w += 1
    return acts + list(ws[n_w:])  # cool-down: the deferred W's


def _rank_actions(rank: int, m: int, warmup: int, defer: int) -> list[Action]:
    fwd, ins, ws = ([Action(rank, op, i) for i in range(m)] for op in (Op.F, Op.I, Op.W))
    return split_backward_list(fwd, ins, ws, warmup, defer)


def zb_h1(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024, section 2.1): 1F1B's warm-up, W's deferred into the drain.

    Rank r issues 1F1B's ``p-1-r`` warm-up forwards and holds its first r W's back, so every
    rank keeps p micro-batches in flight and the W's fill the cool-down gaps of 1F1B.

    Constraints: v = 1; any m >= 1.
    Bubble (comm = 0, costs F, I, W): for m >= p the makespan is
    ``m*(F+I+W) + (p-1)*(F+I-W)`` (a third of 1F1B's (p-1)(F+I+W) when F = I = W), exactly when
    ``W <= min(F, I)``. With a slower W it is larger, and at least ``m*(F+I+W) + (p-1)*I``:
    rank 0 idles (p-1)*I before its first I whatever the costs. For m < p every micro-batch is
    in flight at once and the makespan is ``(m+p-1)*(F+I) + W`` (again when W <= min(F, I)).
    Memory: at most p micro-batches in flight (forward done, W not yet) on every rank, the peak
    of 1F1B (on rank 0); deferred W's keep only W's smaller share of the activations.

    Raises:
        ValueError: for v != 1 or non-positive counts.

    Example:
        >>> [str(a) for a in zb_h1(2, 3).actions[1]]
        ['1F0', '1I0', '1F1', '1I1', '1W0', '1F2', '1I2', '1W1', '1W2']
    """
    _require_one_stage("zb-h1", p, m, v)
    lists = [_rank_actions(r, m, warmup=p - 1 - r, defer=r) for r in range(p)]
    return Schedule.from_lists("zb-h1", m, range(p), lists)


def zb_h2(p: int, m: int, v: int = 1) -> Schedule:
    """ZB-H2 (Qi et al., ICLR 2024, section 2.2): twice the warm-up, no bubble inside a rank.

    Rank r issues ``2*(p-1-r)`` warm-up forwards (so 2p-1-2r before its first I: the forwards
    that fill 1F1B's warm-up bubble) and holds its first 2r W's back: every rank keeps 2p-1
    micro-batches in flight and the ranks' time lines form a parallelogram.

    Constraints: v = 1; any m >= 1; the bubble below needs m >= 2p-1 (with fewer micro-batches
    the warm-up is cut to m and ranks wait for their first I).
    Bubble (comm = 0, costs F, I, W), measured as the paper does on the longest per-rank span
    (a rank's last end minus its first start): for m >= 2p-1 that span is
    ``m*(F+I+W) + (p-1)*max(0, F+I-2W, I-F)``. This is the published ``(p-1)*(F+I-2W)``
    (zero when F+I <= 2W) whenever ``I <= F`` or ``W <= F``; with I > F and W > F rank 0 idles
    (p-1)*(I-F) waiting for its first I, which no reordering of W's can fill. The spans are
    staggered by the fill, so one step's makespan is longer; the paper removes the stagger
    across steps by overlapping the optimizer step.
    Memory: at most 2p-1 micro-batches in flight (forward done, W not yet) on every rank, about
    twice 1F1B's p.

    Raises:
        ValueError: for v != 1 or non-positive counts.

    Example:
        >>> [str(a) for a in zb_h2(2, 3).actions[0]]
        ['0F0', '0F1', '0F2', '0I0', '0W0', '0I1', '0W1', '0I2', '0W2']
    """
    _require_one_stage("zb-h2", p, m, v)
    lists = [_rank_actions(r, m, warmup=2 * (p - 1 - r), defer=2 * r) for r in range(p)]
    return Schedule.from_lists("zb-h2", m, range(p), lists)


register(ScheduleKind("zb-h1", "1F1B with split backward, W's deferred into the drain (ZB-H1)",
                      1, zb_h1))
register(ScheduleKind("zb-h2", "split backward with 2p-1 in flight: no bubble inside a rank "
                      "(ZB-H2)", 1, zb_h2))
