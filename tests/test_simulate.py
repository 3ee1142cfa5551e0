"""The simulator: closed forms for GPipe and 1F1B, the memory model, and cost parsing."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, peak_pairs, peak_units, simulate
from pipetrain.schedules.timeline import Span

GRID = [(p, m) for p in range(1, 9) for m in (1, 2, 3, 5, 8, 12)]
FB = [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0), (0.5, 4.0)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize(("f", "b"), FB)
def test_makespan_closed_form(name: str, p: int, m: int, f: float, b: float) -> None:
    sim = simulate(make_schedule(name, p, m), Costs(F=f, B=b))
    assert sim.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_activations(p: int, m: int) -> None:
    assert simulate(make_schedule("gpipe", p, m)).peak_activations == (m,) * p
    one_f_one_b = simulate(make_schedule("1f1b", p, m)).peak_activations
    assert one_f_one_b == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("comm", [0.25, 1.0, 3.0])
def test_gpipe_makespan_with_comm(p: int, m: int, comm: float) -> None:
    # The first forward crosses p-1 hops to reach the last rank, the last backward crosses
    # p-1 hops back; every other transfer hides behind compute: 2(p-1) comm in all.
    sim = simulate(make_schedule("gpipe", p, m), Costs(F=1, B=2), comm=comm)
    assert sim.makespan == pytest.approx((m + p - 1) * 3 + 2 * (p - 1) * comm)


@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 1), (4, 6), (8, 3)])
def test_comm_never_shortens_1f1b(p: int, m: int) -> None:
    schedule = make_schedule("1f1b", p, m)
    free, slow = simulate(schedule).makespan, simulate(schedule, comm=1.0).makespan
    assert slow >= free + 2 * (p - 1)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 4), (4, 8), (8, 16)])
def test_gpipe_bubbles_span_and_idle(p: int, m: int) -> None:
    sim = simulate(make_schedule("gpipe", p, m), Costs(F=1, B=2))
    bubble = (p - 1) / (m + p - 1)
    assert sim.bubble_fraction == pytest.approx(bubble)
    assert sim.bubble_rate == pytest.approx(bubble)
    assert sim.span == pytest.approx([sim.makespan - 3 * r for r in range(p)])
    assert sim.idle == pytest.approx([(p - 1) * 3] * p)


def test_timeline_has_one_span_per_action() -> None:
    schedule = make_schedule("1f1b", 3, 4)
    sim = simulate(schedule, Costs(F=1, B=2))
    assert len(sim.timeline.spans) == sum(len(acts) for acts in schedule.actions)
    for rank in range(3):
        assert [s.action for s in sim.timeline.of_rank(rank)] == list(schedule.actions[rank])
        assert all(s.duration == (1 if s.action.op is Op.F else 2)
                   for s in sim.timeline.of_rank(rank))


def test_per_stage_costs() -> None:
    # rank 0: 0F0 0-1, 0F1 1-2, 0B0 13-15, 0B1 19-21
    # rank 1: 1F0 1-4, 1F1 4-7, 1B0 7-13, 1B1 13-19
    sim = simulate(make_schedule("gpipe", 2, 2), Costs(F=(1, 3), B=(2, 6)))
    assert sim.makespan == 21
    starts = {str(s.action): (s.start, s.end) for s in sim.timeline.spans}
    assert starts == {"0F0": (0, 1), "0F1": (1, 2), "0B0": (13, 15), "0B1": (19, 21),
                      "1F0": (1, 4), "1F1": (4, 7), "1B0": (7, 13), "1B1": (13, 19)}
    assert sim.bubble_rate == pytest.approx((21 - 18) / 21)  # cost 21, work = rank 1's 18


def test_per_stage_costs_must_match_stages() -> None:
    with pytest.raises(ValueError, match="costs give 3 per-stage values but schedule '1f1b' "
                                         "has 2 stages"):
        simulate(make_schedule("1f1b", 2, 2), Costs.parse("F=1:1:1,B=2"))


# -- memory model --------------------------------------------------------------------------

SPLIT = Schedule.from_text("rank 0\n0F0\n0I0\n0F1\n0W0\n0I1\n0W1\n")


@pytest.mark.parametrize(("w_share", "peak"), [(1.0, 2.0), (0.5, 1.5), (0.0, 1.0)])
def test_w_share_decides_what_i_frees(w_share: float, peak: float) -> None:
    assert simulate(SPLIT, w_share=w_share).peak_activations == (peak,)


def test_default_w_share_keeps_activations_until_w() -> None:
    sim = simulate(SPLIT)
    assert sim.w_share == 1.0
    assert sim.peak_activations == (2.0,)


@pytest.mark.parametrize(("w_share", "peak"), [(1.0, 2.5), (0.5, 2.0)])
def test_i_held_is_added_by_i_and_freed_by_w(w_share: float, peak: float) -> None:
    # 0F0 +1, 0I0 -(1 - w_share) +0.5, 0F1 +1, 0W0 -(w_share + 0.5), ...
    sim = simulate(SPLIT, w_share=w_share, i_held=(0.5,))
    assert sim.peak_activations == (peak,)
    assert sim.to_dict()["i_held"] == [0.5]


def test_a_single_i_held_skips_stage_0_whose_i_has_no_input_gradient() -> None:
    schedule = make_schedule("zb-h1", 2, 8)
    plain = simulate(schedule).peak_activations
    held = simulate(schedule, i_held=0.5).peak_activations
    assert plain == (2.0, 2.0) and held[0] == 2.0 and held[1] > 2.0
    assert simulate(schedule, i_held=(0.0, 0.5)).peak_activations == held
    assert simulate(schedule).i_held == 0.0  # the default leaves it out


def test_frees_count_before_allocations_at_equal_times() -> None:
    # With zero-cost backward, 0B0 ends when 0F1 starts: the peak stays 1.
    sim = simulate(Schedule.from_text("rank 0\n0F0\n0B0\n0F1\n0B1\n"), Costs(F=1, B=0))
    assert sim.peak_activations == (1.0,)


def brute_states(spans: Sequence[Span], w_share: float) -> set[tuple[float, float]]:
    """(units, I-held count) on each interval between event times, recounted from scratch."""
    freed = {Op.B: 1.0, Op.I: 1.0 - w_share, Op.W: w_share}
    times = {s.start for s in spans} | {s.end for s in spans}
    states = {(0.0, 0.0)}
    for t in times:
        units = sum(1.0 if s.action.op is Op.F else 0.0 for s in spans if s.start <= t) - sum(
            freed[s.action.op] for s in spans if s.action.op is not Op.F and s.end <= t)
        held = sum({Op.I: 1, Op.W: -1}.get(s.action.op, 0) for s in spans if s.end <= t)
        states.add((units, float(held)))
    return states


PAIR_CASES = [(kind, p, m, w) for kind in ("zb-h1", "zb-h2", "zbv", "dualpipev",
                                           "interleaved-zb", "1f1b")
              for p, m in ((2, 4), (3, 6), (4, 8)) for w in (1.0, 0.5)]


@pytest.mark.parametrize(("kind", "p", "m", "w_share"), PAIR_CASES)
def test_peak_pairs_are_the_pareto_front_of_the_states(
        kind: str, p: int, m: int, w_share: float) -> None:
    sim = simulate(make_schedule(kind, p, m), Costs(F=1, I=1.5, W=0.5), w_share=w_share)
    for r in range(p):
        spans = sim.timeline.of_rank(r)
        pairs, states = peak_pairs(spans, w_share), brute_states(spans, w_share)
        assert set(pairs) <= states
        assert all(any(u <= pu and n <= pn for pu, pn in pairs) for u, n in states)
        for act, held in ((1.0, 0.0), (1.0, 0.7), (0.2, 3.0), (0.0, 1.0)):
            brute = max(u * act + n * held for u, n in states)
            assert max(u * act + n * held for u, n in pairs) == pytest.approx(brute)
        ones = tuple(1.0 for _ in range(sim.schedule.n_stages))
        assert max(u + n for u, n in pairs) == pytest.approx(peak_units(spans, w_share, ones))


def test_units_and_held_peak_at_different_times_under_zbv() -> None:
    # Rank 1 holds 4 units with 1 held, or 3 units with 3 held, never 4 with 3: the exact peak
    # of 1 byte a unit and 1 a held micro-batch is 6, where the two peaks would add to 7.
    sim = simulate(make_schedule("zbv", 2, 4))
    pairs = peak_pairs(sim.timeline.of_rank(1), sim.w_share)
    assert pairs == ((3.0, 3.0), (4.0, 1.0))
    assert max(u + n for u, n in pairs) == 6.0


def test_peak_pairs_without_i_hold_nothing() -> None:
    sim = simulate(make_schedule("1f1b", 3, 6))
    assert [peak_pairs(sim.timeline.of_rank(r), 1.0) for r in range(3)] == [
        ((3.0, 0.0),), ((2.0, 0.0),), ((1.0, 0.0),)]


# -- arguments -----------------------------------------------------------------------------


def test_invalid_schedule_raises_schedule_error() -> None:
    with pytest.raises(ScheduleError, match="missing 0B0"):
        simulate(Schedule.from_text("rank 0\n0F0\n"))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"comm": -1.0}, "comm must be a finite number >= 0, got -1.0"),
    ({"comm": float("inf")}, "comm must be a finite number >= 0, got inf"),
    ({"w_share": 1.5}, r"w_share must be in \[0, 1\], got 1.5"),
    ({"i_held": -0.5}, "cost i_held must be a finite number >= 0, got -0.5"),
    ({"i_held": (0.5,)}, "i_held gives 1 per-stage values but the schedule has 2 stages"),
])
def test_bad_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(make_schedule("gpipe", 2, 2), **kwargs)  # type: ignore[arg-type]


def test_to_dict_is_json_ready() -> None:
    sim = simulate(make_schedule("1f1b", 2, 3), Costs(F=1, B=2), comm=0.5)
    data = json.loads(json.dumps(sim.to_dict()))
    assert data["schedule"] == "1f1b"
    assert (data["ranks"], data["stages"], data["microbatches"]) == (2, 2, 3)
    assert data["makespan"] == sim.makespan
    assert data["peak_activations"] == [2.0, 1.0]
    assert data["costs"] == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    assert (data["comm"], data["w_share"]) == (0.5, 1.0)
    assert data["actions"][1] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]
    assert data["spans"][0][0] == ["0F0", 0.0, 1.0]
    assert {"span", "idle", "bubble_fraction", "bubble_rate"} <= set(data)


def test_zero_costs() -> None:
    sim = simulate(make_schedule("1f1b", 2, 2), Costs(F=0, B=0))
    assert (sim.makespan, sim.bubble_fraction, sim.bubble_rate) == (0.0, 0.0, 0.0)


# -- costs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("costs", "expected"), [
    (Costs(), (1.0, 2.0, 1.0, 1.0)),
    (Costs(B=3), (1.0, 3.0, 1.5, 1.5)),
    (Costs(B=3, I=1), (1.0, 3.0, 1.0, 2.0)),
    (Costs(B=3, W=1), (1.0, 3.0, 2.0, 1.0)),
    (Costs(I=2), (1.0, 3.0, 2.0, 1.0)),
    (Costs(F=2, B=1, I=1, W=1), (2.0, 1.0, 1.0, 1.0)),
])
def test_cost_defaults(costs: Costs, expected: tuple[float, ...]) -> None:
    assert tuple(costs.of(op, 0) for op in (Op.F, Op.B, Op.I, Op.W)) == expected


@pytest.mark.parametrize("text", [
    "F=1,B=2", "F=1,I=1,W=1", "F=1:2:1:1,B=2", "F=0.5,B=1.25", "B=3", "F=1:2,I=0.1:0.2",
    "F=1e-3,B=2.5e-3",
])
def test_costs_parse_round_trip(text: str) -> None:
    costs = Costs.parse(text)
    assert Costs.parse(str(costs)) == costs


def test_costs_parse_values() -> None:
    costs = Costs.parse(" f = 1:2:1:1 , B=2 ")
    assert costs == Costs(F=(1, 2, 1, 1), B=2)
    assert str(costs) == "F=1:2:1:1,B=2,I=1,W=1"
    assert costs.n_stages == 4
    assert [costs.of(Op.F, s) for s in range(4)] == [1, 2, 1, 1]
    assert Costs(F=1.0).n_stages is None


@pytest.mark.parametrize(("text", "message"), [
    ("", "expected OP=VALUE items"),
    ("F", "at 'F': expected OP=VALUE"),
    ("X=1", "at 'X=1': expected OP=VALUE items with OP one of F, B, I, W"),
    ("F=1,F=2", "F is given twice"),
    ("F=a", "F='a' is not a number or colon-separated numbers per stage"),
    ("F=1:", "F='1:' is not a number"),
    ("F=-1", "cost F must be a finite number >= 0, got -1.0"),
    ("F=nan", "cost F must be a finite number >= 0, got nan"),
    ("F=1:2,B=1:2:3", r"per-stage costs have different lengths \[2, 3\]"),
    ("B=1,I=2", r"derived cost W = B - I is negative \(-1\)"),
])
def test_costs_parse_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Costs.parse(text)


def test_costs_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="cost B must be a number or a non-empty sequence"):
        Costs(B=())
    with pytest.raises(ValueError, match="cost F must be a number"):
        Costs(F=True)
    with pytest.raises(ValueError, match="costs give 2 per-stage values for F, no value for "
                                         "stage 2"):
        Costs(F=(1, 2)).of(Op.F, 2)


def test_a_schedule_validated_once_simulates_alike_without_validation() -> None:
    from pipetrain.schedules.validate import validate

    schedule = make_schedule("zbv", 4, 8)
    validate(schedule)
    costs = Costs(F=1.0, I=1.2, W=0.7)
    assert simulate(schedule, costs, 0.1, validated=True).to_dict() == \
        simulate(schedule, costs, 0.1).to_dict()
