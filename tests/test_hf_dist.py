"""Models we did not write, pipelined across processes (gloo): HF GPT-2 (tied head), Llama
(rotary tables routed to every stage) under 1f1b, interleaved-1f1b, zbv and dualpipev, BERT
(padding mask) under 1f1b and zbv and a BatchNorm ResNet under interleaved-1f1b and dualpipev
on 2 ranks, GPT-2 under zbv (8 stages from split_points="auto") and Llama under 1f1b on 4, in
float64, within 1e-9 of the same micro-batches run one after another on one process; and a
meta-built Llama that each rank materialises alone."""

from __future__ import annotations

import copy

import pytest
import torch

import pipetrain as pt
from helpers.hf import LOSSES, MODELS, batch, materialized, on_meta, points
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

M = 4
CASES = {2: [(name, schedule) for name in ("gpt2", "llama")
             for schedule in ("1f1b", "interleaved-1f1b", "zbv", "dualpipev")]
         + [("bert", "1f1b"), ("bert", "zbv"), ("resnet", "interleaved-1f1b"),
            ("resnet", "dualpipev")],
         4: [("gpt2", "zbv"), ("llama", "1f1b")]}
IN_CI = [("gpt2", "1f1b"), ("llama", "interleaved-1f1b"), ("bert", "zbv"),
         ("resnet", "dualpipev")]
"""Of the cases at 2 ranks, those CI runs (CI's time, CONTRIBUTING.md: tests): each model and each
kind of schedule at least once; the others in the long tier."""


def _case(name: str, schedule: str, ranks: int) -> list[str]:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    ref = copy.deepcopy(model)
    inputs, targets = batch(name, rows=8, seq=10)
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    stages = ranks * (1 if schedule == "1f1b" else 2)
    split = points(name, stages) if stages <= 4 else "auto"
    pipe = pt.Pipeline(model, schedule, M, LOSSES[name], split_points=split,
                       example_inputs=inputs, timeout=60)
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: ref(**x), inputs, targets, LOSSES[name], M)
    problems = [] if got.loss is not None and torch.allclose(got.loss, want, rtol=1e-12, atol=0) \
        else [f"loss {got.loss} != {want}"]
    refs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    for n, p in pipe.named_parameters():
        r = refs[n].grad
        if p.grad is None or r is None or not torch.allclose(
                p.grad, r, rtol=1e-9, atol=1e-9 * r.abs().max().item()):
            problems.append(f"gradient of {n} differs")
    problems += [f"buffer {n} differs" for n, b in pipe.named_buffers()
                 if not torch.equal(b, refs[n])]
    return [f"rank {pipe.rank} {name} {schedule}: {p}" for p in problems]


def _all(ctx: pt.RankContext, cases: list[tuple[str, str]] | None = None) -> list[str]:
    torch.set_num_threads(1)
    return [p for name, schedule in (cases or CASES[ctx.world_size])
            for p in _case(name, schedule, ctx.world_size)]


def _meta_llama(ctx: pt.RankContext) -> list[str]:
    whole = materialized(on_meta("llama"), 5)
    inputs, targets = batch("llama")
    pipe = pt.Pipeline(on_meta("llama"), "zbv", M, LOSSES["llama"], split_points=points("llama", 4),
                       example_inputs=inputs, init_seed=5, timeout=60)
    refs = dict(whole.named_parameters())
    mine = dict(pipe.named_parameters())
    problems = [f"{n} differs at init" for n, p in mine.items() if not torch.equal(p, refs[n])]
    if not 0 < len(mine) < len(refs):
        problems.append(f"holds {len(mine)} of {len(refs)} parameters")
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: whole(**x), inputs, targets, LOSSES["llama"], M)
    if got.loss is None or not torch.equal(got.loss, want):
        problems.append(f"loss {got.loss} != {want}")
    return [f"rank {ctx.rank}: {p}" for p in problems]


def test_hf_models_and_a_cnn_on_two_ranks() -> None:
    assert sum(pt.launch(_all, 2, IN_CI, timeout=600), []) == []


@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests); in CI: the test above, a share of them
def test_hf_models_and_a_cnn_on_two_ranks_under_every_schedule_of_the_table() -> None:
    rest = [c for c in CASES[2] if c not in IN_CI]
    assert sum(pt.launch(_all, 2, rest, timeout=600), []) == []


# in CI: the same models on two ranks: test_hf_models_and_a_cnn_on_two_ranks
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_hf_models_on_four_ranks() -> None:
    assert sum(pt.launch(_all, 4, timeout=600), []) == []


@pytest.mark.long  # beside test_meta_dist.py::test_meta_lm_two_ranks
def test_meta_llama_each_rank_materialises_its_own_stages() -> None:
    assert sum(pt.launch(_meta_llama, 2, timeout=300), []) == []
