"""`pipetrain train --ft` end to end: replicas over torchft that survive a killed rank.

Each test starts local jobs as a user does (tiny preset, seq_len 32) with a fault injected by
``PIPETRAIN_FAULTS``; every replica writes ``<out>/replica-<R>/log.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("torchft")

TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "12", "--microbatches", "2",
        "--sample-tokens", "0", "--eval-every", "0", "--no-progress", "--pp", "2",
        "--timeout", "30"]


def _train(out: Path, *args: str, faults: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    if faults:
        env["PIPETRAIN_FAULTS"] = faults
    return subprocess.run([sys.executable, "-m", "pipetrain", "train", *TINY, "--out", str(out),
                           *args], env=env, text=True, capture_output=True, timeout=240)


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "step"]


def test_a_restarted_replica_loads_a_peers_state_and_rejoins(tmp_path: Path) -> None:
    """dp 3 x pp 2 (6 processes; the command infers --dp 3 from --nproc 6 and --pp 2), replica
    2's first rank killed at step 2 and restarted by its agent (--ft restarts a failed replica
    without --max-restarts): the others never restart, every step is committed once, and replica
    2, with no checkpoint to resume from, goes on within a bounded number of steps from a
    healthy replica's state; all end bitwise equal. (Which replicas take part in the steps right
    after the failure depends on timing: the others go on without replica 2 once torchft has
    seen it gone, unless it is back first; a replica slow to ask for the next quorum is left out
    of it and loads a peer's state at the one after, as torchft does.)"""
    done = _train(tmp_path, "--nproc", "6", "--ft", "--steps", "40",
                  faults="kill@rank4:step2")  # --dp 3 from the world, restarts by default
    assert done.returncode == 0, done.stderr
    assert "pipetrain train: --dp 3 (inferred: 6 ranks / pp=2;" in done.stdout
    assert "max_restarts=3" in done.stdout  # the config line says how many
    logs = {r: _records(tmp_path / f"replica-{r}") for r in range(3)}
    assert [sum(x["kind"] == "start" for x in logs[r]) for r in range(3)] == [1, 1, 2]
    for records in logs.values():
        last_start = max(i for i, x in enumerate(records) if x["kind"] == "start")
        steps = [s["step"] for s in _steps(records[last_start:])]
        assert steps == sorted(set(steps)) and steps[-1] == 39  # each once, in order
        end = records[-1]
        assert end["kind"] == "end" and end["steps"] == 40 and end["replicas_bitwise_equal"]
        assert _steps(records)[-1]["replicas"] == 3
    assert {s["step"] for r in (0, 1) for s in _steps(logs[r])} == set(range(40))
    restarted = logs[2][[x["kind"] for x in logs[2]].index("start", 1):]
    assert restarted[0]["resumed_from"] is None  # no checkpoint: a peer's state
    assert 2 <= _steps(restarted)[0]["step"] <= 30  # back well before the end (40 steps:
    # room for a slow restart on a busy machine, the others then going on without it)


@pytest.mark.long  # 16 processes; a restart under --ft: the test above
def test_with_every_replica_required_a_failure_costs_no_step(tmp_path: Path) -> None:
    """Replicas of pp 2 x fsdp 2 (8 processes), --ft-min-replicas 2 of dp 2: the survivor
    waits for the killed replica to come back (its agent restarts it, it loads the survivor's
    FSDP2 shards and optimizer state), so every step has both replicas' rows and the losses
    and eval loss are bitwise those of the same layout without --ft and without a fault
    (HSDP: FSDP2's all-reduce over the replicas)."""
    shape = ["--nproc", "8", "--dp", "2", "--fsdp", "2", "--batch-size", "16", "--steps", "5"]
    plain = tmp_path / "plain"
    assert _train(plain, *shape).returncode == 0
    ft = tmp_path / "ft"
    done = _train(ft, *shape, "--ft", "--ft-min-replicas", "2", "--max-restarts", "1",
                  faults="kill@rank7:step2")  # replica 1's last rank (4 a replica)
    assert done.returncode == 0, done.stderr
    want = _records(plain)
    for r in (0, 1):
        records = _records(ft / f"replica-{r}")
        assert [s["replicas"] for s in _steps(records)][-3:] == [2] * 3
        assert records[-1]["replicas_bitwise_equal"] is True
        assert records[-1]["eval_loss"] == want[-1]["eval_loss"]
    assert sum(x["kind"] == "start" for x in _records(ft / "replica-1")) == 2
    survivor = _steps(_records(ft / "replica-0"))
    assert [s["loss"] for s in survivor] == [s["loss"] for s in _steps(want)]


# in CI: a replica's failure and restart:
# test_a_restarted_replica_loads_a_peers_state_and_rejoins
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_one_torchrun_per_replica_and_a_replica_that_fails_for_good(tmp_path: Path) -> None:
    """The cluster recipe on one machine: torchft's ``torchft_lighthouse`` command, then one
    torchrun per replica (``--ft-replica-id``, ``--ft-lighthouse``), two ranks each (pp 2).
    Replica 1's second rank raises at step 3 and its torchrun has no restart left: it exits 1,
    while replica 0 logs every step once, alone from step 3 (``replica_left``), never
    restarting."""
    import shutil

    from pipetrain.runtime.launch import free_port

    command = shutil.which("torchft_lighthouse") or str(
        Path(sys.executable).parent / "torchft_lighthouse")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    lighthouse = subprocess.Popen([command, "--bind", f"127.0.0.1:{port}", "--min_replicas",
                                   "1", "--join_timeout_ms", "1000", "--heartbeat_timeout_ms",
                                   "2000"], env={**env, "RUST_LOG": "error"},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        replicas = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "--max-restarts", "0", "-m", "pipetrain", "train", *TINY, "--dp", "2",
             "--ft", "--ft-replica-id", str(r), "--ft-lighthouse", f"127.0.0.1:{port}",
             "--steps", "7", "--out", str(tmp_path)],
            env={**env, "PIPETRAIN_FAULTS": "raise@rank3:step3"}, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
        ends = [p.communicate(timeout=240) for p in replicas]
    finally:
        lighthouse.kill()
        lighthouse.wait()
    assert replicas[0].returncode == 0, ends[0][1][-3000:]
    assert replicas[1].returncode != 0 and "InjectedFault" in ends[1][1], ends[1][1][-3000:]
    survivor = _records(tmp_path / "replica-0")
    steps = _steps(survivor)
    assert [s["step"] for s in steps] == list(range(7))  # each once, no restart
    assert [s["replicas"] for s in steps] == [2, 2, 2, 1, 1, 1, 1]
    assert [(x["replica"], x["step"]) for x in survivor if x["kind"] == "replica_left"] == [(1, 3)]
    assert sum(x["kind"] == "start" for x in survivor) == 1
    assert survivor[-1]["kind"] == "end" and survivor[-1]["replicas_bitwise_equal"] is True
    failed = _steps(_records(tmp_path / "replica-1"))  # until it failed: the same steps
    assert [s["loss"] for s in failed] == [s["loss"] for s in steps[:3]]
