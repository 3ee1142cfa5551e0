"""Overhead: the CPU time a pipeline library spends per action, outside the model's own work.

On a GPU a stage's compute can be shorter than a millisecond, and then what the runtime costs
per action (scheduling, message bookkeeping, autograd plumbing, its threads) decides the step.
Here each stage is one of ``calibrated.py``'s layers with zero sleeps: its F and backward
cost only the autograd calls every library makes alike. pipetrain, torch.distributed.pipelining
and DeepSpeed run 1F1B (the schedule all three have) on the same layers in one launch,
alternating step by step. Per rank and step:

    model    the same layer's forward and backward, m times, in a plain loop (no pipeline)
    cpu      the process's CPU time in the step (all its threads: receivers, gloo), minus model
    wall     the step's wall time between barriers, minus model

each divided by the rank's actions (2m: an F and a B per micro-batch), the median over steps,
the larger of the ranks. DeepSpeed's step includes its optimizer step (SGD, lr 0, one
parameter per layer).

    python benchmarks/overhead.py             # p = 2, 4; m = 16: about 1 min
    python benchmarks/overhead.py --tiny      # p = 2, m = 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from calibrated import Case, SleepLayer, _loss, _Runner
from peers import _deepspeed_engine, installed

import pipetrain as pt


def _model_seconds(case: Case) -> float:
    """One stage's layer, forward and backward, m times (no pipeline), CPU seconds."""
    layer = SleepLayer(0, 0.0, 0.0, 0.0)
    x, y = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    for _ in range(3):
        _loss(layer(x), y).backward()
    start = time.process_time()
    for _ in range(case.microbatches):
        _loss(layer(x), y).backward()
    return time.process_time() - start


def _body(ctx: pt.RankContext, cases: list[Case]) -> list[dict[str, tuple[float, float]]]:
    torch.set_num_threads(1)
    out = []
    for case in cases:
        steps: dict[str, Callable[[], Any]] = {
            lib: _Runner(lib, "1f1b", case, ctx.rank).step for lib in ("pipetrain", "torch")}
        if installed("deepspeed"):
            steps["DeepSpeed"] = _deepspeed_engine(case)
        model = _model_seconds(case)
        seen: dict[str, list[tuple[float, float]]] = {lib: [] for lib in steps}
        for k in range(case.warmup + case.steps):
            for lib, step in steps.items():
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                step()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                dist.barrier()
                if k >= case.warmup:
                    seen[lib].append((cpu - model, wall - model))
        actions = 2 * case.microbatches
        out.append({lib: (statistics.median(c for c, _ in v) / actions,
                          statistics.median(w for _, w in v) / actions)
                    for lib, v in seen.items()})
    return out


def run(ps: Sequence[int], m: int, steps: int) -> list[str]:
    lines = [f"{'p':>2s} {'m':>3s}  {'library':10s} {'cpu us/action':>14s} "
             f"{'wall us/action':>15s} {'cpu vs pipetrain':>17s}"]
    for p in ps:
        case = Case(f"p{p}", p, m, 0.0, 0.0, 0.0, p, ("1f1b",), 2, steps)
        per_rank = pt.launch(_body, p, [case], timeout=600)
        libs = per_rank[0][0]
        for lib in libs:
            cpu = max(r[0][lib][0] for r in per_rank)
            wall = max(r[0][lib][1] for r in per_rank)
            ours = max(r[0]["pipetrain"][0] for r in per_rank)
            lines.append(f"{p:2d} {m:3d}  {lib:10s} {cpu * 1e6:14.0f} {wall * 1e6:15.0f} "
                         f"{cpu / ours:16.2f}x")
    if not installed("deepspeed"):
        lines.append("DeepSpeed: not installed (pip install -e '.[bench]'), skipped")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="p = 2, m = 8, 3 steps")
    parser.add_argument("--steps", type=int, default=10, metavar="N")
    args = parser.parse_args(argv)
    print(f"# torch {torch.__version__}; 1F1B, one zero-cost layer per stage; medians over "
          f"steps, the larger rank")
    ps, m, steps = ((2,), 8, 3) if args.tiny else ((2, 4), 16, args.steps)
    print("\n".join(run(ps, m, steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
