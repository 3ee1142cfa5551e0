"""The validator: valid schedules pass; each kind of broken schedule fails with an exact message."""

from __future__ import annotations

import textwrap

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import format_grid, validate


def _error(text: str) -> str:
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_text(text, name="hand"))
    return str(info.value)


def _expect(message: str) -> str:
    return textwrap.dedent(message).strip("\n")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13])
def test_generated_schedules_are_valid(name: str, p: int, m: int) -> None:
    validate(make_schedule(name, p, m))


def test_split_backward_and_shared_rank_are_valid() -> None:
    # Two stages on one rank (a V shape), split backward, W deferred to the end.
    validate(Schedule.from_text("rank 0\n0F0\n1F0\n1I0\n0I0\n1W0\n0W0\n"))


def test_missing_action() -> None:
    assert _error("rank 0,rank 1\n0F0,1F0\n0F1,1B0\n0B0,1F1\n0B1,.\n") == _expect("""
        schedule 'hand' incomplete:
          - missing 1B1 on rank 1 (no step runs it): every (stage, mb) needs one F and either one B or one I and one W

        step  rank 0  rank 1
           0  0F0     1F0
           1  0F1     1B0
           2  0B0     1F1
           3  0B1     .
    """)  # noqa: E501


def test_missing_w_of_split_backward() -> None:
    message = _error("rank 0\n0F0\n0I0\n")
    assert message.splitlines()[1] == (
        "  - missing 0W0 on rank 0 (no step runs it): every (stage, mb) needs one F and "
        "either one B or one I and one W"
    )


def test_duplicate_action() -> None:
    assert _error("rank 0,rank 1\n0F0,1F0\n0B0,1B0\n0B0,.\n") == _expect("""
        schedule 'hand' incomplete:
          - duplicate 0B0: appears 2 times (rank 0 step 1, rank 0 step 2)

        step  rank 0  rank 1
           0  0F0     1F0
           1  0B0<<   1B0     <-- ERROR HERE
           2  0B0<<   .       <-- ERROR HERE
    """)


def test_fused_and_split_backward_mixed() -> None:
    assert _error("rank 0\n0F0\n0B0\n0I0\n0W0\n").splitlines()[:2] == [
        "schedule 'hand' incomplete:",
        "  - stage 0, mb 0 has both a fused B and a split I/W backward on rank 0; "
        "use either 0B0 or 0I0 + 0W0",
    ]


def test_w_before_i() -> None:
    assert _error("rank 0,rank 1\n0F0,1F0\n0W0,1I0\n0I0,1W0\n") == _expect("""
        schedule 'hand' out of order:
          - rank 0, step 1: 0W0 runs before 0I0 (step 2); W needs the input gradient that I computes

        step  rank 0  rank 1
           0  0F0     1F0
           1  0W0<<   1I0     <-- ERROR HERE
           2  0I0<<   1W0     <-- ERROR HERE
    """)


def test_forward_out_of_order_on_shared_rank() -> None:
    assert _error("rank 0\n1F0\n0F0\n0B0\n1B0\n") == _expect("""
        schedule 'hand' out of order:
          - rank 0, step 0: 1F0 runs before 0F0 (step 1); F needs the previous stage's activation
          - rank 0, step 2: 0B0 runs before 1B0 (step 3); B needs the next stage's input gradient

        step  rank 0
           0  1F0<<   <-- ERROR HERE
           1  0F0<<   <-- ERROR HERE
           2  0B0<<   <-- ERROR HERE
           3  1B0<<   <-- ERROR HERE
    """)


def test_backward_before_own_forward() -> None:
    message = _error("rank 0,rank 1\n0F0,1B0\n0B0,1F0\n")
    assert message.splitlines()[1] == (
        "  - rank 1, step 0: 1B0 runs before 1F0 (step 1); B needs this stage's forward"
    )


def test_deadlock_two_ranks() -> None:
    # Rank 0 runs its backward before the second forward that rank 1 waits for.
    text = """
        rank 0  rank 1
        0F0     1F0
        0B0     1F1
        0F1     1B0
        0B1     1B1
    """
    assert _error(text) == _expect("""
        schedule 'hand' deadlocks:
          - rank 0, step 1: 0B0 waits for 1B0 on rank 1 (its step 2, but rank 1 is stuck at step 1 on 1F1)
          - rank 1, step 1: 1F1 waits for 0F1 on rank 0 (its step 2, but rank 0 is stuck at step 1 on 0B0)

        step  rank 0  rank 1
           0  0F0     1F0
           1  0B0<<   1F1<<   <-- ERROR HERE
           2  0F1     1B0
           3  0B1     1B1
    """)  # noqa: E501


def test_deadlock_names_only_stuck_ranks() -> None:
    # Rank 2 is stuck too, waiting on rank 1, which is itself in the 0 <-> 1 cycle.
    text = "r0,r1,r2\n0F0,1F0,2F0\n0B0,1F1,2B0\n0F1,1B0,2F1\n0B1,1B1,2B1\n"
    lines = _error(text).splitlines()
    assert lines[0] == "schedule 'hand' deadlocks:"
    assert lines[1].startswith("  - rank 0, step 1: 0B0 waits for 1B0 on rank 1")
    assert lines[2].startswith("  - rank 1, step 1: 1F1 waits for 0F1 on rank 0")
    assert lines[3] == "  - rank 2, step 2: 2F1 waits for 1F1 on rank 1 (its step 1, but rank 1 " \
        "is stuck at step 1 on 1F1)"


def test_action_on_wrong_rank() -> None:
    schedule = Schedule.from_lists("moved", 1, [0, 1], [
        [Action(0, Op.F, 0), Action(1, Op.F, 0)], [Action(1, Op.B, 0), Action(0, Op.B, 0)],
    ])
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert str(info.value).splitlines()[:3] == [
        "schedule 'moved' malformed:",
        "  - rank 0, step 1: 1F0 runs stage 1, which is placed on rank 1; move it to that "
        "rank's list",
        "  - rank 1, step 1: 0B0 runs stage 0, which is placed on rank 0; move it to that "
        "rank's list",
    ]


def test_mb_and_stage_out_of_range() -> None:
    schedule = Schedule.from_lists("range", 1, [0], [[Action(0, Op.F, 1), Action(3, Op.B, 0)]])
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    assert str(info.value).splitlines()[1:3] == [
        "  - rank 0, step 0: 0F1 names mb 1, but micro-batches are 0..0",
        "  - rank 0, step 1: 3B0 names stage 3, but stages are 0..0",
    ]


def test_placement_rank_out_of_range() -> None:
    schedule = Schedule.from_lists("place", 1, [0, 2], [[Action(0, Op.F, 0)]])
    with pytest.raises(ScheduleError, match="placement puts stage 1 on rank 2, but ranks are 0..0"):
        validate(schedule)


def test_empty_schedule() -> None:
    with pytest.raises(ScheduleError, match="has 0 ranks, 0 stages and 0 micro-batches"):
        validate(Schedule.from_lists("empty", 0, [], []))


def test_many_problems_are_counted() -> None:
    schedule = make_schedule("gpipe", 2, 20)
    broken = Schedule.from_lists("gpipe", 20, schedule.placement,
                                 [acts[:20] for acts in schedule.actions])
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    lines = str(info.value).splitlines()
    assert lines[1] == "  - missing 0B0 on rank 0 (no step runs it): every (stage, mb) needs " \
        "one F and either one B or one I and one W"
    assert lines[13] == "  ... and 28 more"


def test_format_grid_plain() -> None:
    assert format_grid(make_schedule("1f1b", 2, 2), set()) == _expect("""
        step  rank 0  rank 1
           0  0F0     1F0
           1  0F1     1B0
           2  0B0     1F1
           3  0B1     1B1
    """)


def test_format_grid_context_elides_far_rows() -> None:
    grid = format_grid(make_schedule("gpipe", 1, 10), {(0, 9)}, context=1)
    assert grid == _expect("""
        step  rank 0
           ...
           8  0F8
           9  0F9<<   <-- ERROR HERE
          10  0B0
           ...
    """)


def test_long_schedule_error_shows_rows_near_the_error_only() -> None:
    schedule = make_schedule("gpipe", 3, 40)
    acts = [list(a) for a in schedule.actions]
    acts[1].insert(10, acts[1].pop(50))  # 1B10 moved before 1F10
    with pytest.raises(ScheduleError) as info:
        validate(Schedule.from_lists("long", 40, schedule.placement, acts))
    message = str(info.value)
    assert "  10  0F10    1B10<<  2F10    <-- ERROR HERE" in message
    assert "  40 " not in message and "   ..." in message
