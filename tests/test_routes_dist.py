"""Direct routes across processes: an LM with long skips trains bitwise under every schedule."""

from __future__ import annotations

import torch

import pipetrain as pt
from lm import lm_batch, lm_loss, skip_lm
from models import MULTI, SCHEDULES

POINTS = {2: ["blocks.4"], 4: ["blocks.2", "blocks.4", "blocks.6"],
          8: [f"blocks.{i}" for i in range(1, 8)]}
TIED = "embed.weight"


def _reference(ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = skip_lm()
    total = torch.zeros(())
    for i, m, t in zip(ids.tensor_split(4), mask.tensor_split(4), targets.tensor_split(4)):
        loss = lm_loss(ref(i, attention_mask=m), t) * (len(i) / len(ids))
        loss.backward()  # type: ignore[no-untyped-call]
        total = total + loss.detach()
    return total, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _train(ctx: pt.RankContext, names: list[str]) -> list[str]:
    problems: list[str] = []
    ids, mask, targets = lm_batch(4)
    want, grads = _reference(ids, mask, targets)
    for name in names:
        n_stages = ctx.world_size * (2 if name in MULTI else 1)
        pipe = pt.Pipeline(skip_lm(), name, 4, lm_loss, split_points=POINTS[n_stages],
                           example_inputs={"input_ids": ids[:1], "attention_mask": mask[:1]},
                           timeout=30)
        seen: dict[int, set[str]] = {}
        for s, stage in pipe.stages.items():
            stage.module[0].register_forward_pre_hook(
                lambda _, args, s=s, seen=seen: seen.setdefault(s, set()).update(args[0]))
        got = pipe.step(pipe.pack(ids, attention_mask=mask), targets)
        if got.loss is None or not torch.equal(got.loss, want):
            problems.append(f"{name}: loss {got.loss} != {want}")
        for pname, p in pipe.named_parameters():
            g, r = p.grad, grads[pname]
            ok = g is not None and (torch.allclose(g, r, rtol=1e-5, atol=1e-7) if pname == TIED
                                    else torch.equal(g, r))
            if not ok:
                problems.append(f"{name}: gradient of {pname} differs")
        pairs = {p: set(keys or ()) for p, keys in pipe.routes.pairs().items()}
        last = n_stages - 1
        skips = pairs[("act", 0, last)] - pairs.get(("act", 0, last - 1), set())
        if not skips:
            problems.append(f"{name}: no value goes from stage 0 to stage {last} alone")
        relayed = {s: sorted(keys & skips - pairs.get(("act", 0, s), set()))
                   for s, keys in seen.items() if 0 < s < last}
        if any(relayed.values()):  # a stage between them received a value it does not use
            problems.append(f"{name}: middle stages received the skip: {relayed}")
    return problems


def test_skip_lm_every_schedule_two_ranks() -> None:
    results = pt.launch(_train, 2, SCHEDULES, timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []


def test_skip_lm_four_ranks() -> None:
    results = pt.launch(_train, 4, ["1f1b", "interleaved-1f1b", "zbv"], timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []
