"""PipeDream-2BW as data: the window, its versions, phases, unrolling, validation, steady state."""

from __future__ import annotations

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import versions_alive, walk
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, simulate
from pipetrain.schedules.steady_state import steady_state
from pipetrain.schedules.validate import validate

GRID = [(p, m) for p in range(1, 6) for m in (p, p + 1, 2 * p + 3)]


def test_every_grid_point_is_valid_and_each_phase_runs() -> None:
    for p, m in GRID:
        s = make_schedule("pipedream-2bw", p, m)
        validate(s)
        assert s.update == "2bw" and not s.split_backward
        for which in ("fill", "steady", "drain"):
            assert walk(s.phase(which)).complete, (p, m, which)


def test_the_window_is_1f1b_steady_state_with_the_previous_steps_tail() -> None:
    s = make_schedule("pipedream-2bw", 3, 4)
    assert [str(a) for a in s.actions[0]] == [
        "0F0@0", "0B-2@-1", "0F1@0", "0B-1@-1", "0F2@0", "0B0@0", "0F3@0", "0B1@0"]
    assert [str(a) for a in s.actions[2]] == [
        "2F0@0", "2B0@0", "2F1@0", "2B1@0", "2F2@0", "2B2@0", "2F3@0", "2B3@0"]
    # the first step is 1F1B's warm-up and steady state; the drain its cool-down
    one = make_schedule("1f1b", 3, 4)
    fill, drain = s.phase("fill"), s.phase("drain")
    for r in range(3):
        plain = [Action(a.stage, a.op, a.mb) for a in fill.actions[r]]
        tail = [Action(a.stage, a.op, a.mb + 4) for a in drain.actions[r]]
        assert plain + tail == list(one.actions[r])


def test_unrolled_steps_keep_each_micro_batch_on_one_version_and_two_alive() -> None:
    s = make_schedule("pipedream-2bw", 4, 6).unroll(3)
    validate(s)  # its own checks: every (stage, mb) on the version of its F
    assert s.n_microbatches == 18
    for acts in s.actions:
        for a in acts:
            assert a.version == a.mb // 6  # step t's micro-batches use version t


def test_text_round_trip_keeps_versions_negative_mbs_and_the_update_rule() -> None:
    s = make_schedule("pipedream-2bw", 3, 5)
    text = s.to_text()
    assert "# update: 2bw" in text and "0B-2@-1" in text
    assert Schedule.from_text(text) == s
    assert Action.parse("1B-3@-1") == Action(1, Op.B, -3, -1)


def _edit(s: Schedule, rank: int, step: int, new: Action | None) -> Schedule:
    lists = [list(a) for a in s.actions]
    if new is None:
        del lists[rank][step]
    else:
        lists[rank][step] = new
    return Schedule.from_lists(s.name, s.n_microbatches, s.placement, lists, update=s.update)


@pytest.mark.parametrize(("rank", "step", "new", "says"), [
    (0, 1, Action(0, Op.B, -2, 0), "uses version 0; under 2BW it uses -1"),
    (0, 0, Action(0, Op.F, 0, 1), "uses version 1"),
    (1, 1, None, "0 B actions in the window"),
    (0, 1, Action(0, Op.B, 5, 0), "names mb 5"),
    (0, 1, Action(0, Op.I, -2, -1), "F and B only"),
])
def test_a_broken_window_is_named(rank: int, step: int, new: Action | None, says: str) -> None:
    s = _edit(make_schedule("pipedream-2bw", 3, 4), rank, step, new)
    with pytest.raises(ScheduleError, match=says.replace("(", r"\(")):
        validate(s)


def test_versions_alive_counts_the_newest_and_those_in_flight() -> None:
    lists = [[Action(0, Op.F, 0, 0), Action(0, Op.F, 1, 1), Action(0, Op.F, 2, 2),
              Action(0, Op.B, 0, 0), Action(0, Op.B, 1, 1), Action(0, Op.B, 2, 2)]]
    s = Schedule.from_lists("three", 3, (0,), lists)
    validate(s)  # a flushed schedule may hold as many as it likes
    assert versions_alive(s) == [[1, 2, 3, 2, 1, 1]]
    assert versions_alive(make_schedule("1f1b", 2, 3)) == [[1] * 6, [1] * 6]


def test_a_backward_on_another_version_than_its_forward_is_named() -> None:
    lists = [[Action(0, Op.F, 0, 0), Action(0, Op.B, 0, 1)]]
    with pytest.raises(ScheduleError, match="uses version 1, but its forward used version 0"):
        validate(Schedule.from_lists("mixed", 1, (0,), lists))


def test_steady_state_has_no_bubble_and_1f1b_memory() -> None:
    for p, m in [(2, 4), (4, 8), (4, 16)]:
        s = make_schedule("pipedream-2bw", p, m)
        got = steady_state(s, Costs(F=1, B=2))
        assert got.period == 3 * m and got.bubble_fraction == 0.0
        one = simulate(make_schedule("1f1b", p, m), Costs(F=1, B=2))
        assert got.peak_activations == one.peak_activations
        assert one.makespan == 3 * (m + p - 1)  # what the flush costs 1F1B per step
        assert got.peak_versions == (2,) * (p - 1) + (1,)


def test_the_flush_costs_1f1b_nothing_where_the_first_stage_is_the_bottleneck() -> None:
    """1F1B's fill comes before stage 0's work and its drain after the last stage's: where
    stage 0 is the slowest, its rank never waits, and 2BW's period equals 1F1B's makespan.
    Anywhere else the flush costs 1F1B time that 2BW does not spend."""
    for p, m in [(2, 2), (2, 4), (3, 6), (4, 8)]:
        heavy_first = Costs(F=(2.0,) + (0.2,) * (p - 1), B=(4.0,) + (0.4,) * (p - 1))
        one = simulate(make_schedule("1f1b", p, m), heavy_first).makespan
        two = steady_state(make_schedule("pipedream-2bw", p, m), heavy_first).period
        assert two == pytest.approx(one) == pytest.approx(6.0 * m)
        heavy_last = Costs(F=(0.2,) * (p - 1) + (2.0,), B=(0.4,) * (p - 1) + (4.0,))
        one = simulate(make_schedule("1f1b", p, m), heavy_last).makespan
        two = steady_state(make_schedule("pipedream-2bw", p, m), heavy_last).period
        assert two == pytest.approx(6.0 * m) and one > two + 0.5 * (p - 1)


def test_constraints_are_errors() -> None:
    with pytest.raises(ValueError, match="m >= p"):
        make_schedule("pipedream-2bw", 4, 3)
    with pytest.raises(ValueError, match="stages_per_rank"):
        make_schedule("pipedream-2bw", 2, 4, 2)
    with pytest.raises(ValueError, match="asynchronous"):
        make_schedule("1f1b", 2, 4).unroll(2)
    with pytest.raises(ValueError, match="asynchronous"):
        steady_state(make_schedule("1f1b", 2, 4))


def test_the_cli_shows_the_steady_state_and_three_steps_unrolled(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli import main

    assert main(["simulate", "-s", "pipedream-2bw", "-p", "4", "-m", "8", "--cost",
                 "F=1,B=2"]) == 0
    out = capsys.readouterr().out
    assert "asynchronous (2bw): 24 per step in the steady state, bubble fraction 0.000, " \
           "weight versions per rank 2, 2, 2, 1" in out
    assert "pipedream-2bw x3" in out


def test_simulate_refuses_one_window() -> None:
    with pytest.raises(ValueError, match="unroll"):
        simulate(make_schedule("pipedream-2bw", 2, 4))
