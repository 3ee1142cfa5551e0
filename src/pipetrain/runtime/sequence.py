"""Sequence shards: attention over sequences whose slices live on the ranks of a group.

Under context parallelism (``cp`` ranks) every rank holds one contiguous slice of each
sequence, ``s = S / cp`` tokens, and everything but attention is per token. Attention needs
the whole sequence; here it gets it by two all-to-alls over heads (the method of Jacobs et
al., "DeepSpeed Ulysses", 2023)::

    q, k, v  (B, H, s, D)  this rank's tokens, every head
        │  seq_to_heads: all-to-all; rank j sends its tokens of the heads of rank i to rank i
        ▼
             (B, H/cp, S, D)  every token, this rank's heads      ← any attention kernel,
        │  attention over the whole sequence (causal, a window,      with the mask of the
        │  packed documents: any kernel, any mask)                   whole sequence
        ▼
    out      (B, H/cp, S, D)
        │  heads_to_seq: the inverse all-to-all
        ▼
             (B, H, s, D)  this rank's tokens again

Each all-to-all is the other's gradient, so a backward costs the same two exchanges; both are
on the path to a stage's input, so a split backward runs them in I (on the first stage, whose
input has no gradient, its whole backward is W, and they run there). Every rank
attends over all S queries of its heads: the causal work is the same on every rank without
reordering the sequence (a ring passing key-value blocks needs each rank to hold a head and a
tail slice for that). The heads must divide by cp (key-value heads too, or they are repeated
until they do: :func:`kv_repeats`).

The exchanges are torch custom operators (``pipetrain::seq_to_heads``, ``heads_to_seq``,
``gather_seq``) so that torch.export records each as one node of a captured model. A node
names its group by a tag (a string that every rank's program shares); :class:`Shards` binds
the tag to this process's group, and releases it when closed. Every wait is bounded: a peer
that fails surfaces through :func:`pipetrain.runtime.failure.job_failure.wait`.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.failure import job_failure

__all__ = ["TAG", "Shards", "bound", "document_mask", "gather_seq", "heads_to_seq",
           "kv_repeats", "seq_to_heads", "state"]

TAG = "cp"
"""The tag of a training job's context-parallel group."""

_BOUND: weakref.WeakValueDictionary[str, Shards] = weakref.WeakValueDictionary()
"""Tag -> its open group; a Shards dropped without close() is gone from here too."""


class Shards:
    """This process's ranks of one sequence, bound to ``tag`` while open.

    Args:
        group: the ranks that hold the slices of the same sequences, in order (slice ``i`` on
            the group's rank ``i``); None: one rank holds them all.
        tag: the name the captured operators use for it.
        documents: the sequences are packed documents (positions restart), so attention
            needs a mask of the whole sequence; False: one causal sequence a row.

    Raises:
        RuntimeError: when another group is bound to ``tag`` already (close it first).
    """

    def __init__(self, group: dist.ProcessGroup | None, tag: str = TAG, *,
                 documents: bool = False) -> None:
        if tag in _BOUND:
            raise RuntimeError(f"a context-parallel group is bound to {tag!r} already in this "
                               "process; close() it before building another")
        self.group, self.tag, self.documents = group, tag, documents
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        _BOUND[tag] = self

    def offset(self, length: int) -> int:
        """Where this rank's slice of ``length`` tokens starts in the whole sequence."""
        return self.rank * length

    def close(self) -> None:
        """Release the tag (idempotent)."""
        if _BOUND.get(self.tag) is self:
            del _BOUND[self.tag]

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def bound(tag: str) -> Shards:
    """The group bound to ``tag``.

    Raises:
        RuntimeError: when none is (a captured model runs outside its context-parallel job).
    """
    found = _BOUND.get(tag)
    if found is None:
        raise RuntimeError(f"no context-parallel group is bound to {tag!r}: a model made for "
                           "context parallelism runs inside the Shards (or train --cp job) "
                           "that bound it")
    return found


def state() -> tuple[tuple[str, int, bool], ...]:
    """What the groups bound now change in a captured model: each tag's ranks and whether it
    holds packed documents (part of a capture's reuse key)."""
    return tuple(sorted((tag, s.size, s.documents) for tag, s in _BOUND.items()))


def kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many times each key-value head is repeated so that the key-value heads divide by
    ``cp`` (1: none). Each repeated head still serves whole groups of query heads: with
    ``d = gcd(kv_heads, cp)``, ``cp`` dividing ``heads = kv_heads x groups`` means ``cp / d``
    divides ``groups``.

    Raises:
        ValueError: when ``cp`` does not divide ``heads``.
    """
    if heads % cp:
        raise ValueError(f"context parallelism splits the attention heads among the cp ranks: "
                         f"{heads} heads (per tensor-parallel rank) do not divide by cp={cp}; "
                         "use a cp that divides them")
    return cp // math.gcd(kv_heads, cp)


def _exchange(send: torch.Tensor, tag: str, what: str) -> torch.Tensor:
    """``all_to_all_single`` over the group of ``tag``, first dimension split one per rank."""
    shards = bound(tag)
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=shards.group, async_op=True)
    job_failure.wait(work, f"[rank {dist.get_rank()}] {what} over the context-parallel ranks",
                     poll=send.device.type == "cpu")
    return recv


@torch.library.custom_op("pipetrain::seq_to_heads", mutates_args=())
def seq_to_heads(x: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H, s, D) this rank's tokens -> (B, H/cp, S, D) its heads, every token."""
    n = bound(tag).size
    b, h, s, d = x.shape
    if n == 1:
        return x.clone()
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()
    recv = _exchange(send, tag, "the attention's exchange of heads for tokens")
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


@torch.library.custom_op("pipetrain::heads_to_seq", mutates_args=())
def heads_to_seq(x: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, H/cp, S, D) this rank's heads -> (B, H, s, D) every head, its tokens."""
    n = bound(tag).size
    b, h, length, d = x.shape
    if n == 1:
        return x.clone()
    s = length // n
    send = x.reshape(b, h, n, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = _exchange(send, tag, "the attention's exchange of tokens for heads")
    return recv.transpose(0, 1).reshape(b, n * h, s, d)


@torch.library.custom_op("pipetrain::gather_seq", mutates_args=())
def gather_seq(x: torch.Tensor, tag: str) -> torch.Tensor:
    """(B, s) this rank's slice of per-token values (positions) -> (B, S), no gradient."""
    shards = bound(tag)
    if shards.size == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(shards.size)]
    work = dist.all_gather(parts, x.contiguous(), group=shards.group, async_op=True)
    job_failure.wait(work, f"[rank {dist.get_rank()}] the gather of positions over the "
                     "context-parallel ranks", poll=x.device.type == "cpu")
    return torch.cat(parts, dim=1)


@seq_to_heads.register_fake
def _seq_to_heads_shape(x: torch.Tensor, tag: str) -> torch.Tensor:
    n = bound(tag).size
    b, h, s, d = x.shape
    return x.new_empty(b, h // n, n * s, d)


@heads_to_seq.register_fake
def _heads_to_seq_shape(x: torch.Tensor, tag: str) -> torch.Tensor:
    n = bound(tag).size
    b, h, length, d = x.shape
    return x.new_empty(b, h * n, length // n, d)


@gather_seq.register_fake
def _gather_seq_shape(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], x.shape[1] * bound(tag).size)


def _keep_tag(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.tag = inputs[1]


def _seq_to_heads_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return heads_to_seq(grad.contiguous(), ctx.tag), None


def _heads_to_seq_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return seq_to_heads(grad.contiguous(), ctx.tag), None


seq_to_heads.register_autograd(_seq_to_heads_grad, setup_context=_keep_tag)
heads_to_seq.register_autograd(_heads_to_seq_grad, setup_context=_keep_tag)


def document_mask(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The (B, 1, S, S) boolean mask (True: attend) of whole sequences whose ``positions``
    (B, S) restart at each packed document: a query sees the keys of its own document at its
    position or before, and with ``window`` only the last ``window`` of them (transformers'
    sliding window: ``key > query - window``)."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    document = (step != 1).cumsum(-1)
    same = document[:, :, None] == document[:, None, :]
    q, k = positions[:, :, None], positions[:, None, :]
    mask = same & (k <= q)
    if window is not None:
        mask = mask & (k > q - window)
    return mask[:, None]
