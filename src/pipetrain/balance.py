"""Balance: the contiguous split of layers into stages that minimises the bottleneck, exactly.

    profile_layers   per layer: F, I, W time on a sample micro-batch; parameter, activation bytes
    best_split       exact min-max split for per-stage costs (DP over prefixes)
    best_rank_split  exact min-max of per-rank sums when a rank holds several stages
    plan_balance     profile + a mode's cost model + split, with a report and simulator costs

Stage cost per mode (a rank's cost is the sum over its stages; the split minimises the largest):

    params   parameter bytes of the stage's layers
    time     sum of F + I + W of its layers (B = I + W)
    memory   trainable bytes x state_multiplier + frozen bytes
             + in_flight[stage] x activation bytes of its layers
    callable fn(layer_costs, first, end) -> float for layers first .. end-1

``in_flight[stage]`` is the stage's own peak of live micro-batch activations in
``simulate(schedule)`` (unit costs), counted with the simulator's memory rule (see
:func:`stage_peaks`). 1F1B holds p - r micro-batches on rank r, so memory mode gives the first
ranks fewer activation-heavy layers. Everything after profiling is deterministic.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.action import Op
from pipetrain.backward import backward_input
from pipetrain.errors import PartitionError
from pipetrain.partition import stage_bounds
from pipetrain.payload import flatten, unflatten
from pipetrain.schedule import Schedule
from pipetrain.simulate import Costs, Simulation, simulate

__all__ = ["LayerCost", "StageCost", "RankCost", "RankSplit", "BalancePlan", "MODES",
           "profile_layers", "best_split", "best_rank_split", "stage_peaks", "plan_balance"]

MODES = ("params", "time", "memory")
StageCostFn = Callable[[int, int, int], float]
"""``cost(stage, first_layer, end_layer)`` of layers ``first .. end-1`` placed as ``stage``."""
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class LayerCost:
    """One layer on one micro-batch: seconds of F, I, W, and bytes held."""

    f: float
    i: float
    w: float
    param_bytes: int
    """Parameters first seen in this layer, trainable and frozen (a shared one counts once)."""
    activation_bytes: int
    """Tensors autograd saves for backward plus the output, excluding inputs and parameters."""
    frozen_bytes: int = 0
    """The part of ``param_bytes`` that needs no gradient (no grads or optimizer state)."""

    @property
    def b(self) -> float:
        return self.i + self.w


# -- profiling -----------------------------------------------------------------------------


def profile_layers(
    layers: Sequence[nn.Module], sample_input: Any, *, loss_fn: LossFn | None = None,
    sample_target: Any = None, repeats: int = 3,
) -> list[LayerCost]:
    """Measure each layer, run in sequence like ``nn.Sequential`` on one sample micro-batch.

    Each layer's F, I (:func:`pipetrain.backward.backward_input`) and W (``WeightWork.run``)
    run separately with an all-ones output gradient; times are the median of ``repeats`` runs
    after one warm-up. With ``loss_fn``, the last layer's F and backward include the loss.
    Gradients, buffers and the CPU random state are restored afterwards.

    Raises:
        ValueError: for ``repeats < 1``, no layers, or ``loss_fn`` without ``sample_target``.

    Example:
        >>> costs = profile_layers([nn.Linear(4, 4), nn.Tanh()], torch.randn(2, 4))
        >>> costs[0].param_bytes
        80
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    if loss_fn is not None and sample_target is None:
        raise ValueError("loss_fn is given but sample_target is None; pass both or neither")
    owned = _param_owners(layers)
    result, x = [], sample_input
    with torch.random.fork_rng(devices=[]), _restored(layers):
        for j, layer in enumerate(layers):
            head = loss_fn if j == len(layers) - 1 else None
            times, act, x = _profile_one(layer, x, head, sample_target, repeats)
            frozen = [p for p in owned[j] if not p.requires_grad]
            result.append(LayerCost(*times, _param_bytes(owned[j]), act, _param_bytes(frozen)))
    return result


def _profile_one(layer: nn.Module, x: Any, head: LossFn | None, target: Any,
                 repeats: int) -> tuple[tuple[float, float, float], int, Any]:
    tensors, spec = flatten(x)
    leaves = [t.detach().requires_grad_(t.requires_grad and t.is_floating_point())
              for t in tensors]
    params = list(layer.parameters())
    runs, out, act = [], None, 0
    for k in range(repeats + 1):
        t0 = _now(leaves)
        with _saved_bytes(k == 0) as saved:  # the warm-up, untimed
            out, flat = _forward(layer, unflatten(leaves, spec), head, target)
        if k == 0:  # inputs are the previous layer's outputs; weights are no activations
            held = _storages(params) | _storages(leaves)
            act = sum(b for ptr, b in (saved | _storages(flat)).items() if ptr not in held)
        t1 = _now(flat)
        grads = [torch.ones_like(t) if t.requires_grad else None for t in flat]
        _, work = backward_input(flat, grads, leaves, params)
        t2 = _now(leaves)
        work.run()
        runs.append((t1 - t0, t2 - t1, _now(params) - t2))
    f, i, w = (statistics.median(r[n] for r in runs[1:]) for n in range(3))
    return (f, i, w), act, out


def _forward(layer: nn.Module, x: Any, head: LossFn | None,
             target: Any) -> tuple[Any, list[torch.Tensor]]:
    with torch.enable_grad():
        out = layer(x)
        if head is not None:
            return out, [head(out, target)]
    return out, flatten(out)[0]


@contextmanager
def _saved_bytes(enabled: bool) -> Iterator[dict[int, int]]:
    # The storage (address -> bytes) of every tensor autograd saves while the block runs.
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen.update(_storages([t]))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if enabled else nullcontext():
        yield seen


def _storages(tensors: Sequence[torch.Tensor]) -> dict[int, int]:
    # Tensors without a plain storage (sparse, nested) are not counted.
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
            if t.layout == torch.strided and not t.is_nested}


def _param_bytes(params: Sequence[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _now(tensors: Sequence[torch.Tensor]) -> float:
    if any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()  # kernels run asynchronously: wait before reading the clock
    return time.perf_counter()


def _param_owners(layers: Sequence[nn.Module]) -> list[list[nn.Parameter]]:
    seen: set[int] = set()
    owned = []
    for layer in layers:
        mine = [p for p in layer.parameters() if id(p) not in seen]
        seen.update(id(p) for p in mine)
        owned.append(mine)
    return owned


@contextmanager
def _restored(layers: Sequence[nn.Module]) -> Iterator[None]:
    # W accumulates into .grad in place and forwards update buffers (BatchNorm statistics).
    params = {id(p): p for layer in layers for p in layer.parameters()}
    grads = {k: p.grad for k, p in params.items()}
    buffers = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    for p in params.values():
        p.grad = None
    try:
        yield
    finally:
        for k, p in params.items():
            p.grad = grads[k]
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


# -- exact splits ----------------------------------------------------------------------------


def best_split(costs: Sequence[float] | StageCostFn, n_stages: int, *,
               n_layers: int | None = None) -> list[int]:
    """Layers per stage minimising the largest stage cost, exactly.

    Args:
        costs: one cost per layer (a stage costs their sum), or ``cost(stage, first, end)``.
        n_stages: stages to fill, each with at least one layer.
        n_layers: the number of layers; required when ``costs`` is a function.

    Ties in the largest cost go to the smallest sum of squared stage costs, then of squared
    stage lengths, then the earliest cuts. Two DPs over (stage, prefix): O(n_layers² · n_stages)
    cost evaluations; ``cost`` must return the same value for the same arguments.

    Raises:
        PartitionError: fewer layers than stages.
        ValueError: a negative or NaN cost, or a function without ``n_layers``.

    Example:
        >>> best_split([1, 1, 1, 3], 2)
        [3, 1]
    """
    fn, n = _cost_fn(costs, n_layers)
    _check_fit(n, n_stages)
    bound = _min_max(fn, n, n_stages)
    return _most_even(fn, n, n_stages, bound)


def _cost_fn(costs: Sequence[float] | StageCostFn,
             n_layers: int | None) -> tuple[StageCostFn, int]:
    if callable(costs):
        if n_layers is None:
            raise ValueError("a per-stage cost function needs n_layers")
        return _checked(costs), n_layers
    prefix = [0.0, *itertools.accumulate(float(c) for c in costs)]
    return _checked(lambda s, a, e: prefix[e] - prefix[a]), len(prefix) - 1


def _checked(fn: StageCostFn) -> StageCostFn:
    def cost(s: int, a: int, e: int) -> float:
        c = float(fn(s, a, e))
        if math.isnan(c) or c < 0:
            raise ValueError(f"stage {s} (layers {a}..{e - 1}) costs {c}; costs must be >= 0")
        return c
    return cost


def _check_fit(n_layers: int, n_stages: int) -> None:
    if n_stages < 1:
        raise PartitionError(f"n_stages must be >= 1, got {n_stages}")
    if n_layers < n_stages:
        raise PartitionError(f"{n_layers} layers cannot fill {n_stages} stages (each stage "
                             "needs at least one layer); use fewer stages or more layers")


def _ends(s: int, n: int, n_stages: int) -> range:
    return range(s + 1, n - (n_stages - 1 - s) + 1)  # leave one layer per later stage


def _min_max(fn: StageCostFn, n: int, n_stages: int) -> float:
    best = [0.0] + [math.inf] * n  # best[e]: least bottleneck of the stages so far over 0..e-1
    for s in range(n_stages):
        new = [math.inf] * (n + 1)
        for e in _ends(s, n, n_stages):
            new[e] = min(max(best[a], fn(s, a, e)) for a in range(s, e))
        best = new
    return best[n]


def _most_even(fn: StageCostFn, n: int, n_stages: int, bound: float) -> list[int]:
    keys: list[tuple[float, int] | None] = [(0.0, 0)] + [None] * n
    cuts: list[list[int]] = []
    for s in range(n_stages):
        new: list[tuple[float, int] | None] = [None] * (n + 1)
        cut = [-1] * (n + 1)
        for e in _ends(s, n, n_stages):
            for a in range(s, e):
                prev, c = keys[a], fn(s, a, e)
                if prev is None or c > bound:
                    continue
                key = (prev[0] + c * c, prev[1] + (e - a) ** 2)
                if new[e] is None or key < new[e]:  # type: ignore[operator]
                    new[e], cut[e] = key, a
        keys = new
        cuts.append(cut)
    sizes, e = [], n
    for cut in reversed(cuts):
        sizes.append(e - cut[e])
        e = cut[e]
    return sizes[::-1]


@dataclass(frozen=True)
class RankSplit:
    """A split chosen for the per-rank objective, and how it was found."""

    balance: list[int]
    exact: bool
    """False when the exact search was too large and the start split was taken."""
    method: str


State = tuple[float, ...]  # (max of finished ranks' totals, running totals of open ranks...)
Level = dict[int, list[tuple[State, tuple[int, int]]]]  # end -> [(state, (first, parent))]


class _TooLarge(Exception):
    pass


def best_rank_split(costs: Sequence[float] | StageCostFn, placement: Sequence[int], *,
                    n_layers: int | None = None, max_states: int = 1_000_000) -> RankSplit:
    """Layers per stage minimising the largest per-rank sum of stage costs, exactly.

    ``placement[stage]`` is the rank holding the stage; with one stage per rank this is
    :func:`best_split`. Otherwise a rank's sum does not decompose per stage: a DP over stages
    keeps, per prefix, the Pareto-minimal vectors (max of finished ranks' totals, running
    totals of the others), pruning those not strictly below the rank bottleneck of a start
    split (the per-stage optimum, improved by moving single cuts), which is kept when nothing
    beats it, so ties prefer even stages. Exact, but exponential in the worst case (about a
    second per million states in CPython): past ``max_states`` generated states it returns the
    start split with ``exact=False``.

    Raises:
        PartitionError: fewer layers than stages.
        ValueError: a negative or NaN cost, or a function without ``n_layers``.

    Example:
        >>> best_rank_split([1, 1, 4, 3, 1], [0, 1, 1, 0]).balance  # ranks 0 and 1 cost 5
        [1, 1, 1, 2]
    """
    fn, n = _cost_fn(costs, n_layers)
    _check_fit(n, len(placement))
    per_stage = best_split(fn, len(placement), n_layers=n)
    if len(set(placement)) == len(placement):
        return RankSplit(per_stage, True, "exact: min-max DP over stages and prefixes")
    start = _descend(fn, placement, per_stage)
    try:
        found = _pareto_search(fn, n, placement, max(_rank_totals(fn, placement, start)),
                               max_states)
    except _TooLarge:
        return RankSplit(start, False, f"per-stage min-max improved by moving single cuts (the "
                         f"exact per-rank search passed {max_states} states)")
    return RankSplit(found or start, True, "exact: Pareto DP over stages, per-rank sums")


def _rank_totals(fn: StageCostFn, placement: Sequence[int], balance: Sequence[int]) -> list[float]:
    totals = [0.0] * (max(placement) + 1)
    for s, (a, e) in enumerate(stage_bounds(balance)):
        totals[placement[s]] += fn(s, a, e)
    return totals


def _descend(fn: StageCostFn, placement: Sequence[int], balance: list[int]) -> list[int]:
    # Move one cut by one layer while that lowers (rank bottleneck, sum of squared totals).
    def key(b: list[int]) -> tuple[float, float]:
        totals = _rank_totals(fn, placement, b)
        return max(totals), sum(t * t for t in totals)

    best, best_key, improved = balance, key(balance), True
    while improved:
        improved = False
        for j, d in itertools.product(range(len(best) - 1), (-1, 1)):
            moved = [*best[:j], best[j] + d, best[j + 1] - d, *best[j + 2:]]
            if min(moved) >= 1 and key(moved) < best_key:
                best, best_key, improved = moved, key(moved), True
    return best


def _pareto_search(fn: StageCostFn, n: int, placement: Sequence[int], bound: float,
                   budget: int) -> list[int] | None:
    # The split with the least rank bottleneck strictly below ``bound``, or None.
    n_stages = len(placement)
    last = {r: s for s, r in enumerate(placement)}
    levels: list[Level] = [{0: [((0.0,) * (max(placement) + 2), (0, 0))]}]
    for s, r in enumerate(placement):
        nxt: Level = {}
        for a, states in levels[-1].items():
            for e in range(a + 1, n - (n_stages - 1 - s) + 1):
                c = fn(s, a, e)
                for k, (state, _) in enumerate(states):
                    new = _add(state, 1 + r, c, last[r] == s)
                    if max(new) < bound:
                        nxt.setdefault(e, []).append((new, (a, k)))
                budget -= len(states)
                if budget < 0:
                    raise _TooLarge
        levels.append({e: _pareto(v) for e, v in nxt.items()})
    if n not in levels[-1]:
        return None
    final = levels[-1][n]
    return _backtrack(levels, n, min(range(len(final)), key=lambda k: final[k][0]))


def _add(state: State, at: int, cost: float, finishes: bool) -> State:
    values = list(state)
    values[at] += cost
    if finishes:  # the rank's total is final: fold it into the max
        values[0], values[at] = max(values[0], values[at]), 0.0
    return tuple(values)


def _pareto(items: list[tuple[State, tuple[int, int]]]) -> list[tuple[State, tuple[int, int]]]:
    # Drops every state some other state is <= in every component (first of equals kept).
    first: dict[State, tuple[int, int]] = {}
    for state, parent in items:
        first.setdefault(state, parent)
    states = sorted(first)  # a state can only be dominated by one sorting before it
    x = torch.tensor(states, dtype=torch.float64)
    kept = torch.zeros(0, dtype=torch.long)
    for lo in range(0, len(states), 512):
        rows = torch.arange(lo, min(lo + 512, len(states)))
        beaten = (x[kept][None] <= x[rows][:, None]).all(-1).any(1)
        rows = rows[~beaten]
        inside = (x[rows][None] <= x[rows][:, None]).all(-1)
        inside.fill_diagonal_(False)
        kept = torch.cat([kept, rows[~inside.any(1)]])
    return [(states[k], first[states[k]]) for k in kept.tolist()]


def _backtrack(levels: list[Level], n: int, k: int) -> list[int]:
    sizes, e = [], n
    for level in reversed(levels[1:]):
        a, k = level[e][k][1]
        sizes.append(e - a)
        e = a
    return sizes[::-1]


# -- plans ---------------------------------------------------------------------------------


def stage_peaks(sim: Simulation) -> tuple[float, ...]:
    """Per stage, the most of its own micro-batch activations alive at once in ``sim``.

    The rule of :mod:`pipetrain.simulate`'s memory model, applied to one stage's spans: F
    allocates 1 at its start; B frees 1, I frees ``1 - w_share``, W frees ``w_share`` at their
    ends; frees first at equal times. With one stage per rank it equals ``peak_activations``.
    """
    freed = {Op.B: 1.0, Op.I: 1.0 - sim.w_share, Op.W: sim.w_share}
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(sim.schedule.n_stages)]
    for sp in sim.timeline.spans:
        op = sp.action.op
        event = (sp.start, 1, 1.0) if op is Op.F else (sp.end, 0, -freed[op])
        events[sp.action.stage].append(event)
    return tuple(max(itertools.accumulate((d for *_, d in sorted(ev)), initial=0.0))
                 for ev in events)


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
    """The stage's peak count of micro-batches held at once (:func:`stage_peaks`)."""
    memory_bytes: float
    """Trainable bytes x state multiplier + frozen bytes + in_flight x activation bytes."""
    cost: float


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
        lines = [f"balance {self.balance}  mode {self.mode}  {self.schedule.name} "
                 f"({len(self.ranks)} ranks)  {self.method}",
                 "stage rank layers    F ms    I ms    W ms     params     act/mb  in-flight"
                 "     memory       cost"]
        lines += [f"{s.stage:5d} {s.rank:4d} {f'{s.first}-{s.end - 1}':6s}{_ms(s.f)}{_ms(s.i)}"
                  f"{_ms(s.w)} {_bytes(s.param_bytes)} {_bytes(s.activation_bytes)} "
                  f"{s.in_flight:9g} {_bytes(s.memory_bytes)} {fmt(s.cost)}" for s in self.stages]
        lines.append("rank stages  F+I+W ms     memory       cost")
        lines += [f"{r.rank:4d} {','.join(map(str, r.stages)):8s}{_ms(r.time)} "
                  f"{_bytes(r.memory_bytes)} {fmt(r.cost)}" for r in self.ranks]
        return "\n".join([*lines, f"bottleneck {fmt(self.bottleneck).strip()}"])


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}"


def _bytes(n: float) -> str:
    k = min(int(math.log(max(abs(n), 1), 1024)), 3)
    return f"{n / 1024**k:6.1f} {('B', 'KiB', 'MiB', 'GiB')[k]:>3s}"


LayerCostFn = Callable[[Sequence[LayerCost], int, int], float]
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
    _check_fit(n, schedule.n_stages)
    if not callable(mode) and mode not in MODES:
        raise ValueError(f"unknown balance mode {mode!r}; choose one of {list(MODES)} or pass "
                         "a function fn(layer_costs, first, end) -> float")
    costs = _layer_costs(layers, mode, sample_input, loss_fn, sample_target, layer_costs,
                         repeats)
    in_flight = stage_peaks(simulate(schedule))
    sums = _prefix_sums(costs)

    def total(key: str, a: int, e: int) -> float:
        return sums[key][e] - sums[key][a]

    def memory(s: int, a: int, e: int) -> float:
        frozen = total("frozen_bytes", a, e)
        return ((total("param_bytes", a, e) - frozen) * state_multiplier + frozen
                + in_flight[s] * total("activation_bytes", a, e))

    objective: StageCostFn = {
        "params": lambda s, a, e: total("param_bytes", a, e),
        "time": lambda s, a, e: total("f", a, e) + total("i", a, e) + total("w", a, e),
        "memory": memory,
    }[mode] if isinstance(mode, str) else lambda s, a, e: mode(costs, a, e)
    split = best_rank_split(objective, schedule.placement, n_layers=n, max_states=max_states)
    stages = tuple(StageCost(
        s, schedule.rank_of(s), a, e, total("f", a, e), total("i", a, e), total("w", a, e),
        round(total("param_bytes", a, e)), round(total("activation_bytes", a, e)),
        in_flight[s], memory(s, a, e), objective(s, a, e))
        for s, (a, e) in enumerate(stage_bounds(split.balance)))
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
    return [LayerCost(0.0, 0.0, 0.0, _param_bytes(ps), 0,
                      _param_bytes([p for p in ps if not p.requires_grad]))
            for ps in _param_owners(layers)]


def _prefix_sums(costs: Sequence[LayerCost]) -> dict[str, list[float]]:
    keys = ("f", "i", "w", "param_bytes", "activation_bytes", "frozen_bytes")
    return {k: [0.0, *itertools.accumulate(float(getattr(c, k)) for c in costs)] for k in keys}


def _rank_costs(schedule: Schedule, stages: tuple[StageCost, ...]) -> tuple[RankCost, ...]:
    out = []
    for r in range(schedule.n_ranks):
        mine = [stages[s] for s in schedule.stages_of(r)]
        out.append(RankCost(r, tuple(s.stage for s in mine), sum(s.f + s.i + s.w for s in mine),
                            sum(s.memory_bytes for s in mine), sum(s.cost for s in mine)))
    return tuple(out)
