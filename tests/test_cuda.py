"""CUDA: local mode on one GPU, NCCL across GPUs. Skipped cleanly where there is no GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from models import MULTI, SCHEDULES, batch, mlp
from pipetrain.testing import reference_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
LOSS = nn.MSELoss()


def _compare(pipe: pt.Pipeline, ref: nn.Module) -> None:
    got = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None and got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad, p.grad, msg=name)


@needs_cuda
@pytest.mark.parametrize("name", SCHEDULES)
def test_local_mode_on_one_gpu(name: str) -> None:
    ref, model = mlp().cuda(), mlp()
    x, y = (t.cuda() for t in batch(12))
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, device="cuda",
                       stages_per_rank=2 if name in MULTI else 1)
    got = pipe.step(x, y)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want)
    _compare(pipe, ref)


def _nccl(ctx: pt.RankContext) -> str:
    ref, model = mlp().to(ctx.device), mlp()
    x, y = (t.to(ctx.device) for t in batch(12))
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, "zbv", 4, LOSS)
    got = pipe.step(x, y)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want)
    _compare(pipe, ref)
    return str(pipe.device)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_gpus() -> None:
    assert pt.launch(_nccl, 2, backend="nccl", timeout=300) == ["cuda:0", "cuda:1"]
