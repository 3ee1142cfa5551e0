"""Tied parameters across ranks: one logical parameter, summed gradients, identical values."""

from __future__ import annotations

import pytest  # (the tier's marker)
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def tied_model() -> nn.Sequential:
    torch.manual_seed(4)
    shared = nn.Linear(8, 8)  # used as the first and the last layer (embedding <-> head style)
    middle = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)]
    return nn.Sequential(shared, *middle, shared)


def _tied(ctx: pt.RankContext) -> list[str]:
    problems = []
    for name in ("1f1b", "interleaved-1f1b", "zbv"):
        ref, model = tied_model(), tied_model()
        pipe = pt.Pipeline(model, name, 4, LOSS, timeout=30)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        refs = dict(ref.named_parameters())
        for step in range(2):
            x, y = batch(12, seed=step)
            want = reference_step(ref, x, y, LOSS, 4)
            got = pipe.step(x, y)
            if got.loss is None or not torch.equal(got.loss, want):
                problems.append(f"{name}: loss {got.loss} != {want}")
            for pname, p in pipe.named_parameters():
                if not torch.allclose(p.grad, refs[pname].grad, rtol=1e-6, atol=1e-7):
                    problems.append(f"{name} step {step}: grad of {pname} differs")
            opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
        names = [n for n, _ in pipe.named_parameters()]
        if "7.weight" in names or (ctx.rank == ctx.world_size - 1 and name == "1f1b"
                                   and "0.weight" not in names):
            problems.append(f"{name}: tied parameter not reported under its first name: {names}")
        tied = pipe.tied[0]
        problems += [] if tied.name == "0.weight" else [f"{name}: tied {pipe.tied}"]
        weights = dict(pipe.named_parameters())
        if "0.weight" in weights:
            problems += _same_everywhere(weights["0.weight"].detach(), tied.ranks, ctx.rank, name)
    return problems


def _same_everywhere(w: torch.Tensor, ranks: tuple[int, ...], rank: int, name: str) -> list[str]:
    copies = [torch.empty_like(w) for _ in ranks]
    group = torch.distributed.new_group(list(ranks), use_local_synchronization=True)
    torch.distributed.all_gather(copies, w, group=group)
    return [] if all(torch.equal(c, copies[0]) for c in copies) else [f"{name}: copies differ"]


def test_tied_weights_across_ranks() -> None:
    results = pt.launch(_tied, 2, timeout=120)
    assert [p for r in results for p in r] == []
