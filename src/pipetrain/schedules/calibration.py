"""Calibration: the simulator's op costs and message delay, read off measured step timelines.

Ops profiled alone run faster than inside a pipeline, where each action also encodes and posts
its messages and shares the core with the runtime's other threads; an idle round trip is
faster than a message inside a step. So the costs that predict a step best are the runtime's
own: :func:`calibrate` takes the timelines of one or more steps (``StepResult.timeline``,
every rank's spans) and returns

    costs   per stage and op, the median duration of that stage's actions of that op
    comm    the median hop: from the end of an action whose output another rank needs to the
            start of the action there that needs it, counted only when that rank had been
            idle since before the send (otherwise the wait measures the receiver, not the
            message)

A calibration measured with one split of the layers into stages predicts another split
through :func:`regroup`. Ranks that shared fewer cores than there were ranks (CPU processes)
ran slower while more of them were busy: ``calibrate(..., cores=n)`` reads each span's work at
full speed (:func:`pipetrain.schedules.shared_cores.unshare`), and its predictions share the cores
again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipetrain.schedules.action import Op
from pipetrain.schedules.dataflow import needs, produces
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.shared_cores import unshare
from pipetrain.schedules.simulator import Costs, Simulation, simulate
from pipetrain.schedules.timeline import Span, Timeline

__all__ = ["Calibration", "calibrate", "hop_delays", "regroup", "stage_costs"]

OPS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Calibration:
    """Costs and a per-hop delay measured in steps of a pipeline (see the module docstring)."""

    costs: Costs
    """Per stage, in the timelines' time unit."""
    comm: float
    """The median hop; 0.0 when the timelines hold none."""
    hops: int
    """How many hops the median is over."""
    cores: float | None = None
    """The cores the measured ranks shared (costs are then work at full speed); None: one
    device per rank."""

    def predict(self, schedule: Schedule) -> Simulation:
        """``simulate(schedule, costs, comm, cores=cores)``: the schedule's step at these
        costs."""
        return simulate(schedule, self.costs, self.comm, cores=self.cores)


def calibrate(timelines: Timeline | Sequence[Timeline], schedule: Schedule, *,
              cores: float | None = None) -> Calibration:
    """Read costs per stage and op, and the message delay, off measured steps of ``schedule``.

    Args:
        timelines: one step's timeline or several (medians are over all of them), each with
            the spans of every rank.
        schedule: the schedule the steps ran.
        cores: the cores the ranks shared, when fewer than the ranks; None: a device each.

    Returns:
        A :class:`Calibration`; ``calibration.predict(other_schedule)`` simulates any
        schedule with the same stages.

    Raises:
        ValueError: as :func:`stage_costs`.

    Example:
        >>> from pipetrain import make_schedule
        >>> s = make_schedule("1f1b", 2, 4)
        >>> step = simulate(s, Costs(F=1, B=2), comm=0.5).timeline
        >>> calibrate(step, s).comm
        0.5
    """
    steps = _as_list(timelines)
    delays = hop_delays(steps, schedule)
    comm = max(0.0, statistics.median(delays)) if delays else 0.0
    work = steps if cores is None else [unshare(step, cores) for step in steps]
    return Calibration(stage_costs(work, schedule), comm, len(delays), cores)


def stage_costs(timelines: Timeline | Sequence[Timeline], schedule: Schedule) -> Costs:
    """Per stage, the median duration of each op's actions over ``timelines``.

    A stage whose steps ran no B gets B = I + W; one that ran no I and W gets I = W = B/2
    (the rules of :class:`Costs`, applied per stage).

    Raises:
        ValueError: when some stage has no F, or neither B nor both I and W, in the timelines.
    """
    durations: dict[tuple[str, int], list[float]] = {}
    for step in _as_list(timelines):
        for span in step.spans:
            durations.setdefault((span.action.op.value, span.action.stage), []).append(
                span.duration)
    per_stage = [_one_stage(durations, s) for s in range(schedule.n_stages)]
    return Costs(**{op: tuple(c[op] for c in per_stage) for op in OPS})


def _one_stage(durations: dict[tuple[str, int], list[float]], stage: int) -> dict[str, float]:
    got = {op: statistics.median(durations[op, stage]) for op in OPS if (op, stage) in durations}
    if "F" not in got or ("B" not in got and not {"I", "W"} <= got.keys()):
        missing = "F" if "F" not in got else "B (or I and W)"
        raise ValueError(f"the timelines have no {missing} action of stage {stage}; pass the "
                         "timelines of whole training steps of this schedule")
    if "B" not in got:
        got["B"] = got["I"] + got["W"]
    if "I" not in got or "W" not in got:
        got["I"] = got["W"] = got["B"] / 2
    return got


def hop_delays(timelines: Timeline | Sequence[Timeline], schedule: Schedule) -> list[float]:
    """Every hop in ``timelines`` (see the module docstring), in the timelines' order."""
    out: list[float] = []
    for step in _as_list(timelines):
        made = {produces(s.action): s for s in step.spans}
        for rank in range(step.n_ranks):
            idle_since = -math.inf
            for span in step.of_rank(rank):
                source = _last_input(span, made, schedule)
                if source is not None and source.rank != rank and source.end > idle_since:
                    out.append(span.start - source.end)
                idle_since = span.end
    return out


def _last_input(span: Span, made: dict[tuple[str, int, int], Span], schedule: Schedule
                ) -> Span | None:
    """The input of ``span``'s action that was ready last (None when it needs none); a
    decoding schedule's fed-back token is one."""
    inputs = [made[key] for key in needs(span.action, schedule.n_stages, schedule)
              if key in made]
    return max(inputs, key=lambda s: s.end, default=None)


def regroup(costs: Costs, balance: Sequence[int], target: Sequence[int], *,
            weights: Mapping[str, Sequence[float]] | None = None) -> Costs:
    """Costs measured with the layers split as ``balance``, moved to the split ``target``.

    Each measured stage's cost of an op is spread over its layers in proportion to
    ``weights[op]`` (one value per layer; equal shares for an op not given, or for a stage
    whose weights sum to 0); a target stage costs the sum over its layers. When every target
    stage is a union of measured stages, the weights do not matter and the result is exact
    up to what a stage boundary itself costs.

    Args:
        costs: per-stage costs (or uniform ones) of the split ``balance``.
        balance: layers per measured stage.
        target: layers per stage of the split to predict; the same layers in all.
        weights: per op ("F", "B", "I", "W"), a relative cost per layer, e.g. profiled.

    Raises:
        ValueError: for splits of different layer counts, non-positive layer counts, costs
            with another number of stages than ``balance``, or weights of the wrong length
            or negative.

    Example:
        >>> regroup(Costs(F=(1, 2, 3, 4), B=2), [1, 1, 1, 1], [2, 2]).F
        (3.0, 7.0)
    """
    _check_regroup(costs, balance, target, weights or {})
    fields = {}
    for op in OPS:
        layer = _per_layer(costs, Op(op), balance, (weights or {}).get(op))
        fields[op] = tuple(sum(layer[lo:lo + n]) for lo, n in zip(_starts(target), target))
    return Costs(**fields)


def _per_layer(costs: Costs, op: Op, balance: Sequence[int],
               weights: Sequence[float] | None) -> list[float]:
    out: list[float] = []
    for stage, (lo, n) in enumerate(zip(_starts(balance), balance)):
        share = [1.0] * n if weights is None else [float(w) for w in weights[lo:lo + n]]
        if sum(share) <= 0:
            share = [1.0] * n
        out += [costs.of(op, stage) * w / sum(share) for w in share]
    return out


def _starts(balance: Sequence[int]) -> list[int]:
    return [sum(balance[:j]) for j in range(len(balance))]


def _check_regroup(costs: Costs, balance: Sequence[int], target: Sequence[int],
                   weights: Mapping[str, Sequence[float]]) -> None:
    problems = []
    if any(n < 1 for n in [*balance, *target]):
        problems.append(f"layer counts must be >= 1, got balance {list(balance)} and target "
                        f"{list(target)}")
    if sum(balance) != sum(target):
        problems.append(f"balance {list(balance)} holds {sum(balance)} layers but target "
                        f"{list(target)} holds {sum(target)}; both must split the same layers")
    if costs.n_stages is not None and costs.n_stages != len(balance):
        problems.append(f"costs give {costs.n_stages} per-stage values but balance "
                        f"{list(balance)} has {len(balance)} stages")
    for op, values in weights.items():
        if op not in OPS:
            problems.append(f"weights name op {op!r}; ops are F, B, I, W")
        elif len(values) != sum(balance) or any(not v >= 0 for v in values):
            problems.append(f"weights[{op!r}] must hold {sum(balance)} numbers >= 0 (one per "
                            f"layer), got {list(values)}")
    if problems:
        raise ValueError("cannot regroup costs:\n" + "\n".join(f"  - {p}" for p in problems))


def _as_list(timelines: Timeline | Sequence[Timeline]) -> list[Timeline]:
    return [timelines] if isinstance(timelines, Timeline) else list(timelines)
