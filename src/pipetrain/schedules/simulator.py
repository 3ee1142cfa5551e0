"""Simulator: when each action of a schedule runs, given op costs and a per-hop comm delay.

Times come from :func:`pipetrain.schedules.dataflow.walk`: every rank runs its list in order, each
action as soon as the rank is free and its inputs have arrived; an input produced on another rank
arrives ``comm`` after its producer ends.

Memory model (``peak_activations``), counted per rank in stage-activation units, where one
unit is what one F of one stage on one micro-batch keeps alive for its backward:

    F        allocates 1 unit when it starts
    B        frees 1 unit when it ends
    I        frees ``1 - w_share`` units and allocates ``i_held`` units when it ends
    W        frees ``w_share + i_held`` units when it ends

The peak is the maximum of the running sum over the rank's timeline; at equal times frees are
counted before allocations. Weights, optimizer state, gradients and in-flight messages are not
counted; every stage is assumed to keep the same activation size.

``w_share`` is the part of a micro-batch's saved tensors that must survive from I until W.
The weight gradient of a linear layer needs that layer's input, and the runtime keeps the
micro-batch's saved tensors until its W, so the conservative default is ``w_share = 1.0``
(I frees nothing). Smaller values model a runtime that drops what only I needed.

``i_held`` is what I adds on top and W frees: the gradients at the cut between input and
weight gradients (each weight's output gradient), which I computes and W consumes. A float
applies to every stage but stage 0, whose I has no input gradient to compute (its input is
data) and so keeps next to nothing; a tuple gives every stage's share. The default 0.0 leaves
it out. ``benchmarks/memory.py`` measures 0.69 for a stage of pre-norm transformer blocks
(docs/benchmarks.md), where counting it takes the zero-bubble schedules' ranks after the
first from 1.4-1.75 times the count to within 10 %.
``peak_pairs`` keeps the two apart: the (units, I-held count) pairs that can be the peak, for a
caller that weighs them by bytes measured per stage (:mod:`pipetrain.split.balance`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.shared_cores import shared_walk
from pipetrain.schedules.timeline import Span, Timeline
from pipetrain.schedules.validate import validate

__all__ = ["Costs", "Simulation", "simulate"]

Cost = float | tuple[float, ...]  # one value for every stage, or one value per stage
DEFAULT_W_SHARE = 1.0


@dataclass(frozen=True)
class Costs:
    """Time per stage per micro-batch of each op: a float, or a tuple with one value per stage.

    Unset backward costs are derived: with B alone, I = W = B/2; with B and one of I/W, the
    other is B minus it; without B, I and W default to 1.0 and B = I + W. After construction
    every field holds a value. A B given together with I and W may differ from I + W (a fused
    backward can be cheaper than its two halves).

    Example:
        >>> Costs(F=1.0, B=2.0).of(Op.W, 0)
        1.0
        >>> Costs.parse("F=1:2,B=2").of(Op.F, 1)
        2.0

    Raises:
        ValueError: for a negative or non-finite cost, per-stage tuples of different lengths,
            or derived I/W that would be negative.
    """

    F: Cost = 1.0
    """Forward."""
    B: Cost | None = None
    """Fused backward; default I + W."""
    I: Cost | None = None  # noqa: E741  (the glossary's letter)
    """Input-gradient backward; default B/2 when only B is given, else 1.0."""
    W: Cost | None = None
    """Weight-gradient backward; default B/2 when only B is given, else 1.0."""

    def __post_init__(self) -> None:
        given = {op: _normalize(op, getattr(self, op)) for op in "FBIW"}
        lengths = {len(v) for v in given.values() if isinstance(v, tuple)}
        if len(lengths) > 1:
            raise ValueError(f"per-stage costs have different lengths {sorted(lengths)}; give "
                             "one value per stage for every per-stage op")
        b, i, w = _derive_backward(given["B"], given["I"], given["W"])
        for op, value in zip("FBIW", (given["F"], b, i, w), strict=True):
            object.__setattr__(self, op, value)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Read ``"F=1,B=2"``, ``"F=1,I=1,W=1"`` or per stage ``"F=1:2:1:1,B=2"``.

        Raises:
            ValueError: for an unknown op, a repeated op, or a value that is not a number.
        """
        fields: dict[str, Cost] = {}
        for item in text.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            op = key.upper()
            if not sep or op not in ("F", "B", "I", "W"):
                raise ValueError(f"cannot parse costs {text!r} at {item.strip()!r}: expected "
                                 "OP=VALUE items with OP one of F, B, I, W, for example "
                                 "'F=1,B=2' or per stage 'F=1:2:1:1,B=2'")
            if op in fields:
                raise ValueError(f"cannot parse costs {text!r}: {op} is given twice")
            fields[op] = _parse_value(text, op, value)
        return cls(**fields)

    def of(self, op: Op, stage: int) -> float:
        """The cost of ``op`` on ``stage``.

        Raises:
            ValueError: if per-stage costs do not cover ``stage``.
        """
        value = getattr(self, op.value)
        if not isinstance(value, tuple):
            return float(value)
        if not 0 <= stage < len(value):
            raise ValueError(f"costs give {len(value)} per-stage values for {op.value}, "
                             f"no value for stage {stage}")
        return float(value[stage])

    @property
    def n_stages(self) -> int | None:
        """The number of per-stage values, or None when every op has one value for all."""
        for op in "FBIW":
            value = getattr(self, op)
            if isinstance(value, tuple):
                return len(value)
        return None

    def to_dict(self) -> dict[str, float | list[float]]:
        return {op: _jsonable(getattr(self, op)) for op in "FBIW"}

    def __str__(self) -> str:
        """The text :meth:`parse` reads back into an equal Costs."""
        return ",".join(f"{op}={_format(getattr(self, op))}" for op in "FBIW")


@dataclass(frozen=True)
class Simulation:
    """A simulated run of one schedule: its timeline and the metrics derived from it."""

    schedule: Schedule
    costs: Costs
    comm: float
    """Delay added to every dependency that crosses ranks."""
    w_share: float
    """Share of a micro-batch's activation freed by W rather than I (see module docstring)."""
    timeline: Timeline
    """One span per action."""
    makespan: float
    """Time from the first start to the last end, over all ranks."""
    span: tuple[float, ...]
    """Per rank: its last end minus its first start."""
    idle: tuple[float, ...]
    """Per rank: makespan minus the rank's busy time."""
    bubble_fraction: float
    """1 - total busy / (ranks x makespan): the share of device time spent waiting."""
    bubble_rate: float
    """Zero Bubble (Qi et al. 2024): (cost - work) / cost, cost = the longest per-rank span,
    work = the largest per-rank busy time (their m·v·(F+I+W) for uniform costs)."""
    peak_activations: tuple[float, ...]
    """Per rank, the most stage-activation units alive at once (see module docstring)."""
    i_held: Cost = 0.0
    """Units I adds and W frees (see module docstring): one for all stages but 0, or per stage."""
    cores: float | None = None
    """The cores the ranks shared (:mod:`pipetrain.schedules.shared_cores`); None: a device each."""

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready summary, with the action lists and every span's start and end."""
        s = self.schedule
        return {
            "schedule": s.name, "ranks": s.n_ranks, "stages": s.n_stages,
            "microbatches": s.n_microbatches, "makespan": self.makespan,
            "span": list(self.span), "idle": list(self.idle),
            "bubble_fraction": self.bubble_fraction, "bubble_rate": self.bubble_rate,
            "peak_activations": list(self.peak_activations),
            "costs": self.costs.to_dict(), "comm": self.comm, "w_share": self.w_share,
            "i_held": _jsonable(self.i_held), "cores": self.cores,
            "actions": [[str(a) for a in acts] for acts in s.actions],
            "spans": [[[str(x.action), x.start, x.end] for x in self.timeline.of_rank(r)]
                      for r in range(s.n_ranks)],
        }


def simulate(
    schedule: Schedule, costs: Costs | None = None, comm: float = 0.0, *,
    w_share: float = DEFAULT_W_SHARE, i_held: Cost = 0.0, cores: float | None = None,
    validated: bool = False,
) -> Simulation:
    """Validate ``schedule`` and compute when each action runs and what it costs.

    Args:
        schedule: the schedule to simulate.
        costs: op costs, uniform or per stage; None means F = I = W = 1, B = 2.
        comm: delay added to every dependency that crosses ranks (0 = free communication).
        w_share: share of a micro-batch's stage activation that W (not I) frees, in [0, 1].
        i_held: units I keeps for W on top (the gradients at the cut): one value for every
            stage but stage 0, or a tuple per stage; see the module docstring.
        cores: the cores the ranks share, when fewer than the ranks (CPU processes): each of
            ``k`` busy ranks then runs at ``min(1, cores / k)`` of its speed
            (:mod:`pipetrain.schedules.shared_cores`); None gives each rank its own device.
        validated: the caller validated this very schedule already (a planner simulating one
            schedule under many costs): it is not validated again.

    Returns:
        A :class:`Simulation` with the timeline, makespan, bubble and peak-memory metrics.

    Raises:
        ScheduleError: if the schedule is invalid (see
        :func:`pipetrain.schedules.validate.validate`).
        ValueError: for an asynchronous schedule (see :meth:`Schedule.unroll`), per-stage
            costs of the wrong length, a negative or non-finite
            ``comm``, ``w_share`` outside [0, 1], or a negative ``i_held`` (or a tuple of
            another length than the stages).

    Example:
        >>> from pipetrain import make_schedule
        >>> simulate(make_schedule("gpipe", 4, 8), Costs(F=1, B=2)).makespan
        33.0
    """
    if schedule.update is not None:
        raise ValueError(f"{schedule.name!r} is asynchronous: one step of it has no makespan of "
                         "its own; simulate schedule.unroll(k) (k steps and the drain), or "
                         "take its steady state with pipetrain.schedules.steady_state.steady_state")
    costs = Costs() if costs is None else costs
    _check_arguments(schedule, costs, comm, w_share)
    held = held_per_stage(i_held, schedule.n_stages)
    if not validated:
        validate(schedule)
    def duration(rank: int, a: Action) -> float:
        return costs.of(a.op, a.stage)

    result = (walk(schedule, duration, comm) if cores is None
              else shared_walk(schedule, duration, comm, cores))
    spans = tuple(Span(rank, schedule.actions[rank][step], result.start[rank, step],
                       result.end[rank, step]) for rank, step in result.order)
    timeline = Timeline(schedule.n_ranks, spans)
    ranks = range(schedule.n_ranks)
    span = tuple(timeline.span(r) for r in ranks)
    busy = [timeline.busy(r) for r in ranks]
    cost, work = max(span), max(busy)
    return Simulation(
        schedule=schedule, costs=costs, comm=comm, w_share=w_share, timeline=timeline,
        makespan=timeline.makespan, span=span, idle=tuple(timeline.idle(r) for r in ranks),
        bubble_fraction=timeline.bubble_fraction,
        bubble_rate=(cost - work) / cost if cost > 0 else 0.0,
        peak_activations=tuple(peak_units(timeline.of_rank(r), w_share, held) for r in ranks),
        i_held=i_held, cores=cores,
    )


def _check_arguments(schedule: Schedule, costs: Costs, comm: float, w_share: float) -> None:
    if costs.n_stages is not None and costs.n_stages != schedule.n_stages:
        raise ValueError(f"costs give {costs.n_stages} per-stage values but schedule "
                         f"{schedule.name!r} has {schedule.n_stages} stages")
    if not (math.isfinite(comm) and comm >= 0):
        raise ValueError(f"comm must be a finite number >= 0, got {comm!r}")
    if not 0.0 <= w_share <= 1.0:
        raise ValueError(f"w_share must be in [0, 1], got {w_share!r}")


def held_per_stage(i_held: Cost, n_stages: int) -> tuple[float, ...]:
    """``i_held`` as one value per stage (a float leaves stage 0 out; see the docstring)."""
    if isinstance(i_held, tuple):
        if len(i_held) != n_stages:
            raise ValueError(f"i_held gives {len(i_held)} per-stage values but the schedule has "
                             f"{n_stages} stages")
        return tuple(_finite_nonneg("i_held", x) for x in i_held)
    return (0.0,) + (_finite_nonneg("i_held", i_held),) * (n_stages - 1)


def peak_units(spans: Sequence[Span], w_share: float, held: Sequence[float],
               size: Sequence[float] | None = None,
               replay: Sequence[float] | None = None) -> float:
    """The most activation units alive at once over ``spans`` (the module's memory model).

    ``size[stage]`` weighs one unit of that stage (bytes, say); None counts every unit as 1.
    ``replay[stage]`` is what a recomputed stage's backward rebuilds before it runs: allocated
    when I (or B) starts, freed when W (or B) ends.
    """
    events = [(t, order, units * (1.0 if size is None else size[stage]) + held[stage] * n_held)
              for t, order, stage, units, n_held in _events(spans, w_share)]
    if replay is not None:
        for s in spans:
            if s.action.op in (Op.I, Op.B):
                events.append((s.start, 1, replay[s.action.stage]))
            if s.action.op in (Op.W, Op.B):
                events.append((s.end, 0, -replay[s.action.stage]))
    alive = peak = 0.0
    for _, _, delta in sorted(events):
        alive += delta
        peak = max(peak, alive)
    return peak


def peak_pairs(spans: Sequence[Span], w_share: float) -> tuple[tuple[float, float], ...]:
    """The Pareto-maximal (units, I-held count) pairs alive at once over ``spans``.

    Units follow the module's memory model with ``i_held = 0``; the count is the I's whose W
    has not ended. For weights ``a, h >= 0`` the peak over time of ``a x units + h x count`` is
    the largest ``a x u + h x n`` over these pairs, which two separate peaks can overstate.
    Sorted by units, ascending.

    Example:
        >>> from pipetrain import make_schedule
        >>> sim = simulate(make_schedule("zbv", 2, 4))
        >>> peak_pairs(sim.timeline.of_rank(1), sim.w_share)  # 3 units + 3 held, or 4 + 1
        ((3.0, 3.0), (4.0, 1.0))
    """
    states = {(0.0, 0.0)}
    units = count = 0.0
    for _, _, _, du, dn in sorted(_events(spans, w_share), key=lambda e: e[:2]):
        units, count = units + du, count + dn
        states.add((units, count))
    best: list[tuple[float, float]] = []
    for u, n in sorted(states, key=lambda p: (-p[0], -p[1])):  # most units first
        if not best or n > best[-1][1]:
            best.append((u, n))
    return tuple(reversed(best))


def _events(spans: Sequence[Span], w_share: float
            ) -> list[tuple[float, int, int, float, float]]:
    # (time, order, stage, units, I-held count): order 0 frees, 1 allocations, so frees win ties.
    events: list[tuple[float, int, int, float, float]] = []
    for s in spans:
        stage, op = s.action.stage, s.action.op
        if op is Op.F:
            events.append((s.start, 1, stage, 1.0, 0.0))
            continue
        events.append((s.end, 0, stage, -_freed(s.action, w_share), -1.0 if op is Op.W else 0.0))
        if op is Op.I:  # after I's own frees, as an allocation
            events.append((s.end, 1, stage, 0.0, 1.0))
    return events


def _freed(action: Action, w_share: float) -> float:
    return {Op.B: 1.0, Op.I: 1.0 - w_share, Op.W: w_share}[action.op]


# -- cost values ---------------------------------------------------------------------------


def _normalize(op: str, value: object) -> Cost | None:
    if value is None and op != "F":
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _finite_nonneg(op, float(value))
    if isinstance(value, (tuple, list)) and value:
        return tuple(_finite_nonneg(op, x) for x in value)
    raise ValueError(f"cost {op} must be a number or a non-empty sequence of numbers, "
                     f"got {value!r}")


def _finite_nonneg(op: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"cost {op} must be numeric, got {x!r}")
    if not (math.isfinite(x) and x >= 0):
        raise ValueError(f"cost {op} must be a finite number >= 0, got {x!r}")
    return float(x)


def _derive_backward(b: Cost | None, i: Cost | None, w: Cost | None) -> tuple[Cost, Cost, Cost]:
    # The unset ones of B, I, W from the set ones (rules in the Costs docstring).
    if b is None:
        i, w = (1.0 if i is None else i), (1.0 if w is None else w)
        return _combine(i, w, lambda x, y: x + y), i, w
    if i is None and w is None:
        half = _combine(b, b, lambda x, _: x / 2)
        return b, half, half
    if i is None:
        assert w is not None  # the branch above took i and w both None
        return b, _nonneg("I", "B - W", _combine(b, w, lambda x, y: x - y)), w
    if w is None:
        return b, i, _nonneg("W", "B - I", _combine(b, i, lambda x, y: x - y))
    return b, i, w


def _combine(a: Cost, b: Cost, fn: Callable[[float, float], float]) -> Cost:
    if not isinstance(a, tuple) and not isinstance(b, tuple):
        return fn(a, b)
    n = max(len(v) for v in (a, b) if isinstance(v, tuple))
    xs = a if isinstance(a, tuple) else (a,) * n
    ys = b if isinstance(b, tuple) else (b,) * n
    return tuple(fn(x, y) for x, y in zip(xs, ys, strict=True))


def _nonneg(op: str, formula: str, value: Cost) -> Cost:
    values = value if isinstance(value, tuple) else (value,)
    if any(v < 0 for v in values):
        raise ValueError(f"derived cost {op} = {formula} is negative ({_format(value)}); "
                         f"give {op} explicitly or a larger B")
    return value


def _parse_value(text: str, op: str, value: str) -> Cost:
    try:
        numbers = [float(v) for v in value.split(":")]
    except ValueError:
        raise ValueError(f"cannot parse costs {text!r}: {op}={value!r} is not a number or "
                         "colon-separated numbers per stage (like F=1:2:1:1)") from None
    return numbers[0] if len(numbers) == 1 else tuple(numbers)


def _format(value: Cost) -> str:
    values = value if isinstance(value, tuple) else (value,)
    return ":".join(str(int(v)) if v.is_integer() else repr(v) for v in values)


def _jsonable(value: Cost | None) -> float | list[float]:
    return list(value) if isinstance(value, tuple) else float(value or 0.0)
