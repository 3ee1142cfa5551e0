"""Reporter: what the training loop tells the outside world (progress, logs, pictures)."""

from __future__ import annotations

from typing import Any, Protocol

from pipetrain.schedules.simulator import Simulation
from pipetrain.schedules.timeline import Timeline

__all__ = ["Reporter", "NullReporter"]


class Reporter(Protocol):
    """Receives the run's records on one rank; the loop calls it, never the other way round.

    Record kinds and their fields (every record also has ``"kind"`` and ``"time"``):
    ``start`` (config, world, layout, balance, params), ``step`` (step, loss, lr, grad_norm,
    tokens_per_s, bubble, skipped), ``eval`` (step, eval_loss), ``checkpoint`` (step, path),
    ``sample`` (text), ``end`` (summary fields); with a data set as ``--data``, ``data`` after
    ``start`` (what is trained on: :func:`pipetrain.train.data.examples.example_batches`).
    """

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        """One record, in order."""

    def timeline(self, step: int, measured: Timeline, simulated: Simulation,
                 costs_step: int) -> None:
        """The measured timeline of ``step`` next to the simulator's prediction from the costs
        measured in ``costs_step`` (an earlier step where there is one)."""

    def close(self) -> None:
        """The run ended (normally or not): flush and release everything."""


class NullReporter:
    """A reporter that keeps nothing (ranks other than the reporting one)."""

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        return None

    def timeline(self, step: int, measured: Timeline, simulated: Simulation,
                 costs_step: int) -> None:
        return None

    def close(self) -> None:
        return None
