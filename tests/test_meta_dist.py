"""A traced LM built on the meta device: each rank materialises only its own stages' parameters,
with the values of the whole model materialised at once, and trains like it; a real layer list
leaves each rank holding its own stages' parameters only."""

from __future__ import annotations

import gc

import pytest  # (the tier's marker)
import torch
from torch import nn

import pipetrain as pt
from helpers.lm import TinyLM, lm_batch, lm_loss
from pipetrain.split.lazy import NamedInit
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

SEED = 7
TIED = "embed.weight"
CASES: dict[int, list[tuple[str, list[str] | str]]] = {
    2: [("1f1b", ["blocks.2"]), ("interleaved-1f1b", "auto"),
        ("zbv", ["blocks.0", "blocks.2", "norm"]), ("zb-h2", "auto"), ("gpipe", "auto"),
        ("zb-h1", ["blocks.1"]), ("interleaved-zb", "auto"), ("dualpipev", "auto")],
    4: [("1f1b", ["blocks.1", "blocks.2", "blocks.3"]), ("interleaved-1f1b", "auto"),
        ("zbv", "auto")],
}
IN_CI = CASES[2][:3]
"""Of the cases at 2 ranks, those CI runs (its time, CONTRIBUTING.md: tests): 1F1B, interleaved
1F1B and ZB-V, split by hand and "auto"; the others in the long tier."""


def meta_lm() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


def whole_lm() -> TinyLM:
    """The single-device reference: the same meta model materialised at once."""
    model = meta_lm()
    return NamedInit(model, SEED).materialize(model)  # type: ignore[return-value]


def real_parameters() -> list[nn.Parameter]:
    """Every Parameter with storage alive in this process."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is nn.Parameter and not o.is_meta]


def _only_own(pipe: pt.Pipeline, total_bytes: int) -> list[str]:
    mine = {id(p) for p in pipe.parameters()}
    real = real_parameters()
    others = [tuple(p.shape) for p in real if id(p) not in mine]
    held = sum(p.numel() * p.element_size() for p in real)
    problems = [f"parameters of other stages got storage: {others}"] if others else []
    if not 0 < held < total_bytes or len(mine) != len(real):
        problems.append(f"holds {held} of {total_bytes} parameter bytes")
    return problems


def _compare(pipe: pt.Pipeline, ids: torch.Tensor, mask: torch.Tensor,
             targets: torch.Tensor) -> list[str]:
    ref = whole_lm()
    refs = dict(ref.named_parameters())
    problems = [f"initial value of {n} differs" for n, p in pipe.named_parameters()
                if p.is_meta or not torch.equal(p, refs[n])]
    inputs = pipe.pack(ids, attention_mask=mask)
    want = reference_step(lambda x: ref(**x), inputs, targets, lm_loss, 4)  # type: ignore
    got = pipe.step(inputs, targets)
    if got.loss is None or not torch.equal(got.loss, want):
        problems.append(f"loss {got.loss} != {want}")
    for n, p in pipe.named_parameters():
        g, r = p.grad, refs[n].grad
        same = g is not None and r is not None and (
            torch.allclose(g, r, rtol=1e-5, atol=1e-7) if n == TIED else torch.equal(g, r))
        problems += [] if same else [f"gradient of {n} differs"]
    return problems


def _meta(ctx: pt.RankContext, cases: list[tuple[str, list[str] | str]] | None = None
          ) -> list[str]:
    ids, mask, targets = lm_batch(4)
    example = {"input_ids": ids[:1], "attention_mask": mask[:1]}
    total = sum(p.numel() * 4 for p in meta_lm().parameters())
    problems = []
    for name, split in cases or CASES[ctx.world_size]:
        pipe = pt.Pipeline(meta_lm(), name, 4, lm_loss, split_points=split,
                           example_inputs=example, init_seed=SEED, timeout=30)
        found = _only_own(pipe, total) + _compare(pipe, ids, mask, targets)
        problems += [f"rank {ctx.rank} {name}: {p}" for p in found]
        del pipe
    # a user's real layer list, no other reference kept: each rank keeps its own layers only
    pipe = pt.Pipeline(nn.Sequential(*[nn.Linear(8, 8) for _ in range(2 * ctx.world_size)]),
                       "1f1b", 4, nn.MSELoss(), timeout=30)
    total = 2 * ctx.world_size * (8 * 8 + 8) * 4
    return problems + [f"rank {ctx.rank} layer list: {p}" for p in _only_own(pipe, total)]


def test_meta_lm_two_ranks() -> None:
    assert sum(pt.launch(_meta, 2, IN_CI, timeout=240), []) == []


@pytest.mark.long  # beside test_meta_lm_two_ranks
def test_meta_lm_two_ranks_under_the_other_schedules() -> None:
    assert sum(pt.launch(_meta, 2, CASES[2][len(IN_CI):], timeout=240), []) == []


# in CI: meta models across ranks: test_meta_lm_two_ranks
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_meta_lm_four_ranks() -> None:
    assert sum(pt.launch(_meta, 4, timeout=240), []) == []
