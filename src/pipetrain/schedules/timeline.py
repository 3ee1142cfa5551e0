"""Timeline: when each action ran on each rank, simulated or measured, and what that implies."""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedules.action import Action

__all__ = ["Span", "Timeline"]


@dataclass(frozen=True)
class Span:
    """One action's run on one rank, from ``start`` to ``end`` (any time unit)."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """Spans of every rank; drawing and metrics treat simulated and measured runs alike."""

    n_ranks: int
    spans: tuple[Span, ...]
    unit: str = "units"

    def of_rank(self, rank: int) -> tuple[Span, ...]:
        return tuple(sorted((s for s in self.spans if s.rank == rank), key=lambda s: s.start))

    @property
    def start(self) -> float:
        return min((s.start for s in self.spans), default=0.0)

    @property
    def makespan(self) -> float:
        """Global time from the first start to the last end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - self.start

    def busy(self, rank: int) -> float:
        return sum(s.duration for s in self.spans if s.rank == rank)

    def span(self, rank: int) -> float:
        """Last end minus first start on ``rank`` (0 for a rank with nothing to do)."""
        own = self.of_rank(rank)
        return max(s.end for s in own) - own[0].start if own else 0.0

    def idle(self, rank: int) -> float:
        """Time ``rank`` waits inside the global makespan."""
        return self.makespan - self.busy(rank)

    @property
    def bubble_fraction(self) -> float:
        """1 - busy / (ranks x makespan): the share of device time spent waiting."""
        total = self.n_ranks * self.makespan
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.n_ranks)) / total

    def shifted(self) -> Timeline:
        """The same timeline with its first start moved to 0."""
        t0 = self.start
        spans = tuple(Span(s.rank, s.action, s.start - t0, s.end - t0) for s in self.spans)
        return Timeline(self.n_ranks, spans, self.unit)
