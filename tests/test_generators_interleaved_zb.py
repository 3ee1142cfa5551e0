"""Interleaved 1F1B/ZB, ZB-H1, ZB-H2: completeness, per-stage order, closed forms, errors."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules import simulator as sim
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.generators import REGISTRY
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate

# p: ranks, m: micro-batches, v: stages per rank; f, b, i, w: per-stage costs of F, B, I, W.
SPLIT = ("zb-h1", "zb-h2", "interleaved-zb")
ALL = ("interleaved-1f1b", *SPLIT)


def microbatch_counts(p: int) -> list[int]:
    """m < p, m = p, m not a multiple of p, and larger m, where they exist."""
    return sorted({1, max(1, p - 1), p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2, 4 * p})


def grid(name: str, max_p: int = 8) -> Iterator[tuple[int, int, int]]:
    """(p, m, v) for p up to ``max_p``; timing tests, repeated per cost setting, use fewer."""
    for p in range(1, max_p + 1):
        for m in microbatch_counts(p):
            for v in (range(2, 5) if name.startswith("interleaved") else (1,)):
                yield p, m, v


@functools.cache
def build(name: str, p: int, m: int, v: int = 1) -> Schedule:
    return make_schedule(name, p, m, v)


def rank_text(schedule: Schedule, rank: int) -> str:
    return " ".join(str(a) for a in schedule.actions[rank])


def check_ops(s: Schedule, p: int, m: int, v: int) -> None:
    """Exactly one F and B (or F, I, W) per (stage, mb), per-stage mb order, no deadlock."""
    assert (s.n_ranks, s.n_stages, s.n_microbatches) == (p, p * v, m)
    assert s.placement == tuple(j % p for j in range(p * v))
    ops = (Op.F, Op.I, Op.W) if s.split_backward else (Op.F, Op.B)
    for rank, acts in enumerate(s.actions):
        assert len(acts) == len(set(acts)), f"rank {rank} repeats an action"
        for j in s.stages_of(rank):
            for op in ops:
                mbs = [a.mb for a in acts if a.stage == j and a.op is op]
                assert mbs == list(range(m)), f"stage {j} {op}: {mbs}"
        assert all(s.rank_of(a.stage) == rank and a.op in ops for a in acts)
    assert walk(s).complete, s.to_text()


def in_flight(s: Schedule) -> list[int]:
    """Per rank, the most micro-batch stages whose F ran but whose B (or W) has not."""
    peaks = []
    for acts in s.actions:
        count = peak = 0
        for a in acts:
            count += 1 if a.op is Op.F else (-1 if a.op in (Op.B, Op.W) else 0)
            peak = max(peak, count)
        peaks.append(peak)
    return peaks


def timing(s: Schedule, cost: dict[Op, float]) -> tuple[float, list[float]]:
    """(makespan, per-rank span) at comm = 0."""
    w = walk(s, duration=lambda rank, a: cost[a.op])
    assert w.complete
    first = [w.start[r, 0] for r in range(s.n_ranks)]
    last = [w.end[r, len(acts) - 1] for r, acts in enumerate(s.actions)]
    return max(last), [b - a for a, b in zip(first, last, strict=True)]


# --- every generator, over the grid ------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_complete_ordered_and_deadlock_free(name: str) -> None:
    for p, m, v in grid(name):
        check_ops(build(name, p, m, v), p, m, v)


@pytest.mark.parametrize("name", ALL)
def test_passes_validate(name: str) -> None:
    for p, m, v in grid(name):
        validate(build(name, p, m, v))


def test_registered_with_defaults() -> None:
    make_schedule("1f1b", 1, 1)  # loads the built-in kinds
    assert REGISTRY["interleaved-1f1b"].default_stages_per_rank == 2
    assert REGISTRY["zb-h1"].default_stages_per_rank == 1
    assert REGISTRY["zb-h2"].default_stages_per_rank == 1
    assert REGISTRY["interleaved-zb"].default_stages_per_rank == 2
    assert make_schedule("interleaved-1f1b", 3, 6).n_stages == 6


# --- expected lists, written as text -----------------------------------------------------

def test_interleaved_1f1b_text() -> None:
    s = make_schedule("interleaved-1f1b", 2, 4, 2)
    assert rank_text(s, 0) == "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"
    assert rank_text(s, 1) == "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"


def test_zb_h1_text() -> None:
    # Figure 3 (top) of Qi et al.: the last rank holds its first p-1 W's back.
    s = make_schedule("zb-h1", 3, 4)
    assert rank_text(s, 0) == "0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3"
    assert rank_text(s, 2) == "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"


def test_zb_h2_text() -> None:
    # Figure 3 (bottom): rank 0 runs 2p-1 forwards before its first I.
    s = make_schedule("zb-h2", 3, 6)
    # The last rank runs 2p-1 F-I pairs before its first W.
    assert rank_text(s, 0) == ("0F0 0F1 0F2 0F3 0F4 0I0 0W0 0F5 0I1 0W1 0I2 0W2 0I3 0W3 0I4 0W4 "
                               "0I5 0W5")
    assert rank_text(s, 2) == ("2F0 2I0 2F1 2I1 2F2 2I2 2F3 2I3 2F4 2I4 2W0 2F5 2I5 2W1 2W2 2W3 "
                               "2W4 2W5")


# --- closed forms at comm = 0 ------------------------------------------------------------

@pytest.mark.parametrize(("f", "b"), [(1.0, 1.0), (1.0, 2.0), (2.0, 1.0), (0.5, 1.5)])
def test_interleaved_1f1b_makespan(f: float, b: float) -> None:
    for p, m, v in grid("interleaved-1f1b", max_p=6):
        makespan, _ = timing(build("interleaved-1f1b", p, m, v), {Op.F: f, Op.B: b})
        expected = m * v * (f + b) + (p - 1) * (f + b) if m >= p else (v * p + m - 1) * (f + b)
        assert makespan == pytest.approx(expected), (p, m, v)


# ZB-H1's published form needs W <= min(F, I); these settings meet it.
H1_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 1.5, 1.0), (1.0, 2.0, 1.0), (3.0, 1.0, 0.25)]


@pytest.mark.parametrize(("f", "i", "w"), H1_COSTS)
def test_zb_h1_makespan(f: float, i: float, w: float) -> None:
    for p, m, _ in grid("zb-h1", max_p=6):
        makespan, _ = timing(build("zb-h1", p, m), {Op.F: f, Op.I: i, Op.W: w})
        if m >= p:
            expected = m * (f + i + w) + (p - 1) * (f + i - w)
        else:
            expected = (m + p - 1) * (f + i) + w
        assert makespan == pytest.approx(expected), (p, m)


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 2.0), (1.0, 0.5, 1.0), (1.0, 2.0, 1.5)])
def test_zb_h1_slow_w_is_above_the_published_form(f: float, i: float, w: float) -> None:
    # With W > min(F, I) rank 0 alone idles (p-1)*I before its first I: the form is a bound.
    for p, m, _ in grid("zb-h1", max_p=6):
        if m >= p > 1:
            makespan, _ = timing(build("zb-h1", p, m), {Op.F: f, Op.I: i, Op.W: w})
            assert makespan > m * (f + i + w) + (p - 1) * (f + i - w), (p, m)
            assert makespan >= m * (f + i + w) + (p - 1) * i - 1e-9, (p, m)


@pytest.mark.parametrize(("f", "i", "w"), H1_COSTS)
def test_interleaved_zb_makespan(f: float, i: float, w: float) -> None:
    for p, m, v in grid("interleaved-zb", max_p=6):
        if m >= p:
            makespan, _ = timing(build("interleaved-zb", p, m, v),
                                 {Op.F: f, Op.I: i, Op.W: w})
            assert makespan == pytest.approx(m * v * (f + i + w) + (p - 1) * (f + i - w))


@pytest.mark.parametrize(("f", "i", "w"), [(1.0, 1.0, 1.0), (1.0, 1.0, 2.0), (1.0, 0.5, 1.0)])
def test_interleaved_zb_never_slower_than_interleaved_1f1b(f: float, i: float, w: float) -> None:
    for p, m, v in grid("interleaved-zb", max_p=6):
        split, _ = timing(build("interleaved-zb", p, m, v), {Op.F: f, Op.I: i, Op.W: w})
        fused, _ = timing(build("interleaved-1f1b", p, m, v), {Op.F: f, Op.B: i + w})
        assert split <= fused + 1e-9, (p, m, v)


# ZB-H2: the paper's (p-1)(F+I-2W) when I <= F or W <= F; the I-F term covers the rest.
H2_COSTS = H1_COSTS + [(1.0, 1.0, 2.0), (1.0, 0.5, 1.0), (1.0, 2.0, 2.0), (0.5, 3.0, 1.0)]


@pytest.mark.parametrize(("f", "i", "w"), H2_COSTS)
def test_zb_h2_span(f: float, i: float, w: float) -> None:
    for p, m, _ in grid("zb-h2", max_p=6):
        if m < 2 * p - 1:
            continue
        _, spans = timing(build("zb-h2", p, m), {Op.F: f, Op.I: i, Op.W: w})
        expected = m * (f + i + w) + (p - 1) * max(0.0, f + i - 2 * w, i - f)
        assert max(spans) == pytest.approx(expected), (p, m)
        if i <= f or w <= f:
            paper = m * (f + i + w) + (p - 1) * max(0.0, f + i - 2 * w)
            assert max(spans) == pytest.approx(paper), (p, m)


def test_zb_h2_is_bubble_free_at_equal_costs() -> None:
    for p, m, _ in grid("zb-h2"):
        if m >= 2 * p - 1:
            _, spans = timing(build("zb-h2", p, m), {Op.F: 1, Op.I: 1, Op.W: 1})
            assert spans == [3.0 * m] * p, (p, m)


# --- memory ------------------------------------------------------------------------------

def test_in_flight_limits() -> None:
    for p, m, _ in grid("zb-h1"):
        assert in_flight(build("zb-h1", p, m)) == [min(p, m)] * p, (p, m)
        if m >= 2 * p - 1:
            assert in_flight(build("zb-h2", p, m)) == [2 * p - 1] * p, (p, m)
    for p, m, v in grid("interleaved-1f1b"):
        first_round = m if m < p else m // (m // p) + (1 if m % (m // p) else 0)
        warmup = [min((v - 1) * first_round + 2 * (p - 1 - r), m * v) for r in range(p)]
        expected = [min(warmup[r] + 1, m * v) for r in range(p)]
        assert in_flight(build("interleaved-1f1b", p, m, v)) == expected, (p, m, v)
        expected = [min(warmup[r] + 1 + r, m * v) for r in range(p)]
        zb = in_flight(build("interleaved-zb", p, m, v))
        assert zb == expected and max(zb) == expected[0], (p, m, v)


def test_in_flight_of_one_f_one_b_bounds_zb_h1() -> None:
    for p, m, _ in grid("zb-h1"):
        assert max(in_flight(build("zb-h1", p, m))) == max(
            in_flight(build("1f1b", p, m))), (p, m)


# --- the simulator agrees ----------------------------------------------------------------

def test_simulate_matches_closed_forms() -> None:
    p, m = 4, 12
    run = sim.simulate(make_schedule("interleaved-1f1b", p, m, 3), sim.Costs(F=1.0, B=2.0))
    assert run.makespan == pytest.approx(m * 3 * 3.0 + (p - 1) * 3.0)
    assert run.peak_activations[0] == (3 - 1) * p + 2 * (p - 1) + 1
    run = sim.simulate(build("zb-h1", p, m), sim.Costs(F=1.0, I=1.0, W=1.0))
    assert run.makespan == pytest.approx(m * 3.0 + (p - 1) * 1.0)
    assert run.peak_activations == (float(p),) * p
    run = sim.simulate(build("zb-h2", p, m), sim.Costs(F=1.0, I=1.0, W=1.0))
    assert max(run.span) == pytest.approx(m * 3.0)
    assert run.bubble_rate == pytest.approx(0.0)
    assert run.peak_activations == (float(2 * p - 1),) * p


# --- constraint errors -------------------------------------------------------------------

@pytest.mark.parametrize(("name", "fallback"), [("interleaved-1f1b", "1f1b"),
                                                ("interleaved-zb", "zb-h1")])
def test_interleaved_needs_two_stages_per_rank(name: str, fallback: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} needs stages_per_rank >= 2, got 1; "
                                         rf"use {fallback} for one stage per rank"):
        make_schedule(name, 4, 8, 1)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_zero_bubble_needs_one_stage_per_rank(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} places one stage per rank "
                                         r"\(stages_per_rank=1\), got stages_per_rank=2"):
        make_schedule(name, 4, 8, 2)


@pytest.mark.parametrize("name", ALL)
def test_direct_calls_reject_empty_counts(name: str) -> None:
    build = REGISTRY[name].build
    v = REGISTRY[name].default_stages_per_rank
    with pytest.raises(ValueError, match=rf"{name} needs n_ranks >= 1 and n_microbatches >= 1"):
        build(0, 4, v)
    with pytest.raises(ValueError, match="got n_ranks=2, n_microbatches=0"):
        build(2, 0, v)


def test_split_backward_keeps_i_before_w_on_one_rank() -> None:
    for name in SPLIT:
        for p, m, v in grid(name):
            for acts in build(name, p, m, v).actions:
                seen: set[tuple[int, int]] = set()
                for a in acts:
                    if a.op is Op.I:
                        seen.add((a.stage, a.mb))
                    assert a.op is not Op.W or (a.stage, a.mb) in seen, a
                assert Action(acts[0].stage, Op.F, 0) == acts[0]
