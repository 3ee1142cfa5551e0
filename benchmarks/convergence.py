"""What PipeDream-2BW's delayed update costs in convergence: its loss curve beside 1F1B's.

Both runs are ``pipetrain train`` on the same data, seed and learning-rate schedule (GPT
``small`` by default, 2 processes). 1F1B applies each batch's gradient at once; PipeDream-2BW
applies it one step later, W(t+1) = W(t) - lr * grad f(W(t-1)). A 2BW step's record carries the
loss of the batch its update comes from (the previous one), so its curve is read one step back:
batch t's loss sits in record t + 1. The table gives each curve's mean over windows of batches
and the final held-out loss; ``--png`` draws both curves.

    python benchmarks/convergence.py                  # small, 300 steps, 2 processes
    python benchmarks/convergence.py --tiny           # tiny, 20 steps (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEDULES = ("1f1b", "pipedream-2bw")


def train(schedule: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Run ``pipetrain train``; the loss of every batch (in batch order) and the summary."""
    command = [sys.executable, "-m", "pipetrain", "train", "--nproc", str(args.nproc),
               "--preset", args.preset, "--schedule", schedule, "--steps", str(args.steps),
               "--eval-every", "0", "--sample-tokens", "0", "--checkpoint-every", "0",
               "--no-progress", "--out", str(out), *(["--lr", str(args.lr)] if args.lr else [])]
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in records if r["kind"] == "step"}
    shift = 1 if schedule == "pipedream-2bw" else 0  # record t + 1 holds batch t's loss
    losses = [steps[t + shift] for t in range(args.steps - shift)]
    summary = json.loads((out / "summary.json").read_text())
    return {"schedule": schedule, "losses": losses, "eval_loss": summary["eval_loss"],
            "step_s": summary["step_s"]}


def windows(losses: Sequence[float], size: int) -> list[float]:
    return [statistics.fmean(losses[i:i + size]) for i in range(0, len(losses), size)]


def format_table(runs: list[dict[str, Any]], size: int) -> str:
    means = {r["schedule"]: windows(r["losses"], size) for r in runs}
    n = max(len(v) for v in means.values())
    head = (f"{'batches':<12}" + "".join(f"{r['schedule']:>16}" for r in runs)
            + f"{'2bw - 1f1b':>12}")
    lines = [head, "-" * len(head)]
    for i in range(n):
        cells = [means[r["schedule"]][i] if i < len(means[r["schedule"]]) else float("nan")
                 for r in runs]
        lines.append(f"{f'{i * size}-{(i + 1) * size - 1}':<12}"
                     + "".join(f"{c:>16.4f}" for c in cells) + f"{cells[-1] - cells[0]:>12.4f}")
    lines.append(f"{'eval loss':<12}" + "".join(f"{r['eval_loss']:>16.4f}" for r in runs)
                 + f"{runs[-1]['eval_loss'] - runs[0]['eval_loss']:>12.4f}")
    lines.append(f"{'s per step':<12}" + "".join(f"{r['step_s']:>16.4f}" for r in runs))
    return "\n".join(lines)


def draw(runs: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(range(len(r["losses"])), r["losses"], label=r["schedule"], linewidth=0.8)
    ax.set_xlabel("batch")
    ax.set_ylabel("train loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--window", type=int, default=50, help="batches per table row")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: train's)")
    parser.add_argument("--png", help="draw both curves here")
    parser.add_argument("--json", help="write the curves here")
    parser.add_argument("--tiny", action="store_true", help="tiny preset, 20 steps (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.preset, args.steps, args.window = "tiny", 20, 5
    with tempfile.TemporaryDirectory() as tmp:
        runs = [train(s, args, Path(tmp) / s) for s in SCHEDULES]
    print(format_table(runs, args.window))
    if args.png:
        draw(runs, args.png)
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
