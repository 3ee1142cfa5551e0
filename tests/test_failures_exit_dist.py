"""Every process leaves promptly after a failure: in a user's own launcher (plain processes,
``init_process_group("gloo")``, rank 0 hosts the store), at 4 and 8 ranks, whether a rank
raises, dies, sends a wrong shape or hangs, each survivor names the culprit and its process has
exited within 15 s of the first error: none waits for a culprit that is dead or hung."""

from __future__ import annotations

import atexit
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from pipetrain.runtime.launch import free_port, start_context
from test_failures_scale_dist import Fault

EXIT_S = 15.0  # from the first error to the exit of every surviving process
# the store's host used to stay up for the timeout + 3.5 s after its error, waiting for the
# culprit to count out: both timeouts keep that above EXIT_S, so a wait for it fails the test
TIMEOUT = 30.0
HANG_TIMEOUT = 16.0
HANG_S = 600.0  # the hung rank never wakes by itself: the test ends its process

# (ranks, fault, the rank whose stage faults, the rank every error must name): a wrong shape
# fails in the stage that reads it
CASES = [(4, "raise", 1, 1), (4, "kill", 2, 2), (4, "shape", 1, 2), (4, "hang", 2, 2),
         (8, "raise", 5, 5), (8, "kill", 3, 3), (8, "shape", 6, 7), (8, "hang", 4, 4)]


def _train(rank: int, world: int, port: int, how: str, culprit: int, out: str) -> None:
    """What a user's script does: its own rendezvous, a pipeline, steps; the second faults."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    Fault.hang_s = HANG_S
    faults = [Fault(r) for r in range(world)]  # 1F1B: stage r on rank r
    layers = [m for fault in faults for m in (nn.Linear(4, 4), fault)]
    pipe = pt.Pipeline(nn.Sequential(*layers), "1f1b", 4, nn.MSELoss(),
                       timeout=HANG_TIMEOUT if how == "hang" else TIMEOUT)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    Path(out, f"ready{rank}").touch()
    Fault.armed = (culprit, how)
    pipe.step(x, y)


def _user_rank(rank: int, world: int, port: int, out: str, how: str, culprit: int) -> None:
    """One rank's process: the error propagates and the script ends. A forked process skips
    the interpreter's exit handlers, where a failed store host waits for its peers: run them,
    as a script's own end does."""
    record: dict[str, Any] = {"error": "no error"}
    try:
        _train(rank, world, port, how, culprit, out)
    except Exception as e:  # a PipelineError, named below
        record = {"error_at": time.time(), "error": f"{type(e).__name__}: {e}"}
        raise SystemExit(1) from None
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        atexit._run_exitfuncs()


@dataclass
class Job:
    """The processes of one case, and when each exited (wall-clock seconds)."""

    world: int
    how: str
    culprit: int
    named: int
    out: Path
    procs: list[Any]
    exits: dict[int, float]

    def survivors(self) -> list[int]:
        """Every rank but a culprit that died or hangs."""
        gone = self.how in ("kill", "hang")
        return [r for r in range(self.world) if not (gone and r == self.culprit)]


def _start(ctx: Any, case: tuple[int, str, int, int], out: Path) -> Job:
    world, how, culprit, named = case
    out.mkdir()
    port = free_port()
    procs = [ctx.Process(target=_user_rank, args=(r, world, port, str(out), how, culprit),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    return Job(world, how, culprit, named, out, procs, {})


def _ready(jobs: list[Job], seconds: float) -> None:
    """Wait until every rank of ``jobs`` has run its good step (at most ``seconds``)."""
    deadline = time.time() + seconds
    while time.time() < deadline and not all(
            (job.out / f"ready{r}").exists() for job in jobs for r in range(job.world)):
        time.sleep(0.05)


def _watch(jobs: list[Job], seconds: float) -> None:
    """Note each survivor's exit time, until all exited or ``seconds`` passed."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        for job in jobs:
            for r in job.survivors():
                if r not in job.exits and job.procs[r].exitcode is not None:
                    job.exits[r] = time.time()
        if all(len(job.exits) == len(job.survivors()) for job in jobs):
            return
        time.sleep(0.02)


def _verdict(job: Job) -> list[str]:
    """What is wrong with one case: a survivor late to exit, or not naming the culprit."""
    records = {r: json.loads((job.out / f"rank{r}.json").read_text())
               for r in job.survivors() if (job.out / f"rank{r}.json").exists()}
    first = min([rec["error_at"] for rec in records.values() if "error_at" in rec],
                default=float("inf"))
    case = f"{job.world} ranks, {job.how} on rank {job.culprit}"
    wrong = []
    for r in job.survivors():
        late = job.exits.get(r, float("inf")) - first
        text = records.get(r, {}).get("error", "no record")
        if not late < EXIT_S:
            wrong.append(f"{case}: rank {r} exited {late:.1f} s after the first error")
        if f"rank {job.named}" not in text:
            wrong.append(f"{case}: rank {r} does not name rank {job.named}: {text[:300]}")
    return wrong


def _run(cases: list[tuple[int, str, int, int]], out: Path) -> list[Job]:
    """Every case's processes until all survivors exited; the hangs start first, so their
    timeout runs while the other cases start and fail."""
    ctx = start_context()
    jobs: list[Job] = []
    try:
        for i, case in enumerate(sorted(cases, key=lambda case: case[1] != "hang")):
            if case[1] != "hang" and jobs and jobs[-1].how == "hang":
                _ready(jobs, 60.0)
            jobs.append(_start(ctx, case, out / f"case{i}"))
        _watch(jobs, HANG_TIMEOUT + 60.0)
    finally:
        for p in (p for job in jobs for p in job.procs):
            if p.exitcode is None:
                p.kill()
    return jobs


def test_every_survivor_exits_soon_after_a_failure_naming_the_culprit(tmp_path: Path) -> None:
    wrong = [line for job in _run(CASES, tmp_path) for line in _verdict(job)]
    assert wrong == [], "\n".join(wrong)
