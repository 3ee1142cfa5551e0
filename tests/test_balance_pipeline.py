"""Automatic balance inside Pipeline: one plan on every rank, exact gradients under it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from helpers.models import batch
from pipetrain.errors import PartitionError
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


def lopsided(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)  # two wide layers up front, six narrow ones after
    return nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8),
                         *[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])


def test_params_mode_balances_parameter_bytes() -> None:
    pipe = pt.Pipeline(lopsided(), "1f1b", 4, LOSS, local_ranks=2, balance="params")
    assert pipe.balance == [1, 7]
    assert pipe.balance_plan is not None and "params" in str(pipe.balance_plan)


def test_time_mode_trains_exactly() -> None:
    ref, model = lopsided(), lopsided()
    x, y = batch(12)
    pipe = pt.Pipeline(model, "zbv", 4, LOSS, local_ranks=2, balance="time",
                       example_inputs=x[:3])
    assert sum(pipe.balance) == 8 and len(pipe.balance) == 4
    want = reference_step(ref, x, y, LOSS, 4)
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []
    plan = pipe.balance_plan
    assert plan is not None
    ps.simulate(pipe.schedule, plan.costs_for_simulator())


def test_automatic_balance_errors() -> None:
    with pytest.raises(ValueError, match="pass example_inputs="):
        pt.Pipeline(lopsided(), "1f1b", 4, LOSS, local_ranks=2, balance="time")
    with pytest.raises(PartitionError, match="needs the layers built"):
        pt.Pipeline([pt.LayerSpec(nn.Linear, 2, 2)] * 2, "1f1b", 2, LOSS, local_ranks=2,
                    balance="params")
    with pytest.raises(ValueError, match="unknown balance mode"):
        pt.Pipeline(lopsided(), "1f1b", 4, LOSS, local_ranks=2, balance="speed")


def _same_plan(ctx: pt.RankContext) -> list[int]:
    x, _ = batch(12)
    return pt.Pipeline(lopsided(), "1f1b", 4, LOSS, balance="time", example_inputs=x[:3]).balance


def test_every_rank_gets_rank_zeros_plan() -> None:
    plans = pt.launch(_same_plan, 2, timeout=60)
    assert plans[0] == plans[1] and sum(plans[0]) == 8
