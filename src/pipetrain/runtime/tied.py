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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import CommError

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
              rank_of: Sequence[int], names: Mapping[int, str] | None = None
              ) -> list[TiedParam]:
    """Parameters that appear in more than one stage, in order of first appearance; named by
    ``names`` (``id`` -> the model's name), else by their first holder."""
    seen: dict[int, tuple[str, list[int]]] = {}
    for stage, layers in enumerate(stage_layers):
        for layer_name, layer in layers:
            for pname, p in layer.named_parameters():
                full = (names or {}).get(id(p)) or (
                    f"{layer_name}.{pname}" if layer_name else pname)
                name, stages = seen.setdefault(id(p), (full, []))
                if stage not in stages:
                    stages.append(stage)
    return [TiedParam(name, tuple(stages), tuple(sorted({rank_of[s] for s in stages})))
            for name, stages in seen.values() if len(stages) > 1]


class TiedGrads:
    """This rank's tied parameters that other ranks hold too, and the exchange summing their grads.

    Each holder sends its gradient to every other holder and adds all of them up in rank order,
    so every holder ends with the same bits. The exchange uses point-to-point messages on the
    pipeline group with the pipeline's own tag; no extra process group is created (a subgroup
    made by some ranks only would desynchronise torch's group naming across ranks).
    """

    def __init__(self, tied: Sequence[TiedParam], rank: int, group: dist.ProcessGroup | None,
                 params: Callable[[str], nn.Parameter], tag: int, timeout: float) -> None:
        self.rank, self.group, self.tag, self.timeout = rank, group, tag, timeout
        self.params = params
        """The parameter of a name as the layer holds it now (a wrapper such as FSDP2 swaps
        a sharded one for the gathered one the step's gradients go to)."""
        self.members = [(t.name, t.ranks) for t in tied if len(t.ranks) > 1 and rank in t.ranks]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_reduce(self) -> None:
        """Sum the gradients of every tied parameter across the ranks that hold it."""
        for name, ranks in self.members:
            p = self.params(name)
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            parts = {self.rank: p.grad}
            sends = [dist.isend(p.grad, dst=self._global(r), group=self.group, tag=self.tag)
                     for r in ranks if r != self.rank]
            for r in ranks:
                if r != self.rank:
                    parts[r] = torch.empty_like(p.grad)
                    self._wait(dist.irecv(parts[r], src=self._global(r), group=self.group,
                                          tag=self.tag), name, r)
            for w in sends:
                self._wait(w, name, -1)
            total = parts[ranks[0]].clone()
            for r in ranks[1:]:
                total += parts[r]
            p.grad.copy_(total)

    def _wait(self, work: Any, name: str, peer: int) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            other = f"from rank {peer}" if peer >= 0 else "to its other holders"
            raise CommError(f"rank {self.rank}: summing the gradient of tied parameter {name!r} "
                            f"failed waiting {other}: {str(e).splitlines()[0][:200]}") from None


Place = tuple[nn.Module, str]
"""A module and the attribute it holds a parameter under."""


class LocalCopies:
    """Tied weights that a ``parallelize`` hook gave each stage of this process its own copy
    of (FSDP2 shards each stage's layers apart, so a V schedule's embedding and tied head, both
    on rank 0, end up with two sharded tensors of the same value).

    The first copy is the weight: the optimizer, the gradient norm and checkpoints see it
    alone (:meth:`skipped` names the others). At the start of each step the other copies take
    its values (:meth:`refresh`: local shards, laid out alike); at its end their gradients are
    added into its (:meth:`merge_grads`, on the tensors a step's gradients accumulate in,
    before any reduction), so its gradient is the tied weight's whole gradient, as if the tie
    had never been cut. The copies cost this rank one more shard of the weight.
    """

    def __init__(self, places: dict[str, list[Place]],
                 gathered: Callable[[nn.Parameter], nn.Parameter]) -> None:
        self.places = places
        self.gathered = gathered
        """A parameter -> the tensor its step's gradients accumulate in."""

    def skipped(self) -> set[int]:
        """``id`` of every copy but the first, as the modules hold them now."""
        return {id(getattr(m, a)) for found in self.places.values() for m, a in found[1:]}

    def refresh(self) -> None:
        """Give every other copy the first one's values."""
        from pipetrain.runtime.dtensors import local_shard

        with torch.no_grad():
            for found in self.places.values():
                source = local_shard(getattr(*found[0]))
                for module, attr in found[1:]:
                    local_shard(getattr(module, attr)).copy_(source)

    def merge_grads(self) -> None:
        """Add every other copy's gradient into the first's, and clear theirs."""
        for found in self.places.values():
            first = self.gathered(getattr(*found[0]))
            for module, attr in found[1:]:
                other = self.gathered(getattr(module, attr))
                if other.grad is None:
                    continue
                if first.grad is None:
                    first.grad = other.grad.clone()
                else:
                    first.grad.add_(other.grad)
                other.grad = None
