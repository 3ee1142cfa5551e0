"""Automatic balance: exact splits against brute force, cost modes, profiling, the plan."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.schedules import make_schedule, simulate
from pipetrain.schedules.action import Op
from pipetrain.schedules.timeline import Span
from pipetrain.split.balance import (
    LayerCost,
    best_rank_split,
    best_split,
    plan_balance,
    profile_layers,
    stage_pairs,
    stage_peaks,
)
from pipetrain.split.partition import stage_bounds

StageFn = Callable[[int, int, int], float]


def splits(n: int, n_stages: int) -> list[list[int]]:
    """Every balance of n layers into n_stages non-empty contiguous stages."""
    out = []
    for cuts in itertools.combinations(range(1, n), n_stages - 1):
        edges = [0, *cuts, n]
        out.append([b - a for a, b in zip(edges, edges[1:])])
    return out


def rank_max(fn: StageFn, placement: Sequence[int], balance: list[int]) -> float:
    totals = [0.0] * (max(placement) + 1)
    for s, (a, e) in enumerate(stage_bounds(balance)):
        totals[placement[s]] += fn(s, a, e)
    return max(totals)


def sum_fn(costs: Sequence[float]) -> StageFn:
    return lambda s, a, e: float(sum(costs[a:e]))


CASES = [(n, s, seed) for n in range(1, 10) for s in range(1, min(n, 4) + 1) for seed in range(4)]


@pytest.mark.parametrize(("n", "n_stages", "seed"), CASES)
def test_best_split_equals_brute_force(n: int, n_stages: int, seed: int) -> None:
    rng = random.Random(seed * 100 + n)
    costs = [float(rng.randint(0, 9)) for _ in range(n)]
    got = best_split(costs, n_stages)
    fn = sum_fn(costs)
    brute = min(rank_max(fn, range(n_stages), b) for b in splits(n, n_stages))
    assert sum(got) == n and len(got) == n_stages and min(got) >= 1
    assert rank_max(fn, range(n_stages), got) == brute
    # tie-break: least sum of squared stage costs among the optimal splits
    squares = [sum(fn(s, a, e) ** 2 for s, (a, e) in enumerate(stage_bounds(b)))
               for b in splits(n, n_stages) if rank_max(fn, range(n_stages), b) == brute]
    assert sum(fn(s, a, e) ** 2 for s, (a, e) in enumerate(stage_bounds(got))) == min(squares)


@pytest.mark.parametrize(("n", "n_stages", "seed"), CASES)
def test_best_split_with_stage_dependent_costs(n: int, n_stages: int, seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.random() for _ in range(n)]
    weight = [rng.uniform(0.5, 4) for _ in range(n_stages)]  # e.g. micro-batches in flight

    def fn(s: int, a: int, e: int) -> float:
        return weight[s] * sum(costs[a:e]) + (1.0 if s == 0 else 0.0)

    got = best_split(fn, n_stages, n_layers=n)
    brute = min(rank_max(fn, range(n_stages), b) for b in splits(n, n_stages))
    assert rank_max(fn, range(n_stages), got) == brute


def test_best_split_is_deterministic_and_even_on_ties() -> None:
    assert best_split([1.0] * 8, 4) == [2, 2, 2, 2]
    assert best_split([1, 1, 1, 3], 2) == [3, 1]
    assert best_split([0.0] * 5, 2) == [2, 3] or best_split([0.0] * 5, 2) == [3, 2]
    assert best_split([0.0] * 5, 2) == best_split([0.0] * 5, 2)


PLACEMENTS = [[0, 1, 1, 0], [0, 1, 0, 1], [0, 0], [0, 1, 2, 2, 1, 0], [0, 1, 2, 0, 1, 2],
              [1, 0, 0, 1]]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("seed", range(6))
def test_rank_split_equals_brute_force(placement: list[int], seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(len(placement), 9)
    costs = [float(rng.randint(0, 9)) for _ in range(n)]
    weight = [rng.choice([1.0, 2.0, 3.0]) for _ in placement]

    def fn(s: int, a: int, e: int) -> float:
        return weight[s] * sum(costs[a:e])

    got = best_rank_split(fn, placement, n_layers=n)
    brute = min(rank_max(fn, placement, b) for b in splits(n, len(placement)))
    assert got.exact
    assert rank_max(fn, placement, got.balance) == brute
    assert got == best_rank_split(fn, placement, n_layers=n)  # deterministic


def test_rank_split_beats_per_stage_split_on_a_v() -> None:
    costs = [1, 1, 4, 3, 1]
    per_stage = best_split(costs, 4)  # [2, 1, 1, 1]: stage costs 2, 4, 3, 1; ranks 3, 7
    got = best_rank_split(costs, [0, 1, 1, 0])
    fn = sum_fn(costs)
    assert got.balance == [1, 1, 1, 2]  # stage costs 1, 1, 4, 4; ranks 5, 5
    assert rank_max(fn, [0, 1, 1, 0], per_stage) == 7


def test_rank_split_falls_back_when_the_search_is_too_large() -> None:
    costs = [float(c) for c in range(1, 41)]
    v = [0, 1, 2, 3, 3, 2, 1, 0]
    got = best_rank_split(costs, v, max_states=10)
    assert not got.exact and "per-stage" in got.method
    assert sum(got.balance) == 40 and min(got.balance) >= 1
    assert rank_max(sum_fn(costs), v, got.balance) <= rank_max(sum_fn(costs), v,
                                                                 best_split(costs, 8))


def test_one_stage_per_rank_uses_the_stage_dp() -> None:
    got = best_rank_split([3, 1, 1, 1], [1, 0])
    assert got.exact and got.balance == [1, 3]


# -- errors --------------------------------------------------------------------------------


def test_fewer_layers_than_stages() -> None:
    with pytest.raises(PartitionError, match="3 layers cannot fill 4 stages"):
        best_split([1, 1, 1], 4)
    with pytest.raises(PartitionError, match="2 layers cannot fill 4 stages"):
        plan_balance([nn.Linear(2, 2)] * 2, make_schedule("1f1b", 4, 4), "params")


def test_unknown_mode_lists_the_modes() -> None:
    with pytest.raises(ValueError, match=r"'flops'.*'params', 'time', 'memory'"):
        plan_balance([nn.Linear(2, 2)] * 2, make_schedule("1f1b", 2, 2), "flops")


def test_bad_costs_and_arguments() -> None:
    with pytest.raises(ValueError, match="costs must be >= 0"):
        best_split([1.0, -1.0], 2)
    with pytest.raises(ValueError, match="n_layers"):
        best_split(lambda s, a, e: 1.0, 2)
    with pytest.raises(ValueError, match="sample_input"):
        plan_balance([nn.Linear(2, 2)] * 2, make_schedule("1f1b", 2, 2), "time")
    with pytest.raises(ValueError, match="repeats"):
        profile_layers([nn.Linear(2, 2)], torch.randn(1, 2), repeats=0)


# -- modes ---------------------------------------------------------------------------------


def widths_model() -> list[nn.Module]:
    # parameters 64, 64, 64, 192: params mode for 2 stages must cut before the last layer
    return [nn.Linear(8, 8, bias=False) for _ in range(3)] + [nn.Linear(8, 24, bias=False)]


def test_params_mode_analytic_split() -> None:
    plan = plan_balance(widths_model(), make_schedule("1f1b", 2, 4), "params")
    assert plan.balance == [3, 1]
    assert [s.param_bytes for s in plan.stages] == [3 * 64 * 4, 192 * 4]
    assert plan.bottleneck == 192 * 4


def synthetic(n: int, f: float = 1.0, act: int = 100, params: int = 1) -> list[LayerCost]:
    return [LayerCost(f, f, f, params, act) for _ in range(n)]


def test_time_mode_uses_f_plus_i_plus_w() -> None:
    costs = [LayerCost(1, 1, 1, 0, 0)] * 3 + [LayerCost(3, 3, 3, 0, 0)]
    plan = plan_balance([nn.Identity()] * 4, make_schedule("1f1b", 2, 4), "time",
                        layer_costs=costs)
    assert plan.balance == [3, 1]
    assert [r.time for r in plan.ranks] == [9.0, 9.0]


def test_memory_mode_shifts_layers_away_from_rank_0_under_1f1b() -> None:
    schedule = make_schedule("1f1b", 4, 8)  # 4, 3, 2, 1 micro-batches in flight
    plan = plan_balance([nn.Identity()] * 8, schedule, "memory", layer_costs=synthetic(8))
    assert [s.in_flight for s in plan.stages] == [4, 3, 2, 1]
    assert plan.balance == [1, 1, 2, 4]
    time_plan = plan_balance([nn.Identity()] * 8, schedule, "time", layer_costs=synthetic(8))
    assert time_plan.balance == [2, 2, 2, 2]


def test_memory_mode_counts_optimizer_state_for_trainable_bytes_only() -> None:
    costs = [LayerCost(0, 0, 0, 100, 0, frozen_bytes=100), LayerCost(0, 0, 0, 100, 0)]
    plan = plan_balance([nn.Identity()] * 2, make_schedule("1f1b", 2, 2), "memory",
                        layer_costs=costs, state_multiplier=3.0)
    assert [s.memory_bytes for s in plan.stages] == [100, 300]


def test_memory_mode_counts_what_i_keeps_until_w() -> None:
    # zb-h1 on 2 ranks keeps 2 units on each stage and, on stage 1, 2 micro-batches' I
    # gradients; stage 0's I computes nothing, so its layers' i_held_bytes do not count there.
    schedule = make_schedule("zb-h1", 2, 4)
    plain = [LayerCost(1, 1, 1, 0, 100)] * 4
    plan = plan_balance([nn.Identity()] * 4, schedule, "memory", layer_costs=plain)
    assert plan.balance == [2, 2] and [s.memory_bytes for s in plan.stages] == [400, 400]
    held = [LayerCost(1, 1, 1, 0, 100, 0, 100)] * 4
    plan = plan_balance([nn.Identity()] * 4, schedule, "memory", layer_costs=held)
    assert plan.balance == [3, 1]
    assert [(s.in_flight, s.held, s.i_held_bytes) for s in plan.stages] == [(2, 1, 0),
                                                                            (2, 2, 100)]
    assert [s.memory_bytes for s in plan.stages] == [600, 400]
    assert "held/mb" in str(plan) and "2+2" in str(plan)
    assert "held/mb" not in str(plan_balance([nn.Identity()] * 4, make_schedule("1f1b", 2, 4),
                                             "memory", layer_costs=held))


@pytest.mark.parametrize(("kind", "held"), [("zbv", 300), ("dualpipev", 300), ("zb-h2", 50)])
def test_memory_mode_takes_the_peak_of_units_and_held_together(kind: str, held: int) -> None:
    # Each stage's memory is the peak over time of units x act + held x i_held, recounted here
    # from the timeline; where the two counts peak apart it is less than the sum of peaks.
    schedule = make_schedule(kind, 2, 4)
    plan = plan_balance([nn.Identity()] * 8, schedule, "memory",
                        layer_costs=[LayerCost(1, 1, 1, 0, 100, 0, held)] * 8)
    sim = simulate(schedule)
    for s in plan.stages:
        spans = [sp for sp in sim.timeline.spans if sp.action.stage == s.stage]
        act, kept = s.activation_bytes, s.i_held_bytes
        brute = max(unit_bytes(spans, t, act, kept) for t in {sp.end for sp in spans}
                    | {sp.start for sp in spans})
        assert s.memory_bytes == brute
        assert kept == (0 if s.stage == 0 else held * (s.end - s.first))
    if kind == "dualpipev":  # stage 1 holds 3 units with none held, or 1 with 1 held
        assert stage_pairs(sim)[1] == ((1.0, 1.0), (3.0, 0.0))


def unit_bytes(spans: Sequence[Span], t: float, act: int, kept: int) -> float:
    # Bytes alive from time t on, under the default w_share = 1 (W frees the unit, not I).
    ops = [sp.action.op for sp in spans if sp.end <= t]
    started = sum(sp.start <= t for sp in spans if sp.action.op is Op.F)
    units = started - ops.count(Op.B) - ops.count(Op.W)
    return units * act + (ops.count(Op.I) - ops.count(Op.W)) * kept


def test_memory_mode_on_a_profiled_toy_model() -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(8)]
    plan = plan_balance(layers, make_schedule("1f1b", 4, 8), "memory", torch.randn(64, 16),
                        repeats=1)
    assert plan.balance[0] < plan.balance[-1]


def test_callable_mode() -> None:
    def last_heavy(costs: Sequence[LayerCost], first: int, end: int) -> float:
        return float(sum(10 if j == len(costs) - 1 else 1 for j in range(first, end)))

    plan = plan_balance([nn.Identity()] * 6, make_schedule("1f1b", 2, 2), last_heavy,
                        layer_costs=synthetic(6))
    assert plan.balance == [5, 1] and plan.mode == "last_heavy"


def test_v_schedule_balances_per_rank() -> None:
    schedule = make_schedule("zbv", 2, 4)  # stages 0..3 on ranks 0, 1, 1, 0
    costs = [LayerCost(c, 0, 0, 0, 0) for c in (1, 1, 1, 1, 4, 4)]
    plan = plan_balance([nn.Identity()] * 6, schedule, "time", layer_costs=costs)
    assert plan.exact and [r.cost for r in plan.ranks] == [6, 6]
    assert [r.stages for r in plan.ranks] == [(0, 3), (1, 2)]


# -- profiling -------------------------------------------------------------------------------


def test_profile_layers_times_and_bytes() -> None:
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    frozen = nn.Linear(8, 4)
    frozen.requires_grad_(False)
    layers: list[nn.Module] = [shared, nn.Tanh(), nn.Sequential(shared, nn.Linear(8, 8)), frozen]
    for p in shared.parameters():
        p.grad = torch.full_like(p, 7.0)
    x = torch.randn(4, 8)
    running = torch.get_rng_state()
    costs = profile_layers(layers, x, repeats=2)
    assert all(c.f > 0 and c.i >= 0 and c.w >= 0 for c in costs)
    assert costs[0].f > 0 and costs[0].i > 0 and costs[0].w > 0
    assert [c.param_bytes for c in costs] == [72 * 4, 0, 72 * 4, 36 * 4]  # shared counted once
    assert [c.frozen_bytes for c in costs] == [0, 0, 0, 36 * 4]
    assert costs[1].activation_bytes == 4 * 8 * 4  # tanh saves its output, which is the output
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in shared.parameters())
    assert torch.equal(torch.get_rng_state(), running)


def test_profile_layers_reuses_the_costs_of_layers_that_do_the_same_work() -> None:
    import statistics

    from pipetrain.split.profile import REUSE_SAMPLES

    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)
    # 1 to 5 do the same work (0 does not: its input needs no gradient); 6 shares 0's weights
    # (owns none), 7 has frozen ones, 8 other sizes
    layers: list[nn.Module] = [shared, *[nn.Linear(8, 8) for _ in range(5)], shared, frozen,
                               nn.Linear(8, 4)]
    x = torch.randn(4, 8)
    costs = profile_layers(layers, x, repeats=1, reuse=True)
    assert REUSE_SAMPLES == 3 and costs[4] is costs[5]  # 1, 2, 3 measured; 4, 5 their median
    for op in ("f", "i", "w"):
        assert getattr(costs[4], op) == statistics.median(getattr(c, op) for c in costs[1:4])
    assert len({id(c) for c in costs}) == len(layers) - 1
    assert costs[6].param_bytes == 0 and costs[7].frozen_bytes == 72 * 4
    assert costs[8].param_bytes == 36 * 4
    plain = profile_layers(layers, x, repeats=1)
    assert len({id(c) for c in plain}) == len(layers)
    assert [(c.param_bytes, c.activation_bytes, c.frozen_bytes) for c in costs] == [
        (c.param_bytes, c.activation_bytes, c.frozen_bytes) for c in plain]


def test_profile_layers_charges_the_loss_to_the_last_layer() -> None:
    layers: list[nn.Module] = [nn.Embedding(50, 16), nn.Linear(16, 50)]
    tokens = torch.randint(0, 50, (4, 6))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())

    costs = profile_layers(layers, tokens, loss_fn=loss_fn, sample_target=tokens, repeats=1)
    logits_bytes = 4 * 6 * 50 * 4
    assert costs[1].activation_bytes >= logits_bytes  # the loss saves its log-softmax
    assert costs[0].param_bytes == 50 * 16 * 4


def test_profile_layers_measures_what_i_keeps_until_w() -> None:
    torch.manual_seed(0)
    frozen = nn.Linear(8, 8)
    frozen.requires_grad_(False)

    def mlp() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    layers: list[nn.Module] = [mlp(), nn.Linear(8, 8), nn.Tanh(), frozen, mlp()]
    costs = profile_layers(layers, torch.randn(4, 8), repeats=1)
    out, hidden = 4 * 8 * 4, 4 * 16 * 4
    # Fed data (stage 0's place), I computes nothing: W starts from the output gradient alone.
    assert costs[0].i_held_bytes == out
    assert costs[1].i_held_bytes == out  # the gradient at the weight's output
    assert costs[2].i_held_bytes == costs[3].i_held_bytes == 0  # no trainable weights
    assert costs[4].i_held_bytes == out + hidden  # and the gradient at the inner cut


def test_profile_keeps_buffers() -> None:
    norm = nn.BatchNorm1d(4)
    before = norm.running_mean.clone()
    profile_layers([norm], torch.randn(8, 4) + 3, repeats=1)
    assert torch.equal(norm.running_mean, before)


# -- plans -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "zbv", "interleaved-1f1b", "zb-h1"])
def test_plan_costs_simulate(kind: str) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(8)]
    schedule = make_schedule(kind, 2, 4)
    plan = plan_balance(layers, schedule, "time", torch.randn(4, 8), loss_fn=nn.MSELoss(),
                        sample_target=torch.randn(4, 8), repeats=1)
    sim = simulate(schedule, plan.costs_for_simulator())
    assert sim.makespan > 0 and sum(plan.balance) == 8
    text = str(plan)
    assert f"balance {plan.balance}" in text and "bottleneck" in text


@pytest.mark.parametrize("i_held", [0.0, 0.69, (0.1, 0.2, 0.3, 0.4)])
@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "zb-h2"])
def test_stage_peaks_equal_rank_peaks_with_one_stage_per_rank(
        kind: str, i_held: float | tuple[float, ...]) -> None:
    sim = simulate(make_schedule(kind, 4, 8), w_share=0.5, i_held=i_held)
    assert stage_peaks(sim) == sim.peak_activations


def test_stage_peaks_count_what_i_keeps_for_w() -> None:
    schedule = make_schedule("zb-h1", 4, 8)
    plain, held = stage_peaks(simulate(schedule)), stage_peaks(simulate(schedule, i_held=0.5))
    assert held[0] == plain[0]  # stage 0's I keeps nothing
    assert all(h > p for h, p in zip(held[1:], plain[1:]))


def test_stage_peaks_sum_bounds_rank_peaks() -> None:
    schedule = make_schedule("zbv", 4, 8)
    sim = simulate(schedule)
    peaks = stage_peaks(sim)
    for r in range(4):
        assert sum(peaks[s] for s in schedule.stages_of(r)) >= sim.peak_activations[r]
