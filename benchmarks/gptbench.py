"""GPT benchmark workload: one model and batch, run by pipetrain, by torch.distributed.pipelining
on the very same stage modules, or by one process accumulating gradients over the micro-batches.

Every runner's ``step(x, y)`` does the forward and backward of one batch (no optimizer step,
which is the same work for all three) and returns the batch loss, or None on a rank that does
not hold the last stage. Gradients agree between the runners: torch's schedule gets the loss
divided by m and ``scale_grads=False`` (its own 1/m rescaling divides a weight shared by two
stages of one rank twice), and the embedding/head weight shared across ranks is all-reduced
after its step, as pipetrain does inside its step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.models.gpt import PRESETS, GPTConfig, gpt_layers, lm_loss
from pipetrain.runtime import microbatch
from pipetrain.runtime.tied import find_tied
from pipetrain.split.balance import plan_balance
from pipetrain.split.partition import stage_bounds
from pipetrain.train.data.text import Batches, default_corpus

TORCH_CLASSES = {  # pipetrain name -> torch.distributed.pipelining.schedules class
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
Span = tuple[str, float, float]  # (op, start, end) of one action on one rank
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zb-h1", "zb-h2", "zbv",
                 "dualpipev")


@dataclass(frozen=True)
class Workload:
    """A GPT preset, a batch of byte-level text and its micro-batch count."""

    preset: str
    batch: int
    microbatches: int
    ranks: int = 2
    seed: int = 0

    @property
    def config(self) -> GPTConfig:
        return PRESETS[self.preset]

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return self.batch * self.config.seq_len

    def layers(self) -> list[nn.Module]:
        """The model, initialised from ``seed``: the same values in every process."""
        torch.manual_seed(self.seed)
        return gpt_layers(self.config)

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of the standard library's text: inputs and next-byte targets."""
        corpus = default_corpus(max_bytes=1 << 20)
        return Batches(corpus.train, self.batch, self.config.seq_len, seed=self.seed).batch(0)

    def schedule(self, name: str) -> ps.Schedule:
        return ps.make_schedule(name, self.ranks, self.microbatches)


def split(layers: Sequence[nn.Module], schedule: ps.Schedule) -> list[int]:
    """Layers per stage, balanced by parameter bytes (deterministic; blocks weigh the same)."""
    return plan_balance(layers, schedule, "params").balance


def stage_modules(layers: Sequence[nn.Module], schedule: ps.Schedule, balance: Sequence[int],
                  rank: int) -> dict[int, nn.Module]:
    """This rank's stages as ``nn.Sequential`` s of the given layers (no copies)."""
    bounds = stage_bounds(balance)
    return {s: nn.Sequential(*layers[bounds[s][0]:bounds[s][1]]) for s in schedule.stages_of(rank)}


def unique_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def clear_grads(params: Sequence[nn.Parameter]) -> None:
    """``optimizer.zero_grad()``: the next step allocates fresh gradients."""
    for p in params:
        p.grad = None


class PipetrainRunner:
    """pipetrain's Pipeline over ``layers`` split by ``balance``."""

    label = "pipetrain"

    def __init__(self, work: Workload, name: str, layers: Sequence[nn.Module],
                 balance: Sequence[int], recompute: str = "never") -> None:
        self.pipe = pt.Pipeline(list(layers), work.schedule(name), loss_fn=lm_loss,
                                balance=list(balance), timeout=600.0, recompute=recompute)
        self.params = list(self.pipe.parameters())
        self.last_result: pt.StepResult | None = None

    def modules(self) -> dict[int, nn.Module]:
        return {s: stage.module for s, stage in self.pipe.stages.items()}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        self.last_result = self.pipe.step(x, y)
        return None if self.last_result.loss is None else float(self.last_result.loss)

    def spans(self) -> list[Span]:
        """This rank's actions of the last step: (op, start, end), wall-clock seconds."""
        if self.last_result is None:
            return []
        rank = self.pipe.rank
        return [(s.action.op.value, s.start, s.end)
                for s in self.last_result.timeline.spans if s.rank == rank]


class _ScaledLoss:
    def __init__(self, m: int) -> None:
        self.m = m

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets) / self.m


class TorchRunner:
    """torch.distributed.pipelining's schedule of the same name over the given stage modules."""

    label = "torch"

    def __init__(self, work: Workload, name: str, modules: dict[int, nn.Module],
                 layers: Sequence[nn.Module], balance: Sequence[int], rank: int) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as tps

        sched = work.schedule(name)
        self.first, self.last = 0 in modules, sched.n_stages - 1 in modules
        stages = [PipelineStage(modules[s], s, sched.n_stages, torch.device("cpu"))
                  for s in sorted(modules)]
        cls = getattr(tps, TORCH_CLASSES[name])
        self.schedule = cls(stages[0] if len(stages) == 1 else stages, work.microbatches,
                            loss_fn=_ScaledLoss(work.microbatches), scale_grads=False)
        self.params = unique_params(list(modules.values()))
        self.tied = _tied_groups(layers, sched, balance, rank)
        self._spans: list[Span] = []
        for stage in stages:
            _record(stage, self._spans)

    def spans(self) -> list[Span]:
        """This rank's F, B, I, W of the last step: (op, start, end), wall-clock seconds."""
        return sorted(self._spans, key=lambda s: s[1])

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        self._spans.clear()
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        for p, group in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        return float(torch.stack(losses).detach().sum()) if losses else None


def _record(stage: Any, spans: list[Span]) -> None:
    """Wrap a torch PipelineStage's per-micro-batch compute so each call appends its span."""
    def timed(op: Callable[[dict[str, Any]], str], fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((op(kwargs), start, time.time()))
        return run

    stage.forward_one_chunk = timed(lambda k: "F", stage.forward_one_chunk)
    stage.backward_one_chunk = timed(lambda k: "B" if k.get("full_backward", True) else "I",
                                     stage.backward_one_chunk)
    stage.backward_weight_one_chunk = timed(lambda k: "W", stage.backward_weight_one_chunk)


def _tied_groups(layers: Sequence[nn.Module], sched: ps.Schedule, balance: Sequence[int],
                 rank: int) -> list[tuple[nn.Parameter, Any]]:
    # Every rank creates every group (new_group is collective), in the same order.
    stage_layers = [[(str(i), layers[i]) for i in range(a, e)] for a, e in stage_bounds(balance)]
    params = {str(i) + "." + n: p for i, layer in enumerate(layers)
              for n, p in layer.named_parameters()}
    out = []
    for t in find_tied(stage_layers, sched.placement):
        if len(t.ranks) > 1:
            group = dist.new_group(list(t.ranks))
            if rank in t.ranks:
                out.append((params[t.name], group))
    return out


class SequentialRunner:
    """The whole model in this process: forward and backward of each micro-batch in turn."""

    label = "one process"

    def __init__(self, work: Workload, layers: Sequence[nn.Module]) -> None:
        self.model = nn.Sequential(*layers)
        self.m = work.microbatches
        self.params = list(self.model.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        total = torch.zeros(())
        n = x.size(0)
        for xi, yi in zip(microbatch.split(x, self.m), microbatch.split(y, self.m)):
            loss = lm_loss(self.model(xi), yi) * (xi.size(0) / n)
            loss.backward()
            total += loss.detach()
        return float(total)


def grad_difference(before: dict[str, torch.Tensor], params: Iterator[tuple[str, Any]]) -> float:
    """Largest ``max|a - b| / max|a|`` over the named gradients of two runs."""
    worst = 0.0
    for name, p in params:
        a, b = before.get(name), p.grad
        if a is None or b is None:
            if (a is None) != (b is None):
                return float("inf")
            continue
        worst = max(worst, float((a - b).abs().max() / a.abs().max().clamp_min(1e-30)))
    return worst


def median_step(per_rank: Sequence[Sequence[tuple[float, float]]]) -> float:
    """Median over steps of (last rank's end - first rank's start)."""
    n = len(per_rank[0])
    return statistics.median(max(r[j][1] for r in per_rank) - min(r[j][0] for r in per_rank)
                             for j in range(n))


def workload_args(parser: argparse.ArgumentParser, *, warmup: int, steps: int,
                  schedules_help: str) -> None:
    """The flags of a GPT-workload benchmark (preset, batch, m, schedules, warm-up, steps,
    JSON output, tiny mode); apply ``--tiny`` with :func:`apply_tiny` after parsing."""
    parser.add_argument("--preset", default="small",
                        help="GPT preset (pipetrain.models.gpt.PRESETS)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--schedules", default="1f1b,zbv", help=schedules_help)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--json", help="write the figures and machine description here")
    parser.add_argument("--tiny", action="store_true", help="tiny preset, batch 4, 2 steps (CI)")


def apply_tiny(args: argparse.Namespace) -> None:
    """``--tiny``: the CI size of :func:`workload_args`'s workload."""
    if args.tiny:
        args.preset, args.batch, args.m, args.warmup, args.steps = "tiny", 4, 4, 1, 2


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "pipetrain": pt.__version__, "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def save_json(path: str, body: dict[str, Any], **meta: Any) -> None:
    """Write a benchmark's results to ``path``: ``body`` beside a ``meta`` entry holding the
    machine, the command line and ``meta``."""
    with open(path, "w") as fh:
        json.dump({"meta": {"machine": machine(), "argv": list(sys.argv), **meta}, **body}, fh,
                  indent=1)

