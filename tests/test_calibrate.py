"""Calibration: costs and message delay read back off timelines whose answer is known."""

from __future__ import annotations

import pytest

import pipetrain.schedules as ps
from pipetrain.schedules.action import Action
from pipetrain.schedules.calibration import Calibration, calibrate, hop_delays, regroup, stage_costs
from pipetrain.schedules.timeline import Span, Timeline

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"]


def _costs(schedule: ps.Schedule) -> ps.Costs:
    """Distinct per-stage costs, with B != I + W so a fused and a split backward differ."""
    n = schedule.n_stages
    return ps.Costs(F=tuple(1.0 + 0.25 * s for s in range(n)), B=tuple(2.5 + s for s in range(n)),
                    I=tuple(1.25 + 0.5 * s for s in range(n)), W=(1.0,) * n)


def _ran(schedule: ps.Schedule, costs: ps.Costs) -> ps.Costs:
    """``costs`` as far as a run of ``schedule`` shows them (derived where it runs no op)."""
    ops = {a.op.value for acts in schedule.actions for a in acts}
    return ps.Costs(F=costs.F, **{op: getattr(costs, op) for op in "BIW" if op in ops})


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("comm", [0.0, 0.375])
def test_calibration_reads_back_the_costs_and_comm_of_a_simulated_step(name: str,
                                                                      comm: float) -> None:
    schedule = ps.make_schedule(name, 2, 6)
    costs = _ran(schedule, _costs(schedule))
    step = ps.simulate(schedule, costs, comm)
    got = calibrate(step.timeline, schedule)
    assert got.costs == costs
    assert got.comm == pytest.approx(comm) and got.hops > 0
    # the simulation from the calibration reproduces the step it was read off
    assert got.predict(schedule).makespan == pytest.approx(step.makespan)


def test_costs_are_medians_over_all_actions_of_every_step() -> None:
    schedule = ps.make_schedule("1f1b", 2, 3)
    steps = [ps.simulate(schedule, ps.Costs(F=f, B=2 * f)).timeline for f in (1.0, 3.0, 2.0)]
    got = stage_costs(steps, schedule)
    assert got == ps.Costs(F=(2.0, 2.0), B=(4.0, 4.0))
    # one slow action among three of its stage and op does not move the median
    first = steps[0]
    slow = tuple(Span(s.rank, s.action, s.start, s.end + 10 * (str(s.action) == "1F0"))
                 for s in first.spans)
    assert stage_costs(Timeline(2, slow), schedule).F == (1.0, 1.0)


def test_a_wait_on_a_busy_receiver_is_not_a_hop() -> None:
    # GPipe, 2 ranks, 2 micro-batches. Hops: 1F0 starts 0.5 after 0F0 ends on a rank idle
    # since the step began; 0B0 starts 0.25 after 1B0 ends on a rank idle since 2. Not hops:
    # 1F1 waits for rank 1's own 1F0 (until 4), not for 0F1 (ends 2); 0B1 waits for 0B0.
    schedule = ps.make_schedule("gpipe", 2, 2)
    times = {"0F0": (0, 1), "0F1": (1, 2), "0B0": (7.25, 9.25), "0B1": (9.25, 11.25),
             "1F0": (1.5, 4), "1F1": (4, 5), "1B0": (5, 7), "1B1": (7, 9)}
    step = Timeline(2, tuple(Span(int(a[0]), Action.parse(a), float(t[0]), float(t[1]))
                             for a, t in times.items()))  # stage s on rank s
    assert hop_delays(step, schedule) == [0.25, 0.5]
    assert calibrate([step, step], schedule).comm == 0.375


def test_missing_stage_or_backward_is_named() -> None:
    schedule = ps.make_schedule("1f1b", 2, 2)
    timeline = ps.simulate(schedule).timeline
    only_f = Timeline(2, tuple(s for s in timeline.spans if s.action.op.value == "F"))
    with pytest.raises(ValueError, match="no B \\(or I and W\\) action of stage 0"):
        stage_costs(only_f, schedule)
    stage0 = Timeline(2, tuple(s for s in timeline.spans if s.action.stage == 0))
    with pytest.raises(ValueError, match="no F action of stage 1"):
        calibrate(stage0, schedule)


def test_no_hop_means_free_messages() -> None:
    schedule = ps.make_schedule("gpipe", 1, 3)
    got = calibrate(ps.simulate(schedule).timeline, schedule)
    assert got == Calibration(ps.Costs(F=(1.0,), B=(2.0,)), 0.0, 0)


def test_regroup_sums_whole_stages_whatever_the_weights() -> None:
    v = ps.Costs(F=(3.0, 1.0, 2.0, 2.0), B=(6.0, 2.0, 4.0, 5.0), I=(3.0, 1.0, 2.0, 2.0),
                 W=(2.0, 1.0, 2.0, 3.0))
    weights = {"F": [0.1, 5, 2, 1, 1, 1, 1, 7]}
    two = regroup(v, [3, 1, 2, 2], [4, 4], weights=weights)
    assert two == ps.Costs(F=(4.0, 4.0), B=(8.0, 9.0), I=(4.0, 4.0), W=(3.0, 5.0))


def test_regroup_splits_a_stage_by_the_weights_of_its_layers() -> None:
    costs = ps.Costs(F=(4.0, 1.0), B=(8.0, 2.0))
    even = regroup(costs, [3, 1], [2, 2])
    assert even.F == pytest.approx((4 * 2 / 3, 4 / 3 + 1.0))
    weighted = regroup(costs, [3, 1], [2, 2], weights={"F": [0.0, 1.0, 3.0, 1.0]})
    assert weighted.F == pytest.approx((1.0, 4.0)) and weighted.B == even.B
    # a stage whose layers all weigh 0 splits evenly; uniform costs apply to every stage
    assert regroup(costs, [3, 1], [2, 2], weights={"F": [0, 0, 0, 1]}).F == even.F
    assert regroup(ps.Costs(F=2.0), [2, 2], [1, 3]).F == (1.0, 3.0)


def test_regroup_lists_every_problem() -> None:
    with pytest.raises(ValueError) as e:
        regroup(ps.Costs(F=(1.0, 2.0)), [2, 0, 2], [5], weights={"F": [1.0], "X": [1.0]})
    text = str(e.value)
    for part in ("layer counts must be >= 1", "holds 4 layers but target [5] holds 5",
                 "costs give 2 per-stage values", "weights['F'] must hold 4 numbers",
                 "weights name op 'X'"):
        assert part in text
