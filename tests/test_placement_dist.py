"""Rank placement in `pipetrain train` runs: pp 2 x fsdp 2 on 4 processes trains the same
under both mesh orders, a run saved under dp-outer resumes under pp-outer with the losses of
an uninterrupted pp-outer run, and rank 0 prints and logs where each rank landed.

The runs are ``pipetrain.cli.main`` in this process (its ranks start from the session's
forkserver), tiny preset, 4 steps at a constant learning rate, so that a 2-step run followed
by its resume makes the steps of one 4-step run."""

from __future__ import annotations

import argparse
import json
import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

COMMON = ["--nproc", "4", "--pp", "2", "--fsdp", "2", "--preset", "tiny", "--seq-len", "32",
          "--batch-size", "8", "--microbatches", "2", "--eval-every", "0", "--eval-batches",
          "1", "--sample-tokens", "0", "--warmup", "0", "--lr", "3e-3", "--min-lr", "3e-3",
          "--no-progress", "--timeout", "60"]


def _train(tmp: Path, out: str, *args: str) -> list[dict[str, Any]]:
    """Run ``pipetrain train``; the records of ``out/log.jsonl``."""
    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
            env.delenv(key)
        assert main(["train", *COMMON, "--data", str(tmp / "corpus.txt"), "--out",
                     str(tmp / out), *args]) == 0
    lines = (tmp / out / "log.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def _steps(records: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records if r["kind"] == "step"}


def _coords(start: dict[str, Any]) -> list[tuple[int, int]]:
    """(pp, shard) of each global rank, from a start record's rank map."""
    assert [e["rank"] for e in start["ranks"]] == [0, 1, 2, 3]
    return [(e["pp"], e["shard"]) for e in start["ranks"]]


@pytest.mark.long  # beside test_train_torchrun.py::test_two_torchrun_agents_rendezvous_and_...
def test_a_dp_outer_run_resumes_under_pp_outer_with_the_uninterrupted_losses(
        tmp_path: Path) -> None:
    from pipetrain.train.placement import format_rank_map

    sources = [Path(textwrap.__file__), Path(argparse.__file__)]
    (tmp_path / "corpus.txt").write_bytes(b"".join(p.read_bytes() for p in sources))
    whole = _train(tmp_path, "whole", "--steps", "4")  # pp-outer, the default
    start = next(r for r in whole if r["kind"] == "start")
    # the lines rank 0 prints (the ranks' stdout is not this test's: they start from the
    # session's forkserver)
    printed = "\n".join(format_rank_map(start["ranks"], start["layout"]["mesh_order"]))
    assert "ranks by node (r global rank, L local rank, pp pipeline rank, s fsdp shard; " \
           "--mesh-order pp-outer):" in printed, printed
    assert "  node 0 (" in printed and "r0 L0 pp0 s0 | r1 L1 pp0 s1 | r2 L2 pp1 s0 | " \
           "r3 L3 pp1 s1" in printed, printed  # one node: the local launch
    first = _train(tmp_path, "moved", "--steps", "2", "--mesh-order", "dp-outer")
    rest = _train(tmp_path, "moved", "--steps", "4")  # resumes at step 2, pp-outer
    starts = [r for r in rest if r["kind"] == "start"]
    assert [s["start_step"] for s in starts] == [0, 2]
    assert [s["layout"]["mesh_order"] for s in starts] == ["dp-outer", "pp-outer"]
    assert _coords(starts[0]) == [(0, 0), (1, 0), (0, 1), (1, 1)]  # r = shard * pp + pp
    assert _coords(starts[1]) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # r = pp * fsdp + shard
    assert _coords([r for r in whole if r["kind"] == "start"][0]) == _coords(starts[1])
    want = _steps(whole)
    assert sorted(want) == [0, 1, 2, 3]
    assert _steps(first) == {s: want[s] for s in (0, 1)}  # the order changes no number
    assert _steps(rest) == want
