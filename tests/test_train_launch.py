"""`pipetrain train` end to end as a subprocess: files, loopback-only sockets, fail-stop, resume.

Each test starts one small job (tiny preset, seq_len 32, a few steps, 2 local processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipetrain.checkpoint import run as checkpoint
from pipetrain.checkpoint import store as checkpoint_store
from pipetrain.train.logs import report

TINY = ["--nproc", "2", "--preset", "tiny", "--seq-len", "32", "--batch-size", "8",
        "--microbatches", "4", "--sample-tokens", "16", "--no-progress"]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

def _bound(timeout: float) -> float:
    """Seconds from a fault to the end of every process: the peers' timeout, the watchdog's
    probe, the agent's SIGTERM grace, and room for a busy machine."""
    from pipetrain.runtime.failure.watchdog import _ANSWER_S
    from pipetrain.train.launch.elastic import SHUTDOWN_GRACE

    return 3 * timeout + _ANSWER_S + SHUTDOWN_GRACE + 5

pytestmark = [pytest.mark.slow,  # the full suite's tier (CONTRIBUTING.md: tests)
              pytest.mark.skipif(not Path("/proc/net/tcp").exists(),
                                 reason="reads sockets and processes from Linux /proc")]


def _start(out: Path, *args: str, faults: str | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    if faults:
        env["PIPETRAIN_FAULTS"] = faults
    return subprocess.Popen([sys.executable, "-m", "pipetrain", "train", *TINY,
                             "--out", str(out), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# ------------------------------------------------------------------------ /proc inspection


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc/<pid>/task/*/children)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += list(kids - found)
            found |= kids
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> str:
    """``0100007F`` → 127.0.0.1; 32 hex digits → an IPv6 address (kernel byte order)."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped and f"::ffff:{v6.ipv4_mapped}" or v6)


def _listening(pids: set[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by one of ``pids``."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            if " 0A " not in line:  # not listening: most of a busy machine's lines, skipped
                continue  # unsplit (this runs every 50 ms while a job lives)
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                addr, port = cols[1].split(":")
                found.add((_address(addr), int(port, 16)))
    return found


def _watch(proc: subprocess.Popen[str], listening: bool = True
           ) -> tuple[set[tuple[str, int]], set[int]]:
    """Until ``proc`` ends: the job's listening sockets (unless not ``listening``: reading the
    machine's socket tables 20 times a second costs the job CPU) and its worker processes."""
    sockets: set[tuple[str, int]] = set()
    workers: set[int] = set()
    while proc.poll() is None:
        try:
            now = {proc.pid} | _children(proc.pid)
            workers |= {pid for pid in now if _is_worker(pid)}
            if listening:
                sockets |= _listening(now)
        except OSError:
            pass
        time.sleep(0.05)
    return sockets, workers


def _is_worker(pid: int) -> bool:
    """A worker: spawned, or forked by the forkserver (not the launcher, not the forkserver
    itself, not multiprocessing's resource tracker)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        parent = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1]
        forked = b"forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return False
    return b"spawn_main" in command or (b"forkserver" in command and forked)


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


# ----------------------------------------------------------------------------------- tests


def test_train_writes_every_file_and_listens_on_loopback_only(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--steps", "4", "--eval-every", "2", "--schedule", "zbv")
    sockets, workers = _watch(proc)
    out, err = proc.communicate()
    assert proc.returncode == 0, out + err
    assert len(workers) == 2, workers
    assert sockets, "no listening socket seen while the job ran"
    assert {addr for addr, _ in sockets} <= LOOPBACK, sockets
    for name in ("log.jsonl", "loss.png", "timeline.png", "timeline.json", "summary.json",
                 "config.toml"):
        assert (tmp_path / name).stat().st_size > 0, name
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2, 3]
    assert [r["kind"] for r in records].count("eval") == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] > 0
    assert (summary["timeline_step"], summary["timeline_costs_step"]) == (3, 2)  # not fitted
    trace = json.loads((tmp_path / "timeline.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert {"rank 0 measured", "rank 1 simulated"} <= names
    assert "schedule=zbv" in out and "step 3/4" in out


@pytest.mark.parametrize(("fault", "first", "cause"), [  # kill: the long tier, beside hang
    pytest.param("kill@rank1:step2", "rank 1 failed first: killed by SIGKILL", None,
                 marks=pytest.mark.long),
    ("hang@rank1:step2", "rank 0 failed first: exit code 1",
     "the cause, found by rank 0's watchdog: rank 1 is outside the pipeline for"),
], ids=["kill", "hang"])
def test_a_failed_rank_stops_every_rank_within_the_bound(tmp_path: Path, fault: str,
                                                         first: str, cause: str | None) -> None:
    timeout = 3.0
    proc = _start(tmp_path, "--steps", "50", "--timeout", str(timeout), faults=fault)
    _, workers = _watch(proc, listening=False)
    ended = time.time()
    out, err = proc.communicate()
    assert proc.returncode == 1, out + err
    fired = [f.stat().st_mtime for f in (tmp_path / "faults").rglob("*") if f.is_file()]
    assert len(fired) == 1, f"the fault's marker: {fired}"
    assert ended - fired[0] < _bound(timeout), f"took {ended - fired[0]:.1f} s after the fault"
    assert len(workers) == 2 and not _alive(workers), "a worker outlived the launcher"
    assert first in err and "without restarts" in err, err
    if cause:  # the launcher's last line names the rank that held everyone up
        assert cause in err.strip().splitlines()[-1] and "ended step 1" in err, err
    assert "step 49" not in out


@pytest.mark.long  # a hang across replicas: test_failures_job_dist.py; a restart: below
def test_dp2_pp2_hang_is_named_and_restarts_resume(tmp_path: Path) -> None:
    # rank 3 (pipeline rank 1 of replica 1 under the default pp-outer placement, whose
    # pipelines are ranks {0, 2} and {1, 3}) hangs between steps: its pipeline peer, rank 1,
    # times out and names it; replica 0, waiting in the gradient all-reduce, reads the news;
    # the agent restarts the job, which resumes from step 2's checkpoint and finishes
    args = ["--nproc", "4", "--dp", "2", "--pp", "2", "--steps", "4", "--timeout", "3",
            "--checkpoint-every", "1", "--max-restarts", "1", "--eval-every", "0"]
    proc = _start(tmp_path, *args, faults="hang@rank3:step2")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    named = "rank 3 (rank 1 of its pipeline) is outside the pipeline for"
    assert "timed out" in err and named in err, err  # rank 1 timed out and named rank 3
    for rank in (0, 2):  # the other replica stopped on the news, not on its own timeout
        assert f"RankFailed: [rank {rank}] the gradient all-reduce over replicas: rank 1" in err
    assert "restart 1 of 1" in out + err and "resuming at step 2" in out and "step 3/4" in out


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint under ``out``."""
    path = checkpoint_store.latest(out / "checkpoints")
    assert path is not None, f"no committed checkpoint under {out}"
    index = checkpoint_store.open_checkpoint(path).metadata.state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in index.items() if key.startswith(("model/", "optim/"))}
    checkpoint.load(path, state, strict=False)
    return state


@pytest.mark.parametrize("schedule", [  # 1f1b: killed and restarted also in test_soak.py (zbv)
    pytest.param("1f1b", marks=pytest.mark.long), "pipedream-2bw"])
def test_killed_rank_restarts_from_checkpoint_and_ends_bitwise_equal(tmp_path: Path,
                                                                      schedule: str) -> None:
    # pipedream-2bw: killed mid-stream (micro-batches in flight), restarted from the drained
    # checkpoint of step 3
    common = ["--steps", "8", "--checkpoint-every", "3", "--eval-every", "0", "--timeout", "5",
              "--schedule", schedule]
    # both runs skip step 2 (NaN loss on rank 0); only the second loses rank 1 at step 5
    plain = _start(tmp_path / "plain", *common, faults="nan@rank0:step2")
    killed = _start(tmp_path / "killed", *common, "--max-restarts", "1",
                    faults="nan@rank0:step2,kill@rank1:step5")
    for proc in (plain, killed):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, out + err
    assert "restart 1 of 1" in out and "resuming at step 3" in out, out
    assert len(list((tmp_path / "killed" / "faults").glob("*/kill@rank1:step5"))) == 1
    a, b = _final_state(tmp_path / "plain"), _final_state(tmp_path / "killed")
    assert a.keys() == b.keys() and any(k.startswith("model/") for k in a)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
    steps = [{r["step"]: (r["loss"], r["skipped"])
              for r in report.read_log(tmp_path / run / "log.jsonl") if r["kind"] == "step"}
             for run in ("plain", "killed")]
    assert steps[0] == steps[1] and len(steps[0]) == 8
    assert [s for s, (_, skipped) in steps[0].items() if skipped] == [2]
    if schedule == "pipedream-2bw":  # drained before each checkpoint and at the end: step 2's
        # record carries batch 1's update, and batch 2's (NaN, skipped) as drained
        drained = {r["step"]: (r["loss"] is not None, r["drained"]["skipped"])
                   for r in report.read_log(tmp_path / "plain" / "log.jsonl")
                   if r["kind"] == "step" and "drained" in r}
        assert drained == {2: (True, True), 5: (True, False), 7: (True, False)}, drained


@pytest.mark.parametrize(("extra", "code", "said"), [
    ([], 1, 1), pytest.param(["--verbose"], 1, 3, marks=pytest.mark.long),
    pytest.param(["--max-restarts", "1"], 0, 1, marks=pytest.mark.long)],
    ids=["plain", "verbose", "restart"])
def test_the_console_holds_back_native_notes_and_says_a_shared_error_once(
        tmp_path: Path, extra: list[str], code: int, said: int) -> None:
    """An error every rank raises alike (injected in both at step 2; step 1's memory is
    measured under the torch profiler) is said once: by the launcher's verdict, or by one
    rank when the launcher restarts the job, whose console then holds that line only, no note
    of torch's profiler or allocator. ``--verbose`` shows the notes and every rank's line."""
    both = "raise@rank0:step2,raise@rank1:step2"
    proc = _start(tmp_path, "--steps", "3", *extra, faults=both)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == code, out + err
    assert err.count("injected exception at step 2") == said, (extra, err)
    assert ("profiler_start" in err) == (extra == ["--verbose"]), (extra, err)
    if code == 0:  # restarted and finished: the one line is all of stderr
        assert len(err.strip().splitlines()) == 1, err
