"""Pipelines one after another in one process: each schedule's efficiency there, and alone.

A user's sweep, notebook or evaluation builds pipeline after pipeline in one process, each
dropped when the next is bound to the same name. Whatever one leaves running (a thread, a
connection, a cycle that a garbage collection frees in the middle of the next one's step)
slows the next. This builds seven schedules in turn in one launch (``together``) and each
schedule in a launch of its own (``alone``), on ``calibrated.py``'s sleep layers, and prints
each schedule's efficiency (the simulator's makespan over the median measured step) both
ways; rounds alternate the two, so both see the same machine::

    python benchmarks/lifetimes.py                  # p = 4, m = 8, 10 ms per F, I and W
    python benchmarks/lifetimes.py --rounds 3 --json out.json
    python benchmarks/lifetimes.py --tiny           # p = 2, m = 4, 1 ms: a quick check

pipetrain only (``calibrated.py`` puts torch.distributed.pipelining beside it, also with every
schedule built in one launch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import calibrated as cal
import gptbench as gb

import pipetrain as pt

SEVEN = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "zb-h1", "dualpipev")


def rank_body(ctx: pt.RankContext, case: cal.Case) -> list[dict[str, Any]]:
    """Each schedule of ``case`` in turn, built, measured and dropped (rebinding one name)."""
    out = []
    runner = None
    for name in case.schedules:
        runner = cal._Runner("pipetrain", name, case, ctx.rank)
        raw = cal._measure({"pipetrain": runner}, case)["pipetrain"]
        out.append({"schedule": name, "step": raw["step"]})
    del runner
    return out


def efficiencies(case: cal.Case) -> dict[str, float]:
    """Per schedule of ``case``, the simulator's makespan over the median measured step."""
    per_rank = pt.launch(rank_body, case.ranks, case, timeout=3600)
    effs = {}
    for j, name in enumerate(case.schedules):
        measured = cal._median_step([rank[j]["step"] for rank in per_rank])
        predicted, _ = cal._predict(case, name, None)
        effs[name] = predicted / measured
    return effs


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4, help="ranks (processes)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches")
    parser.add_argument("--ms", type=float, default=10.0, help="F = I = W per layer, ms")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per schedule")
    parser.add_argument("--rounds", type=int, default=2, help="together, then alone, N times")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--tiny", action="store_true", help="p=2, m=4, 1 ms, 2 steps, 1 round")
    args = parser.parse_args(argv)
    if args.tiny:
        args.p, args.m, args.ms, args.steps, args.rounds = 2, 4, 1.0, 2, 1
    s = args.ms / 1e3

    def case(schedules: tuple[str, ...]) -> cal.Case:
        return cal.Case("F=I=W", args.p, args.m, s, s, s, 2 * args.p, schedules, 1, args.steps)

    started = time.time()
    together: dict[str, list[float]] = {name: [] for name in SEVEN}
    alone: dict[str, list[float]] = {name: [] for name in SEVEN}
    for _ in range(args.rounds):
        for name, eff in efficiencies(case(SEVEN)).items():
            together[name].append(eff)
        for name in SEVEN:
            alone[name].append(efficiencies(case((name,)))[name])
    print(f"p = {args.p}, m = {args.m}, F = I = W = {args.ms:g} ms per layer, "
          f"{2 * args.p} layers; efficiency = simulated makespan / median step, per round")
    print(f"{'schedule':<18}{'together (in turn)':>26}{'alone':>22}{'ratio':>8}")
    rows = []
    for name in SEVEN:
        ratio = statistics.median(together[name]) / statistics.median(alone[name])
        print(f"{name:<18}{' '.join(f'{e:.3f}' for e in together[name]):>26}"
              f"{' '.join(f'{e:.3f}' for e in alone[name]):>22}{ratio:>8.3f}")
        rows.append({"schedule": name, "together": together[name], "alone": alone[name],
                     "ratio": ratio})
    print("together: the seven built, stepped and dropped in turn in one launch, in the order "
          "listed; alone: each in a launch of its own; ratio: median together / median alone")
    if args.json:
        gb.save_json(args.json, {"rows": rows}, wall_s=time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
