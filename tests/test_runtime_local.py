"""Local mode: every schedule's action lists, run in one process, match single-device training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp, structured
from pipetrain.errors import PartitionError, StageError
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


def _check(name: str, p: int, m: int, v: int | None, n_batch: int = 12, steps: int = 1,
           reduction: str = "mean") -> None:
    ref, model = mlp(), mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    pipe = pt.Pipeline(model, name, m, LOSS if reduction == "mean" else nn.MSELoss(reduction="sum"),
                       stages_per_rank=v, local_ranks=p, loss_reduction=reduction)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(n_batch, seed=step)
        want = reference_step(ref, x, y, pipe.loss_fn, m, loss_reduction=reduction)  # type: ignore[arg-type]
        got = pipe.step(x, y)
        assert got.loss is not None and torch.equal(got.loss, want), (got.loss, want)
        assert grad_mismatches(pipe.named_parameters(), ref) == []
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()


CASES = [(name, p, m, v) for name in SCHEDULES for p in (1, 2, 4) for m in (1, 3, 4, 8)
         for v in ((2,) if name in MULTI else (1,)) if p * v <= 8]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_matches_single_device(name: str, p: int, m: int, v: int) -> None:
    _check(name, p, m, v)


@pytest.mark.parametrize("name", ["interleaved-1f1b"])
def test_three_stages_per_rank(name: str) -> None:
    _check(name, 2, 4, 3)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_two_steps_with_optimizer(name: str) -> None:
    _check(name, 2, 4, None, steps=2)


def test_uneven_microbatches_and_sum_reduction() -> None:
    _check("zb-h1", 2, 5, 1, n_batch=13)
    _check("1f1b", 2, 5, 1, n_batch=13, reduction="sum")


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "dualpipev"])
def test_structured_payloads(name: str) -> None:
    ref, model = structured(), structured()
    x, y = batch(8)
    want = reference_step(ref, x, y, LOSS, 4)
    v = 2 if name in MULTI else 1
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=4 // v, stages_per_rank=v)
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_eval_step_and_outputs() -> None:
    model = mlp()
    x, y = batch(12)
    pipe = pt.Pipeline(model, "zbv", 4, LOSS, local_ranks=2)
    result = pipe.eval_step(x, y)
    with torch.no_grad():  # the same micro-batches, one after another on one device
        want = torch.cat([model(part) for part in x.chunk(4)])
    assert torch.equal(result.outputs, want)
    assert all(p.grad is None for p in pipe.parameters())
    step = pipe.step(x, y, return_outputs=True)
    assert torch.equal(step.outputs, want)


def test_named_parameters_keep_original_names() -> None:
    model = mlp(4)
    pipe = pt.Pipeline(model, "1f1b", 2, LOSS, local_ranks=2)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]


def test_balance_is_checked() -> None:
    with pytest.raises(PartitionError, match="its sum is 7 but the model has 8 layers"):
        pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2, balance=[3, 4])
    pipe = pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2, balance=[3, 5])
    assert pipe.balance == [3, 5]


def test_stage_error_names_rank_stage_mb_and_action() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] == 2:  # the last micro-batch of 11 split into 4 is the smallest
                raise RuntimeError("boom")
            return x

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), Boom(), nn.Linear(8, 8))
    pipe = pt.Pipeline(model, "1f1b", 4, LOSS, local_ranks=2)
    x, y = batch(11)
    with pytest.raises(StageError, match=r"\[rank 1 \| stage 1 \| mb 3 \| 1F3\] step 0 failed"):
        pipe.step(x, y)
    with pytest.raises(pt.PipelineError, match="failed earlier"):
        pipe.step(x, y)


def test_missing_inputs_and_targets_are_errors() -> None:
    pipe = pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2)
    x, y = batch(4)
    with pytest.raises(ValueError, match="holds stage 0 and needs inputs"):
        pipe.step(None, y)
    pipe = pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2)
    with pytest.raises(ValueError, match="needs targets"):
        pipe.step(x, None)
    pipe = pt.Pipeline(mlp(), "1f1b", 8, LOSS, local_ranks=2)
    with pytest.raises(ValueError, match="cannot be split into 8 micro-batches"):
        pipe.step(x, y)


def test_measured_timeline_draws_like_a_simulated_one(tmp_path: object) -> None:
    from pathlib import Path

    from pipetrain.schedules import draw

    x, y = batch(8)
    result = pt.Pipeline(mlp(), "zbv", 4, LOSS, local_ranks=2).step(x, y)
    timeline = result.timeline
    assert timeline.unit == "s" and len(timeline.spans) == 4 * 4 * 3  # 4 stages x 4 mb x F,I,W
    out = Path(str(tmp_path))
    draw.save_png(timeline, out / "measured.png", title="zbv measured")
    draw.save_trace(timeline, out / "measured.json")
    assert (out / "measured.png").stat().st_size > 1000
    assert "rank 1" in draw.text_timeline(timeline)
