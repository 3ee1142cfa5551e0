"""Plan accuracy: does `pipetrain plan` choose a layout that fits, runs as predicted, and wins?

For each preset and memory limit: run `pipetrain plan`, then train its three best predicted
candidates for a few steps each with `pipetrain train` on the same ranks, and print, per
candidate, the predicted and measured step time and peak bytes per rank. The checks of the
planner: the chosen layout's measured peak stays at or under the limit on every rank, its step
runs within 15 % of the prediction, and it is the fastest measured of the three ("within the
noise" when another measured faster by less than the larger half-range of the two's rounds).

A shared machine's speed drifts from one launch to the next (on this 2-core VM the same run
measures up to 15 % apart), so the three candidates are trained in turn, ``--rounds`` times,
and each one's step time is the median of its rounds; the spread of the rounds is printed.

    python benchmarks/plan_accuracy.py                 # small and medium at 4 processes
    python benchmarks/plan_accuracy.py --tiny          # seconds: the tiny preset, 2 processes
    python benchmarks/plan_accuracy.py --json out.json
    python benchmarks/plan_accuracy.py --layouts       # per pp x dp x fsdp x tp layout

``--layouts`` checks the planner's model of sharding instead: one plan of small at 4
processes under a loose limit, and for each layout it searched (pp4; pp2 with dp2, fsdp2 under
each reshard, tp2) its best candidate trained, predicted and measured step time and peak bytes
side by side per pipeline rank (a pipeline rank's measured peak: the most of its processes).

Medium runs at a shorter sequence and batch than its preset's (a CPU runs its full size at
minutes per step); the layer shapes are the preset's. Limits are set from the model: the
replicated parameter state per rank plus a low, middle and high share of what 1F1B's
activations need, so each limit excludes different layouts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pipetrain.cli import main as pipetrain_main

MIB = 2**20
SETUPS = {  # preset: (seq_len, batch_size, nproc, steps)
    "small": (128, 16, 4, 8),
    "medium": (64, 8, 4, 5),
}
TINY = {"tiny": (64, 16, 2, 6)}
TOLERANCE = 0.15


@dataclasses.dataclass
class Row:
    preset: str
    limit: int
    rank: int
    candidate: dict[str, Any]
    step_s: float = float("nan")
    peaks: list[int] = dataclasses.field(default_factory=list)
    rounds: list[float] = dataclasses.field(default_factory=list)


def _cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pipetrain_main(argv)
    return code, out.getvalue()


def plan(preset: str, seq: int, batch: int, nproc: int, limit: int, out: Path) -> dict[str, Any]:
    code, text = _cli(["plan", "--preset", preset, "--seq-len", str(seq), "--batch-size",
                       str(batch), "--nproc", str(nproc), "--memory-limit", str(limit),
                       "--out", str(out), "--json"])
    report: dict[str, Any] = json.loads(text)
    report["exit"] = code
    return report


def measure(preset: str, seq: int, batch: int, nproc: int, steps: int, cand: dict[str, Any],
            out: Path) -> tuple[float, list[int]]:
    schedule = cand["schedule"]
    if "schedule_text" in cand:  # a searched schedule (zb-auto): run the very one planned
        out.mkdir(parents=True, exist_ok=True)
        schedule = str(out / "plan.schedule.csv")
        Path(schedule).write_text(cand["schedule_text"])
    argv = ["train", "--preset", preset, "--seq-len", str(seq), "--batch-size", str(batch),
            "--nproc", str(nproc), "--schedule", schedule, "--stages-per-rank",
            str(cand["stages_per_rank"]), "--microbatches", str(cand["microbatches"]),
            "--balance", ",".join(map(str, cand["balance"])), "--recompute", cand["recompute"],
            "--pp", str(cand["pp"]), "--dp", str(cand["dp"]), "--fsdp", str(cand["fsdp"]),
            "--tp", str(cand["tp"]), "--fsdp-reshard", cand["fsdp_reshard"],
            "--steps", str(steps), "--out", str(out), "--no-resume", "--no-progress",
            "--sample-tokens", "0", "--eval-batches", "1"]
    code, _ = _cli(argv)
    if code != 0:
        raise RuntimeError(f"pipetrain {' '.join(argv)} exited {code}")
    summary = json.loads((out / "summary.json").read_text())
    return float(summary["step_s"]), [int(x) for x in summary["peak_memory_bytes"]]


def limits(preset: str, seq: int, batch: int, nproc: int, out: Path) -> list[int]:
    """Three limits: the loosest plan's smallest and largest predicted peaks, and between."""
    report = plan(preset, seq, batch, nproc, 1 << 40, out)
    peaks = sorted(max(c["predicted_peak_bytes"]) for c in report["candidates"])
    low, high = peaks[0], peaks[-1]
    return [int(low + (high - low) * share) for share in (0.1, 0.4, 0.9)]


def run(setups: dict[str, tuple[int, int, int, int]], work: Path, rounds: int) -> list[Row]:
    rows = []
    for preset, (seq, batch, nproc, steps) in setups.items():
        for limit in limits(preset, seq, batch, nproc, work / preset / "probe"):
            report = plan(preset, seq, batch, nproc, limit, work / preset / str(limit))
            group = [Row(preset, limit, k, c) for k, c in enumerate(report["candidates"][:3])]
            for turn in range(rounds):  # in turn, so that a drift of the machine hits all three
                for row in group:
                    step_s, peaks = measure(preset, seq, batch, nproc, steps, row.candidate,
                                            work / preset / f"{limit}-{row.rank}-{turn}")
                    row.rounds.append(step_s)
                    row.peaks = [max(a, b) for a, b in zip(peaks, row.peaks or peaks)]
            for row in group:
                row.step_s = statistics.median(row.rounds)
                print(_line(row), flush=True)
            rows += group
    return rows


def _line(r: Row) -> str:
    c = r.candidate
    err = r.step_s / c["predicted_step_s"] - 1
    layout = (f"{c['schedule']} v{c['stages_per_rank']} m{c['microbatches']} "
              f"{','.join(map(str, c['balance']))} {c['recompute']}")
    return (f"{r.preset:7s} {r.limit / MIB:8.1f} {r.rank + 1:4d}  {layout:36s} "
            f"{c['predicted_step_s']:8.3f} {r.step_s:8.3f} {_spread(r.rounds):>6s} {err:+7.1%}  "
            f"{max(c['predicted_peak_bytes']) / MIB:8.1f} {max(r.peaks) / MIB:8.1f}  "
            f"{'yes' if max(r.peaks) <= r.limit else 'NO':>4s}")


def _half_range(rounds: list[float]) -> float:
    """Half the rounds' range, over their median."""
    return (max(rounds) - min(rounds)) / 2 / statistics.median(rounds)


def _spread(rounds: list[float]) -> str:
    return f"±{_half_range(rounds):.0%}"


def verdicts(rows: list[Row]) -> list[str]:
    """Per (preset, limit): the planner's three checks on its chosen layout."""
    out = []
    for key in sorted({(r.preset, r.limit) for r in rows}):
        group = [r for r in rows if (r.preset, r.limit) == key]
        best = group[0]
        err = best.step_s / best.candidate["predicted_step_s"] - 1
        fastest = min(group, key=lambda r: r.step_s)
        behind = best.step_s / fastest.step_s - 1
        noise = max(_half_range(best.rounds), _half_range(fastest.rounds))
        verdict = ("yes" if fastest is best else
                   f"{'within the noise' if behind <= noise else 'NO'} (candidate "
                   f"{fastest.rank + 1} measured {fastest.step_s:.3f} s, the chosen one "
                   f"{behind:.1%} slower; their rounds spread {_spread(best.rounds)} and "
                   f"{_spread(fastest.rounds)})")
        out.append(f"{key[0]} {key[1] / MIB:.1f} MiB: fits measured "
                   f"{'yes' if max(best.peaks) <= key[1] else 'NO'}; step within 15 %: "
                   f"{'yes' if abs(err) <= TOLERANCE else 'NO'} ({err:+.1%}); fastest of the "
                   f"top 3 measured: {verdict}")
    return out


def by_layout(preset: str, seq: int, batch: int, nproc: int, steps: int, work: Path,
              rounds: int) -> list[str]:
    """Per layout of one loose plan, its best candidate's predicted and measured figures."""
    report = plan(preset, seq, batch, nproc, 1 << 40, work / "plan")
    best: dict[str, dict[str, Any]] = {}
    for c in report["candidates"]:
        best.setdefault(_layout_name(c), c)
    lines = []
    for name, c in best.items():
        runs = [measure(preset, seq, batch, nproc, steps, c, work / f"{name}-{k}".replace(" ", "_"))
                for k in range(rounds)]
        step_s = statistics.median(r[0] for r in runs)
        pred = c["predicted_peak_bytes"]
        peaks = [max(r[1][g] for r in runs for g in range(nproc)
                     if g // c["tp"] % c["pp"] == k) for k in range(c["pp"])]
        errs = " ".join(f"{m / p - 1:+.0%}" for p, m in zip(pred, peaks))
        lines.append(f"{name:18s} {c['schedule']:>16s} m{c['microbatches']:<3d} "
                     f"{c['predicted_step_s']:7.3f} {step_s:7.3f} "
                     f"{step_s / c['predicted_step_s'] - 1:+7.1%}  "
                     f"{' '.join(f'{b / MIB:.1f}' for b in pred):>18s} "
                     f"{' '.join(f'{b / MIB:.1f}' for b in peaks):>18s}  {errs}")
        print(lines[-1], flush=True)
    return lines


def _layout_name(c: dict[str, Any]) -> str:
    words = [f"pp{c['pp']}"] + [f"{k}{c[k]}" for k in ("dp", "fsdp", "tp") if c[k] > 1]
    return " ".join(words + ([c["fsdp_reshard"]] if c["fsdp"] > 1 else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny preset only (seconds)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the rows")
    parser.add_argument("--presets", default=None, metavar="NAMES",
                        help="comma-separated presets among small, medium (default: both)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N",
                        help="times each candidate is trained, in turn (default: %(default)s)")
    parser.add_argument("--layouts", action="store_true",
                        help="per sharding layout: predicted and measured peaks (small, 4 ranks)")
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {platform.platform()}, {torch.get_num_threads()} threads")
    if args.layouts:
        seq, batch, nproc, steps = SETUPS["small"]
        print(f"small, seq {seq}, batch {batch}, {nproc} processes, {steps} steps, "
              f"{args.rounds} rounds (medians; peaks: the most of the rounds)")
        print(f"{'layout':18s} {'schedule':>16s} {'m':4s} {'pred s':>7s} {'meas s':>7s} "
              f"{'error':>7s}  {'pred MiB per rank':>18s} {'meas MiB per rank':>18s}  error")
        with tempfile.TemporaryDirectory(prefix="plan-layouts-") as tmp:
            by_layout("small", seq, batch, nproc, steps, Path(tmp), args.rounds)
        return 0
    header = (f"{'preset':7s} {'limit':>8s} {'rank':>4s}  {'layout':36s} {'pred s':>8s} "
              f"{'meas s':>8s} {'spread':>6s} {'error':>7s}  {'pred MiB':>8s} {'meas MiB':>8s}  "
              f"{'fits':>4s}")
    print(header)
    with tempfile.TemporaryDirectory(prefix="plan-accuracy-") as tmp:
        setups = TINY if args.tiny else {
            name: SETUPS[name] for name in (args.presets or ",".join(SETUPS)).split(",")}
        rows = run(setups, Path(tmp), args.rounds)
    print()
    print("\n".join(verdicts(rows)))
    if args.json:
        args.json.write_text(json.dumps([{**dataclasses.asdict(r)} for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
