"""Steady state: an asynchronous window's time per step, idle share and memory, simulated."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules.dataflow import versions_alive
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, simulate

__all__ = ["SteadyState", "steady_state"]


@dataclass(frozen=True)
class SteadyState:
    """What a flush-less schedule gives once its pipeline is full.

    A synchronous schedule's step is its makespan (:func:`simulate`); an asynchronous one's
    is the ``period`` between two steps of a long run, since no flush separates them.
    """

    schedule: Schedule
    costs: Costs
    comm: float
    period: float
    """Time per step once the pipeline is full: the makespan of ``steps + 1`` steps (and the
    drain) minus that of ``steps``."""
    busy: tuple[float, ...]
    """Per rank, its compute per step."""
    bubble_fraction: float
    """1 - mean busy / period: the share of device time idle in the steady state."""
    peak_activations: tuple[float, ...]
    """Per rank, the most stage-activations alive at once (the simulator's units)."""
    peak_versions: tuple[int, ...]
    """Per rank, the most weight versions one of its stages keeps at once."""

    def to_dict(self) -> dict[str, object]:
        return {"schedule": self.schedule.name, "ranks": self.schedule.n_ranks,
                "microbatches": self.schedule.n_microbatches, "period": self.period,
                "busy": list(self.busy), "bubble_fraction": self.bubble_fraction,
                "peak_activations": list(self.peak_activations),
                "peak_versions": list(self.peak_versions), "costs": self.costs.to_dict(),
                "comm": self.comm}


def steady_state(schedule: Schedule, costs: Costs | None = None, comm: float = 0.0,
                 steps: int = 6) -> SteadyState:
    """Simulate ``steps`` and ``steps + 1`` steps of an asynchronous window (each with its
    drain, :meth:`Schedule.unroll`) and read the steady state off their difference.

    Raises:
        ValueError: for a schedule without ``update`` or ``steps < 2``.
        ScheduleError: if the window is invalid.

    Example:
        >>> from pipetrain import make_schedule
        >>> steady_state(make_schedule("pipedream-2bw", 4, 8), Costs(F=1, B=2)).period
        24.0
    """
    if schedule.update is None or steps < 2:
        raise ValueError(f"steady_state needs an asynchronous schedule and steps >= 2; "
                         f"{schedule.name!r} has update={schedule.update!r}")
    costs = Costs() if costs is None else costs
    short = simulate(schedule.unroll(steps), costs, comm)
    long = simulate(schedule.unroll(steps + 1), costs, comm)
    period = long.makespan - short.makespan
    busy = tuple(sum(costs.of(a.op, a.stage) for a in acts) for acts in schedule.actions)
    return SteadyState(
        schedule=schedule, costs=costs, comm=comm, period=period, busy=busy,
        bubble_fraction=1.0 - sum(busy) / (len(busy) * period) if period > 0 else 0.0,
        peak_activations=long.peak_activations,
        peak_versions=tuple(max(c, default=1) for c in versions_alive(schedule.unroll(steps))))
