"""Peers: pipetrain next to DeepSpeed's pipeline engine and torchgpipe on calibrated stages.

The layers are ``calibrated.py``'s: each sleeps F, I and W (10 ms each by default) in its
forward, input-gradient and weight-gradient backward, so only bubbles and each library's own
overhead show. Each peer runs the schedule it shares with pipetrain, on the same layers, in
the same launch, alternating step by step (a drift of the machine hits both):

    DeepSpeed   PipelineModule + engine.train_batch (its 1F1B TrainSchedule), p processes
                (gloo, DS_ACCELERATOR=cpu), against pipetrain's 1f1b on the same p processes
    torchgpipe  GPipe in one process (its partitions on "cpu" devices, checkpoint "never" and
                its default "except_last"), against pipetrain's gpipe in one process
                (local_ranks) and on p processes

Every step is timed between two barriers (the slowest rank's step); each row is the median
of ``--steps`` steps after ``--warmup``. ``bound`` is the schedule's simulated makespan on
these costs (the first stage has no input gradient to compute, as in both libraries).

    python benchmarks/peers.py                 # p = 2, 4; m = 8, 16: about 3 min
    python benchmarks/peers.py --tiny          # p = 2, m = 8, 5 ms layers: about 20 s
    python benchmarks/peers.py --gpt           # real compute, GPT small (peers_gpt.py)

The peers come with the ``bench`` extra (``pip install torch==2.13.0 -e ".[bench]"``); a
peer that is not installed is skipped, and the table says so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from calibrated import Case, _loss, stage_costs
from peer_steps import ROWS, WIDTH, deepspeed_step, installed, missing, timed, trained

import pipetrain as pt
import pipetrain.schedules as ps


def _case(p: int, m: int, cost: float, steps: int, warmup: int) -> Case:
    return Case(f"p{p} m{m}", p, m, cost, cost, cost, 2 * p, ("1f1b",), warmup, steps)


def _data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS * m, WIDTH, generator=g), torch.randn(ROWS * m, WIDTH, generator=g)


def bound(case: Case, schedule: str) -> float:
    return ps.simulate(ps.make_schedule(schedule, case.ranks, case.microbatches),
                       stage_costs(case, case.ranks)).makespan


# -- DeepSpeed, p processes ------------------------------------------------------------------


def _deepspeed_engine(case: Case) -> Callable[[], None]:
    return deepspeed_step(case.make_layers(), case.ranks, _loss, *_data(case.microbatches),
                          case.microbatches)


def _pipetrain_step(case: Case, schedule: str, **where: Any) -> Callable[[], None]:
    pipe = pt.Pipeline(case.make_layers(), schedule, case.microbatches, _loss, **where)
    x, y = _data(case.microbatches)
    return trained(pipe, lambda: pipe.step(x, y))


def _ranks_body(ctx: pt.RankContext, cases: list[Case]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    out = []
    for case in cases:
        steps = {"pipetrain 1f1b": _pipetrain_step(case, "1f1b")}
        if installed("deepspeed"):
            steps["DeepSpeed 1F1B"] = _deepspeed_engine(case)
        steps["pipetrain gpipe"] = _pipetrain_step(case, "gpipe")  # torchgpipe's schedule
        out.append({name: statistics.median(t) for name, t in timed(steps, case).items()})
    return out


# -- torchgpipe, one process -------------------------------------------------------------


def _one_process(case: Case) -> dict[str, float]:
    from torch import nn

    x, y = _data(case.microbatches)
    steps: dict[str, Callable[[], None]] = {
        "pipetrain gpipe local": _pipetrain_step(case, "gpipe", local_ranks=case.ranks)}
    if installed("torchgpipe"):
        from torchgpipe import GPipe

        for mode in ("never", "except_last"):
            model = GPipe(nn.Sequential(*case.make_layers()), chunks=case.microbatches,
                          balance=[case.layers // case.ranks] * case.ranks,
                          devices=["cpu"] * case.ranks, checkpoint=mode)

            def step(model: Any = model) -> None:
                _loss(model(x), y).backward()
            steps[f"torchgpipe ({mode})"] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    for k in range(case.warmup + case.steps):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            if k >= case.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# -- report ----------------------------------------------------------------------------------


def run(ps: Sequence[int], ms: Sequence[int], cost: float, steps: int, warmup: int
        ) -> list[str]:
    lines = [f"{'case':9s} {'library':26s} {'step s':>8s} {'bound s':>8s} {'vs pipetrain':>13s}"]
    for p in ps:
        cases = [_case(p, m, cost, steps, warmup) for m in ms]
        rows = pt.launch(_ranks_body, p, cases, timeout=600)[0]
        for case, measured in zip(cases, rows, strict=True):
            measured.update(_one_process(case))
            lines += _rows(case, measured)
    return lines + missing("deepspeed", "torchgpipe")


def _rows(case: Case, measured: dict[str, float]) -> list[str]:
    out = []
    for name, seconds in measured.items():
        schedule = "1f1b" if "1F1B" in name or "1f1b" in name else "gpipe"
        ours = measured["pipetrain 1f1b" if schedule == "1f1b" else (
            "pipetrain gpipe local" if "local" in name or "torchgpipe" in name
            else "pipetrain gpipe")]
        out.append(f"{case.label:9s} {name:26s} {seconds:8.3f} {bound(case, schedule):8.3f} "
                   f"{seconds / ours:12.2f}x")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="p = 2, m = 8, 5 ms layers")
    parser.add_argument("--steps", type=int, default=5, metavar="N")
    parser.add_argument("--gpt", action="store_true",
                        help="real compute: GPT small (tiny with --tiny), p = 2, 4, m = 8, 16")
    args = parser.parse_args(argv)
    if args.gpt:
        import peers_gpt  # real compute: its own module

        print("\n".join(peers_gpt.run(args.tiny, args.steps)))
        return 0
    print(f"# torch {torch.__version__}; layers sleep F = I = W; 2 layers per pipeline rank; "
          f"{args.steps} steps after 1 (medians)")
    ps, ms, cost = ((2,), (8,), 0.005) if args.tiny else ((2, 4), (8, 16), 0.010)
    print("\n".join(run(ps, ms, cost, args.steps, 1)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
