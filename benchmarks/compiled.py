"""Compiled stages: the speed-up ``Pipeline(compile=True)`` gives, beside ``torch.compile``'s on one
process.

Two models: pipetrain's GPT preset (a layer list) and a Hugging Face Llama built from a small
config (captured and split by ``split_points="auto"``). For each, on this machine's CPU (or its
GPU with ``--device cuda``):

    one process   the whole model, forward + backward of each micro-batch in turn, eager and
                  under ``torch.compile`` (inductor): the speed-up compiling gives one process
    pipeline      p processes (gloo, one thread each) under each schedule, eager and
                  ``compile=True``, the two pipelines' steps alternating

Reported: the median step, tokens/s, the speed-up (eager step / compiled step) and the
pipeline's speed-up as a share of the one process's; the first step's extra time (tracing and
compiling, the inductor cache warm or not as found); and the largest difference between the
compiled and eager pipelines' losses.

    python benchmarks/compiled.py                    # GPT small and Llama, 1f1b and zbv
    python benchmarks/compiled.py --tiny             # CI size, a minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import gptbench as gb
import torch
from torch import nn

import pipetrain as pt
from pipetrain.models.gpt import lm_loss
from pipetrain.runtime import microbatch

Batch = tuple[torch.Tensor, torch.Tensor]


def llama(tiny: bool) -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    """A Llama from a small config (no download), a batch of tokens and its causal LM loss."""
    import transformers

    torch.manual_seed(0)
    width = 64 if tiny else 256
    cfg = transformers.LlamaConfig(vocab_size=512 if tiny else 4096, hidden_size=width,
                                   intermediate_size=4 * width, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4 if tiny else 16, 64 if tiny else 256))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           target[:, 1:].reshape(-1))
    return model, (ids, ids), loss_fn


def workload(name: str, args: argparse.Namespace) -> tuple[Any, Batch, Callable[..., Any], bool]:
    """(model or layer list, batch, loss, captured) of ``name``."""
    if name == "llama":
        model, data, loss = llama(args.tiny)
        return model, data, loss, True
    work = gb.Workload(args.preset, args.batch, args.m, args.p)
    return work.layers(), work.data(), lm_loss, False


def _inputs(x: torch.Tensor, captured: bool) -> Any:
    return {"input_ids": x} if captured else x


def one_process(model: Any, data: Batch, loss_fn: Callable[..., Any], captured: bool, m: int,
                compiled: bool, steps: int, device: torch.device) -> dict[str, Any]:
    """Forward and backward of each micro-batch in turn: step times and the batch loss."""
    net = (model if captured else nn.Sequential(*model)).to(device)
    run = torch.compile(net) if compiled else net
    x, y = (t.to(device) for t in data)
    times, loss = [], 0.0
    for _ in range(steps + 1):
        for p in net.parameters():
            p.grad = None
        _sync(device)
        t0 = time.perf_counter()
        total = 0.0
        for xi, yi in zip(microbatch.split(x, m), microbatch.split(y, m)):
            out = loss_fn(run(input_ids=xi) if captured else run(xi), yi) / m
            out.backward()
            total += float(out.detach())
        _sync(device)
        times.append(time.perf_counter() - t0)
        loss = total
    return {"first": times[0], "steps": times[1:], "loss": loss}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def pipeline_body(ctx: pt.RankContext, name: str, args: argparse.Namespace,
                  schedules: Sequence[str]) -> list[dict[str, Any]]:
    """One rank of the pipelines (gloo, one thread)."""
    torch.set_num_threads(1)
    return pipelines(name, args, schedules, ctx.device, None)


def pipelines(name: str, args: argparse.Namespace, schedules: Sequence[str],
              device: torch.device, local_ranks: int | None) -> list[dict[str, Any]]:
    """Each schedule: an eager and a compiled pipeline, steps alternating."""
    rows = []
    for sched in schedules:
        pipes = {}
        for compiled in (False, True):
            model, data, loss_fn, captured = workload(name, args)
            example = {"input_ids": data[0][:data[0].size(0) // args.m]} if captured else None
            pipes[compiled] = pt.Pipeline(model, sched, args.m, loss_fn, timeout=900.0,
                                          split_points="auto" if captured else None,
                                          example_inputs=example, compile=compiled,
                                          balance=None if captured else "params",
                                          device=device, local_ranks=local_ranks)
        x, y = data
        got: dict[bool, dict[str, Any]] = {c: {"first": [], "steps": [], "losses": []}
                                         for c in pipes}
        for n in range(args.steps + 1):
            for compiled, pipe in pipes.items():
                for p in pipe.parameters():
                    p.grad = None
                _sync(device)
                t0 = time.perf_counter()
                result = pipe.step(_inputs(x, captured), y)
                _sync(device)
                got[compiled]["first" if n == 0 else "steps"] += [time.perf_counter() - t0]
                if result.loss is not None:
                    got[compiled]["losses"].append(float(result.loss))
        rows.append({"schedule": sched, "eager": got[False], "compiled": got[True]})
    return rows


def summarize(name: str, tokens: int, single: dict[bool, dict[str, Any]],
              piped: list[list[dict[str, Any]]], ranks: int) -> list[dict[str, Any]]:
    def med(steps: list[float]) -> float:
        return statistics.median(steps)

    base = med(single[False]["steps"]) / med(single[True]["steps"])
    out = [{"model": name, "run": "one process", "eager": med(single[False]["steps"]),
            "compiled": med(single[True]["steps"]), "speedup": base, "share": 1.0,
            "compile_s": single[True]["first"] - med(single[True]["steps"]),
            "loss_diff": abs(single[True]["loss"] - single[False]["loss"])}]
    for k, row in enumerate(piped[0]):
        # a step's time: the slowest rank's
        eager = med([max(r[k]["eager"]["steps"][j] for r in piped)
                     for j in range(len(row["eager"]["steps"]))])
        comp = med([max(r[k]["compiled"]["steps"][j] for r in piped)
                    for j in range(len(row["compiled"]["steps"]))])
        first = max(r[k]["compiled"]["first"][0] for r in piped)
        losses = [(a, b) for r in piped for a, b in zip(r[k]["eager"]["losses"],
                                                          r[k]["compiled"]["losses"])]
        out.append({"model": name, "run": f"p = {ranks}, {row['schedule']}",
                    "eager": eager, "compiled": comp, "speedup": eager / comp,
                    "share": (eager / comp) / base, "compile_s": first - comp,
                    "loss_diff": max(abs(a - b) for a, b in losses)})
    for r in out:
        r["tokens_s"] = tokens / r["compiled"]
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<6} {'run':<16} {'eager s':>8} {'compiled s':>10} {'tokens/s':>9} "
             f"{'speed-up':>8} {'of 1 proc':>9} {'compile s':>9} {'loss diff':>9}"]
    for r in rows:
        lines.append(f"{r['model']:<6} {r['run']:<16} {r['eager']:>8.4f} {r['compiled']:>10.4f} "
                     f"{r['tokens_s']:>9.0f} {r['speedup']:>7.3f}x {r['share']:>9.3f} "
                     f"{r['compile_s']:>9.1f} {r['loss_diff']:>9.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gb.workload_args(parser, warmup=1, steps=8, schedules_help="schedules, comma-separated")
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--p", type=int, default=2, help="pipeline ranks")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (local mode, one GPU)")
    args = parser.parse_args(argv)
    gb.apply_tiny(args)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        model, data, loss_fn, captured = workload(name, args)
        single = {c: one_process(workload(name, args)[0], data, loss_fn, captured, args.m, c,
                                 args.steps, device) for c in (False, True)}
        schedules = args.schedules.split(",")
        if device.type == "cuda":
            piped = [pipelines(name, args, schedules, device, args.p)]  # every rank here
        else:
            piped = pt.launch(pipeline_body, args.p, name, args, schedules, timeout=1800)
        rows += summarize(name, data[0].numel(), single, piped, args.p)
    print(format_table(rows))
    if args.json:
        gb.save_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
