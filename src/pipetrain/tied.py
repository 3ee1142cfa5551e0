"""Tied parameters: one logical parameter held by stages on several ranks (embedding <-> head).

Every rank builds (or describes) the whole layer list, so every rank can see which parameter
objects appear in more than one stage. Each such parameter keeps one name (its first name in the
original model) and, when its stages live on different ranks, those ranks form a small process
group: after every training step their gradients are all-reduced (summed), so each holder sees
the full gradient and identical optimizer steps keep the copies identical. A checkpoint saves it
once, from its lowest rank (:attr:`TiedParam.owner`).

The sum is exact but its floating-point order differs from single-device autograd, which adds
each micro-batch's head and embedding contributions alternately: tied gradients match the
single-device ones to rounding, not bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

__all__: list[str] = []


@dataclass(frozen=True)
class TiedParam:
    """A parameter used by several stages; ``ranks`` are the pipeline ranks holding it."""

    name: str
    stages: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def owner(self) -> int:
        return self.ranks[0]


def find_tied(stage_layers: Sequence[Sequence[tuple[str, nn.Module]]],
              rank_of: Sequence[int]) -> list[TiedParam]:
    """Parameters that appear in more than one stage, in order of first appearance."""
    seen: dict[int, tuple[str, list[int]]] = {}
    for stage, layers in enumerate(stage_layers):
        for layer_name, layer in layers:
            for pname, p in layer.named_parameters():
                full = f"{layer_name}.{pname}" if layer_name else pname
                name, stages = seen.setdefault(id(p), (full, []))
                if stage not in stages:
                    stages.append(stage)
    return [TiedParam(name, tuple(stages), tuple(sorted({rank_of[s] for s in stages})))
            for name, stages in seen.values() if len(stages) > 1]


class TiedGrads:
    """The groups of this rank's cross-rank tied parameters, and their gradient all-reduce."""

    def __init__(self, tied: Sequence[TiedParam], rank: int, group: dist.ProcessGroup | None,
                 params: dict[str, nn.Parameter]) -> None:
        self.members: list[tuple[nn.Parameter, dist.ProcessGroup | None]] = []
        for t in tied:
            if len(t.ranks) < 2:
                continue  # all its stages are on one rank: autograd already sums it
            ranks = [dist.get_global_rank(group, r) if group is not None else r for r in t.ranks]
            if rank in t.ranks:
                pg = dist.new_group(ranks, use_local_synchronization=True)
                self.members.append((params[t.name], pg))

    def all_reduce(self) -> None:
        """Sum the gradients of every tied parameter across the ranks that hold it."""
        for p, pg in self.members:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=pg)
