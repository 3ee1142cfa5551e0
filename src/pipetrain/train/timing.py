"""Timing: per-stage op costs and the message delay read off one measured step, and the
simulator's prediction from them.

The picture of a run's last step shows its measured timeline next to what
:func:`pipetrain.schedules.simulate` predicts for the same schedule when every action of stage
``s`` with op ``o`` takes the median measured duration of that stage's ``o`` actions and every
message between ranks the median hop (:mod:`pipetrain.schedules.calibration`), both read off
the step
before it: the prediction is not fitted to the step it predicts. What remains between the two
is step-to-step and per-action variation, and waits the hop's median does not cover.
"""

from __future__ import annotations

from pipetrain.schedules.calibration import calibrate, stage_costs
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, Simulation
from pipetrain.schedules.timeline import Timeline

__all__ = ["measured_costs", "predict"]


def measured_costs(timeline: Timeline, schedule: Schedule) -> Costs:
    """Per-stage median durations of each op in ``timeline`` (:func:`stage_costs`).

    Raises:
        ValueError: when the timeline has no F, or no backward, of some stage.
    """
    return stage_costs(timeline, schedule)


def predict(timeline: Timeline, schedule: Schedule) -> Simulation:
    """The simulation of ``schedule`` with the costs and message delay measured in ``timeline``."""
    return calibrate(timeline, schedule).predict(schedule)
