"""Testing: the single-device reference a pipeline must match, and the comparison of gradients.

The reference runs the same micro-batches one after another through the unsplit model, each
loss weighted as the pipeline weights it, so on fp32 CPU the pipeline's loss and every
parameter's gradient must be *bitwise* equal to it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from pipetrain.runtime import microbatch
from pipetrain.runtime import rng as streams

__all__ = ["reference_step", "grad_mismatches", "reload_mismatches"]


def reference_step(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int, *, split_dim: int = 0, loss_reduction: str = "mean",
    rng: bool = False, device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Accumulate ``model``'s gradients over the micro-batches in order; return the batch loss.

    ``inputs`` is the model's one argument, or a dict of keyword arguments (what
    ``Pipeline.pack`` makes, or a dict a captured model is stepped with). With ``rng`` (a
    pipeline whose ``rng`` is True), each micro-batch runs on its own random stream, started
    as the pipeline starts it on stage 0's rank (:mod:`pipetrain.runtime.rng`), and ``device``'s
    generator is put back after it.
    """
    xs = microbatch.split(inputs, microbatches, split_dim)
    ys = microbatch.split(targets, microbatches, split_dim)
    total_size = microbatch.batch_size(targets, split_dim)
    sizes = microbatch.sizes(total_size, microbatches)
    dev = torch.device(device)
    base = streams.draw_base() if rng else 0
    total: torch.Tensor | None = None
    for i, (x, y, n) in enumerate(zip(xs, ys, sizes)):
        weight = n / total_size if loss_reduction == "mean" else 1.0
        with streams.stream(dev, streams.start(base, i, dev), []) if rng else nullcontext():
            out = model(**x) if _keywords(model, x) else model(x)
            loss = loss_fn(out, y) * weight
            loss.backward()  # type: ignore[no-untyped-call]
        total = loss.detach() if total is None else total + loss.detach()
    if total is None:
        raise ValueError("no micro-batches")
    return total


def _keywords(model: Callable[..., Any], x: Any) -> bool:
    """Whether ``x`` is a dict of a module's keyword arguments (else its one argument; a
    function, such as ``lambda x: ref(**x)``, always gets the dict whole)."""
    if not isinstance(x, dict) or not isinstance(model, nn.Module):
        return False
    try:
        inspect.signature(model.forward).bind(**x)
    except (TypeError, ValueError):
        return False
    return True


def grad_mismatches(
    pipeline_params: Iterable[tuple[str, nn.Parameter]], reference: nn.Module, *,
    skip: Collection[str] = ()
) -> list[str]:
    """Names of parameters whose ``.grad`` differs (bitwise) from the reference model's.

    Outside a ``torch.distributed`` job, where one process holds every stage, also the
    reference's parameters that ``pipeline_params`` lacks (a stage left out); in a job, each
    rank passes its own. ``skip`` names parameters the caller compares itself (a tied weight
    whose parts add in another order).
    """
    ref = dict(reference.named_parameters())
    bad = []
    seen = set(skip)
    for name, p in pipeline_params:
        seen.add(name)
        if name in skip:
            continue
        q = ref.get(name)
        if q is None:
            bad.append(f"{name}: not a parameter name of the reference model")
            continue
        if (p.grad is None) != (q.grad is None):
            bad.append(f"{name}: grad is None on one side only")
        elif p.grad is not None and q.grad is not None and not torch.equal(p.grad.cpu(), q.grad):
            diff = (p.grad.cpu() - q.grad).abs().max().item()
            bad.append(f"{name}: max abs difference {diff:.3g}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return bad  # this rank's stages only
    return bad + [f"{name}: held by no stage" for name in ref if name not in seen]


def reload_mismatches(path: Any, want: dict[str, torch.Tensor],
                      pipelines: Iterable[tuple[str, Any, torch.optim.Optimizer]]) -> list[str]:
    """Load the checkpoint at ``path`` into each ``(label, pipeline, optimizer)`` (its model
    and optimizer state); the keys whose whole values then differ from ``want`` (whole
    tensors by key, as :func:`pipetrain.checkpoint.run.model_state` and ``optimizer_state`` name
    them), labelled."""
    from pipetrain.checkpoint import run as ck
    from pipetrain.runtime.dtensors import whole

    def state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        named = list(pipe.named_parameters())
        return {**ck.model_state(named), **ck.optimizer_state(opt, named)}

    problems = []
    for label, pipe, opt in pipelines:
        into = state(pipe, opt)
        ck.load(path, into)
        ck.load_optimizer_state(opt, pipe.named_parameters(), into)
        got = state(pipe, opt)
        problems += [f"{label}: {k} differs" for k in want
                     if not torch.equal(whole(got[k]).detach(), want[k])]
    return problems
