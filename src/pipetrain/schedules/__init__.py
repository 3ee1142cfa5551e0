"""Schedules: per-rank action lists as data, their generators, checks, simulation, pictures.

A schedule is a list of actions (``1F0``, ``2I3``, ``2W3``) per rank, generated from integers
(``generators/``), printed and parsed back (``schedule.py``, ``action.py``), validated against
the one definition of what waits for what (``dataflow.py``, ``validate.py``), simulated with
per-stage costs (``simulator.py``, ``shared_cores.py``, ``calibration.py``; an asynchronous
window's steady state in ``steady_state.py``) and drawn (``timeline.py``, ``draw.py``).
Nothing here runs a model.

May import: :mod:`pipetrain.errors` (and torch, the standard library).
"""

from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.calibration import calibrate
from pipetrain.schedules.generators import Target, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, simulate

__all__ = ["Action", "Costs", "Op", "Schedule", "Target", "calibrate", "make_schedule",
           "simulate"]
