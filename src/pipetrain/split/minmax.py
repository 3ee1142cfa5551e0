"""Min-max: the contiguous split of a cost sequence that minimises the bottleneck, exactly.

    best_split       per-stage costs: two DPs over (stage, prefix), O(n^2 S); ties go to the
                     smallest sum of squared stage costs, then of squared lengths, then earliest
    best_rank_split  several stages per rank: minimise the largest per-rank SUM, exactly, by a
                     DP over stages keeping only non-dominated rank-total states (exponential in
                     the worst case: past ``max_states`` it returns the local optimum, exact=False)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pipetrain.errors import PartitionError
from pipetrain.split.partition import stage_bounds

__all__ = ["RankSplit", "StageCostFn", "best_rank_split", "best_split"]

StageCostFn = Callable[[int, int, int], float]
"""``cost(stage, first_layer, end_layer)`` of layers ``first .. end-1`` placed as ``stage``."""


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
    check_fit(n, n_stages)
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


def check_fit(n_layers: int, n_stages: int) -> None:
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
    check_fit(n, len(placement))
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


