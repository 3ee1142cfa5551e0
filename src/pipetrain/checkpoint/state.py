"""Checkpoint state: a run's tensors by name (parameters, optimizer state, RNG) and back.

Keys are the original model's parameter names with a prefix per kind, so they mean the same at
every pipeline layout: ``model/<name>``, ``optim/<name>/<field>`` and ``rng/rank<r>/<device>``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["model_state", "optimizer_state", "load_optimizer_state", "rng_state",
           "set_rng_state"]


def model_state(named_params: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``{"model/<name>": parameter}``: live tensors, which ``checkpoint.load`` overwrites."""
    return {f"model/{name}": p.detach() for name, p in named_params}


def _index(optimizer: torch.optim.Optimizer,
           named_params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, nn.Parameter]:
    """Name -> parameter for every parameter of ``optimizer``, checking the names cover it."""
    names = {id(p): n for n, p in named_params}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    unnamed = sum(id(p) not in names for p in held)
    if unnamed:
        raise ValueError(f"{unnamed} of the optimizer's {len(held)} parameters have no name in "
                         "named_params; pass the named_parameters() of the same pipeline")
    return {names[id(p)]: p for p in held}


def optimizer_state(optimizer: torch.optim.Optimizer,
                    named_params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    """``{"optim/<name>/<field>": tensor}`` for every per-parameter state (AdamW: exp_avg,
    exp_avg_sq, step), materialised first for trainable parameters that have none yet.

    The tensors are the optimizer's own, so :func:`load` fills them in place. Materialising
    runs one optimizer step with zero gradients and learning rate 0 (parameters stay bitwise
    unchanged for torch's Adam/AdamW/SGD) and zeroes the new state (AdamW: step 0).
    Param-group settings (lr, betas, weight decay) are not included: they come from the run's
    config and LR schedule.
    """
    params = _index(optimizer, named_params)
    _materialise(optimizer, [p for p in params.values()
                             if p.requires_grad and not optimizer.state.get(p)])
    out = {}
    for name, p in params.items():
        for field, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}/{field}"] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"optim/{name}/{field}"] = torch.tensor(value)
    return out


def _materialise(optimizer: torch.optim.Optimizer, fresh: list[nn.Parameter]) -> None:
    """Create the state of ``fresh`` parameters with one zero-gradient, zero-lr step, zeroed."""
    if not fresh:
        return
    held = [p for g in optimizer.param_groups for p in g["params"]]
    grads = {id(p): p.grad for p in held}
    lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in held:
            p.grad = None
        for p in fresh:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
        for p in fresh:  # placeholders to load into: zeros, as if no step had been taken
            for value in optimizer.state.get(p, {}).values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p in held:
            p.grad = grads[id(p)]


def load_optimizer_state(optimizer: torch.optim.Optimizer,
                         named_params: Iterable[tuple[str, nn.Parameter]],
                         state: dict[str, torch.Tensor]) -> None:
    """Put the ``optim/...`` tensors of ``state`` into ``optimizer`` (the inverse of
    :func:`optimizer_state`; a no-op for tensors that already are the optimizer's own)."""
    for name, p in _index(optimizer, named_params).items():
        prefix = f"optim/{name}/"
        slots = optimizer.state.setdefault(p, {})
        for key, value in state.items():
            if not key.startswith(prefix):
                continue
            field = key[len(prefix):]
            old = slots.get(field)
            if isinstance(old, torch.Tensor):
                if old is not value:
                    old.copy_(value)
            elif isinstance(old, (int, float)) and not isinstance(old, bool):
                slots[field] = type(old)(value.item())
            else:
                slots[field] = value.clone()


def rng_state(rank: int | None = None) -> dict[str, torch.Tensor]:
    """This process's torch RNG states: ``rng/rank<r>/cpu`` and ``rng/rank<r>/cuda<i>``.

    ``rank`` defaults to the global rank (0 without torch.distributed).
    """
    r = _rank(rank)
    out = {f"rng/rank{r}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/rank{r}/cuda{i}"] = s
    return out


def set_rng_state(state: dict[str, torch.Tensor], rank: int | None = None) -> None:
    """Restore the RNG states :func:`rng_state` produced for ``rank`` (keys it lacks are kept).

    Raises:
        KeyError: when ``state`` holds no ``rng/rank<r>/cpu``.
    """
    r = _rank(rank)
    if f"rng/rank{r}/cpu" not in state:
        raise KeyError(f"state has no rng/rank{r}/cpu; build it with rng_state() before load")
    torch.set_rng_state(state[f"rng/rank{r}/cpu"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if f"rng/rank{r}/cuda{i}" in state:
                torch.cuda.set_rng_state(state[f"rng/rank{r}/cuda{i}"], i)


def _rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
