"""Micro-batches: split a batch (any payload) along one dimension, and merge outputs back.

A batch of size N split into m micro-batches gets sizes that differ by at most one (the first
``N % m`` micro-batches are one larger), like ``torch.tensor_split``. Plain values are repeated
into every micro-batch. Loss weights make uneven micro-batches exact: with a mean-reduced loss
micro-batch i is weighted ``n_i / N``, with a sum-reduced loss ``1``.
"""

from __future__ import annotations

from typing import Any

import torch

from pipetrain.runtime.torch_private import pytree
from pipetrain.runtime.transport.payload import flatten, unflatten

__all__: list[str] = []


def batch_size(batch: Any, dim: int) -> int:
    """The size along ``dim`` shared by every tensor of ``batch``.

    Raises:
        ValueError: if the batch holds no tensor, or tensors disagree on that size.
    """
    tensors, _ = flatten(batch)
    sizes = {t.shape[dim] for t in tensors if t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot split the batch along dim {dim}: its tensors have sizes {sorted(sizes)} "
            "there (need exactly one size; pass split_dim= to choose another dimension)"
        )
    return sizes.pop()


def split(batch: Any, n: int, dim: int = 0) -> list[Any]:
    """Split ``batch`` into ``n`` micro-batches along ``dim``.

    Raises:
        ValueError: if the batch has fewer than ``n`` samples.
    """
    size = batch_size(batch, dim)
    if size < n:
        raise ValueError(
            f"batch of size {size} (dim {dim}) cannot be split into {n} micro-batches; "
            f"use a batch of at least {n} samples or fewer micro-batches"
        )
    tensors, spec = flatten(batch)
    parts = [torch.tensor_split(t, n, dim=dim) if t.dim() > 0 else [t] * n for t in tensors]
    return [unflatten([p[i] for p in parts], spec) for i in range(n)]


def sizes(total: int, n: int) -> list[int]:
    """Micro-batch sizes for a batch of ``total`` split into ``n``."""
    return [total // n + (1 if i < total % n else 0) for i in range(n)]


def merge(parts: list[Any], dim: int = 0) -> Any:
    """Concatenate micro-batch outputs back into one batch-shaped output of the same type.

    Tensors are concatenated along ``dim`` (scalars stacked); any structure ``torch.utils.
    _pytree`` knows (tuples, lists, dicts, a Hugging Face ``ModelOutput``) is kept, and a
    non-tensor leaf is taken from the first micro-batch.
    """
    flat = [pytree.tree_flatten(p) for p in parts]
    leaves = []
    for i, first in enumerate(flat[0][0]):
        column = [f[0][i] for f in flat]
        if isinstance(first, torch.Tensor):
            leaves.append(torch.cat(column, dim=dim) if first.dim() > 0 else torch.stack(column))
        else:
            leaves.append(first)
    return pytree.tree_unflatten(leaves, flat[0][1])
