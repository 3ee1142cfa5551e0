"""Peers on real compute: pipetrain's GPT trained under DeepSpeed and torchgpipe beside pipetrain.

pipetrain's GPT ``small`` (4.87 M parameters; ``tiny`` with ``--tiny``) with its head untied,
as DeepSpeed's PipelineModule and torchgpipe take plain layers; 2m sequences of 128 tokens
(64 for tiny), the layers split evenly over p parts, SGD with lr 0 after each step. For each
p in (2, 4) and m in (8, 16) (p = 2, m = 8 with ``--tiny``), two tables:

    1F1B     DeepSpeed (PipelineModule + train_batch) on p processes against pipetrain's
             1f1b on the same processes, steps alternating
    GPipe    in one process: torchgpipe under its checkpoint modes ("never", and its default
             "except_last": every micro-batch but the last recomputed) against pipetrain's
             local mode (``local_ranks=p``) without and with ``recompute="always"`` (every
             micro-batch), steps alternating; then pipetrain's GPipe on p processes

Each step is the median of ``--steps`` after one; tokens/s is the batch's tokens over it. Each
rank's peak of live tensor bytes in a step (``memprobe.py``) comes from a launch per library,
so that each process holds one model.

    python benchmarks/peers.py --gpt             # about 5 min
    python benchmarks/peers.py --gpt --tiny      # p = 2, m = 8, GPT tiny: about 30 s
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from calibrated import Case
from peer_steps import ROWS, deepspeed_step, installed, missing, timed, trained

import pipetrain as pt
from pipetrain.split.partition import even_balance

Steps = dict[str, Callable[[], None]]


def _layers(preset: str, seq: int) -> list[Any]:
    """The GPT preset's layers with its own (untied) head."""
    from pipetrain.models.gpt import PRESETS, Head, gpt_layers

    config = dataclasses.replace(PRESETS[preset], seq_len=seq)
    torch.manual_seed(0)
    layers = gpt_layers(config)
    layers[-1] = Head(config)
    return layers


def _batch(seq: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (ROWS * m, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _deepspeed(preset: str, seq: int, m: int, p: int) -> Callable[[], None]:
    from pipetrain.models.gpt import lm_loss

    return deepspeed_step(_layers(preset, seq), p, lm_loss, *_batch(seq, m), m)


def _steps(preset: str, seq: int, m: int, p: int, libs: Sequence[str]) -> Steps:
    """The steps of ``libs`` on this process: "pipetrain 1f1b", "pipetrain gpipe" and
    "DeepSpeed 1F1B" on p processes; "pipetrain gpipe local", "pipetrain local recompute",
    "torchgpipe (never)" and "torchgpipe (except_last)" in one process of p parts."""
    from pipetrain.models.gpt import lm_loss

    x, y = _batch(seq, m)
    steps: Steps = {}
    for name in libs:
        if name.startswith("pipetrain"):
            layers = _layers(preset, seq)
            local = {"local_ranks": p} if "local" in name else {}
            pipe = pt.Pipeline(layers, "1f1b" if "1f1b" in name else "gpipe", m, lm_loss,
                               balance=even_balance(len(layers), p), **local,
                               recompute="always" if "recompute" in name else "never")
            steps[name] = trained(pipe, lambda pipe=pipe: pipe.step(x, y))
        elif name.startswith("torchgpipe"):
            from torch import nn
            from torchgpipe import GPipe

            layers = _layers(preset, seq)
            model = GPipe(nn.Sequential(*layers), balance=even_balance(len(layers), p),
                          devices=["cpu"] * p, chunks=m, checkpoint=name[12:-1])
            steps[name] = trained(model, lambda model=model: lm_loss(model(x), y).backward())
        else:
            steps[name] = _deepspeed(preset, seq, m, p)
    return steps


def _time(ctx: pt.RankContext, preset: str, seq: int, m: int, p: int, steps: int,
          libs: Sequence[str]) -> dict[str, float]:
    torch.set_num_threads(1)
    case = Case("gpt", ctx.world_size, m, 0, 0, 0, 1, (), 1, steps)
    times = timed(_steps(preset, seq, m, p, libs), case)
    return {name: statistics.median(t) for name, t in times.items()}


def _memory(ctx: pt.RankContext, preset: str, seq: int, m: int, p: int, lib: str) -> int:
    import memprobe

    torch.set_num_threads(1)
    memprobe.enable()
    (step,) = _steps(preset, seq, m, p, [lib]).values()
    step()  # gradients and buffers exist, as in every step after the first
    torch.distributed.barrier()
    with memprobe.Probe() as probe:
        step()
    torch.distributed.barrier()
    return int(probe.peak_bytes)


def _rows(p: int, m: int, preset: str, seq: int, times: dict[str, float], ours: str
          ) -> list[str]:
    """One line per library: its step, tokens/s, step over ``ours``, and peaks per rank."""
    out = []
    for name, seconds in times.items():
        procs = 1 if "local" in name or "torchgpipe" in name else p
        peaks = pt.launch(_memory, procs, preset, seq, m, p, name, timeout=900)
        out.append(f"{f'p{p} m{m}':7s} {name:25s} {seconds:7.3f} "
                   f"{ROWS * m * seq / seconds:9,.0f} {seconds / times[ours]:9.3f}x "
                   f"{' / '.join(f'{b / 2**20:.1f}' for b in peaks):>29s}")
    return out


def run(tiny: bool, steps: int) -> list[str]:
    preset, seq = ("tiny", 64) if tiny else ("small", 128)
    grid = [(2, 8)] if tiny else [(2, 8), (2, 16), (4, 8), (4, 16)]
    head = (f"{'case':7s} {'library':25s} {'step s':>7s} {'tokens/s':>9s} {'vs ours':>10s} "
            f"{'peak live MiB per rank':>29s}")
    one_f = [f"# torch {torch.__version__}; GPT {preset}, {ROWS} x {seq} tokens per "
             f"micro-batch; step: median of {steps} after 1", "## 1F1B, p processes", head]
    gpipe = ["## GPipe: one process of p parts (vs pipetrain gpipe local), then p processes",
             head]
    peers = ["DeepSpeed 1F1B"] if installed("deepspeed") else []
    local = ["pipetrain gpipe local", "pipetrain local recompute"] + (
        ["torchgpipe (never)", "torchgpipe (except_last)"] if installed("torchgpipe") else [])
    for p, m in grid:
        times = pt.launch(_time, p, preset, seq, m, p, steps, ["pipetrain 1f1b", *peers],
                          timeout=900)[0]
        one_f += _rows(p, m, preset, seq, times, "pipetrain 1f1b")
        times = pt.launch(_time, 1, preset, seq, m, p, steps, local, timeout=900)[0]
        times |= pt.launch(_time, p, preset, seq, m, p, steps, ["pipetrain gpipe"],
                           timeout=900)[0]
        gpipe += _rows(p, m, preset, seq, times, "pipetrain gpipe local")
    return one_f + gpipe + missing("deepspeed", "torchgpipe")
