"""Planner: predicted step time and peak bytes of a layout, the fit, and the ranking."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.plan.planner import (
    MARGIN,
    Profiled,
    Scale,
    actions_per_rank,
    evaluate,
    microbatch_choices,
    search,
)
from pipetrain.plan.planner import (
    ranked as rank_candidates,
)
from pipetrain.schedules import make_schedule
from pipetrain.split.profile import LayerCost

MIB = 2**20


def _profile(rows: int, n: int = 6, largest: int = MIB // 2) -> Profiled:
    # Every layer: F 1 ms, I 1 ms, W 1 ms per row; 1 MiB of parameters, the largest weight
    # half of it; 1 MiB of activations per row, of which W needs a quarter after I; inputs of
    # 1/8 MiB per row.
    layer = LayerCost(f=1e-3 * rows, i=1e-3 * rows, w=1e-3 * rows, param_bytes=MIB,
                      activation_bytes=MIB * rows, i_held_bytes=MIB * rows // 4,
                      largest_grad_bytes=largest)
    return Profiled(rows, (layer,) * n, (MIB * rows // 8,) * n)


def test_microbatch_choices_split_the_rows_evenly_from_half_the_ranks() -> None:
    assert microbatch_choices(32, 4) == [2, 4, 8, 16]
    assert microbatch_choices(12, 4, most=3) == [2, 3, 4]
    assert microbatch_choices(3, 8) == [3]


def test_one_f_one_b_prediction_is_the_simulated_makespan_plus_overhead() -> None:
    prof, scale = _profile(2), Scale(overhead=0.5)
    cand = evaluate(prof, make_schedule("1f1b", 2, 4), [3, 3], "never", 1e12, scale)
    # per stage and micro-batch: F 6 ms, B 12 ms; (m + p - 1) (F + B) = 5 x 18 ms
    assert cand.predicted_step_s == pytest.approx(0.090 + 0.5)
    # rank 0: 3 layers x 4 bytes per parameter byte + 2 micro-batches x (6 MiB + the 1/4 MiB
    # input) + 6 MiB working + the largest weight's gradient (1/2 MiB) before it is added
    assert cand.predicted_peak_bytes[0] == 12 * MIB + 2 * (6 * MIB + MIB // 4) + 6 * MIB + MIB // 2
    assert cand.predicted_peak_bytes[1] == 12 * MIB + (6 * MIB + MIB // 4) + 6 * MIB + MIB // 2
    assert cand.fits and cand.to_dict()["balance"] == [3, 3]


def test_recompute_keeps_only_stage_inputs_and_pays_one_more_forward() -> None:
    prof = _profile(2)
    never = evaluate(prof, make_schedule("1f1b", 2, 4), [3, 3], "never", 1e12, Scale())
    always = evaluate(prof, make_schedule("1f1b", 2, 4), [3, 3], "always", 1e12, Scale())
    assert always.predicted_step_s == pytest.approx(5 * (0.006 + 0.018))
    # 2 micro-batches' inputs kept, one micro-batch rebuilt for its B, B's working memory and
    # the largest weight's gradient
    assert always.predicted_peak_bytes[0] == (12 * MIB + 2 * (MIB // 4) + 6 * MIB + 6 * MIB
                                              + MIB // 2)
    assert max(always.predicted_peak_bytes) < max(never.predicted_peak_bytes)


def test_a_recomputed_split_backward_keeps_what_its_i_rebuilt_until_w() -> None:
    cand = evaluate(_profile(2), make_schedule("zb-h1", 2, 4), [3, 3], "always", 1e12, Scale())
    # rank 1 runs 1I0 1F1 1I1 before 1W0: two replayed micro-batches (6 MiB each) with their
    # I-held gradients (1.5 MiB each) and the inputs F kept (1/4 MiB each), + 6 MiB working
    # and the largest weight's gradient
    assert cand.predicted_peak_bytes[1] == (12 * MIB + 2 * 6 * MIB + 3 * MIB + MIB // 2
                                            + 6 * MIB + MIB // 2)


def test_the_optimizer_step_can_be_the_peak() -> None:
    # one 1-row micro-batch of 1 MiB activations, but a weight of 8 MiB: per-tensor AdamW
    # (CPU) makes two temporaries of its size once the activations are gone
    prof = _profile(1, largest=8 * MIB)
    cpu = evaluate(prof, make_schedule("1f1b", 2, 1), [3, 3], "never", 1e12, Scale())
    assert cpu.predicted_peak_bytes[0] == 12 * MIB + 2 * 8 * MIB
    # foreach AdamW (CUDA) makes one temporary the size of every weight it updates
    prof = _profile(1, largest=MIB // 2)
    cuda = evaluate(prof, make_schedule("1f1b", 2, 1), [3, 3], "never", 1e12,
                    Scale(foreach=True))
    backward = 12 * MIB + (3 * MIB + MIB // 8) + 3 * MIB + MIB // 2
    assert cuda.predicted_peak_bytes[0] == backward  # 13.1 MiB of backward above 3 MiB
    light = LayerCost(1e-3, 1e-3, 1e-3, param_bytes=4 * MIB, activation_bytes=MIB // 8,
                      largest_grad_bytes=MIB)
    light_prof = Profiled(1, (light,) * 6, (0,) * 6)
    cuda = evaluate(light_prof, make_schedule("1f1b", 2, 1), [3, 3], "never", 1e12,
                    Scale(foreach=True))
    assert cuda.predicted_peak_bytes[0] == 48 * MIB + 12 * MIB  # 12 MiB of weights at once


def test_split_backward_keeps_what_w_needs_until_w() -> None:
    prof = _profile(2)
    cand = evaluate(prof, make_schedule("zb-h1", 2, 4), [3, 3], "never", 1e12, Scale())
    # rank 1 (not stage 0): its I's gradients for W (1.5 MiB per micro-batch) count too
    plain = evaluate(prof, make_schedule("1f1b", 2, 4), [3, 3], "never", 1e12, Scale())
    assert cand.predicted_peak_bytes[1] > plain.predicted_peak_bytes[1]


def test_search_ranks_fitting_layouts_first_then_fastest() -> None:
    profiles = [_profile(r) for r in (1, 2, 4)]
    ranked = search(profiles, 2, 8, 40 * MIB, Scale(comm=1e-4),
                    schedules=("gpipe", "1f1b", "zb-h1", "zbv"))
    fits = [c.fits for c in ranked]
    assert fits == sorted(fits, reverse=True) and fits[0] and not fits[-1]
    fitting = [c.predicted_step_s for c in ranked if c.fits]
    assert fitting[1:] == sorted(fitting[1:])  # the first may be a near tie's fewer actions
    assert fitting[0] <= min(fitting) * (1 + MARGIN)
    assert all(max(c.predicted_peak_bytes) <= 40 * MIB for c in ranked if c.fits)
    assert {c.microbatches for c in ranked} == {2, 4, 8}
    assert ranked[0].schedule in ("zb-h1", "zbv")  # split backward fills 1F1B's bubble


def test_a_near_tie_goes_to_the_layout_with_fewer_actions() -> None:
    profiles = [_profile(r) for r in (1, 2, 4)]
    found = search(profiles, 2, 8, 1e12, Scale(), schedules=("1f1b",), recompute=("never",))
    by_m = {c.microbatches: c for c in found if c.balance == (3, 3)}
    assert [actions_per_rank(by_m[m].simulation.schedule) for m in (8, 4, 2)] == [16, 8, 4]

    def ranked(*slower: float) -> list[int]:  # m = 8, 4, 2 at 1 + slower[k] of the fastest
        cands = [replace(by_m[m], predicted_step_s=1.0 + x) for m, x in zip((8, 4, 2), slower)]
        return [c.microbatches for c in rank_candidates(cands)]

    assert ranked(0.0, MARGIN / 2, MARGIN) == [2, 8, 4]  # all three tie: the fewest actions
    assert ranked(0.0, MARGIN / 2, 1.5 * MARGIN) == [4, 8, 2]
    assert ranked(0.0, 1.5 * MARGIN, 2 * MARGIN) == [8, 4, 2]


def test_a_profile_must_split_the_rows() -> None:
    with pytest.raises(ValueError, match="does not split 8 rows"):
        search([_profile(3)], 2, 8, 1e12, Scale())


def test_fsdp_shards_the_state_and_pays_for_its_gathers() -> None:
    from pipetrain.plan.shardcost import Sharding

    prof, schedule = _profile(2), make_schedule("1f1b", 2, 4)
    whole = evaluate(prof, schedule, [3, 3], "never", 1e12, Scale(), Sharding(dp=2))
    part = evaluate(prof, schedule, [3, 3], "never", 1e12, Scale(), Sharding(fsdp=2))
    # 3 MiB trainable per rank: 12 MiB replicated; under FSDP 3 x 3 / 2 of shards, 3 of whole
    # gradients and one layer gathered (1 MiB, a layer being one unit here); the optimizer's
    # temporaries and everything else alike
    assert [w - p for w, p in zip(whole.predicted_peak_bytes, part.predicted_peak_bytes)] == \
        [12 * MIB - (9 * MIB // 2 + 3 * MIB + MIB)] * 2
    assert part.predicted_step_s > whole.predicted_step_s - 1e-3  # the gathers cost
    assert part.to_dict()["fsdp"] == 2 and whole.to_dict()["dp"] == 2


def test_processes_per_pipeline_rank_share_the_cores() -> None:
    from pipetrain.plan.shardcost import Sharding

    prof, schedule = _profile(2), make_schedule("1f1b", 2, 4)
    alone = evaluate(prof, schedule, [3, 3], "never", 1e12, Scale(cores=2.0))
    shared = evaluate(prof, schedule, [3, 3], "never", 1e12, Scale(cores=2.0),
                      Sharding(dp=2))
    # two pipelines on two cores: each runs on one, its two ranks sharing it
    assert shared.simulation.makespan > 1.3 * alone.simulation.makespan
