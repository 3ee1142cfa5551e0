"""Non-finite steps: one verdict for the whole world (go, skip or stop), and injected NaNs.

A NaN or Inf can appear on any rank: in the loss (on the rank of the last stage, shared with
its replica at the end of the step) or in any rank's gradients. If each rank decided alone,
some would step their optimizer and others not, and the replicas and stages would drift
apart. So every rank puts its own finding into a world-sized vector, the vector is
all-reduced (max) over the world, and every rank acts on the same result:

    OK         step the optimizer
    OVERFLOW   fp16 only: finite loss but non-finite gradients; lower the scale, skip
    NONFINITE  a non-finite loss (or gradients outside fp16): ``skip`` or ``abort`` as configured
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipetrain.errors import PipelineError
from pipetrain.runtime.failure import job_failure
from pipetrain.runtime.torch_private import pytree

if TYPE_CHECKING:
    from pipetrain.pipeline import Pipeline

__all__ = ["OK", "OVERFLOW", "NONFINITE", "Verdict", "finding", "decide", "NaNInjector"]

OK, OVERFLOW, NONFINITE = 0, 1, 2
_NAMES = {OK: "ok", OVERFLOW: "fp16 overflow", NONFINITE: "non-finite loss or gradients"}


@dataclass(frozen=True)
class Verdict:
    """The world's decision about one step, and which ranks found what."""

    level: int
    """OK, OVERFLOW or NONFINITE: the worst finding of any rank."""
    findings: tuple[int, ...]
    """Each global rank's own finding."""

    @property
    def skip(self) -> bool:
        return self.level != OK

    def ranks(self, level: int) -> list[int]:
        return [r for r, f in enumerate(self.findings) if f == level]

    def error(self, rank: int, step: int) -> PipelineError:
        """The error every rank raises when ``nonfinite='abort'``."""
        return PipelineError(
            f"[rank {rank}] step {step}: {_NAMES[self.level]} found on rank(s) "
            f"{self.ranks(self.level)}; every rank stops here (nonfinite='abort'). Lower --lr, "
            "keep --grad-clip on, use --precision fp32/bf16, or pass --nonfinite skip to skip "
            "such steps")


def finding(loss: float, grad_square_sum: float, fp16: bool) -> int:
    """This rank's finding from its loss and the sum of squares of its own gradients."""
    if not math.isfinite(loss):
        return NONFINITE
    if not math.isfinite(grad_square_sum):
        return OVERFLOW if fp16 else NONFINITE
    return OK


def decide(own: int, rank: int, world: int, device: torch.device) -> Verdict:
    """Every rank's finding, all-reduced over the world (call on every rank at once)."""
    vector = torch.zeros(world, dtype=torch.int32, device=device)
    vector[rank] = own
    if dist.is_initialized():
        job_failure.all_reduce(vector, "the finite-loss check", op=dist.ReduceOp.MAX)
    findings = tuple(int(v) for v in vector.tolist())
    return Verdict(max(findings), findings)


class NaNInjector:
    """Makes the outputs of chosen modules NaN while armed (fault injection, tests).

    A forward hook on each module multiplies its tensor outputs by NaN when :attr:`armed`;
    the NaN then reaches the loss and, through the backward, every gradient.
    :meth:`for_pipeline` chooses each stage's output.
    """

    def __init__(self, modules: list[nn.Module]) -> None:
        self.armed = False
        self.handles: list[RemovableHandle] = [m.register_forward_hook(self._hook)
                                               for m in modules]

    @classmethod
    def for_pipeline(cls, pipe: Pipeline) -> NaNInjector:
        """An injector of NaN into the output of every stage this process holds.

        It hooks each stage's last layer, not the stage's ``nn.Sequential``: a stage that
        recomputes runs its layers segment by segment (and again in the replay, where the
        hook fires alike while armed), but every layer is always called as a module, so the
        stage output is poisoned under every recompute policy.
        """
        return cls([pipe.stages[s].module[-1] for s in sorted(pipe.stages)])

    def _hook(self, module: nn.Module, args: object, output: object) -> object:
        if not self.armed:
            return None
        return pytree.tree_map_only(  # keeps the output's type (a Hugging Face ModelOutput)
            torch.Tensor, lambda t: t * float("nan") if t.is_floating_point() else t, output)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
