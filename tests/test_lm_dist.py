"""A standard-style transformer LM, traced into stages, trains under every schedule across ranks."""

from __future__ import annotations

import pytest  # (the tier's marker)
import torch

import pipetrain as pt
from helpers.lm import lm_batch, lm_loss, tiny_lm
from helpers.models import MULTI, SOME

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

SPLITS = {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}
TIED = "embed.weight"


def _lm(ctx: pt.RankContext) -> list[str]:
    problems: list[str] = []
    for name in SOME:
        n_stages = ctx.world_size * (2 if name in MULTI else 1)
        ref, model = tiny_lm(), tiny_lm()
        ids, mask, targets = lm_batch(4)
        example = {"input_ids": ids[:1], "attention_mask": mask[:1]}
        pipe = pt.Pipeline(model, name, 4, lm_loss, split_points=SPLITS[n_stages],
                           example_inputs=example, timeout=30)
        inputs = pipe.pack(ids, attention_mask=mask)
        want = _reference(ref, ids, mask, targets)
        got = pipe.step(inputs, targets)
        if got.loss is None or not torch.equal(got.loss, want):
            problems.append(f"{name}: loss {got.loss} != {want}")
        refs = dict(ref.named_parameters())
        for pname, p in pipe.named_parameters():
            g, r = p.grad, refs[pname].grad
            ok = (torch.allclose(g, r, rtol=1e-5, atol=1e-7) if pname == TIED
                  else torch.equal(g, r)) if g is not None and r is not None else False
            if not ok:
                problems.append(f"{name}: gradient of {pname} differs")
        mine = {n for n, _ in pipe.named_parameters()}
        if len(mine) >= len(refs):
            problems.append(f"{name}: rank {ctx.rank} holds every parameter")
    return problems


def _reference(ref: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    total = None
    for i, m, t in zip(ids.tensor_split(4), mask.tensor_split(4), targets.tensor_split(4)):
        loss = lm_loss(ref(i, attention_mask=m), t) * (len(i) / len(ids))
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    return total


def test_traced_lm_every_schedule_two_ranks() -> None:
    results = pt.launch(_lm, 2, timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []
