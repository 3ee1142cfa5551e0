"""Basic schedules: GPipe (all forwards, then all backwards) and 1F1B (alternating)."""

from __future__ import annotations

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.generators import ScheduleKind, register
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []


def _require_v1(name: str, v: int) -> None:
    if v != 1:
        raise ValueError(
            f"{name} places one stage per rank (stages_per_rank=1), got stages_per_rank={v}; "
            "use interleaved-1f1b, zbv or dualpipev for several stages per rank"
        )


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al., 2019): every rank runs all m forwards, then all m backwards.

    Constraints: v = 1; any m >= 1.
    Bubble: (p-1)(F+B) per step; makespan (m+p-1)(F+B).
    Memory: rank r holds all m micro-batches' activations at the F/B turn (peak m).
    """
    _require_v1("gpipe", v)
    lists = [
        [Action(r, Op.F, i) for i in range(m)] + [Action(r, Op.B, i) for i in range(m)]
        for r in range(p)
    ]
    return Schedule.from_lists("gpipe", m, range(p), lists)


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B (Narayanan et al., PipeDream-Flush 2021): warm up with forwards, then alternate.

    Constraints: v = 1; any m >= 1 (for m < p the warm-up is simply shorter).
    Bubble: (p-1)(F+B), the same makespan as GPipe, (m+p-1)(F+B).
    Memory: rank r holds at most min(p-r, m) micro-batches' activations.
    """
    _require_v1("1f1b", v)
    lists = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(r, Op.F, i) for i in range(warmup)]  # warm-up: nF
        for i in range(m - warmup):  # steady: 1F1B
            acts += [Action(r, Op.F, warmup + i), Action(r, Op.B, i)]
        acts += [Action(r, Op.B, i) for i in range(m - warmup, m)]  # cool-down: nB
        lists.append(acts)
    return Schedule.from_lists("1f1b", m, range(p), lists)


register(ScheduleKind("gpipe", "all forwards, then all backwards (GPipe)", 1, gpipe))
register(ScheduleKind("1f1b", "one forward, one backward after a warm-up (PipeDream-Flush)", 1,
                      one_f_one_b))
