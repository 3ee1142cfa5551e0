"""Context parallel: each rank of a group holds one slice of every sequence of its rows.

:class:`ContextParallel` binds a group of ``cp`` ranks for the attention exchanges of
:mod:`pipetrain.runtime.sequence` (for as long as it is open), cuts a batch into this rank's
slice of each sequence (:meth:`ContextParallel.take`), and points pipetrain's GPT layers at it
(:meth:`ContextParallel.apply`, before the model goes to ``Pipeline``): the embedding adds the
positions of its slice, the attention exchanges heads for tokens. A Hugging Face model takes it
through transformers' attention interface instead (:mod:`pipetrain.hf.sequence_attention`),
also before it is captured. Neither touches a weight, so every schedule and ``compile=`` run
with it as without.

    sequence of S tokens:  [ t0 ... t(s-1) | ts ... t(2s-1) | ... ]    s = S / cp
    held by cp rank:              0                1

Every rank computes its slice's loss (a mean over its tokens, or a sum weighted by the whole
batch's count) and the gradients of its tokens; averaging over the ``dp x fsdp x cp`` ranks
(:mod:`pipetrain.train.mesh`) gives the whole sequence's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.models.gpt import Attention, Embedding
from pipetrain.runtime.sequence import TAG, Shards
from pipetrain.runtime.torch_private import pytree

__all__ = ["ContextParallel", "slice_attention"]


def slice_attention(model: nn.Module, tag: str = TAG) -> nn.Module:
    """``model`` with its GPT embeddings and attention pointed at the group bound under
    ``tag``: the embedding adds its slice's positions, attention exchanges heads for tokens.

    The group need not be open yet: the layers look it up when they run."""
    for module in model.modules():
        if isinstance(module, (Attention, Embedding)):
            module.sequence = tag
    return model


class ContextParallel:
    """The slices of each sequence over ``group`` (one per rank, in the group's order).

    Args:
        group: the context-parallel ranks.
        documents: rows are packed documents (positions restart), so attention builds the
            mask of the whole sequence; False: one causal sequence a row.
        tag: the name the exchanges know the group by (:data:`pipetrain.runtime.sequence.TAG`).

    Raises:
        RuntimeError: when another one is open in this process under the same tag.
    """

    def __init__(self, group: dist.ProcessGroup | None, *, documents: bool = False,
                 tag: str = TAG) -> None:
        self.shards = Shards(group, tag, documents=documents)
        self.tag = tag

    @property
    def size(self) -> int:
        return self.shards.size

    @property
    def rank(self) -> int:
        return self.shards.rank

    def apply(self, model: nn.Module) -> nn.Module:
        """Point pipetrain's GPT layers in ``model`` at this group (before ``Pipeline``)."""
        return slice_attention(model, self.tag)

    def take(self, tree: Any, length: int) -> Any:
        """This rank's slice of every tensor in ``tree`` whose second dimension is
        ``length`` (token ids, positions, labels, masks); other leaves as they are.

        Raises:
            ValueError: when ``length`` does not divide by the ranks.
        """
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split into "
                             f"cp={self.size} equal slices; use a --seq-len that divides by "
                             f"{self.size}")
        s = length // self.size
        lo = self.rank * s

        def cut(leaf: Any) -> Any:
            if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[1] == length:
                return leaf[:, lo:lo + s].contiguous()
            return leaf
        return pytree.tree_map(cut, tree)

    def close(self) -> None:
        """Release the tag (the GPT layers it pointed at it then refuse to run)."""
        self.shards.close()

    def __enter__(self) -> ContextParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
