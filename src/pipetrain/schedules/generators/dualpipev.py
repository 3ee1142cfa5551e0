"""DualPipeV: DeepSeek's DualPipe cut in half onto a V, overlapping one forward with one backward.

DualPipe runs two pipelines in opposite directions over 2x the parameters; DualPipeV keeps one
copy of the model, folded as a V (rank r holds stages r and 2p-1-r, see ``vshape``), so the two
legs of the V play the two directions. In the steady phase each rank pairs a forward of one leg
with a backward of the other ("F&B"), which a runtime may overlap (compute of one hides the
communication of the other). Here a pair is simply two consecutive actions, forward first.
"""

from __future__ import annotations

from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.generators.vshape import RankOps, check_v_args, v_placement
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []


def dualpipev(p: int, m: int, v: int = 2) -> Schedule:
    """DualPipeV (DeepSeek-AI): V-shape schedule of overlapped forward/backward pairs.

    Mostly full backwards (B); the zero-bubble split into I and W is used where it fills
    a gap: in the warm-up (I1 W1 F1), in the second half of the cool-down's backwards, and
    for the last backwards of the down stage, whose W's close the step.

    Constraints: v = 2; any p >= 1 and m >= 1. The phases are full for m >= 2p (the
    reference implementation requires that); smaller m is built for 2p micro-batches with
    the extra ones dropped, which keeps it deadlock-free but leaves a longer bubble.
    Bubble: for m >= 2p, no communication time, and W <= I, F <= I (per-stage costs, as in
    the reference), each rank idles (S/2 - 1)(F&B + B - 3W) of the step's makespan, with
    S = 2p stages, B = I + W and F&B = F + B, when each F&B pair runs as one block. Run as
    separate actions (as ``dataflow.walk`` does), the pair's F need not wait for its B's
    gradient, and the idle time is at most that.
    Memory: for m >= 2p every rank peaks at S + 1 = 2p + 1 stage-activations, for any split
    of an activation between I and W: one more than ZB-V's 2p.

    Cites: DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), and the deepseek-ai/DualPipe
    repository (DualPipeV).

    Raises:
        ValueError: if ``v != 2``, ``p < 1`` or ``m < 1``.
    """
    check_v_args("dualpipev", p, m, v)
    n = max(m, 2 * p)
    lists = [_dualpipev_rank(p, n, r).below(m) for r in range(p)]
    return Schedule.from_lists("dualpipev", m, v_placement(p), lists)


def _dualpipev_rank(p: int, n: int, r: int) -> RankOps:
    # Requires n >= 2p so that every phase count is non-negative.
    down, up = r, 2 * p - 1 - r
    ops = RankOps()
    for _ in range(2 * (p - r - 1)):  # warm-up: nF0
        ops.f(down)
    for _ in range(r + 1):  # warm-up: n(F0 F1)
        ops.f(down)
        ops.f(up)
    for _ in range(p - r - 1):  # warm-up: n(I1 W1 F1) (zero bubble)
        ops.i(up)
        ops.w()
        ops.f(up)
    for _ in range(n - 2 * p + r + 1):  # steady: n(F0&B1 F1&B0)
        ops.f(down)
        ops.b(up)
        ops.f(up)
        ops.b(down)
    for _ in range(p - r - 1):  # steady, forwards of the down stage done: n(B1 F1&B0)
        ops.b(up)
        ops.f(up)
        ops.b(down)
    _dualpipev_cooldown(ops, p, r)
    return ops


def _dualpipev_cooldown(ops: RankOps, p: int, r: int) -> None:
    down, up = r, 2 * p - 1 - r
    for k in range(2 * (r + 1)):  # cool-down: n(B1 B0), the second half split as I, W later
        stage = up if k % 2 == 0 else down
        if k < r + 1:
            ops.b(stage)
        else:
            ops.i(stage)
    for _ in range(p - r - 1):  # cool-down: n(W I0) (oldest pending W first)
        ops.w()
        ops.i(down)
    for _ in range(r + 1):  # cool-down: nW
        ops.w()


register(ScheduleKind("dualpipev", "DeepSeek DualPipeV: V-shape, overlapped F&B pairs, 2 stages "
                      "per rank", 2, dualpipev))
