"""Balance: the contiguous split of layers into stages that minimises the bottleneck, exactly.

    profile_layers   per layer: F, I, W time on a sample micro-batch; parameter, activation bytes
    best_split       exact min-max split for per-stage costs (DP over prefixes)
    best_rank_split  exact min-max of per-rank sums when a rank holds several stages
    plan_balance     profile + a mode's cost model + split, with a report and simulator costs

Stage cost per mode (a rank's cost is the sum over its stages; the split minimises the largest):

    params   parameter bytes of the stage's layers
    time     sum of F + I + W of its layers (B = I + W)
    memory   trainable bytes x state_multiplier + frozen bytes
             + the stage's peak over time of  units x activation bytes + held x i_held bytes
    callable fn(layer_costs, first, end) -> float for layers first .. end-1

``units`` is the stage's own count of live micro-batch activations in ``simulate(schedule)``
(unit costs, the simulator's memory rule), and ``held`` the count of its micro-batches whose I
has run and W has not: a split backward's I keeps the gradients at the cut until W (the layers'
``i_held_bytes``). Stage 0 holds none: its input is data, so its I computes nothing and W runs
the whole backward from the gradient the stage received (left out, as the simulator leaves
messages out). The two counts need not peak at the same time (ZB-V), so the peak is taken over
the pairs the simulator can reach (:func:`stage_pairs`), not as the sum of two peaks. 1F1B
holds p - r micro-batches on rank r, so memory mode gives the first ranks fewer
activation-heavy layers. Everything after profiling is deterministic.
"""


from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipetrain.schedules.action import Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import (
    Costs,
    Simulation,
    held_per_stage,
    peak_pairs,
    peak_units,
    simulate,
)
from pipetrain.schedules.timeline import Span
from pipetrain.split.minmax import RankSplit, StageCostFn, best_rank_split, best_split, check_fit
from pipetrain.split.partition import stage_bounds
from pipetrain.split.profile import LayerCost, LossFn, param_bytes, param_owners, profile_layers

__all__ = ["LayerCost", "StageCost", "RankCost", "RankSplit", "BalancePlan", "MODES",
           "profile_layers", "best_split", "best_rank_split", "stage_peaks", "stage_pairs",
           "plan_balance"]

MODES = ("params", "time", "memory")
LayerCostFn = Callable[[Sequence[LayerCost], int, int], float]

# -- plans ---------------------------------------------------------------------------------


def stage_peaks(sim: Simulation) -> tuple[float, ...]:
    """Per stage, the most of its own micro-batch activations alive at once in ``sim``.

    :mod:`pipetrain.schedules.simulator`'s memory model (``w_share`` and ``i_held`` included)
    applied to one stage's spans; with one stage per rank it equals ``peak_activations``.
    """
    held = held_per_stage(sim.i_held, sim.schedule.n_stages)
    return tuple(peak_units(spans, sim.w_share, held) for spans in _by_stage(sim))


def stage_pairs(sim: Simulation) -> tuple[tuple[tuple[float, float], ...], ...]:
    """Per stage, the Pareto-maximal (units, I-held count) pairs alive at once in ``sim``.

    See :func:`pipetrain.schedules.simulator.peak_pairs`; ``sim.i_held`` is not used (the count is
    kept apart so that a caller can weigh it by bytes).
    """
    return tuple(peak_pairs(spans, sim.w_share) for spans in _by_stage(sim))


def _by_stage(sim: Simulation) -> list[list[Span]]:
    by_stage: list[list[Span]] = [[] for _ in range(sim.schedule.n_stages)]
    for sp in sim.timeline.spans:
        by_stage[sp.action.stage].append(sp)
    return by_stage


def _peak(pairs: Sequence[tuple[float, float]], act: float, held: float
          ) -> tuple[float, float, float]:
    """The pair with the most ``units x act + count x held`` bytes: (bytes, units, count)."""
    return max((u * act + n * held, u, n) for u, n in pairs)


@dataclass(frozen=True)
class StageCost:
    """One stage's predicted cost per micro-batch (seconds, bytes) and its mode objective."""

    stage: int
    rank: int
    first: int
    end: int
    f: float
    i: float
    w: float
    param_bytes: int
    activation_bytes: int
    in_flight: float
    """Micro-batch activation units alive at the stage's memory peak (with nothing held for W,
    its peak count, :func:`stage_peaks`)."""
    memory_bytes: float
    """Trainable bytes x state multiplier + frozen bytes + in_flight x activation bytes
    + held x i_held_bytes."""
    cost: float
    i_held_bytes: int = 0
    """Bytes I keeps until W per micro-batch (the layers' sum; 0 on stage 0)."""
    held: float = 0.0
    """Micro-batches whose I's gradients are kept for W at the stage's memory peak."""


@dataclass(frozen=True)
class RankCost:
    """A rank's sums over its stages: F + I + W time, memory bytes and mode objective."""

    rank: int
    stages: tuple[int, ...]
    time: float
    memory_bytes: float
    cost: float


@dataclass(frozen=True)
class BalancePlan:
    """The chosen split, its predicted per-stage and per-rank costs, and how it was found."""

    balance: list[int]
    mode: str
    method: str
    exact: bool
    """False when the split is the fallback of a too-large per-rank search."""
    schedule: Schedule
    stages: tuple[StageCost, ...]
    ranks: tuple[RankCost, ...]

    @property
    def bottleneck(self) -> float:
        """The largest per-rank cost: what the split minimises."""
        return max(r.cost for r in self.ranks)

    def costs_for_simulator(self) -> Costs:
        """Per-stage F, I, W (B = I + W), for ``simulate(plan.schedule, <these>)``."""
        st = self.stages
        return Costs(F=tuple(s.f for s in st), I=tuple(s.i for s in st),
                     W=tuple(s.w for s in st))

    def __str__(self) -> str:
        fmt = {"params": _bytes, "memory": _bytes, "time": _ms}.get(self.mode, "{:10.4g}".format)
        split = any(a.op is Op.I for acts in self.schedule.actions for a in acts)
        lines = [f"balance {self.balance}  mode {self.mode}  {self.schedule.name} "
                 f"({len(self.ranks)} ranks)  {self.method}",
                 "stage rank layers    F ms    I ms    W ms     params     act/mb"
                 + ("    held/mb   act+held" if split else "  in-flight")
                 + "     memory       cost"]
        lines += [f"{s.stage:5d} {s.rank:4d} {f'{s.first}-{s.end - 1}':6s}{_ms(s.f)}{_ms(s.i)}"
                  f"{_ms(s.w)} {_bytes(s.param_bytes)} {_bytes(s.activation_bytes)} "
                  + (f"{_bytes(s.i_held_bytes)} {f'{s.in_flight:g}+{s.held:g}':>10s}" if split
                     else f"{s.in_flight:9g}")
                  + f" {_bytes(s.memory_bytes)} {fmt(s.cost)}" for s in self.stages]
        lines.append("rank stages  F+I+W ms     memory       cost")
        lines += [f"{r.rank:4d} {','.join(map(str, r.stages)):8s}{_ms(r.time)} "
                  f"{_bytes(r.memory_bytes)} {fmt(r.cost)}" for r in self.ranks]
        return "\n".join([*lines, f"bottleneck {fmt(self.bottleneck).strip()}"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def _bytes(n: float) -> str:
    k = min(int(math.log(max(abs(n), 1), 1024)), 3)
    return f"{n / 1024**k:6.1f} {('B', 'KiB', 'MiB', 'GiB')[k]:>3s}"


"""``fn(layer_costs, first, end)``: a user's cost of layers ``first .. end-1`` as one stage."""


def plan_balance(
    layers: Sequence[nn.Module], schedule: Schedule, mode: str | LayerCostFn = "time",
    sample_input: Any = None, *, loss_fn: LossFn | None = None, sample_target: Any = None,
    layer_costs: Sequence[LayerCost] | None = None, repeats: int = 3,
    state_multiplier: float = 4.0, max_states: int = 1_000_000,
) -> BalancePlan:
    """Profile ``layers`` and choose the split minimising the bottleneck rank under ``mode``.

    Args:
        layers: the whole model's layers, in order.
        schedule: where each stage lives (``rank_of``) and what each rank holds in flight.
        mode: ``"params"``, ``"time"``, ``"memory"`` (module docstring), or a
            :data:`LayerCostFn` ``fn(layer_costs, first, end) -> float``.
        sample_input: one micro-batch for :func:`profile_layers`; may be None in params mode.
        loss_fn, sample_target: the loss and a micro-batch target, charged to the last layer.
        layer_costs: measured costs to use instead of profiling.
        repeats: timed runs per layer (median taken).
        state_multiplier: bytes per trainable parameter byte in memory mode (4: weights,
            gradients and two Adam moments).
        max_states: limit of the exact per-rank search (see :func:`best_rank_split`).

    Raises:
        PartitionError: fewer layers than the schedule's stages.
        ValueError: an unknown mode, a mode needing ``sample_input`` without one, or
            ``layer_costs`` of the wrong length.

    Example:
        >>> from pipetrain import make_schedule
        >>> layers = [nn.Linear(8, 8) for _ in range(6)]
        >>> plan_balance(layers, make_schedule("1f1b", 2, 4), "params").balance
        [3, 3]
    """
    n = len(layers)
    check_fit(n, schedule.n_stages)
    if not callable(mode) and mode not in MODES:
        raise ValueError(f"unknown balance mode {mode!r}; choose one of {list(MODES)} or pass "
                         "a function fn(layer_costs, first, end) -> float")
    costs = _layer_costs(layers, mode, sample_input, loss_fn, sample_target, layer_costs,
                         repeats)
    pairs = stage_pairs(simulate(schedule if schedule.update is None  # asynchronous: two
                                 else schedule.unroll(2)))  # steps hold what any step holds
    held_share = held_per_stage(1.0, schedule.n_stages)  # the simulator's rule: 0 on stage 0
    sums = _prefix_sums(costs)

    def total(key: str, a: int, e: int) -> float:
        return sums[key][e] - sums[key][a]

    def kept(s: int, a: int, e: int) -> float:  # stage 0's I computes nothing (docstring)
        return total("i_held_bytes", a, e) * held_share[s]

    def peak(s: int, a: int, e: int) -> tuple[float, float, float]:
        return _peak(pairs[s], total("activation_bytes", a, e), kept(s, a, e))

    def memory(s: int, a: int, e: int) -> float:
        frozen = total("frozen_bytes", a, e)
        return ((total("param_bytes", a, e) - frozen) * state_multiplier + frozen
                + peak(s, a, e)[0])

    objective: StageCostFn = {
        "params": lambda s, a, e: total("param_bytes", a, e),
        "time": lambda s, a, e: total("f", a, e) + total("i", a, e) + total("w", a, e),
        "memory": memory,
    }[mode] if isinstance(mode, str) else lambda s, a, e: mode(costs, a, e)
    split = best_rank_split(objective, schedule.placement, n_layers=n, max_states=max_states)
    def stage_cost(s: int, a: int, e: int) -> StageCost:
        _, units, held = peak(s, a, e)
        return StageCost(s, schedule.rank_of(s), a, e, total("f", a, e), total("i", a, e),
                         total("w", a, e), round(total("param_bytes", a, e)),
                         round(total("activation_bytes", a, e)), units, memory(s, a, e),
                         objective(s, a, e), round(kept(s, a, e)), held)

    stages = tuple(stage_cost(s, a, e) for s, (a, e) in enumerate(stage_bounds(split.balance)))
    name = mode if isinstance(mode, str) else getattr(mode, "__name__", "custom")
    return BalancePlan(split.balance, name, split.method, split.exact, schedule, stages,
                       _rank_costs(schedule, stages))


def _layer_costs(layers: Sequence[nn.Module], mode: str | LayerCostFn, sample_input: Any,
                 loss_fn: LossFn | None, sample_target: Any,
                 given: Sequence[LayerCost] | None, repeats: int) -> list[LayerCost]:
    if given is not None:
        if len(given) != len(layers):
            raise ValueError(f"layer_costs has {len(given)} entries for {len(layers)} layers")
        return list(given)
    if sample_input is not None:
        return profile_layers(layers, sample_input, loss_fn=loss_fn,
                              sample_target=sample_target, repeats=repeats)
    if mode != "params":
        raise ValueError(f"balance mode {mode!r} profiles the layers: pass sample_input "
                         "(one micro-batch) or layer_costs")
    return [LayerCost(0.0, 0.0, 0.0, param_bytes(ps), 0,
                      param_bytes([p for p in ps if not p.requires_grad]),
                      largest_grad_bytes=max((param_bytes([p]) for p in ps if p.requires_grad),
                                             default=0))
            for ps in param_owners(layers)]


def _prefix_sums(costs: Sequence[LayerCost]) -> dict[str, list[float]]:
    keys = ("f", "i", "w", "param_bytes", "activation_bytes", "frozen_bytes", "i_held_bytes")
    return {k: [0.0, *itertools.accumulate(float(getattr(c, k)) for c in costs)] for k in keys}


def _rank_costs(schedule: Schedule, stages: tuple[StageCost, ...]) -> tuple[RankCost, ...]:
    out = []
    for r in range(schedule.n_ranks):
        mine = [stages[s] for s in schedule.stages_of(r)]
        out.append(RankCost(r, tuple(s.stage for s in mine), sum(s.f + s.i + s.w for s in mine),
                            sum(s.memory_bytes for s in mine), sum(s.cost for s in mine)))
    return tuple(out)
