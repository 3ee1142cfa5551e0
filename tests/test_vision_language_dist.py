"""Image-text models across processes: 2 gloo ranks, one stage each under 1F1B and two each
under ZB-V, the vision prefix on rank 0 and what it hands the graph (``inputs_embeds``, 3-D
position ids, Gemma 3's own masks, Mllama's cross-attention states) sent to the stages that
use them; loss and every gradient within 1e-9 of the same micro-batches built apart and run
one after another through the unsplit model (:mod:`test_vision_language`'s families)."""

from __future__ import annotations

import copy

import pytest
import torch

import pipetrain as pt
from test_vision_language import BY_NAME, TOL, batch, differences, lm_loss, reference, rows_of

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

CASES = [("mllama", "1f1b"), ("qwen2_vl", "1f1b"), ("gemma3", "zbv")]
IN_CI = CASES[:1]
"""CI's (its time, CONTRIBUTING.md: tests): Mllama, its cross-attention states sent to the
stages that use them; the others in the long tier (Gemma 3 under ZB-V across processes in CI
through the command, tests/test_image_text_train_dist.py; Qwen2-VL's 3-D position ids go as
those states go, and it trains in one process in CI, tests/test_vision_language.py)."""


def _ranks(ctx: pt.RankContext, cases: list[tuple[str, str]]) -> list[list[str]]:
    torch.set_num_threads(1)
    problems = []
    for name, schedule in cases:
        family = BY_NAME[name]
        model = family.build()
        ref = copy.deepcopy(model)
        rows = rows_of(family)
        full = batch(rows)
        pipe = pt.Pipeline(model, schedule, 2, lm_loss, split_points="auto",
                           example_inputs=full)
        got = pipe.step(full if ctx.rank == 0 else None, full["input_ids"]).loss
        want = reference(ref, rows)
        wrong = differences(pipe, ref)
        if got is not None and abs(got.item() - want) > TOL * abs(want):
            wrong.append(f"loss {got.item()} != {want}")
        held = [n for n, _ in pipe.named_parameters()]
        if ctx.rank == 0 and not any(".visual." in n or "vision" in n for n in held):
            wrong.append("rank 0 holds no vision parameter")
        problems.append([f"{name} {schedule} rank {ctx.rank}: {w}" for w in wrong])
        pipe.close()
    return problems


def test_image_text_models_on_two_processes() -> None:
    ranks = pt.launch(_ranks, 2, IN_CI, timeout=400)
    assert [p for rank in ranks for case in rank for p in case] == []


@pytest.mark.long  # beside test_image_text_models_on_two_processes
def test_image_text_models_on_two_processes_in_every_case() -> None:
    ranks = pt.launch(_ranks, 2, CASES[len(IN_CI):], timeout=400)
    assert [p for rank in ranks for case in rank for p in case] == []
