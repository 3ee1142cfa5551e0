"""DTensors: a rank's slice of a split tensor, its whole value, and a whole value copied in.

FSDP2 shards and tensor-parallel slices are DTensors. These helpers take any tensor and treat a
plain one as its own whole. They look DTensor up only once ``torch.distributed.tensor`` is
imported (a DTensor cannot exist before), so importing pipetrain does not import it (half a
second).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import torch

from pipetrain.runtime.torch_distributed import is_strided_shard

__all__ = ["local_shard", "whole", "copy_whole_", "is_strided", "strided_on"]


def _dtensor(t: Any) -> ModuleType | None:
    """torch.distributed.tensor when ``t`` is a DTensor, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return module if module is not None and isinstance(t, module.DTensor) else None


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, or ``t`` itself."""
    if _dtensor(t) is None:
        return t
    local: torch.Tensor = t.to_local()  # type: ignore[attr-defined]
    return local


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full value of ``t``: itself, or a DTensor's gathered (collective over its mesh)."""
    if _dtensor(t) is None:
        return t
    full: torch.Tensor = t.full_tensor()  # type: ignore[attr-defined]
    return full


def copy_whole_(dest: torch.Tensor, value: torch.Tensor) -> None:
    """Copy ``value`` (the full value) into ``dest``: a plain tensor, or this rank's pieces of
    a DTensor. No messages: every rank holding a piece of ``dest`` passes the whole value."""
    module = _dtensor(dest)
    if module is None:
        dest.copy_(value)
        return
    d: Any = dest
    mine = module.distribute_tensor(value.to(d.device), d.device_mesh, d.placements,
                                    src_data_rank=None)
    d.to_local().copy_(mine.to_local())


def strided_on(placement: Any) -> int | None:
    """The tensor dimension a strided split (``_StridedShard``: several pieces per rank, as
    tensor parallelism splits a fused q, k, v) cuts, or None for any other placement."""
    if not is_strided_shard(placement):
        return None
    dim: int = placement.dim
    return dim


def is_strided(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor with a strided split, which DCP cannot describe."""
    return _dtensor(t) is not None and any(
        strided_on(p) is not None for p in t.placements)  # type: ignore[attr-defined]
