"""What one killed rank costs with ``--ft`` (torchft replicas) and with a restart from a checkpoint.

Runs ``pipetrain train`` at dp 2 x pp 2 (4 local processes) four ways per round, alternating:

- ``ft``: ``--ft``, no fault; ``ft+kill``: ``--ft --max-restarts 1`` with replica 1's second
  rank killed at ``--kill-step`` (its agent restarts it; it loads replica 0's state);
- ``restart``: today's path, ``--checkpoint-every 10 --max-restarts 1``, no fault;
  ``restart+kill``: the same rank killed at the same step (every rank restarts and resumes from
  the newest checkpoint).

Prints the wall time of each (median over rounds), the time lost to the fault (the faulty
run's wall time less the same mode's without a fault), the survivor's step time before, at and
after the failure under ``--ft`` (from replica 0's ``log.jsonl``), and the steady-state cost of
``--ft`` (median step time with and without)::

    python benchmarks/ft.py                    # tiny preset, 60 steps, kill at step 25
    python benchmarks/ft.py --rounds 3 --json ft.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = {"ft": ["--ft"], "ft+kill": ["--ft", "--max-restarts", "1"],
         "restart": ["--checkpoint-every", "10", "--max-restarts", "1"],
         "restart+kill": ["--checkpoint-every", "10", "--max-restarts", "1"]}


def run(mode: str, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    if mode.endswith("+kill"):
        env["PIPETRAIN_FAULTS"] = f"kill@rank3:step{args.kill_step}"
    argv = [sys.executable, "-m", "pipetrain", "train", "--nproc", "4", "--dp", "2", "--pp",
            "2", "--preset", args.preset, "--steps", str(args.steps), "--seq-len",
            str(args.seq_len), "--batch-size", "16", "--microbatches", "4", "--eval-every", "0",
            "--sample-tokens", "0", "--no-progress", "--out", str(out), *MODES[mode]]
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    log = out / ("replica-0" if mode.startswith("ft") else "") / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    summary = json.loads((log.parent / "summary.json").read_text())
    return {"wall_s": wall, "step_s": summary["step_s"], "steps": _step_times(records)}


def _step_times(records: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's seconds from the record before it (the last run's records for a step)."""
    out: dict[int, float] = {}
    last = None
    for r in records:
        if r["kind"] == "step" and last is not None:
            out[r["step"]] = r["time"] - last
        if r["kind"] in ("step", "start"):
            last = r["time"]
    return out


def phases(steps: dict[int, float], kill: int) -> dict[str, float]:
    """The survivor's step time before the failure (median), at the failed step (the step in
    flight, run again), and after it (median of the steps after)."""
    before = [t for s, t in steps.items() if 2 <= s < kill]
    after = [t for s, t in steps.items() if s > kill + 1]
    return {"before_s": statistics.median(before), "at_failure_s": steps[kill],
            "next_s": steps.get(kill + 1, float("nan")), "after_s": statistics.median(after)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kill-step", type=int, default=25)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for mode in MODES:  # alternating, each mode once a round
                results[mode].append(run(mode, Path(tmp) / f"{mode}-{i}", args))
    wall = {m: statistics.median(r["wall_s"] for r in rs) for m, rs in results.items()}
    step = {m: statistics.median(r["step_s"] for r in rs) for m, rs in results.items()}
    print(f"dp 2 x pp 2, preset {args.preset}, {args.steps} steps, rank 3 killed at step "
          f"{args.kill_step}; median of {args.rounds} rounds, alternating")
    print(f"{'mode':<14}{'wall s':>9}{'step s':>9}")
    for m in MODES:
        print(f"{m:<14}{wall[m]:>9.2f}{step[m]:>9.4f}")
    lost = {"ft": wall["ft+kill"] - wall["ft"], "restart": wall["restart+kill"] - wall["restart"]}
    print(f"time lost to the fault: --ft {lost['ft']:.2f} s, restart from checkpoint "
          f"{lost['restart']:.2f} s")
    survivor = [phases(r["steps"], args.kill_step) for r in results["ft+kill"]]
    seen = {k: statistics.median(p[k] for p in survivor) for k in survivor[0]}
    print("--ft survivor's step time: before {before_s:.3f} s, the failed step "
          "{at_failure_s:.3f} s, the next {next_s:.3f} s, after {after_s:.3f} s".format(**seen))
    print(f"steady-state cost of --ft: step {step['ft']:.4f} s against {step['restart']:.4f} s "
          f"({step['ft'] / step['restart'] - 1:+.1%})")
    if args.json:
        args.json.write_text(json.dumps({"wall_s": wall, "step_s": step, "lost_s": lost,
                                         "survivor": seen, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
