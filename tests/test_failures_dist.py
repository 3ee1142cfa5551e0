"""Failures across processes: a raising stage or a dead peer makes every rank raise, quickly."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch, mlp

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


class FailAt(nn.Module):
    """Raises (or kills its process) on the micro-batch of a given size."""

    def __init__(self, size: int, how: str) -> None:
        super().__init__()
        self.size, self.how = size, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == self.size:
            if self.how == "die":
                os._exit(3)
            if self.how == "hang":
                time.sleep(8)
            raise RuntimeError("injected failure")
        return x


def _fail(ctx: pt.RankContext, how: str) -> str:
    # 3 ranks, 1F1B; stage 1 fails on its last micro-batch (mb 3: 11 rows split into 3,3,3,2)
    model = nn.Sequential(nn.Linear(8, 8), FailAt(2, how), nn.Linear(8, 8))
    pipe = pt.Pipeline(model, "1f1b", 4, nn.MSELoss(), timeout=3.0)
    x, y = batch(11)
    start = time.monotonic()
    try:
        pipe.step(x, y)
    except pt.PipelineError as e:
        raise pt.PipelineError(f"elapsed={time.monotonic() - start:.1f}s: {e}") from None
    return "no error"


def _elapsed(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"elapsed=(\d+\.\d)s", text)] or [-1.0]


def _messages(how: str) -> str:
    with pytest.raises(pt.PipelineError) as info:
        pt.launch(_fail, 3, how, timeout=60)
    return str(info.value)


def test_stage_exception_reaches_every_rank() -> None:
    text = _messages("raise")
    assert "3 of 3 ranks failed" in text
    assert "[rank 1 | stage 1 | mb 3 | 1F3] step 0 failed: RuntimeError('injected failure')" in text
    assert text.count("rank 1 failed at stage 1, mb 3, action 1F3 (step 0)") >= 2  # ranks 0, 2


def test_dead_peer_is_reported_not_waited_for() -> None:
    text = _messages("die")
    assert "rank 1 ---\nprocess exited with code 3" in text
    assert "the peer closed the connection" in text or "timed out" in text
    assert 0 < max(_elapsed(text)) < 10, text


def test_hung_peer_times_out() -> None:
    text = _messages("hang")
    # rank 0's receiver (gloo's 3 s) or its runtime's wait (3 s) times out first: either names
    # the peer, by rank or by its stage
    assert "timed out" in text and ("from rank 1" in text or "from stage 1 to stage 0" in text)
    assert "rank 1 is stuck in its own stage code: 1F3 of step 0" in text  # the watchdog's
    # the timeout (3 s), the watchdog's probe (2.5 s at most), and room for a busy machine
    assert 0 < max(_elapsed(text)) < 3 * 3.0 + 5, text


def _after_a_failure(ctx: pt.RankContext) -> str:
    # rank 1 fails before its first action; rank 0 fails because rank 1 did. Rank 1's receiver
    # was waiting for rank 0's next activation: a wait that runs into its timeout makes gloo
    # close the connection for good, so rank 0 must tell rank 1 too (a relayed ABORT).
    x, y = batch(12)
    pipe = pt.Pipeline(mlp(4), "1f1b", 4, nn.MSELoss(), timeout=1.0)
    try:
        pipe.step(x, y if ctx.rank == 0 else None)
    except (pt.PipelineError, ValueError):
        pass
    time.sleep(2.0)  # longer than that timeout
    fresh = pt.Pipeline(mlp(4), "1f1b", 4, nn.MSELoss(), timeout=10.0)
    loss = fresh.step(x, y).loss
    return "trained" if loss is not None else "no loss"


def test_a_relayed_failure_leaves_no_receiver_waiting_into_its_timeout() -> None:
    assert pt.launch(_after_a_failure, 2, timeout=60) == ["trained", "trained"]
