"""Optimisation: AdamW with decay groups, the warm-up + cosine LR, and global-norm clipping.

The learning rate is a pure function of the step (:func:`lr_at`), so the schedule's whole
state is the step counter. Clipping uses the norm of the gradient of the *whole* model, not of
one rank's part: every pipeline rank sums the squares of the gradients it counts, the sums are
all-reduced over the pipeline group, and every rank scales its gradients by the same factor.
A tied parameter (held by several ranks, its gradient already summed among them) is counted
only by its owner, the lowest pipeline rank holding it; data-parallel replicas hold identical
gradients after their all-reduce, so the pipeline group alone gives the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.gpt import Embedding
from pipetrain.pipeline import Pipeline
from pipetrain.runtime.dtensors import local_shard
from pipetrain.runtime.failure import job_failure
from pipetrain.runtime.torch_private import foreach_mul_, foreach_norm

__all__ = ["lr_at", "no_decay_names", "param_groups", "build_optimizer", "set_lr",
           "counted_parameters", "grad_square_sum", "global_grad_norm", "clip_grads_"]

BETAS = (0.9, 0.95)
EPS = 1e-8
CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6)


def lr_at(step: int, *, peak: float, min_lr: float, warmup: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based).

    Linear warm-up ``peak * (step + 1) / warmup`` for the first ``warmup`` steps, then a
    cosine from ``peak`` (step ``warmup``) down to ``min_lr`` (step ``steps - 1``); ``min_lr``
    beyond that.

    Example:
        >>> lr_at(0, peak=1.0, min_lr=0.0, warmup=4, steps=10)
        0.25
        >>> lr_at(9, peak=1.0, min_lr=0.1, warmup=4, steps=10)
        0.1
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    span = steps - 1 - warmup
    if span <= 0 or step >= steps - 1:
        return peak if span <= 0 and step < steps else min_lr
    progress = (step - warmup) / span
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * progress))


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameters that get no weight decay: biases, norms (anything under 2-d) and embeddings.

    Names are those of ``model.named_parameters()`` (a tied parameter under its first name),
    the names :meth:`Pipeline.named_parameters` uses for a layer list wrapped in
    ``nn.Sequential``.
    """
    embedded = {id(p) for m in model.modules() if isinstance(m, (Embedding, nn.Embedding))
                for p in m.parameters()}
    return {n for n, p in model.named_parameters() if p.dim() < 2 or id(p) in embedded}


def param_groups(named: Iterable[tuple[str, nn.Parameter]], no_decay: set[str],
                 weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups, ``decay`` and ``no_decay`` (each present even when empty)."""
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for name, p in named:
        if p.requires_grad:
            (plain if name in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": plain, "weight_decay": 0.0, "name": "no_decay"}]


def build_optimizer(named: Iterable[tuple[str, nn.Parameter]], no_decay: set[str], *,
                    lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (betas 0.9, 0.95) over :func:`param_groups`.

    Raises:
        ValueError: for a negative learning rate or weight decay.
    """
    if lr < 0 or weight_decay < 0:
        raise ValueError(f"lr and weight_decay must be >= 0, got {lr}, {weight_decay}")
    return torch.optim.AdamW(param_groups(named, no_decay, weight_decay), lr=lr, betas=BETAS,
                             eps=EPS)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def counted_parameters(pipe: Pipeline) -> list[nn.Parameter]:
    """This rank's parameters that count towards the global norm (tied ones by their owner)."""
    others = {t.name for t in pipe.tied if t.owner != pipe.rank}
    return [p for n, p in pipe.named_parameters() if n not in others and p.requires_grad]


def grad_square_sum(counted: Sequence[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The sum of squares of the gradients of ``counted`` on this rank (float32 scalar)."""
    grads = [local_shard(p.grad) for p in counted if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = foreach_norm(grads, 2.0)
    return torch.stack([n.float() for n in norms]).square().sum().to(device)


def global_grad_norm(counted: Sequence[nn.Parameter], group: dist.ProcessGroup | None,
                     device: torch.device) -> torch.Tensor:
    """The 2-norm of the gradients of every rank's ``counted`` parameters (float32 scalar).

    Call on every rank of ``group`` (None: this process only). Non-finite when any gradient
    is (or when the sum of squares overflows float32).
    """
    total = grad_square_sum(counted, device)
    if group is not None:
        job_failure.all_reduce(total, "the gradient norm", group=group)
    return total.sqrt()


def clip_grads_(params: Iterable[nn.Parameter], norm: torch.Tensor, max_norm: float) -> float:
    """Scale gradients by ``min(1, max_norm / (norm + 1e-6))``; return the factor used.

    ``max_norm <= 0`` leaves them as they are (factor 1).
    """
    if max_norm <= 0:
        return 1.0
    factor = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)  # float32, as torch computes it
    grads = [local_shard(p.grad) for p in params if p.grad is not None]
    if grads and float(factor) < 1.0:
        foreach_mul_(grads, factor.to(grads[0].device))
    return float(factor)

