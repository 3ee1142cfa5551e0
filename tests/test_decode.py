"""Decoding schedules as data: generated from integers, printed and parsed back with their
feedback, validated (forward-only, the fed-back token before its use), simulated (the steady
state's bubble is :func:`steady_bubble`), and run by the executor in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.errors import ScheduleError
from pipetrain.schedules.action import Action, B, F, Op
from pipetrain.schedules.generators.decode import decode_schedule, steady_bubble
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import simulate
from pipetrain.schedules.validate import validate


def test_decode_lists_and_feedback() -> None:
    s = decode_schedule(3, 2, 4, fed_from=2)
    assert s.n_microbatches == 8 and s.placement == (0, 1, 2) and s.feedback == (2, 4)
    assert [str(a) for a in s.actions[1][:3]] == ["1F0", "1F1", "1F2"]
    assert {a.op for acts in s.actions for a in acts} == {Op.F}
    assert s.fed_back(F(0, 3)) is None  # a prefill step: the caller's input
    assert s.fed_back(F(0, 5)) == F(2, 3)
    assert s.fed_back(F(1, 5)) is None  # only stage 0 takes the token
    validate(s)


@pytest.mark.parametrize(("p", "g", "steps", "fed"), [(1, 1, 3, 1), (2, 3, 5, 2), (4, 4, 6, 1)])
def test_decode_text_round_trip(p: int, g: int, steps: int, fed: int) -> None:
    s = decode_schedule(p, g, steps, fed_from=fed)
    text = s.to_text()
    assert f"# feedback: lag={g} start={g * fed}" in text
    assert Schedule.from_text(text) == s


def test_feedback_line_must_parse() -> None:
    text = decode_schedule(2, 2, 2).to_text().replace("start=2", "start=two")
    with pytest.raises(ScheduleError, match="feedback: lag=L start=S"):
        Schedule.from_text(text)


@pytest.mark.parametrize(("args", "match"), [((0, 1, 1), "ranks, groups and steps"),
                                             ((2, 2, 3, 0), "fed_from must be in 1..3"),
                                             ((2, 2, 3, 4), "fed_from must be in 1..3")])
def test_decode_rejects_counts(args: tuple[int, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        decode_schedule(*args)


def _with(s: Schedule, actions: list[list[Action]], feedback: tuple[int, int] | None
          ) -> Schedule:
    return Schedule.from_lists("decode", s.n_microbatches, s.placement, actions, feedback)


def test_validate_refuses_backward_and_bad_lag() -> None:
    s = decode_schedule(2, 2, 2)
    with pytest.raises(ScheduleError, match="backward action in a decoding schedule"):
        validate(_with(s, [list(s.actions[0]), [*s.actions[1], B(1, 0)]], s.feedback))
    with pytest.raises(ScheduleError, match="lag must be at least 1 and at most start"):
        validate(_with(s, [list(a) for a in s.actions], (3, 2)))


def test_validate_names_a_token_used_before_it_is_picked() -> None:
    s = decode_schedule(1, 2, 3)  # one rank: 0F2 takes 0F0's token, 0F3 takes 0F1's
    early = [F(0, 0), F(0, 2), F(0, 1), F(0, 3), F(0, 4), F(0, 5)]
    validate(_with(s, [early], s.feedback))  # 0F2 after 0F0: fine
    wrong = [F(0, 2), F(0, 0), F(0, 1), F(0, 3), F(0, 4), F(0, 5)]
    with pytest.raises(ScheduleError, match="0F2 runs before 0F0.*feedback takes"):
        validate(_with(s, [wrong], s.feedback))


def test_validate_finds_a_feedback_deadlock() -> None:
    s = decode_schedule(2, 1, 3)  # rank 0 waits for 1F0's token before it sends 0F0
    wrong = [[F(0, 1), F(0, 0), F(0, 2)], list(s.actions[1])]
    with pytest.raises(ScheduleError, match="deadlock|waits for"):
        validate(_with(s, wrong, s.feedback))


@pytest.mark.parametrize(("p", "g"), [(2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (4, 8), (3, 5)])
def test_simulated_steady_state_bubble(p: int, g: int) -> None:
    steps = 40
    sim = simulate(decode_schedule(p, g, steps, fed_from=1))
    spans = sorted(x.start for x in sim.timeline.of_rank(0))
    # rank 0 in the middle of the run: busy g units out of every period
    window = [t for t in spans if spans[len(spans) // 4] <= t < spans[3 * len(spans) // 4]]
    busy = len(window)
    period = window[-1] - window[0] + 1
    assert busy / period == pytest.approx(1 - steady_bubble(p, g), rel=0.05)


def test_steady_bubble_closed_form() -> None:
    assert steady_bubble(4, 4) == 0.0 and steady_bubble(4, 8) == 0.0
    assert steady_bubble(4, 2) == pytest.approx(0.5)
    assert steady_bubble(2, 2, comm=0.5) == pytest.approx(1 - 2 / 3)


class _Ring:
    """A toy loop: the "token" of a micro-batch is its output's row sums, rounded."""

    def __init__(self) -> None:
        self.entered: list[tuple[int, int]] = []
        self.picked: dict[int, torch.Tensor] = {}

    def enter(self, stage: int, mb: int) -> None:
        self.entered.append((stage, mb))

    def pick(self, mb: int, outputs: torch.Tensor) -> torch.Tensor:
        self.picked[mb] = outputs.sum(-1).round()
        return self.picked[mb]

    def feed(self, mb: int, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[:, None].repeat(1, 4) / 10


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_executor_runs_the_ring(ranks: int) -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(3)]
    pipe = pt.Pipeline(layers, decode_schedule(ranks, 2, 1), local_ranks=ranks)
    schedule = decode_schedule(ranks, 2, 4)
    x = [torch.randn(3, 4), torch.randn(3, 4)]
    loop = _Ring()
    pipe.decode(schedule, x, loop)
    model = nn.Sequential(*layers)
    with torch.no_grad():
        for g in range(2):  # the same ring, one step after another
            inp = x[g]
            for step in range(4):
                tokens = model(inp).sum(-1).round()
                assert torch.equal(loop.picked[step * 2 + g], tokens)
                inp = tokens[:, None].repeat(1, 4) / 10
    assert sorted(loop.entered) == sorted((s, mb) for s in range(ranks) for mb in range(8))


def test_decode_refuses_a_training_schedule() -> None:
    pipe = pt.Pipeline([nn.Linear(2, 2), nn.Linear(2, 2)], "gpipe", 2, local_ranks=2)
    with pytest.raises(ValueError, match="decoding schedule"):
        pipe.decode(ps.make_schedule("gpipe", 2, 2), [torch.ones(1, 2)] * 2, _Ring())
