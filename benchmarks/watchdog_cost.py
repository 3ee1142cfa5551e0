"""Watchdog cost: step time with the watchdog and the job's news on, and with both off.

Every pipeline rank runs a daemon thread that checks the job's store twice a second for a probe
and for news (:mod:`pipetrain.runtime.failure.watchdog`,
:mod:`pipetrain.runtime.failure.job_failure`), records its
current action (two updates per action: a clock read and a few attribute writes each), and, under
data parallelism, waits for gradient all-reduces by polling so that news can interrupt them. This
script measures what that costs: the same job, alternating rounds with ``PIPETRAIN_WATCHDOG=0``
(off) and without (on), median step time per round, on a 4-rank pipeline (1F1B) and on dp 2 x
pp 2 (ZB-V, gradients averaged by ``GradReducer``).

    python benchmarks/watchdog_cost.py              # README figures (about 1 minute)
    python benchmarks/watchdog_cost.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pipetrain as pt
from pipetrain.runtime.failure.job_failure import OFF_ENV
from pipetrain.train.mesh import GradReducer, build_mesh


def _model(width: int, n_layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n_layers) for m in (nn.Linear(width, width),
                                                                   nn.Tanh())])


def _steps(ctx: pt.RankContext, layout: str, on: bool, width: int, steps: int) -> list[float]:
    """Per-step seconds of one round (after two warm-up steps), in a fresh pipeline."""
    os.environ[OFF_ENV] = "1" if on else "0"
    dp = 2 if layout == "dp2xpp2" else 1
    mesh = build_mesh(dp, None)
    schedule = "zbv" if dp == 2 else "1f1b"
    n_stages = mesh.pp * (2 if schedule == "zbv" else 1)
    pipe = pt.Pipeline(_model(width, 2 * n_stages), schedule, 8, nn.MSELoss(),
                       group=mesh.pp_group, balance=[4] * n_stages)
    reducer = GradReducer({s: list(st.parameters()) for s, st in pipe.stages.items()},
                          mesh.dp_group, mesh.dp)
    x, y = torch.randn(64, width), torch.randn(64, width)
    times = []
    for i in range(steps + 2):
        torch.distributed.barrier()
        start = time.perf_counter()
        pipe.step(x, y, on_grads_ready=reducer.hook)
        reducer.finish()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return times


def _job(ctx: pt.RankContext, layouts: list[str], rounds: int, width: int,
         steps: int) -> dict[str, dict[str, list[float]]]:
    out: dict[str, dict[str, list[float]]] = {}
    for layout in layouts:
        out[layout] = {"on": [], "off": []}
        for r in range(rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                step = statistics.median(_steps(ctx, layout, on, width, steps))
                out[layout]["on" if on else "off"].append(step)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="rounds per mode, alternating")
    p.add_argument("--steps", type=int, default=40, help="timed steps per round")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="1 round of 3 steps (the tests)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    rounds, steps = (1, 3) if a.tiny else (a.rounds, a.steps)
    layouts = ["pp4", "dp2xpp2"]
    per_rank = pt.launch(_job, 4, layouts, rounds, a.width, steps, timeout=1200)
    rows: dict[str, Any] = {}
    print(f"{'layout':<10}{'on ms':>9}{'off ms':>9}{'on/off':>8}   (median of {rounds} rounds "
          f"x {steps} steps; rank 0's step time)")
    for layout in layouts:
        on = statistics.median(per_rank[0][layout]["on"]) * 1e3
        off = statistics.median(per_rank[0][layout]["off"]) * 1e3
        spread = [v * 1e3 for v in per_rank[0][layout]["on"] + per_rank[0][layout]["off"]]
        rows[layout] = {"on_ms": on, "off_ms": off, "ratio": on / off,
                        "rounds_on_ms": [v * 1e3 for v in per_rank[0][layout]["on"]],
                        "rounds_off_ms": [v * 1e3 for v in per_rank[0][layout]["off"]]}
        print(f"{layout:<10}{on:>9.2f}{off:>9.2f}{on / off:>8.3f}   rounds "
              f"{min(spread):.2f}-{max(spread):.2f} ms")
    if a.json:
        a.json.write_text(json.dumps({"rounds": rounds, "steps": steps, "width": a.width,
                                      "layouts": rows, "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
