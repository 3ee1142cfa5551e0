"""Actions and schedules as text: parse/format round trips and the errors bad text raises."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action, B, F, I, Op, W
from pipetrain.schedules.schedule import Schedule


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize(("stage", "mb"), [(0, 0), (3, 7), (12, 0), (0, 31), (15, 127)])
def test_action_round_trip(op: Op, stage: int, mb: int) -> None:
    action = Action(stage, op, mb)
    assert str(action) == f"{stage}{op.value}{mb}"
    assert Action.parse(str(action)) == action


def test_action_parse_multi_digit_and_spaces() -> None:
    assert Action.parse("12W34") == Action(12, Op.W, 34)
    assert Action.parse(" 2 I 5 ") == Action(2, Op.I, 5)


def test_action_shorthands() -> None:
    assert [F(1, 2), B(1, 2), I(1, 2), W(1, 2)] == [
        Action.parse(t) for t in ("1F2", "1B2", "1I2", "1W2")
    ]


@pytest.mark.parametrize("text", ["", "F0", "3F", "3X0", "3f0", "-1F0", "3F0F", "3 F 0 1"])
def test_action_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action") as info:
        Action.parse(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 4), (4, 9), (8, 2)])
def test_text_round_trip(name: str, p: int, m: int) -> None:
    schedule = make_schedule(name, p, m)
    assert Schedule.from_text(schedule.to_text()) == schedule


def test_to_text_pads_short_columns() -> None:
    text = make_schedule("1f1b", 2, 1).to_text()
    assert text == "# schedule: 1f1b\nrank 0,rank 1\n0F0,1F0\n0B0,1B0\n"
    text = make_schedule("gpipe", 1, 2).to_text()
    assert text == "# schedule: gpipe\nrank 0\n0F0\n0F1\n0B0\n0B1\n"


def test_from_text_whitespace_grid_with_padding() -> None:
    text = """
        # schedule: hand
        rank 0  rank 1
        0F0     .
        0F1     1F0
        .       1B0
        0B0     1F1
        0B1     1B1
    """
    schedule = Schedule.from_text(text)
    assert schedule.name == "hand"
    assert schedule.placement == (0, 1)
    assert schedule.n_microbatches == 2
    assert [[str(a) for a in acts] for acts in schedule.actions] == [
        ["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"],
    ]


def test_from_text_comma_grid_with_empty_and_dash_cells() -> None:
    schedule = Schedule.from_text("r0,r1\n0F0,\n-,1F0\n0B0,1B0\n")
    assert [[str(a) for a in acts] for acts in schedule.actions] == [["0F0", "0B0"],
                                                                     ["1F0", "1B0"]]


def test_from_text_without_header_keeps_first_row() -> None:
    # A hand-written grid without the "rank 0,rank 1" line used to lose its first row.
    schedule = Schedule.from_text("0F0,1F0\n0B0,1B0\n")
    assert [[str(a) for a in acts] for acts in schedule.actions] == [["0F0", "0B0"],
                                                                     ["1F0", "1B0"]]


def test_from_text_name_argument_wins() -> None:
    text = make_schedule("gpipe", 2, 2).to_text()
    assert Schedule.from_text(text, name="mine").name == "mine"
    assert Schedule.from_text("rank 0\n0F0\n0B0\n").name == "custom"


def test_from_text_interleaved_placement() -> None:
    schedule = Schedule.from_text("rank 0,rank 1\n0F0,1F0\n2F0,3F0\n")
    assert schedule.placement == (0, 1, 0, 1)
    assert schedule.stages_of(0) == (0, 2)
    assert schedule.rank_of(3) == 1


def test_stage_on_two_ranks() -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text("rank 0,rank 1\n0F0,1F0\n0B0,0B1\n")
    assert str(info.value) == (
        "stage 0 appears on rank 0 and on rank 1 (action 0B1); a stage lives on exactly one rank"
    )


def test_missing_stage() -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text("rank 0,rank 1\n0F0,2F0\n0B0,2B0\n")
    assert str(info.value) == (
        "stages [1] have no actions on any rank; every stage 0..2 needs its F and backward actions"
    )


def test_bad_cell_names_line_and_rank() -> None:
    with pytest.raises(ScheduleError, match=r"^line 3, rank 1: cannot parse action '1X0'"):
        Schedule.from_text("rank 0,rank 1\n0F0,1F0\n0B0,1X0\n")


def test_row_wider_than_header() -> None:
    with pytest.raises(ScheduleError, match="^line 2: 3 cells but the header names 2 ranks$"):
        Schedule.from_text("rank 0,rank 1\n0F0,1F0,2F0\n")


def test_empty_text() -> None:
    with pytest.raises(ScheduleError, match="no rank header and no actions"):
        Schedule.from_text("# schedule: nothing\n\n")


def test_split_backward_and_counts() -> None:
    schedule = Schedule.from_text("rank 0\n0F0\n0I0\n0W0\n")
    assert schedule.split_backward
    assert not make_schedule("1f1b", 2, 2).split_backward
    assert (schedule.n_ranks, schedule.n_stages, schedule.n_microbatches) == (1, 1, 1)


def test_save_and_load(tmp_path: Path) -> None:
    schedule = make_schedule("1f1b", 3, 5)
    path = tmp_path / "s.csv"
    schedule.save(path)
    assert Schedule.load(path) == schedule
