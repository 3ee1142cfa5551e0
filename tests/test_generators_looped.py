"""Looped BFS: validity, the makespan and memory of its docstring, text round trip, errors."""

from __future__ import annotations

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, simulate
from pipetrain.schedules.validate import validate


def _grid() -> list[tuple[int, int, int]]:
    return [(p, m, v) for p in range(1, 6) for m in (1, 2, p, p + 1, 2 * p + 3)
            for v in (1, 2, 3)]


def test_every_grid_point_is_valid_and_looped() -> None:
    for p, m, v in _grid():
        s = make_schedule("looped-bfs", p, m, v)
        validate(s)
        assert s.placement == tuple(stage % p for stage in range(p * v))
        for acts in s.actions:
            assert len(acts) == 2 * v * m
            turn = [a.op for a in acts].index(Op.B)
            assert turn == v * m  # every forward of the rank comes before its first backward


@pytest.mark.parametrize(("f", "b"), [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_makespan_is_gpipe_fill_with_smaller_stages(f: float, b: float) -> None:
    for p, m, v in _grid():
        sim = simulate(make_schedule("looped-bfs", p, m, v), Costs(F=f, B=b))
        want = (v * m + p - 1) * (f + b) if m >= p else (p * v + m - 1) * (f + b)
        assert sim.makespan == pytest.approx(want), (p, m, v)
        assert sim.peak_activations == (v * m,) * p


def test_v1_is_gpipe() -> None:
    looped, gpipe = make_schedule("looped-bfs", 3, 5, 1), make_schedule("gpipe", 3, 5)
    assert looped.actions == gpipe.actions


def test_text_round_trip_and_default_v() -> None:
    s = make_schedule("looped-bfs", 3, 4)
    assert s.n_stages == 6
    back = Schedule.from_text(s.to_text())
    assert back.actions == s.actions and back.placement == s.placement


def test_less_bubble_than_gpipe_and_more_memory_than_interleaved() -> None:
    costs = Costs(F=1, B=2)
    looped = simulate(make_schedule("looped-bfs", 4, 8, 2), costs)
    gpipe = simulate(make_schedule("gpipe", 4, 8), Costs(F=2, B=4))  # same work per rank
    interleaved = simulate(make_schedule("interleaved-1f1b", 4, 8, 2), costs)
    assert looped.makespan < gpipe.makespan
    assert max(looped.peak_activations) > max(interleaved.peak_activations)


@pytest.mark.parametrize(("args", "match"), [((0, 2, 2), "n_ranks must be a positive"),
                                             ((2, 0, 2), "n_microbatches must be a positive")])
def test_errors(args: tuple[int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_schedule("looped-bfs", *args)
