"""Soak: train through many random faults (kill, raise, hang, NaN, wrong shape) and check them all.

One ``pipetrain train`` job of the tiny GPT preset saves a checkpoint every few steps, may
restart as often as it needs, and gets a fault plan drawn from a seed
(:func:`pipetrain.train.launch.faults.random_plan`: every kind about equally often, ranks and steps
uniform). From the job's log, its fired-fault markers and its console lines (timestamped here
as they arrive) the script then checks every fault:

- ``kill``, ``raise``, ``hang``, ``shape``: it ended the attempt it fired in (``raise`` and
  ``shape`` with an error naming the rank, ``shape`` also the stage and micro-batch; ``hang``
  by a peer's timeout, whose watchdog names the hung rank), the first failure came within its
  bound (``timeout`` + 3 s for a hang, 3 s otherwise), and the next attempt resumed from the
  newest checkpoint before the fault;
- ``nan``: its step was logged as skipped by every rank (the collective non-finite policy), and
  it cost no restart;

and the whole run: every step done, exactly one restart per restarting fault, and the final
history bitwise equal to an uninterrupted run of the same configuration given the same NaN
steps (no other faults): the loss and skip flag of every step, and every model and optimizer
tensor of the final checkpoint. Steps lost are steps run twice: done after the newest
checkpoint before a failure, run again after the restart. Any failed check is printed and
makes the script exit 1.

Latest figures (README, "Reliability"; seed 0, 400 steps, 20 faults, 4 per kind, 2-core VM):
all survived, 16 restarts, 96 steps lost, bitwise equal, at 2 ranks ZB-V (100 s against 27 s
uninterrupted), 4 ranks 1F1B (167 s against 30 s) and dp 2 x pp 2 ZB-V (177 s against 47 s).

    python benchmarks/soak.py                       # the README's figures (about 2 minutes)
    python benchmarks/soak.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipetrain.checkpoint import run as checkpoint
from pipetrain.checkpoint import store as checkpoint_store
from pipetrain.train.launch import faults
from pipetrain.train.logs import report

RESTARTING = ("kill", "raise", "hang", "shape")
FIRST_FAILURE_S = 3.0
"""Bound from a fault to the first failure line (plus ``timeout`` for a hang)."""
_FAILURE = re.compile(r"^pipetrain train: (?!restart |summary|\d+ process)")  # a rank's failure


def _names_hung(rank: int) -> re.Pattern[str]:
    """The watchdog's finding for a rank hung between steps (``faults``' hang fires there)."""
    return re.compile(rf"rank {rank}( \(rank \d+ of its pipeline\))? is outside the pipeline")


_NAMES_STAGE = re.compile(r"\[rank \d+ \| stage \d+ \| mb \d+ \| \d+[FBIW]\d+\]")


@dataclass
class Job:
    """One finished ``pipetrain train`` process: where it wrote, how it ended, what it said."""

    out: Path
    returncode: int
    seconds: float
    lines: list[tuple[float, str]]
    """Console lines (stdout and stderr) with the time each arrived."""


@dataclass
class Outcome:
    """What became of one planned fault."""

    fault: faults.Fault
    fired: float | None = None
    survived: bool = False
    first_failure_s: float | None = None
    recovery_s: float | None = None
    """Fault to the next attempt's start record (detection, stop, restart, rebuild, restore)."""
    resumed_at: int | None = None
    steps_lost: int = 0
    problems: list[str] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"fault": str(self.fault), "kind": self.fault.kind, "rank": self.fault.rank,
                "step": self.fault.step, "fired": self.fired is not None,
                "survived": self.survived, "first_failure_s": self.first_failure_s,
                "recovery_s": self.recovery_s, "resumed_at": self.resumed_at,
                "steps_lost": self.steps_lost, "problems": self.problems}


# --------------------------------------------------------------------------------- running


def train_args(a: argparse.Namespace) -> list[str]:
    return ["--nproc", str(a.nproc), "--dp", str(a.dp), "--preset", "tiny",
            "--schedule", a.schedule,
            "--seq-len", str(a.seq_len), "--batch-size", "8", "--microbatches", "4",
            "--steps", str(a.steps), "--checkpoint-every", str(a.checkpoint_every),
            "--eval-every", "0", "--sample-tokens", "0", "--timeout", str(a.timeout),
            "--no-progress"]


def run_job(out: Path, args: list[str], plan: str, limit: float) -> Job:
    """Run ``pipetrain train`` with ``plan`` injected; kill its session after ``limit`` s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    env.update({faults.ENV: plan, "PYTHONUNBUFFERED": "1"} if plan else {"PYTHONUNBUFFERED": "1"})
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipetrain", "train", *args, "--out",
                             str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(limit, os.killpg, (proc.pid, signal.SIGKILL))
    timer.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
        returncode = proc.wait()
    finally:
        timer.cancel()
    out.parent.mkdir(parents=True, exist_ok=True)  # kept with --keep, for a post-mortem
    out.with_name(out.name + ".console.txt").write_text(
        "".join(f"{t:.3f} {line}\n" for t, line in lines))
    return Job(out, returncode, time.time() - start, lines)


# ------------------------------------------------------------------------------- checking


def fired_at(out: Path) -> dict[str, float]:
    """Each fired fault's marker (``str(fault)``) and the time written in it."""
    found = {}
    for path in (out / "faults").glob("*/*"):
        words = path.read_text().split()
        found[path.name] = float(words[words.index("time") + 1])
    return found


def check_fault(o: Outcome, job: Job, records: list[dict[str, Any]], timeout: float) -> None:
    """Fill ``o`` from the job's records and lines; problems go to ``o.problems``."""
    if o.fired is None:
        o.problems.append("never fired")
        return
    if o.fault.kind == "nan":
        _check_nan(o, records)
    else:
        _check_restart(o, job, records, timeout)
    o.survived = not o.problems


def _check_nan(o: Outcome, records: list[dict[str, Any]]) -> None:
    assert o.fired is not None
    fired = o.fired  # ranks log in their own time: find the step, then the attempt's end
    step = next((r for r in records if r["kind"] == "step" and r["step"] == o.fault.step
                 and r["time"] >= fired), None)
    restart = next((r for r in records if r["kind"] == "start" and r["time"] > fired), None)
    if step is None or (restart is not None and restart["time"] < step["time"]):
        o.problems.append("the step did not finish in the same attempt")
    elif not step["skipped"]:
        o.problems.append("the step was not skipped (log: skipped=false)")


def _check_restart(o: Outcome, job: Job, records: list[dict[str, Any]],
                   timeout: float) -> None:
    assert o.fired is not None
    fired = o.fired
    nxt = next((r for r in records if r["kind"] == "start" and r["time"] > fired), None)
    if nxt is None:
        o.problems.append("no restart after it")
        return
    o.recovery_s = nxt["time"] - fired
    o.resumed_at = int(nxt["start_step"])
    saved = [r["step"] for r in records if r["kind"] == "checkpoint"
             and r["time"] < nxt["time"] and r["step"] <= o.fault.step]
    newest = max(saved, default=0)
    if o.resumed_at != newest:
        o.problems.append(f"resumed at step {o.resumed_at}, newest checkpoint {newest}")
    o.steps_lost = o.fault.step - o.resumed_at
    said = [(t, s) for t, s in job.lines if fired <= t <= nxt["time"]
            and (_FAILURE.match(s) or s.startswith("  watchdog: "))]  # a timeout's finding
    if not said:
        o.problems.append("no failure line before the restart")
        return
    o.first_failure_s = said[0][0] - fired
    bound = FIRST_FAILURE_S + (timeout if o.fault.kind == "hang" else 0.0)
    if o.first_failure_s > bound:
        o.problems.append(f"first failure {o.first_failure_s:.1f} s after it (bound {bound} s)")
    text = "\n".join(s for _, s in said)
    wanted = {"raise": f"[rank {o.fault.rank}] injected exception at step {o.fault.step}",
              "hang": "timed out"}.get(o.fault.kind)
    if wanted and wanted not in text:
        o.problems.append(f"no failure line says {wanted!r}")
    if o.fault.kind == "hang" and not _names_hung(o.fault.rank).search(text):
        o.problems.append(f"no failure line names rank {o.fault.rank} as stuck (the watchdog)")
    if o.fault.kind == "shape" and not _NAMES_STAGE.search(text):
        o.problems.append("no failure line names rank, stage, micro-batch and action")


def final_state(out: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest checkpoint under ``out``."""
    path = checkpoint_store.latest(out / "checkpoints")
    if path is None:
        return {}
    index = checkpoint_store.open_checkpoint(path).metadata.state_dict_metadata
    state = {key: torch.empty(entry.size, dtype=entry.properties.dtype)
             for key, entry in index.items() if key.startswith(("model/", "optim/"))}
    checkpoint.load(path, state, strict=False)
    return state


def read_records(out: Path) -> list[dict[str, Any]]:
    """The latest run's records of ``out/log.jsonl``, every attempt's, in log order
    (``report.read_log`` keeps one record per step; the checks here time each attempt and
    count the steps run twice)."""
    path = out / "log.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return report.latest_run([json.loads(line) for line in lines if line])


def history(records: list[dict[str, Any]]) -> dict[int, tuple[Any, bool]]:
    """Each step's loss and skip flag; a step run again after a restart counts its last run."""
    return {r["step"]: (r["loss"], r["skipped"]) for r in records if r["kind"] == "step"}


def compare(faulty: Path, reference: Path) -> dict[str, Any]:
    """Bitwise comparison of the two runs' step histories and final checkpoints."""
    a, b = final_state(faulty), final_state(reference)
    differ = sorted(k for k in a.keys() | b.keys()
                    if k not in a or k not in b or not torch.equal(a[k], b[k]))
    ha, hb = (history(read_records(p)) for p in (faulty, reference))
    steps = sorted(s for s in ha.keys() | hb.keys() if ha.get(s) != hb.get(s))
    return {"equal": bool(a) and not differ and not steps and bool(ha), "tensors": len(a),
            "steps": len(ha), "different_tensors": differ[:10], "different_steps": steps[:10]}


# -------------------------------------------------------------------------------- the soak


def soak(a: argparse.Namespace, root: Path) -> dict[str, Any]:
    kinds = tuple(a.kinds.split(","))
    plan = faults.random_plan(a.seed, a.steps, a.nproc, a.faults, kinds)
    planned = faults.parse(plan)
    args = train_args(a)
    restarting = sum(f.kind in RESTARTING for f in planned)
    limit = 120 + a.steps + restarting * (60 + a.timeout)
    print(f"soak: {plan}", flush=True)
    job = run_job(root / "faulty", [*args, "--max-restarts", str(restarting + 2)], plan, limit)
    records = read_records(job.out)
    fired = fired_at(job.out)
    outcomes = [Outcome(f, fired.get(str(f))) for f in planned]
    for o in outcomes:
        check_fault(o, job, records, a.timeout)
    problems = _run_problems(a, job, records, restarting)
    lost = sum(r["kind"] == "step" for r in records) - len(history(records))
    if lost != sum(o.steps_lost for o in outcomes):
        problems.append(f"{lost} steps run twice, but the faults account for "
                        f"{sum(o.steps_lost for o in outcomes)}")
    skipped = sorted(s for s, (_, skip) in history(records).items() if skip)
    nan_at = {f.step: f for f in planned if f.kind == "nan"}
    problems += [f"step {s} skipped without a NaN fault" for s in skipped if s not in nan_at]
    reference_plan = ",".join(str(nan_at[s]) for s in skipped if s in nan_at)
    ref = run_job(root / "reference", args, reference_plan, 120 + a.steps)
    if ref.returncode != 0:
        problems.append(f"the reference run failed (exit {ref.returncode})")
    bitwise = compare(job.out, ref.out)
    if not bitwise["equal"]:
        problems.append(f"not bitwise equal to the uninterrupted run: {bitwise}")
    problems += [f"{o.fault}: {p}" for o in outcomes for p in o.problems]
    return _result(a, plan, outcomes, job, ref, records, bitwise, problems)


def _run_problems(a: argparse.Namespace, job: Job, records: list[dict[str, Any]],
                  restarting: int) -> list[str]:
    problems = []
    if job.returncode != 0:
        tail = "\n".join(s for _, s in job.lines[-15:])
        problems.append(f"the faulty run failed (exit {job.returncode}):\n{tail}")
    done = history(records)
    if sorted(done) != list(range(a.steps)):
        problems.append(f"steps done {len(done)} of {a.steps}")
    restarts = sum(r["kind"] == "start" for r in records) - 1
    if restarts != restarting:
        problems.append(f"{restarts} restarts for {restarting} restarting faults")
    return problems


def _result(a: argparse.Namespace, plan: str, outcomes: list[Outcome], job: Job, ref: Job,
            records: list[dict[str, Any]], bitwise: dict[str, Any],
            problems: list[str]) -> dict[str, Any]:
    by_kind = {k: {"injected": sum(o.fired is not None for o in outcomes if o.fault.kind == k),
                   "planned": sum(o.fault.kind == k for o in outcomes),
                   "survived": sum(o.survived for o in outcomes if o.fault.kind == k)}
               for k in faults.KINDS}
    recovery = [o.recovery_s for o in outcomes if o.recovery_s is not None]
    step_records = sum(r["kind"] == "step" for r in records)
    return {
        "config": {"seed": a.seed, "steps": a.steps, "faults": a.faults, "nproc": a.nproc,
                   "dp": a.dp,
                   "schedule": a.schedule, "checkpoint_every": a.checkpoint_every,
                   "timeout": a.timeout, "seq_len": a.seq_len, "kinds": a.kinds},
        "plan": plan, "by_kind": by_kind,
        "injected": sum(o.fired is not None for o in outcomes),
        "survived": sum(o.survived for o in outcomes),
        "restarts": sum(r["kind"] == "start" for r in records) - 1,
        "steps_lost": step_records - len(history(records)),
        "wall_s": job.seconds, "reference_wall_s": ref.seconds,
        "recovery_s": sum(recovery), "recovery_max_s": max(recovery, default=0.0),
        "bitwise": bitwise, "faults_detail": [o.row() for o in outcomes],
        "problems": problems, "ok": not problems,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform()},
    }


def print_report(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"\nsoak: seed {c['seed']}, {c['faults']} faults over {c['steps']} steps, "
          f"{c['nproc']} ranks (dp {c.get('dp', 1)}, {c['schedule']}), checkpoint every "
          f"{c['checkpoint_every']} steps, timeout {c['timeout']} s")
    print(f"{'fault':<22}{'fired':>6}{'survived':>9}{'1st failure s':>14}{'recovery s':>11}"
          f"{'resumed at':>11}{'steps lost':>11}")
    for f in r["faults_detail"]:
        print(f"{f['fault']:<22}{_yes(f['fired']):>6}{_yes(f['survived']):>9}"
              f"{_num(f['first_failure_s']):>14}{_num(f['recovery_s']):>11}"
              f"{_num(f['resumed_at']):>11}{f['steps_lost']:>11}")
    print(f"\n{'kind':<8}{'planned':>8}{'injected':>9}{'survived':>9}")
    for kind, n in r["by_kind"].items():
        print(f"{kind:<8}{n['planned']:>8}{n['injected']:>9}{n['survived']:>9}")
    b = r["bitwise"]
    print(f"\ninjected {r['injected']}, survived {r['survived']}, restarts {r['restarts']}, "
          f"steps lost {r['steps_lost']}\nwall {r['wall_s']:.1f} s (uninterrupted "
          f"{r['reference_wall_s']:.1f} s); fault to restarted attempt {r['recovery_s']:.1f} s "
          f"in all, at most {r['recovery_max_s']:.1f} s\nbitwise equal to the uninterrupted "
          f"run: {_yes(b['equal'])} ({b['steps']} steps, {b['tensors']} tensors)")
    for p in r["problems"]:
        print(f"PROBLEM: {p}", file=sys.stderr)
    print("soak: OK" if r["ok"] else f"soak: FAILED ({len(r['problems'])} problems)")


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _num(x: float | None) -> str:
    return "-" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--kinds", default=",".join(faults.KINDS))
    p.add_argument("--nproc", type=int, default=2, help="ranks in all (dp x pp)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--schedule", default="zbv")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--tiny", action="store_true",
                   help="12 steps, 3 faults (kill, shape, nan): the test's run")
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--keep", type=Path, help="run under this directory and keep it")
    a = p.parse_args(argv)
    if a.tiny:
        a.steps, a.faults, a.kinds, a.checkpoint_every = 12, 3, "kill,shape,nan", 3
    if a.keep and a.keep.exists() and any(a.keep.iterdir()):
        p.error(f"--keep {a.keep} is not empty (a run there would resume, not start afresh)")
    with tempfile.TemporaryDirectory(prefix="pipetrain-soak-") as tmp:
        root = a.keep or Path(tmp)
        result = soak(a, root)
    print_report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
