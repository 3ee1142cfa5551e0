"""Generators: every named schedule, built from integers (ranks p, micro-batches m, v)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipetrain.schedule import Schedule

__all__ = ["ScheduleKind", "REGISTRY", "make_schedule", "register"]


@dataclass(frozen=True)
class ScheduleKind:
    """A named schedule family: its generator and the stages per rank it uses by default."""

    name: str
    description: str
    default_stages_per_rank: int
    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> Schedule


REGISTRY: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> None:
    REGISTRY[kind.name] = kind


def make_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None
) -> Schedule:
    """Generate the named schedule for ``n_ranks`` ranks and ``n_microbatches`` micro-batches.

    Args:
        name: one of ``pipetrain.generators.REGISTRY`` (``pipetrain schedules`` lists them).
        n_ranks: ranks in the pipeline (p).
        n_microbatches: micro-batches per step (m).
        stages_per_rank: model stages held by each rank (v); None takes the schedule's own.

    Raises:
        ValueError: for an unknown name or integers outside the schedule's constraints.

    Example:
        >>> print(make_schedule("1f1b", 2, 3).actions[1])  # doctest: +SKIP
    """
    _load_builtin()
    if name not in REGISTRY:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(REGISTRY)}")
    kind = REGISTRY[name]
    v = kind.default_stages_per_rank if stages_per_rank is None else stages_per_rank
    for label, value in (("n_ranks", n_ranks), ("n_microbatches", n_microbatches),
                         ("stages_per_rank", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")
    return kind.build(n_ranks, n_microbatches, v)


def _load_builtin() -> None:
    # Importing the modules registers their kinds; kept lazy so the registry has no cycles.
    import importlib

    for module in ("basic", "interleaved", "zerobubble", "vshape", "dualpipev"):
        importlib.import_module(f"pipetrain.generators.{module}")
