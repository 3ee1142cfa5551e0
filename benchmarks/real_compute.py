"""Real compute: GPT training steps on CPU, pipetrain next to torch.distributed.pipelining.

For each schedule (default 1F1B and ZB-V) on p = 2 processes with one thread each, three runs
of identical work: the same model values, the same batch and micro-batches, the same loss.

    pipetrain    pt.Pipeline over the GPT layer list, split by parameter bytes
    torch        torch.distributed.pipelining's schedule over the very same stage modules
    one process  the whole model in one process (one thread), forward + backward of each
                 micro-batch in turn, gradients accumulating: the no-pipeline baseline

Time: the median over steps of first rank's start to last rank's end of one step (forward and
backward of the batch; no optimizer step); the two libraries' steps alternate, so both see the
same machine noise. The two libraries' losses and gradients on the same batch are compared.

Peak memory, per rank, measured in separate processes where only one library exists:

    live    the most bytes of live CPU tensors at once during a step, counted by torch's CPU
            allocator for the whole process (every thread): parameters, gradients (set to
            None before the step, as zero_grad does), activations, message buffers
    step+   how far ``live`` rises above its level when the step starts
    RSS     the process's peak resident set during an unprofiled step (all memory, coarse)

    python benchmarks/real_compute.py                      # GPT "small", a few minutes
    python benchmarks/real_compute.py --tiny --json out.json
    python benchmarks/real_compute.py --p 4 --m 16         # other pipeline shapes
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import gptbench as gb
import memprobe
import torch
import torch.distributed as dist

import pipetrain as pt

LIBS = ("pipetrain", "torch")
Batch = tuple[torch.Tensor, torch.Tensor]


def _build(lib: str, work: gb.Workload, name: str, rank: int) -> Any:
    layers = work.layers()
    balance = gb.split(layers, work.schedule(name))
    if lib == "pipetrain":
        return gb.PipetrainRunner(work, name, layers, balance)
    modules = gb.stage_modules(layers, work.schedule(name), balance, rank)
    return gb.TorchRunner(work, name, modules, layers, balance, rank)


# -- timing: both libraries in one process group --------------------------------------------


def _check(ours: gb.PipetrainRunner, theirs: gb.TorchRunner, x: torch.Tensor,
           y: torch.Tensor) -> dict[str, Any]:
    """One step of each on the same batch: their losses and largest gradient difference."""
    gb.clear_grads(ours.params)
    loss_pt = ours.step(x, y)
    grads = {n: p.grad.clone() for n, p in ours.pipe.named_parameters() if p.grad is not None}
    gb.clear_grads(ours.params)
    loss_th = theirs.step(x, y)
    diff = gb.grad_difference(grads, ours.pipe.named_parameters())
    return {"loss": {"pipetrain": loss_pt, "torch": loss_th}, "grad_diff": diff}


def time_body(ctx: pt.RankContext, work: gb.Workload, data: Batch, names: Sequence[str],
              warmup: int, steps: int) -> list[dict[str, Any]]:
    """Per schedule: the libraries' check and step spans on this rank."""
    x, y = data
    out = []
    for name in names:
        layers = work.layers()
        balance = gb.split(layers, work.schedule(name))
        ours = gb.PipetrainRunner(work, name, layers, balance)
        theirs = gb.TorchRunner(work, name, ours.modules(), layers, balance, ctx.rank)
        row: dict[str, Any] = {"schedule": name, "balance": balance,
                               **_check(ours, theirs, x, y),
                               **{k: {lib: [] for lib in LIBS} for k in ("steps", "spans", "cpu")}}
        for n in range(warmup + steps):
            for lib, runner in (("pipetrain", ours), ("torch", theirs)):
                gb.clear_grads(runner.params)
                dist.barrier()
                cpu = (time.thread_time(), time.process_time())
                t0 = time.time()
                runner.step(x, y)
                t1 = time.time()
                if n >= warmup:
                    row["steps"][lib].append((t0, t1))
                    row["spans"][lib].append(runner.spans())
                    row["cpu"][lib].append((time.thread_time() - cpu[0],
                                            time.process_time() - cpu[1]))
        out.append(row)
        del ours, theirs
        gc.collect()
    return out


# -- memory: one library per process group --------------------------------------------------


def _probe_step(runner: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """A warm-up step, then an unprofiled step (resident set) and a profiled one (tensors)."""
    runner.step(x, y)
    gb.clear_grads(runner.params)
    with memprobe.Probe(tensors=False) as rss:
        runner.step(x, y)
    gb.clear_grads(runner.params)
    with memprobe.Probe() as live:
        loss = runner.step(x, y)
    return {**live.to_dict(), "rss_peak_bytes": rss.rss_peak_bytes,
            "rss_start_bytes": rss.rss_start_bytes, "loss": loss}


def memory_body(ctx: pt.RankContext, work: gb.Workload, data: Batch, names: Sequence[str],
                lib: str) -> list[dict[str, Any]]:
    """Per schedule, ``lib`` alone, built afresh: the memory of a step on this rank."""
    memprobe.enable()
    x, y = data
    out = []
    for name in names:
        runner = _build(lib, work, name, ctx.rank)  # layers of other ranks are freed here
        gc.collect()
        dist.barrier()
        out.append({"schedule": name, **_probe_step(runner, x, y)})
        del runner
        gc.collect()
    return out


def baseline_body(ctx: pt.RankContext, work: gb.Workload, data: Batch, warmup: int,
                  steps: int) -> dict[str, Any]:
    """The one-process run: step times, loss and memory."""
    memprobe.enable()
    x, y = data
    runner = gb.SequentialRunner(work, work.layers())
    spans = []
    for n in range(warmup + steps):
        gb.clear_grads(runner.params)
        t0 = time.time()
        runner.step(x, y)
        if n >= warmup:
            spans.append((t0, time.time()))
    gb.clear_grads(runner.params)
    return {"steps": spans, **_probe_step(runner, x, y)}


# -- summary --------------------------------------------------------------------------------


def _memory_cells(per_rank: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {"live_peak_bytes": [r["peak_bytes"] for r in per_rank],
            "step_rise_bytes": [r["peak_bytes"] - r["start_bytes"] for r in per_rank],
            "rss_peak_bytes": [r["rss_peak_bytes"] for r in per_rank]}


def breakdown(steps: list[list[tuple[float, float]]], spans: list[list[list[gb.Span]]],
              cpu: list[list[tuple[float, float]]]) -> dict[str, Any]:
    """Medians over steps: the step, its actions' span, the busiest rank's time in actions,
    its main thread's and other threads' CPU time, and each op's mean duration
    (``steps[rank][j]``, ``spans[rank][j]``, ``cpu[rank][j]``)."""
    step, span, busy = [], [], []
    main = statistics.median(max(r[j][0] for r in cpu) for j in range(len(cpu[0])))
    other = statistics.median(max(r[j][1] - r[j][0] for r in cpu) for j in range(len(cpu[0])))
    per_op: dict[str, list[float]] = {}
    for j in range(len(steps[0])):
        rows = [s for r in spans for s in r[j]]
        step.append(max(r[j][1] for r in steps) - min(r[j][0] for r in steps))
        span.append(max(s[2] for s in rows) - min(s[1] for s in rows))
        busy.append(max(sum(s[2] - s[1] for s in r[j]) for r in spans))
        for op, a, b in rows:
            per_op.setdefault(op, []).append(b - a)
    return {"step_s": statistics.median(step), "span_s": statistics.median(span),
            "busy_s": statistics.median(busy), "cpu_main_s": main, "cpu_other_s": other,
            "op_ms": {op: 1e3 * statistics.mean(v) for op, v in sorted(per_op.items())}}


def summarize(work: gb.Workload, timing: list[list[dict[str, Any]]],
              memory: dict[str, list[list[dict[str, Any]]]],
              base: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for j, first in enumerate(timing[0]):
        name = first["schedule"]
        losses = [r[j]["loss"] for r in timing]
        for lib in LIBS:
            step = gb.median_step([r[j]["steps"][lib] for r in timing])
            mem = _memory_cells([r[j] for r in memory[lib]])
            loss = next(v[lib] for v in losses if v[lib] is not None)
            parts = breakdown(*([r[j][k][lib] for r in timing] for k in ("steps", "spans", "cpu")))
            rows.append({"schedule": name, "run": lib, "balance": first["balance"],
                         "loss": loss, "step_s": step, "tokens_per_s": work.tokens / step,
                         "grad_diff": max(r[j]["grad_diff"] for r in timing), **mem,
                         "breakdown": parts})
    step = gb.median_step([base["steps"]])
    rows.append({"schedule": "-", "run": "one process", "balance": None, "loss": base["loss"],
                 "step_s": step, "tokens_per_s": work.tokens / step, "grad_diff": None,
                 **_memory_cells([base])})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cells = [["/".join(memprobe.mib(v) for v in r[k])
              for k in ("live_peak_bytes", "step_rise_bytes", "rss_peak_bytes")] for r in rows]
    heads = ("live MiB/rank", "step+ MiB/rank", "RSS MiB/rank")
    widths = [max(len(h), *(len(c[i]) for c in cells)) + 2 for i, h in enumerate(heads)]
    head = (f"{'schedule':<17}{'run':<13}{'loss':>9}{'step s':>8}{'tokens/s':>10}"
            + "".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True)))
    lines = [head, "-" * len(head)]
    for r, c in zip(rows, cells, strict=True):
        lines.append(f"{r['schedule']:<17}{r['run']:<13}{r['loss']:>9.5f}{r['step_s']:>8.3f}"
                     f"{r['tokens_per_s']:>10.0f}"
                     + "".join(f"{v:>{w}}" for v, w in zip(c, widths, strict=True)))
    return "\n".join(lines)


def format_breakdown(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<17}{'run':<11}{'step s':>8}{'in ops':>8}{'waits':>8}{'outside':>9}"
            f"{'cpu main':>10}{'cpu other':>10}  mean op ms")
    lines = [head, "-" * len(head)]
    for r in rows:
        b = r.get("breakdown")
        if b is None:
            continue
        ops = " ".join(f"{op} {ms:.1f}" for op, ms in b["op_ms"].items())
        lines.append(f"{r['schedule']:<17}{r['run']:<11}{b['step_s']:>8.3f}{b['busy_s']:>8.3f}"
                     f"{b['span_s'] - b['busy_s']:>8.3f}{b['step_s'] - b['span_s']:>9.3f}"
                     f"{b['cpu_main_s']:>10.3f}{b['cpu_other_s']:>10.3f}  {ops}")
    return "\n".join(lines)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Per schedule: pipetrain's throughput and peak memory against torch's."""
    out = []
    for name in dict.fromkeys(r["schedule"] for r in rows if r["run"] == "pipetrain"):
        ours, theirs = (next(r for r in rows if r["schedule"] == name and r["run"] == lib)
                        for lib in LIBS)
        speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
        mem = max(a / b for a, b in zip(ours["live_peak_bytes"], theirs["live_peak_bytes"]))
        out.append(f"{name}: pipetrain/torch tokens/s {speed:.3f} (target >= 1: "
                   f"{'met' if speed >= 1 else 'MISSED'}); live peak, worst rank "
                   f"{mem:.3f} (target <= 1: {'met' if mem <= 1 else 'MISSED'}); largest "
                   f"gradient difference {ours['grad_diff']:.1e}")
    return out


def run(work: gb.Workload, names: Sequence[str], warmup: int, steps: int) -> list[dict[str, Any]]:
    data = work.data()
    timing = pt.launch(time_body, work.ranks, work, data, names, warmup, steps, timeout=3600)
    memory = {lib: pt.launch(memory_body, work.ranks, work, data, names, lib, timeout=3600)
              for lib in LIBS}
    base = pt.launch(baseline_body, 1, work, data, warmup, steps, timeout=3600)[0]
    return summarize(work, timing, memory, base)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gb.workload_args(parser, warmup=2, steps=10, schedules_help="comma list (both libraries)")
    parser.add_argument("--p", type=int, default=2, help="pipeline processes")
    args = parser.parse_args(argv)
    gb.apply_tiny(args)
    names = args.schedules.split(",")
    unknown = [n for n in names if n not in gb.TORCH_CLASSES]
    if unknown:
        parser.error(f"--schedules {unknown}: both libraries must have them; choose from "
                     f"{list(gb.TORCH_CLASSES)}")
    work = gb.Workload(args.preset, args.batch, args.m, ranks=args.p)
    started = time.time()
    rows = run(work, names, args.warmup, args.steps)
    print(f"GPT {args.preset}: {work.config.n_params:,} parameters, batch {args.batch} x "
          f"{work.config.seq_len} tokens, m = {args.m}; p = {work.ranks} processes, 1 thread "
          "each (one process: 1 thread)")
    print(format_table(rows))
    print("step s: median of first start to last end; live: peak bytes of live CPU tensors "
          "in the rank's process during a step (torch allocator, all threads); step+: its rise "
          "during the step; RSS: peak resident set of an unprofiled step")
    print()
    print(format_breakdown(rows))
    print("medians over steps: in ops: the busiest rank's time inside F/B/I/W; waits: the rest"
          " of the span from the first action's start to the last one's end; outside: step "
          "time outside that span (step start and end); cpu main / other: CPU time of a "
          "rank's main thread / of its other threads (gloo's, the watchdog) during the step, the "
          "larger over ranks")
    for line in verdicts(rows):
        print(line)
    if args.json:
        gb.save_json(args.json, {"rows": rows}, wall_s=time.time() - started,
                     preset=args.preset, batch=args.batch, microbatches=args.m,
                     tokens_per_step=work.tokens, ranks=work.ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
