"""Breakdown: where each rank's main thread spends a pipetrain step, piece by piece of the runtime.

The GPT workload of ``real_compute.py`` runs under pipetrain alone, with the runtime's pieces
wrapped in timers (wall clock and the main thread's own CPU time), per step and rank:

    Executor.run         every action of the step
    Stage.forward        F (its send included)          Stage.backward   B or I (send included)
    Stage.weight         W                              _Graph           I's walk of the graph
    P2P.send             one message: encode + post     encode           header, copy into a buffer
    post                 handing the buffer to gloo     P2P.recv         wait for and take one

A piece whose wall time is well above its CPU time waited (for a lock, or for a core); one
whose CPU time is large did the work itself. The wrappers cost a few microseconds per call.

    python benchmarks/breakdown.py                           # GPT "small", about 1 minute
    python benchmarks/breakdown.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import gptbench as gb
import torch

import pipetrain as pt
from pipetrain.runtime import backward, stage
from pipetrain.runtime import executor as runtime
from pipetrain.runtime.transport import comm, encoder

Record = dict[str, list[tuple[float, float]]]  # piece -> (wall s, cpu s) per call

PIECES: list[tuple[Any, str, str]] = [
    (runtime.Executor, "run", "Executor.run"),
    (stage.Stage, "forward", "Stage.forward"),
    (stage.Stage, "backward", "Stage.backward"),
    (stage.Stage, "weight", "Stage.weight"),
    (backward._Graph, "__init__", "_Graph"),
    (comm.P2P, "send", "P2P.send"),
    (encoder.Encoder, "__call__", "encode"),
    (comm.P2P, "recv", "P2P.recv"),
]


def _timed(fn: Callable[..., Any], label: str, rec: Record) -> Callable[..., Any]:
    def inner(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            rec[label].append((time.perf_counter() - wall, time.thread_time() - cpu))
    return inner


class _TimedFrames:
    """The frame group, with the posting of each send timed (``post``)."""

    def __init__(self, group: Any, rec: Record) -> None:
        self.group, self.rec = group, rec

    def send(self, *args: Any) -> Any:
        return _timed(self.group.send, "post", self.rec)(*args)

    def recv(self, *args: Any) -> Any:  # the posts of receives: not timed
        return self.group.recv(*args)


def body(ctx: pt.RankContext, work: gb.Workload, name: str, warmup: int,
         steps: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    rec: Record = defaultdict(list)
    for owner, attr, label in PIECES:
        setattr(owner, attr, _timed(getattr(owner, attr), label, rec))
    layers = work.layers()
    sched = work.schedule(name)
    runner = gb.PipetrainRunner(work, name, layers, gb.split(layers, sched))
    transport = runner.pipe.engine.transport
    if transport is not None:
        link = transport._link  # the groups each direction's messages are posted on
        transport._link = dataclasses.replace(link, up=_TimedFrames(link.up, rec),
                                              down=_TimedFrames(link.down, rec))
    x, y = work.data()
    for _ in range(warmup):
        runner.step(x, y)
    rec.clear()
    cpu = time.thread_time()
    for _ in range(steps):
        runner.step(x, y)
    main_cpu = (time.thread_time() - cpu) / steps
    return {"main_cpu_ms": main_cpu * 1e3,
            "pieces": {k: _summary(v, steps) for k, v in rec.items()}}


def _summary(calls: list[tuple[float, float]], steps: int) -> dict[str, float]:
    walls, cpus = [w * 1e3 for w, _ in calls], [c * 1e3 for _, c in calls]
    return {"calls_per_step": len(calls) / steps, "wall_ms_per_step": sum(walls) / steps,
            "cpu_ms_per_step": sum(cpus) / steps, "wall_ms_median": statistics.median(walls),
            "wall_ms_max": max(walls), "cpu_ms_median": statistics.median(cpus)}


def format_table(name: str, per_rank: Sequence[dict[str, Any]]) -> str:
    head = (f"{name:<8} {'piece':<15} {'calls':>5}  {'wall ms/step':>12} {'cpu ms/step':>11}"
            f"  {'median ms wall/cpu':>18}  {'max ms':>6}")
    lines = [head, "-" * len(head)]
    for rank, res in enumerate(per_rank):
        for _, _, label in PIECES[:6] + [(None, "", "post")] + PIECES[6:]:
            s = res["pieces"].get(label)
            if s is None:
                continue
            lines.append(f"rank {rank:<3} {label:<15} {s['calls_per_step']:5.0f}  "
                         f"{s['wall_ms_per_step']:12.1f} {s['cpu_ms_per_step']:11.1f}  "
                         f"{s['wall_ms_median']:8.3f}/{s['cpu_ms_median']:.3f}  "
                         f"{s['wall_ms_max']:6.2f}")
        lines.append(f"rank {rank:<3} {'main thread cpu':<15} {'':5}  {'':12} "
                     f"{res['main_cpu_ms']:11.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gb.workload_args(parser, warmup=1, steps=4, schedules_help="comma list")
    args = parser.parse_args(argv)
    gb.apply_tiny(args)
    work = gb.Workload(args.preset, args.batch, args.m)
    print(f"GPT {args.preset}, batch {args.batch}, m = {args.m}, p = {work.ranks} (1 thread "
          f"each); per step, mean of {args.steps} steps after {args.warmup} warm-up")
    out: dict[str, Any] = {}
    for name in args.schedules.split(","):
        out[name] = pt.launch(body, work.ranks, work, name, args.warmup, args.steps,
                              timeout=1800)
        print(format_table(name, out[name]))
    if args.json:
        gb.save_json(args.json, {"schedules": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
