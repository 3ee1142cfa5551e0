"""Encoder: a message written from the last one alike on its route, its header encoded once.

In a step, each route (kind, source and destination stage) carries the same structure again
and again: the same tensors' dtypes and shapes, the same spec, micro-batch after micro-batch.
:func:`~pipetrain.runtime.transport.wire.encode` writes a message's header field by field and its
spec
as JSON; here the first message of a route is encoded so, and its header and spec bytes are
kept. A later message alike (same spec, same tensors' dtypes, shapes and gradient flags, on
the CPU, fitting the capacity) copies them, writes its step and micro-batch over the kept ones,
and copies its tensors' bytes behind::

    kept     [header: magic, kind, step, mb, ... per tensor ... | spec | pad]   (first message)
    next     [     kept bytes, step and mb written over them      | tensor 0 | pad | ... ]

The bytes are those :func:`~pipetrain.runtime.transport.wire.encode` writes for the same message
(``tests/test_encoder.py`` checks them equal), so a receiver cannot tell the two apart.

A buffer written so is lent to its sends; once they completed (a later message proved them
taken: :mod:`pipetrain.runtime.transport.receipts`), the transport hands it back
(:meth:`Encoder.done`)
and the route's next message is written into it: the kept header and padding are still there,
so only the step, the mb and the tensors' bytes are written again.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from pipetrain.runtime.transport.wire import (
    HEADER_BYTES,
    KEEP,
    KEEP_BYTES,
    Message,
    encode,
    flat_bytes,
    new_bytes,
)

__all__: list[str] = []

_STEP_MB = struct.Struct("<2q")  # the header's step and mb fields (int64 2 and 3)
Signature = tuple[tuple[torch.dtype, torch.Size, bool] | None, ...]
Spare = list[tuple[torch.Tensor, Any]]  # a route's buffers whose sends completed, with numpy's
Home = tuple[Spare, Any]  # where a buffer goes back, and numpy's array over it


class Encoded(NamedTuple):
    """A message encoded: its first send, its separate payload or None, its payload bytes,
    and where ``first`` goes back once every send of it completed (None: nowhere)."""

    first: torch.Tensor
    payload: torch.Tensor | None
    size: int
    home: Home | None


@dataclass(frozen=True)
class _Form:
    """A route's last message, as encoded: what a message alike reuses."""

    spec: Any
    signature: Signature
    kept: Any  # numpy uint8: the header, the spec and its padding
    offsets: tuple[tuple[int, int], ...]  # per present tensor: (offset in the payload, bytes)
    size: int  # payload bytes
    spare: Spare  # buffers of this form whose sends completed: written again as they are


def _signature(msg: Message) -> Signature | None:
    """Each tensor's dtype, shape and gradient flag (None where absent); None when a tensor is
    not on the CPU (its payload travels on its own)."""
    flags = msg.requires_grad
    out: list[tuple[torch.dtype, torch.Size, bool] | None] = []
    for i, t in enumerate(msg.tensors):
        if t is None:
            out.append(None)
            continue
        if not t.is_cpu:
            return None
        out.append((t.dtype, t.shape, bool(flags[i]) if i < len(flags) else False))
    return tuple(out)


def same_spec(a: Any, b: Any) -> bool:
    """Whether two specs encode to the same JSON bytes: equal, and alike in every leaf's type
    and key order (``1 == True == 1.0`` and ``0.0 == -0.0`` in Python, not in JSON)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_spec(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_spec(x, y) for x, y in zip(a, b))
    return repr(a) == repr(b) if isinstance(a, float) else bool(a == b)


class Encoder:
    """``encode`` for one sending rank, reusing each route's last header (see the module)."""

    def __init__(self, src_rank: int) -> None:
        self.src_rank = src_rank
        self._forms: dict[tuple[int, int, int, int], _Form] = {}
        self.reused = 0
        """How many messages were encoded from a kept form (for tests and benchmarks)."""

    def __call__(self, msg: Message, op: int, capacity: int) -> Encoded:
        """As :func:`~pipetrain.runtime.transport.wire.encode` (``msg`` from this rank)."""
        k = msg.key
        route = (k.kind, k.src_stage, k.dst_stage, op)
        form = self._forms.get(route)
        signature = _signature(msg)
        if (form is not None and signature == form.signature and form.size <= capacity
                and same_spec(msg.spec, form.spec)):
            self.reused += 1
            out, buffer = self._fill(form, msg)
            keep = HEADER_BYTES + form.size <= KEEP_BYTES
            return Encoded(out, None, form.size, (form.spare, buffer) if keep else None)
        first, payload, size = encode(msg, self.src_rank, op, capacity)
        if payload is None and signature is not None:
            self._forms[route] = _keep(msg, signature, first, size)
        return Encoded(first, payload, size, None)

    @staticmethod
    def done(first: torch.Tensor, home: Home) -> None:
        """Every send of ``first`` (from a call that gave ``home``) completed: the route's
        next message may be written into it."""
        spare, buffer = home
        if len(spare) < KEEP:
            spare.append((first, buffer))

    @staticmethod
    def _fill(form: _Form, msg: Message) -> tuple[torch.Tensor, Any]:
        present = (t for t in msg.tensors if t is not None)
        if form.spare:  # the kept header and the padding are in it still
            out, buffer = form.spare.pop()
            _STEP_MB.pack_into(buffer, 16, msg.key.step, msg.key.mb)
            for (at, nbytes), t in zip(form.offsets, present):
                at += HEADER_BYTES
                buffer[at:at + nbytes] = flat_bytes(t)
            return out, buffer
        out, buffer = new_bytes(HEADER_BYTES + form.size)
        end = form.kept.size
        buffer[:end] = form.kept
        _STEP_MB.pack_into(buffer, 16, msg.key.step, msg.key.mb)
        for (at, nbytes), t in zip(form.offsets, present):
            at += HEADER_BYTES
            buffer[end:at] = 0  # the padding: no stale bytes on the wire
            end = at + nbytes
            buffer[at:end] = flat_bytes(t)
        buffer[end:] = 0
        return out, buffer


def _keep(msg: Message, signature: Signature, first: torch.Tensor, size: int) -> _Form:
    """The form of a message just encoded inline: its header and spec bytes, tensor offsets."""
    offsets: list[tuple[int, int]] = []
    at = size
    for entry in reversed(signature):  # the tensors lie at the payload's end, each padded
        if entry is None:
            continue
        dtype, shape, _ = entry
        nbytes = shape.numel() * dtype.itemsize
        at -= (nbytes + 15) // 16 * 16
        offsets.append((at, nbytes))
    offsets.reverse()
    kept = first.numpy()[:HEADER_BYTES + at].copy()
    return _Form(msg.spec, signature, kept, tuple(offsets), size, [])
