"""Parallel memory: the peak bytes per rank and the step time of each way to split the state.

``pipetrain train --pp 2`` on the small preset with each layout: plain data parallelism
(``--dp 2``), FSDP2 (``--fsdp 2`` in each ``--fsdp-reshard`` mode), tensor parallelism
(``--tp 2``, with and without sequence parallelism) and both (``--fsdp 2 --tp 2``, 8 ranks).
Each run's ``summary.json`` gives ``peak_memory_bytes`` (one figure per rank, see
:mod:`pipetrain.train.memory` for how it is measured on CPU) and ``step_s``; the table shows,
per pipeline rank, the largest peak of the ranks holding it and its ratio to ``--dp 2``'s.

    python benchmarks/parallel_memory.py                 # README figures (about 5 minutes)
    python benchmarks/parallel_memory.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20
LAYOUTS: dict[str, list[str]] = {
    "dp2": ["--dp", "2"],
    "fsdp2 step": ["--fsdp", "2", "--fsdp-reshard", "step"],
    "fsdp2 layer": ["--fsdp", "2", "--fsdp-reshard", "layer"],
    "fsdp2 part": ["--fsdp", "2", "--fsdp-reshard", "part"],
    "tp2 sp": ["--tp", "2"],
    "tp2": ["--tp", "2", "--no-sequence-parallel"],
    "fsdp2 x tp2": ["--fsdp", "2", "--tp", "2", "--nproc", "8"],
}
TINY = ("dp2", "tp2 sp")


IN_PROCESS = False
"""Run ``pipetrain train`` in this process (the test's: its launches reuse the session's
workers) rather than a process of its own per layout (quiet: its output kept back)."""


def run(layout: str, preset: str, steps: int, work: Path) -> dict[str, Any]:
    """One run of ``layout``; its per-pipeline-rank peaks (MiB: the largest of the ranks
    holding each, by the run's rank map) and seconds per step."""
    out = work / layout.replace(" ", "_")
    args = LAYOUTS[layout]
    nproc = [] if "--nproc" in args else ["--nproc", "4"]
    argv = ["train", "--pp", "2", *nproc, *args, "--preset", preset, "--steps", str(steps),
            "--sample-tokens", "0", "--eval-every", "0", "--no-progress", "--out", str(out)]
    _train(argv, layout)
    summary = json.loads((out / "summary.json").read_text())
    start = next(r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
                 if r["kind"] == "start")
    peaks: dict[int, float] = {}
    for place, peak in zip(start["ranks"], summary["peak_memory_bytes"], strict=True):
        peaks[place["pp"]] = max(peaks.get(place["pp"], 0.0), peak / MIB)
    return {"layout": layout, "args": args, "ranks": summary["layout"]["world"],
            "peak_mib": [peaks[r] for r in range(summary["layout"]["pp"])],
            "step_s": summary["step_s"]}


def _train(argv: list[str], layout: str) -> None:
    if IN_PROCESS:
        from pipetrain.cli import main as pipetrain_main

        code = pipetrain_main(argv)
        failure = ""
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
        done = subprocess.run([sys.executable, "-m", "pipetrain", *argv], env=env,
                              capture_output=True, text=True, timeout=1200)
        code, failure = done.returncode, done.stderr[-2000:]
    if code != 0:
        raise SystemExit(f"{layout}: pipetrain {' '.join(argv)} failed:\n{failure}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="two layouts on the tiny preset")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    names = TINY if args.tiny else tuple(LAYOUTS)
    preset = "tiny" if args.tiny else "small"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, preset, args.steps, Path(tmp)) for name in names]
    base = rows[0]["peak_mib"]
    print(f"pipetrain train --pp 2 --preset {preset} --steps {args.steps}: peak per rank "
          "(largest of each pipeline rank's holders)")
    print(f"{'layout':<14} {'ranks':>5}  {'pp rank 0':>10} {'pp rank 1':>10}  "
          f"{'vs dp2':>12}  {'s/step':>7}")
    for row in rows:
        ratio = " ".join(f"{p / b:.2f}" for p, b in zip(row["peak_mib"], base, strict=True))
        row["vs_dp2"] = [p / b for p, b in zip(row["peak_mib"], base, strict=True)]
        print(f"{row['layout']:<14} {row['ranks']:>5}  {row['peak_mib'][0]:>8.1f} M "
              f"{row['peak_mib'][1]:>8.1f} M  {ratio:>12}  {row['step_s']:>7.3f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
