"""PipeDream-2BW and PipeDream against 1F1B and ZB-V on sleep-calibrated stages: time per step.

The layers are ``calibrated.py``'s (fixed sleeps for F, I and W, so only bubbles and runtime
overhead show). Every schedule runs ``--steps`` steps back to back after its warm-up, timed as
one block with a barrier only before and after it: a synchronous schedule's step ends with its
flush anyway, while PipeDream-2BW's ranks run on into the next step. Its drain runs after the
block, untimed (once per run). The bound is the simulator's: a synchronous schedule's makespan,
an asynchronous one's steady-state period (``pipetrain.schedules.steady_state``). PipeDream steps an
SGD optimizer after every backward, inside its step.

    python benchmarks/asynchronous.py                 # p = 4, m = 8, F = I = W = 10 ms
    python benchmarks/asynchronous.py --m 16 --json out.json
    python benchmarks/asynchronous.py --tiny
    python benchmarks/asynchronous.py --gpt small --p 2 --steps 4    # real compute
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import gptbench as gb
import torch
import torch.distributed as dist
from calibrated import Case, _loss, stage_costs

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.schedules.steady_state import steady_state

SCHEDULES = ("1f1b", "zbv", "pipedream-2bw", "pipedream")


def bound(case: Case, name: str) -> float:
    """The simulator's time per step: makespan, or the steady period of an asynchronous one."""
    schedule = ps.make_schedule(name, case.ranks, case.microbatches)
    costs = stage_costs(case, schedule.n_stages)
    if schedule.update is not None:
        return steady_state(schedule, costs).period
    return ps.simulate(schedule, costs).makespan


def rank_body(ctx: pt.RankContext, case: Case, gpt: str | None = None
              ) -> list[dict[str, Any]]:
    """Each schedule's measured seconds per step on this rank (the block's wall time / steps);
    ``gpt``: real compute, a GPT preset's layers on rows of random tokens (2 per
    micro-batch), instead of the sleep layers."""
    from pipetrain.models.gpt import PRESETS, gpt_layers, lm_loss

    n = case.microbatches * 2
    x, y = torch.randn(n, 8), torch.randn(n, 8)
    if gpt is not None:
        config = PRESETS[gpt]
        x = torch.randint(0, config.vocab_size, (n, config.seq_len + 1))
        x, y = x[:, :-1], x[:, 1:]
    rows = []
    for name in case.schedules:
        torch.manual_seed(0)
        layers = case.make_layers() if gpt is None else gpt_layers(PRESETS[gpt])
        stash = (lambda ps: torch.optim.SGD(ps, lr=1e-3)) if name == "pipedream" else None
        pipe = pt.Pipeline(layers, name, case.microbatches, _loss if gpt is None else lm_loss,
                           timeout=300.0, optimizer=stash,  # PipeDream steps after every B
                           balance="params" if gpt is not None else None)
        for _ in range(case.warmup):
            pipe.step(x, y)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(case.steps):
            pipe.step(x, y)
        dist.barrier()
        seconds = (time.perf_counter() - start) / case.steps
        if pipe.asynchronous:
            pipe.drain()
        rows.append({"schedule": name, "measured_s": seconds})
    return rows


def summarize(case: Case, per_rank: list[list[dict[str, Any]]], gpt: str | None = None
              ) -> list[dict[str, Any]]:
    rows = []
    first = {r["schedule"]: max(rank[j]["measured_s"] for rank in per_rank)
             for j, r in enumerate(per_rank[0])}
    for name, measured in first.items():
        predicted = bound(case, name) if not gpt else float("nan")
        rows.append({"schedule": name, "p": case.ranks, "m": case.microbatches,
                     "bound_s": predicted, "measured_s": measured,
                     "of_bound": predicted / measured,
                     "speed_vs_1f1b": first["1f1b"] / measured if "1f1b" in first else None})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<15}{'p':>3}{'m':>4}{'bound s':>10}{'measured s':>12}"
            f"{'of bound':>10}{'x 1f1b':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs = "-" if r["speed_vs_1f1b"] is None else f"{r['speed_vs_1f1b']:.3f}"
        bound, of = ((f"{r['bound_s']:.3f}", f"{r['of_bound']:.3f}")
                     if r["bound_s"] == r["bound_s"] else ("-", "-"))  # (GPT: no bound)
        lines.append(f"{r['schedule']:<15}{r['p']:>3}{r['m']:>4}{bound:>10}"
                     f"{r['measured_s']:>12.3f}{of:>10}{vs:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4, help="ranks (processes)")
    parser.add_argument("--m", type=int, nargs="+", default=[8], help="micro-batches")
    parser.add_argument("--f", type=float, default=10.0, help="F = I = W per layer, ms")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", help="write the rows and machine description here")
    parser.add_argument("--tiny", action="store_true", help="p = 2, m = 4, 1 ms, 3 steps (CI)")
    parser.add_argument("--gpt", metavar="PRESET", help="real compute: a GPT preset's layers "
                        "(small, ...), no bound")
    args = parser.parse_args(argv)
    if args.tiny:
        args.p, args.m, args.f, args.warmup, args.steps = 2, [4], 1.0, 1, 3
    rows: list[dict[str, Any]] = []
    for m in args.m:
        f = args.f / 1e3
        case = Case(f"F=I=W={args.f:g}", args.p, m, f, f, f, 2 * args.p,
                    tuple(args.schedules.split(",")), args.warmup, args.steps)
        rows += summarize(case, pt.launch(rank_body, args.p, case, args.gpt, timeout=1800),
                          args.gpt)
    print(format_table(rows))
    if args.json:
        gb.save_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
