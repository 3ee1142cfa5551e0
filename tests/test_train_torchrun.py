"""`pipetrain train` under two torchrun agents: the multi-node launch and rank placement.

A file of its own (its one test takes about 40 s), so that the test runner can start it beside
tests/test_train_launch.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.train.logs import report
from test_train_launch import TINY

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


def test_two_torchrun_agents_rendezvous_and_train_pp_by_fsdp_to_the_end(tmp_path: Path) -> None:
    """Two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1), two ranks each,
    train pp=2 x fsdp=2 to the end (``--pp 2 --dp 1``: the command infers ``--fsdp 2`` from
    torchrun's world and says so once): the multi-node launch, on one machine; rank 0 prints and
    logs where the ranks landed, the stages across the agents and the shards within each."""
    from pipetrain.runtime.launch import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    out = tmp_path / "out"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
             f"127.0.0.1:{free_port()}", "--rdzv-id", "two-agents", "--max-restarts", "0",
             "-m", "pipetrain", "train", *TINY[2:], "--pp", "2", "--dp", "1", "--steps", "3",
             "--out", str(out)]
    agents = [subprocess.Popen(agent, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE) for _ in range(2)]
    ends = [a.communicate(timeout=240) for a in agents]
    if [a.returncode for a in agents] != [0, 0]:  # the whole of each agent's reason
        pytest.fail("\n\n".join(f"agent {i} exited {a.returncode}:\n{_why(e[1])}"
                                  for i, (a, e) in enumerate(zip(agents, ends))))
    printed = "".join(stdout for stdout, _ in ends)  # global rank 0's agent printed
    assert printed.count("pipetrain train: --fsdp 2 (inferred: 4 ranks / pp=2 x dp=1;") == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["layout"]["world"] == 4
    assert (summary["layout"]["pp"], summary["layout"]["fsdp"]) == (2, 2)
    assert len(summary["peak_memory_bytes"]) == 4
    # pp-outer placement: each pipeline spans the two "nodes" (agents: torchrun's GROUP_RANK,
    # as both share one host), each FSDP shard group stays on one
    start = next(r for r in report.read_log(out / "log.jsonl") if r["kind"] == "start")
    ranks = start["ranks"]
    assert [e["rank"] for e in ranks] == [0, 1, 2, 3] and start["layout"]["mesh_order"] == \
        "pp-outer"
    assert [(e["node"], e["local_rank"]) for e in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    pipelines: dict[tuple[int, int, int], set[int]] = {}
    shards: dict[tuple[int, int, int], set[int]] = {}
    for e in ranks:
        pipelines.setdefault((e["dp"], e["shard"], e["tp"]), set()).add(e["node"])
        shards.setdefault((e["pp"], e["dp"], e["tp"]), set()).add(e["node"])
    assert list(pipelines.values()) == [{0, 1}, {0, 1}], ranks
    assert sorted(map(sorted, shards.values())) == [[0], [1]], ranks
    host = ranks[0]["host"]
    assert f"  node 0 ({host}): r0 L0 pp0 s0 | r1 L1 pp0 s1\n" in printed, printed[-3000:]
    assert f"  node 1 ({host}): r2 L0 pp1 s0 | r3 L1 pp1 s1\n" in printed, printed[-3000:]


def _why(stderr: str) -> str:
    """An agent's stderr, cut to what says why a rank ended: its error lines and the tail."""
    said = [line for line in stderr.splitlines()
            if any(w in line for w in ("Error", "error:", "terminate", "what()", "Signal"))]
    return "\n".join(said[:40]) + "\n...\n" + stderr[-1500:]
