"""grad_mismatches in a job: the ranks of each pipeline together must hold every parameter.

One launched group of two gloo processes runs every case: a pipeline over both ranks, one
rank that leaves a parameter out (a copy of its pipeline whose ``named_parameters`` drops a
name), ``(name, parameter)`` pairs over a group, two one-rank pipelines (data-parallel
replicas, each checked over its own group) and a local pipeline, which gathers nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest  # (the tier's marker)
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from helpers.models import batch, mlp
from pipetrain.testing import grad_mismatches, reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def _stepped(**kwargs: Any) -> tuple[pt.Pipeline, nn.Module]:
    """A pipeline of ``mlp()`` after one step, and the reference model after the same step."""
    ref, model = mlp(), mlp()
    x, y = batch(8)
    reference_step(ref, x, y, LOSS, 2)
    pipe = pt.Pipeline(model, kwargs.pop("schedule", "1f1b"), 2, LOSS, timeout=30, **kwargs)
    pipe.step(x, y)
    return pipe, ref


def _dropping(pipe: pt.Pipeline, *names: str) -> pt.Pipeline:
    """A copy of ``pipe`` whose ``named_parameters()`` leaves ``names`` out (a rank that lost
    them), as a pipeline-like object on this rank only."""
    fake = copy.copy(pipe)

    def named_parameters(stage: int | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in pipe.named_parameters(stage) if n not in names)

    fake.named_parameters = named_parameters  # type: ignore[method-assign]
    return fake


def _cases(ctx: pt.RankContext) -> dict[str, Any]:
    got: dict[str, Any] = {}
    pipe, ref = _stepped()  # layers 0-3 on rank 0, 4-7 on rank 1
    got["whole"] = grad_mismatches(pipe, ref)
    got["rank 1 drops one"] = grad_mismatches(
        _dropping(pipe, "6.0.weight") if ctx.rank == 1 else pipe, ref)
    got["each rank drops one"] = grad_mismatches(
        _dropping(pipe, "7.0.bias" if ctx.rank == 1 else "0.0.weight"), ref)
    got["dropped but skipped"] = grad_mismatches(
        _dropping(pipe, "6.0.weight") if ctx.rank == 1 else pipe, ref,
        skip={"6.0.weight"} if ctx.rank == 1 else ())
    pairs = list(pipe.named_parameters())
    got["pairs over the world"] = grad_mismatches(
        [(n, p) for n, p in pairs if n != "5.0.bias"] if ctx.rank == 1 else pairs, ref)
    try:
        grad_mismatches(pipe, ref, group=dist.group.WORLD)
        got["pipeline and group"] = "no error"
    except ValueError as e:
        got["pipeline and group"] = str(e)

    # data-parallel replicas of one rank each: every rank makes every group, in one order
    groups = [dist.new_group([0]), dist.new_group([1])]
    mine = groups[ctx.rank]
    replica, ref = _stepped(schedule="gpipe", group=mine)
    lost = _dropping(replica, "3.0.weight") if ctx.rank == 1 else replica
    got["replicas"] = grad_mismatches(lost, ref)
    lost_pairs = list(lost.named_parameters())
    got["replica pairs over their group"] = grad_mismatches(lost_pairs, ref, group=mine)
    got["replica pairs over the world"] = grad_mismatches(lost_pairs, ref)  # rank 0 covers

    if ctx.rank == 0:  # a local pipeline holds every stage: rank 0 alone calls it, no gather
        local, ref = _stepped(local_ranks=2)
        got["local"] = grad_mismatches(_dropping(local, "7.0.bias"), ref)
    return got


def test_ranks_together_hold_every_parameter() -> None:
    ranks0, ranks1 = pt.launch(_cases, 2, timeout=120)
    both = "held by no stage on the pipeline's ranks [0, 1]"
    for got in (ranks0, ranks1):
        assert got["whole"] == []
        assert got["rank 1 drops one"] == [f"6.0.weight: {both}"]
        assert got["each rank drops one"] == [f"0.0.weight: {both}", f"7.0.bias: {both}"]
        assert got["dropped but skipped"] == []
        assert got["pairs over the world"] == [f"5.0.bias: {both}"]
        assert got["pipeline and group"].startswith("grad_mismatches: pass group= only with")
        assert got["replica pairs over the world"] == []  # why a replica needs its own group
    assert ranks0["replicas"] == ranks0["replica pairs over their group"] == []
    alone = ["3.0.weight: held by no stage on the pipeline's ranks [1]"]
    assert ranks1["replicas"] == ranks1["replica pairs over their group"] == alone
    assert ranks0["local"] == ["7.0.bias: held by no stage"]
    assert "local" not in ranks1
