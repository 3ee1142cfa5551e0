"""Bad input, each with its exact message, raised on every rank (never a hang, never stale data).

One group of 2 processes runs every case in turn; each case builds a fresh pipeline, so this
also checks that a pipeline built after a failed one is not disturbed by its leftovers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch, mlp

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


class Narrow(nn.Module):
    """Returns fewer features than the next layer takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :7]


def _cases(rank: int) -> dict[str, Callable[[], Any]]:
    x, y = batch(12)

    def pipe(model: nn.Module | None = None, **kw: Any) -> pt.Pipeline:
        return pt.Pipeline(model or mlp(), "1f1b", kw.pop("m", 4), nn.MSELoss(), timeout=20, **kw)

    narrow = nn.Sequential(*mlp(4), Narrow(), *mlp(4))
    return {
        "m0": lambda: pipe(m=0),
        "stages": lambda: pipe(balance=[2, 3, 3]),
        "balance": lambda: pipe(balance=[3, 3]),
        "small": lambda: pipe().step(x[:3], y[:3]),
        "no-inputs": lambda: pipe().step(None if rank == 0 else x, y),
        "no-targets": lambda: pipe().step(x, None if rank == 1 else y),
        "shape": lambda: pipe(narrow, balance=[5, 4]).step(x, y),
        "targets-rows": lambda: pipe().step(x, y[:10]),
        "after-all-that": lambda: pipe().step(x, y).loss,
    }


def _run(ctx: pt.RankContext) -> dict[str, str]:
    out = {}
    for name, case in _cases(ctx.rank).items():
        try:
            result = case()
            out[name] = f"ok {type(result).__name__}"
        except Exception as e:  # noqa: BLE001  (each case's error is the result compared)
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return pt.launch(_run, 2, timeout=300)  # type: ignore[no-any-return]


EVERY_RANK = {  # the same error on both ranks: every rank checks it before any message
    "m0": "ValueError: 1f1b: n_microbatches must be a positive integer, got 0",
    "stages": "PartitionError: balance [2, 3, 3] does not fit: it has 3 entries but the "
              "pipeline has 2 stages",
    "balance": "PartitionError: balance [3, 3] does not fit: its sum is 6 but the model has 8 "
               "layers",
    "small": "ValueError: batch of size 3 (dim 0) cannot be split into 4 micro-batches; use a "
             "batch of at least 4 samples or fewer micro-batches",
}


@pytest.mark.parametrize("case", sorted(EVERY_RANK))
def test_checked_on_every_rank(results: list[dict[str, str]], case: str) -> None:
    assert [r[case] for r in results] == [EVERY_RANK[case]] * 2


def test_missing_inputs_named_on_their_rank_and_relayed(results: list[dict[str, str]]) -> None:
    own = "ValueError: [rank 0] step 0: this rank holds stage 0 and needs inputs, got None"
    assert results[0]["no-inputs"] == own
    relayed = f"PeerFailed: rank 0 failed outside any action (step 0): {own}"
    assert results[1]["no-inputs"] == relayed


def test_missing_targets_named_on_their_rank_and_relayed(results: list[dict[str, str]]) -> None:
    own = ("[rank 1] step 0: this rank holds the last stage 1 and computes the loss, so it needs "
           "targets, got None")
    assert results[1]["no-targets"] == f"ValueError: {own}"
    assert results[0]["no-targets"] == (f"PeerFailed: rank 1 failed outside any action (step 0): "
                                        f"ValueError: {own}")


def test_wrong_shape_between_stages_names_the_receiving_action(
        results: list[dict[str, str]]) -> None:
    own = "[rank 1 | stage 1 | mb 0 | 1F0] step 0 failed: RuntimeError('mat1 and mat2 shapes"
    assert results[1]["shape"].startswith(f"StageError: {own}")
    assert results[0]["shape"].startswith(
        f"PeerFailed: rank 1 failed at stage 1, mb 0, action 1F0 (step 0): StageError: {own}")


def test_targets_misaligned_with_inputs(results: list[dict[str, str]]) -> None:
    text = results[1]["targets-rows"]
    assert text == ("StageError: [rank 1 | stage 1 | mb 2 | 1F2] step 0 failed: ValueError('the "
                    "model output has 3 rows along dim 0 but the targets have 2: pass targets "
                    "with the same batch size as the inputs')")
    # the peer's own message or the job's news, whichever reaches rank 0 first (news'
    # RankFailed is a PeerFailed); either names the failed rank's action
    assert re.match(r"(PeerFailed|RankFailed): rank 1 failed at stage 1, mb 2, action 1F2 ",
                    results[0]["targets-rows"]), results[0]


def test_a_fresh_pipeline_after_failures_trains(results: list[dict[str, str]]) -> None:
    assert [r["after-all-that"] for r in results] == ["ok Tensor"] * 2
