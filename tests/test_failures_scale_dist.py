"""Failures at pipeline scale: on 4 and 8 ranks every rank learns of a failure anywhere, with
its cause, from the ranks it exchanges messages with (they pass the origin's news on)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain as pt

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

TIMEOUT = 30.0  # far above the time news takes: a rank that only timed out fails the test
HANG_TIMEOUT = 8.0
HANG_S = HANG_TIMEOUT + 10.0  # past a peer's timeout, its 2.5 s probe, and 7.5 s of slack


class Fault(nn.Module):
    """Identity, except on the armed rank: raises, returns a wrong shape, or kills its process."""

    armed: tuple[int, str] | None = None
    hang_s = HANG_S  # how long "hang" sleeps: far longer than its peers wait

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Fault.armed is not None and Fault.armed[0] == self.rank:
            how = Fault.armed[1]
            if how == "kill":
                os._exit(3)
            if how == "shape":
                return torch.cat([x, x[:, :1]], 1)
            if how == "hang":
                time.sleep(Fault.hang_s)
            raise RuntimeError("injected failure")
        return x


def _run(ctx: pt.RankContext, schedule: str, how: str, culprit: int) -> str:
    """One pipeline, a good step, then a step where ``culprit``'s stage fails ``how``."""
    torch.manual_seed(0)
    per = 1 if schedule == "1f1b" else 2
    n_stages = ctx.world_size * per
    faults = [Fault(-1) for _ in range(n_stages)]
    layers = [m for fault in faults for m in (nn.Linear(4, 4), fault)]
    pipe = pt.Pipeline(nn.Sequential(*layers), schedule, 8, nn.MSELoss(),
                       balance=[2] * n_stages, timeout=HANG_TIMEOUT if how == "hang" else TIMEOUT)
    for s, fault in enumerate(faults):  # the rank holding each stage, by the schedule
        fault.rank = pipe.schedule.rank_of(s)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    pipe.step(x, y)
    Fault.armed = (culprit, how)
    start = time.monotonic()
    try:
        pipe.step(x, y)
    except pt.PipelineError as e:
        return f"{time.monotonic() - start:.2f} {e}"
    finally:
        Fault.armed = None
    return "no error"


def _cases(ctx: pt.RankContext, cases: list[tuple[str, str, int, int]], out: str) -> list[str]:
    results = []
    for schedule, how, culprit, _ in cases:
        results.append(_run(ctx, schedule, how, culprit))
        with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(results, f)  # what a survivor saw, also when another rank dies
    return results


def _check(out: Path, cases: list[tuple[str, str, int, int]], survivors: list[int]) -> None:
    results = {r: json.loads((out / f"rank{r}.json").read_text()) for r in survivors}
    for i, (schedule, how, _, named) in enumerate(cases):
        texts = {r: results[r][i] for r in survivors}
        bound = 3 * HANG_TIMEOUT if how == "hang" else TIMEOUT / 2
        late = {r: t for r, t in texts.items() if float(t.split()[0]) > bound}
        assert late == {}, f"{schedule} {how}: ranks that waited for a timeout: {late}"
        quiet = {r: t for r, t in texts.items() if f"rank {named}" not in t}
        assert quiet == {}, f"{schedule} {how}: errors not naming rank {named}: {quiet}"


# (schedule, fault, the rank whose stage faults, the rank every error must name): a wrong
# shape fails in the stage that reads it, rank 2's stage 2 output in rank 3's stage 3
CASES = [("1f1b", "raise", 1, 1), ("interleaved-1f1b", "shape", 2, 3), ("zbv", "raise", 1, 1)]


@pytest.mark.parametrize("world", [4, 8])
def test_raise_and_wrong_shape_reach_every_rank(world: int, tmp_path: Path) -> None:
    cases = CASES if world == 4 else CASES[2:]
    pt.launch(_cases, world, cases, str(tmp_path), timeout=300)
    _check(tmp_path, cases, list(range(world)))


def test_a_killed_rank_is_named_on_every_rank(tmp_path: Path) -> None:
    cases = [("1f1b", "kill", 1, 1)]
    with pytest.raises(pt.PipelineError, match="rank 1 ---\nprocess exited with code 3"):
        pt.launch(_cases, 4, cases, str(tmp_path), timeout=120)
    _check(tmp_path, cases, [0, 2, 3])


@pytest.mark.long  # beside test_failures_dist.py::test_hung_peer_times_out
def test_a_hung_rank_is_named_with_its_action_on_every_rank(tmp_path: Path) -> None:
    """At 4 ranks (8 ranks wait the same timeout and probe the same way; the raise above runs
    at 8, and the suite's time budget takes one hang)."""
    world, schedule = 4, "interleaved-1f1b"
    cases = [(schedule, "hang", 1, 1)]
    pt.launch(_cases, world, cases, str(tmp_path), timeout=300)
    texts = [json.loads((tmp_path / f"rank{r}.json").read_text())[0] for r in range(world)]
    survivors = [r for r in range(world) if r != 1]
    _check(tmp_path, cases, survivors)
    for r in survivors:  # the watchdog tells the rank in its own code from those waiting
        assert "rank 1 is stuck in its own stage code: 1F0 of step 1 has run for" in texts[r]
    assert any("waits for rank" in texts[r] for r in survivors)
