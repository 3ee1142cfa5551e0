"""Sharing: ranks on fewer cores than ranks run at cores/busy speed, and calibration undoes it."""

from __future__ import annotations

import random

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action
from pipetrain.schedules.calibration import calibrate
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.shared_cores import rate, shared_walk, unshare
from pipetrain.schedules.simulator import Costs, simulate
from pipetrain.schedules.timeline import Span, Timeline

CASES = [("gpipe", 2, 4), ("1f1b", 4, 8), ("zb-h1", 3, 6), ("zbv", 2, 4),
         ("interleaved-1f1b", 2, 4), ("dualpipev", 2, 4), ("v-half", 4, 8)]


def _costs(n_stages: int, seed: int) -> Costs:
    rng = random.Random(seed)
    return Costs(F=tuple(rng.uniform(0.5, 2) for _ in range(n_stages)),
                 I=tuple(rng.uniform(0.5, 2) for _ in range(n_stages)),
                 W=tuple(rng.uniform(0.5, 2) for _ in range(n_stages)),
                 B=tuple(rng.uniform(1, 4) for _ in range(n_stages)))


def test_rate_is_full_up_to_the_cores_then_a_fair_share() -> None:
    assert [rate(k, 2) for k in (0, 1, 2, 3, 4)] == [1.0, 1.0, 1.0, 2 / 3, 0.5]


def test_two_ranks_on_one_core_share_it_while_both_are_busy() -> None:
    # the module's picture: work 2 each, rank 1's input arrives at 1
    s = make_schedule("gpipe", 2, 1)
    got = shared_walk(s, lambda r, a: 2.0 if a.op.value == "F" else 0.0, 0.0, 1.0)
    assert got.complete
    assert got.end[0, 0] == 2.0  # alone
    assert (got.start[1, 0], got.end[1, 0]) == (2.0, 4.0)  # rank 1 F waits for rank 0's F
    walked = simulate(make_schedule("gpipe", 2, 2), Costs(F=2, B=0, I=0, W=0), cores=1.0)
    f = {str(x.action): (x.start, x.end) for x in walked.timeline.spans if x.action.op.value == "F"}
    # 0F1 and 1F0 both start at 2 and share the core: work 2 at half speed each, to 6
    assert f["0F1"] == (2.0, 6.0) and f["1F0"] == (2.0, 6.0) and f["1F1"] == (6.0, 8.0)


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_enough_cores_is_the_plain_walk(name: str, p: int, m: int) -> None:
    s = make_schedule(name, p, m)
    costs = _costs(s.n_stages, 1)
    plain = simulate(s, costs, 0.3)
    shared = simulate(s, costs, 0.3, cores=float(p))
    def times(sim: object) -> dict[str, tuple[float, float]]:
        return {str(x.action): (x.start, x.end) for x in sim.timeline.spans}  # type: ignore[attr-defined]

    got, want = times(shared), times(plain)
    assert got.keys() == want.keys()
    assert all(got[k] == pytest.approx(want[k]) for k in want)
    assert shared.cores == p and shared.to_dict()["cores"] == p


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_one_core_without_delays_is_never_idle(name: str, p: int, m: int) -> None:
    s = make_schedule(name, p, m)
    costs = _costs(s.n_stages, 2)
    total = sum(costs.of(a.op, a.stage) for acts in s.actions for a in acts)
    assert simulate(s, costs, cores=1.0).makespan == pytest.approx(total)


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_unshare_recovers_the_work_and_calibration_the_costs(name: str, p: int, m: int) -> None:
    s = make_schedule(name, p, m)
    costs = _costs(s.n_stages, 3)
    sim = simulate(s, costs, 0.1, cores=p / 2)
    slower = simulate(s, costs, 0.1)
    assert sim.makespan > slower.makespan  # sharing only slows
    for span in unshare(sim.timeline, p / 2).spans:
        assert span.duration == pytest.approx(costs.of(span.action.op, span.action.stage))
    again = calibrate(sim.timeline, s, cores=p / 2)
    for op in ("FIW" if s.split_backward else "FB"):  # the ops the steps ran
        assert again.costs.to_dict()[op] == pytest.approx(costs.to_dict()[op])
    assert again.predict(s).makespan == pytest.approx(sim.makespan)


def test_unshare_integrates_the_rate_over_each_span() -> None:
    a = Action.parse("0F0")
    t = Timeline(3, (Span(0, a, 0.0, 4.0), Span(1, a, 1.0, 3.0), Span(2, a, 2.0, 3.0)))
    # cores 1: span 0 is alone 0..1 and 3..4 (2), with one other 1..2 (0.5), two others 2..3
    assert [s.duration for s in unshare(t, 1.0).spans] == pytest.approx([2.5 + 1 / 3,
                                                                         0.5 + 1 / 3, 1 / 3])


def test_cores_must_be_positive() -> None:
    s = make_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="cores must be a positive number, got 0"):
        shared_walk(s, lambda r, a: 1.0, 0.0, 0)


def test_a_deadlocked_list_is_reported_as_the_plain_walk_reports_it() -> None:
    from pipetrain.schedules.schedule import Schedule

    s = Schedule.from_lists("bad", 1, [0, 1], [[Action.parse("0F0"), Action.parse("0B0")],
                                                [Action.parse("1B0"), Action.parse("1F0")]])
    got, plain = shared_walk(s, lambda r, a: 1.0, 0.0, 1.0), walk(s, lambda r, a: 1.0)
    assert not got.complete and got.stuck == plain.stuck
