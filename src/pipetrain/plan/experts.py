"""Plan experts: the expert-parallel degrees a layout may take, and a MoE layer's sizes for them.

``pipetrain plan --hf`` on a mixture of experts whose config declares an expert-parallel plan
(:mod:`pipetrain.hf.expert_parallel`) searches ``ep`` too: each divisor of a layout's
data-parallel ranks that ``pipetrain train`` accepts (no tensor parallelism; with FSDP, ``ep``
and ``fsdp`` dividing one another). For each traced unit the profile walk records what the
cost model of :mod:`pipetrain.plan.shardcost` needs: the bytes of its experts' weights, and
the bytes one all-to-all of a micro-batch moves (every (token, expert) row's hidden state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ep_choices", "expert_sizes"]


def ep_choices(model: nn.Module | None, data: int, fsdp: int, tp: int,
               given: int | None) -> list[int]:
    """The ``ep`` of a layout of ``data`` data-parallel ranks (``fsdp`` of them shards) and
    ``tp``: ``given`` if it fits, else every one that does (1 for a model without experts)."""
    from pipetrain.hf.expert_parallel import experts_paths

    spread = model is not None and tp == 1 and bool(experts_paths(model))
    fits = [e for e in range(1, data + 1) if data % e == 0 and (
        e == 1 or spread and (fsdp == 1 or e % fsdp == 0 or fsdp % e == 0))]
    return [e for e in fits if given is None or e == given]


def expert_sizes(model: nn.Module | None) -> Callable[[nn.Module, torch.Tensor],
                                                        tuple[int, int]]:
    """(unit, token ids) -> (bytes of its experts' weights, bytes of one all-to-all of its
    (token, expert) rows), for ``model``'s experts modules (zeros without them)."""
    from pipetrain.hf.expert_parallel import experts_paths

    paths = experts_paths(model) if model is not None else []
    config: Any = getattr(model, "config", None)
    top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    width = int(getattr(config, "hidden_size", 0) or 0)

    def sizes(unit: nn.Module, ids: torch.Tensor) -> tuple[int, int]:
        held = [p for n, p in unit.named_parameters()
                if any(n.startswith(path + ".") for path in paths)]
        if not held:
            return 0, 0
        layers = sum(1 for path in paths if any(n.startswith(path + ".")
                                                for n, _ in unit.named_parameters()))
        element = held[0].element_size()
        return (sum(p.numel() * p.element_size() for p in held),
                layers * ids.numel() * top_k * width * element)
    return sizes
