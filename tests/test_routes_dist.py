"""Direct routes across processes: an LM with long skips trains bitwise under every schedule."""

from __future__ import annotations

import pytest  # (the tier's marker)
import torch

import pipetrain as pt
from helpers.lm import lm_batch, lm_loss, skip_lm
from helpers.models import MULTI, SOME

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

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
        problems += _relays(pipe.routes.pairs(), seen, name)
    return problems


def _relays(pairs: dict[tuple[str, int, int], tuple[str, ...] | None],
            seen: dict[int, set[str]], name: str) -> list[str]:
    """A value sent past a stage that does not use it must not reach that stage."""
    acts = {(s, d): set(keys or ()) for (kind, s, d), keys in pairs.items() if kind == "act"}
    bypassed = [(k, src, mid) for (src, dst), keys in acts.items() for k in keys
                for mid in range(src + 1, dst) if k not in acts.get((src, mid), set())]
    problems = [f"{name}: stage {mid} received {k!r} (from stage {src}), which it does not use"
                for k, src, mid in bypassed if k in seen.get(mid, set())]
    if not bypassed and max(d for _, d in acts) > 1:
        problems.append(f"{name}: no value skips a stage")
    return problems


def test_skip_lm_every_schedule_two_ranks() -> None:
    results = pt.launch(_train, 2, SOME, timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []


@pytest.mark.long  # beside test_skip_lm_every_schedule_two_ranks
def test_skip_lm_four_ranks() -> None:
    results = pt.launch(_train, 4, ["1f1b", "interleaved-1f1b", "zbv"], timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []
