"""Generators: every named schedule, built from integers (ranks p, micro-batches m, v)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipetrain.schedules.schedule import Schedule

if TYPE_CHECKING:
    from pipetrain.schedules.simulator import Costs

__all__ = ["ScheduleKind", "Target", "REGISTRY", "make_schedule", "register"]


@dataclass(frozen=True)
class Target:
    """What a searching generator (``zb-auto``) fits its schedule to; others ignore it.

    Attributes:
        memory_limit: the most stage-activations any rank may hold, in the simulator's count
            (:mod:`pipetrain.schedules.simulator`) at ``w_share``; None lets the generator
            pick its own.
        costs: op costs per stage per micro-batch; None means F = I = W = 1.
        comm: the delay of every message between ranks.
        w_share: share of an activation kept from I until W (the simulator's ``w_share``).

    Example: a zero-bubble schedule whose ranks hold at most 3 stage-activations::

        schedule = pt.schedules.make_schedule("zb-auto", 4, 8,
                                              target=pt.schedules.Target(memory_limit=3))
        pt.schedules.simulate(schedule).peak_activations  # every rank <= 3
    """

    memory_limit: float | None = None
    costs: Costs | None = None
    comm: float = 0.0
    w_share: float = 1.0


@dataclass(frozen=True)
class ScheduleKind:
    """A named schedule family: its generator and the stages per rank it uses by default."""

    name: str
    description: str
    default_stages_per_rank: int
    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> Schedule
    search: Callable[[int, int, int, Target], Schedule] | None = None
    """For a searching generator: (p, m, v, target) -> Schedule; ``build`` uses Target()."""
    update: str | None = None
    """Its schedules' :attr:`~pipetrain.schedules.schedule.Schedule.update` (an asynchronous
    family's: ``"stash"``, ``"2bw"``), known before one is built."""


REGISTRY: dict[str, ScheduleKind] = {}


def register(kind: ScheduleKind) -> None:
    REGISTRY[kind.name] = kind


def make_schedule(
    name: str, n_ranks: int, n_microbatches: int, stages_per_rank: int | None = None,
    target: Target | None = None,
) -> Schedule:
    """Generate the named schedule for ``n_ranks`` ranks and ``n_microbatches`` micro-batches.

    Args:
        name: one of ``pipetrain.schedules.generators.REGISTRY`` (``pipetrain schedules``
            lists them).
        n_ranks: ranks in the pipeline (p).
        n_microbatches: micro-batches per step (m).
        stages_per_rank: model stages held by each rank (v); None takes the schedule's own.
        target: the memory limit and costs a searching schedule (``zb-auto``) fits; the
            fixed schedules ignore it.

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
    if target is not None and kind.search is not None:
        return kind.search(n_ranks, n_microbatches, v, target)
    return kind.build(n_ranks, n_microbatches, v)


def _load_builtin() -> None:
    # Importing the modules registers their kinds; kept lazy so the registry has no cycles.
    import importlib

    for module in ("basic", "interleaved", "zerobubble", "vshape", "dualpipev", "controllable",
                   "zbauto", "looped", "pipedream"):
        importlib.import_module(f"pipetrain.schedules.generators.{module}")
