"""Timing: per-stage op costs read off one measured step, and the simulator's prediction from them.

The picture of a step shows the measured timeline next to what :func:`pipetrain.simulate`
predicts for the same schedule when every action of stage ``s`` with op ``o`` takes the
median measured duration of that stage's ``o`` actions. What remains between the two is
communication, waiting on peers, and per-action variation.
"""

from __future__ import annotations

import statistics

from pipetrain.action import Op
from pipetrain.schedule import Schedule
from pipetrain.simulate import Costs, Simulation, simulate
from pipetrain.timeline import Timeline

__all__ = ["measured_costs", "predict"]


def measured_costs(timeline: Timeline, schedule: Schedule) -> Costs:
    """Per-stage median durations of F and B (or F, I and W) in ``timeline``.

    Raises:
        ValueError: when the timeline has no span of some stage and op the schedule runs.
    """
    ops = (Op.F, Op.I, Op.W) if schedule.split_backward else (Op.F, Op.B)
    durations: dict[tuple[Op, int], list[float]] = {}
    for span in timeline.spans:
        durations.setdefault((span.action.op, span.action.stage), []).append(span.duration)
    costs: dict[str, tuple[float, ...]] = {}
    for op in ops:
        per_stage = []
        for stage in range(schedule.n_stages):
            found = durations.get((op, stage))
            if not found:
                raise ValueError(f"the measured timeline has no {op.value} action of stage "
                                 f"{stage}; pass the timeline of a training step")
            per_stage.append(statistics.median(found))
        costs[op.value] = tuple(per_stage)
    return Costs(**costs)


def predict(timeline: Timeline, schedule: Schedule) -> Simulation:
    """The simulation of ``schedule`` with the costs measured in ``timeline``."""
    return simulate(schedule, measured_costs(timeline, schedule))
