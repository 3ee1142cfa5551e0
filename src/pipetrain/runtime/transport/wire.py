"""Wire: the byte layout of one stage-to-stage message: a header, and its payload right behind it.

Every message starts with a fixed-size header; its payload follows in the same buffer when it
fits the room the receiver has posted (the direction's *capacity*), else as a second message::

    message  [header: 256 x int64 | payload, up to the capacity]     (one send)
         or  [header: 256 x int64]  then  [payload]                    (two sends: too large,
                                                                        or on a GPU)
    header   [magic, kind, step, mb, src_stage, dst_stage, src_rank, n_tensors,
              spec_bytes, payload_bytes, op, on_device, inline, one_tensor, 0, 0,  per tensor:
              present, dtype, requires_grad, ndim, dim0..dim7]
    payload  [JSON spec | pad | tensor 0 bytes | pad | tensor 1 bytes | ...]   (16-byte aligned)

(``one_tensor``: the payload is one tensor, the usual activation or gradient, and its spec is
implied.) gloo moves a send's bytes only into a matching receive that is already posted, and a
send larger than that receive kills the process, so the receiver posts the receive of a peer's
next message ahead of need, sized header + capacity, and the sender never puts more behind the
header than the same capacity. Both ends compute it alike, by construction: a :class:`Capacity`
per direction of each rank pair, fed the same history (the sender the headers it sent, the
receiver the headers it received, in the one order gloo delivers them on a tag). A payload
larger than the capacity travels as a second message, and raises the capacity for the next
ones. Nothing is pickled: the payload's structure travels as JSON, tensors as raw bytes.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from pipetrain.errors import CommError
from pipetrain.runtime.transport.payload import (
    DTYPES,
    dtype_code,
    spec_from_bytes,
    spec_to_bytes,
)

__all__: list[str] = []

HEADER_LEN = 256
HEADER_BYTES = HEADER_LEN * 8
INLINE_BYTES = 6144  # the least capacity: every small message (and every ABORT) fits
FRAME_BYTES = HEADER_BYTES + INLINE_BYTES  # the least receive a receiver ever posts
WINDOW = 8  # a capacity covers the largest of the direction's last WINDOW payloads
KEEP = 4  # buffers kept to be written again: per route (sends), per peer (receives)
KEEP_BYTES = 1 << 20  # the largest buffer kept (a larger one's copy dwarfs its allocation)
_FIXED = 16
_PER_TENSOR = 12
MAX_TENSORS = (HEADER_LEN - _FIXED) // _PER_TENSOR
MAX_DIMS = 8
MAGIC = 0x70697065  # "pipe"
ACT, GRAD, DONE, ABORT = 1, 2, 3, 4
KIND_NAMES = {ACT: "activation", GRAD: "gradient", DONE: "end-of-step", ABORT: "abort"}
OPS = "FBIW"

_HEAD = struct.Struct("<14q")
_FIXED_FIELDS = struct.Struct(f"<{_FIXED}q")
_TENSOR_FIELDS = [struct.Struct(f"<{n * _PER_TENSOR}q") for n in range(MAX_TENSORS + 1)]
_DESC = [struct.Struct(f"<{4 + n}q") for n in range(MAX_DIMS + 1)]
_ONE_TENSOR = {"t": 0}  # the spec of a payload that is one tensor: the common case
_NP_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16,
          torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}  # not bfloat16
Bytes = Any  # a flat uint8 buffer: a tensor, or a numpy array (CPU)


class Key(NamedTuple):
    """Identity of one message: what it carries, for which step, micro-batch and stages."""

    kind: int
    step: int
    mb: int
    src_stage: int
    dst_stage: int

    def route(self) -> tuple[int, int, int, int]:
        """The key without its step: (kind, mb, src_stage, dst_stage), unique within a step."""
        return self.kind, self.mb, self.src_stage, self.dst_stage

    def describe(self) -> str:
        name = KIND_NAMES.get(self.kind, f"kind {self.kind}")
        if self.kind == DONE:
            return f"{name} message of rank {self.mb} (step {self.step})"
        return (f"{name} of mb {self.mb} from stage {self.src_stage} to stage {self.dst_stage} "
                f"(step {self.step})")


@dataclass
class Message:
    """A received or to-be-sent message: tensors (None where absent) and a payload spec."""

    key: Key
    tensors: list[torch.Tensor | None]
    spec: Any = None
    requires_grad: list[bool] = field(default_factory=list)


class Capacity:
    """Payload bytes that travel behind the header in one send, for one direction of a pair.

    It is the largest CPU payload among the direction's last ``WINDOW`` messages (at least
    ``INLINE_BYTES``): a function of headers both ends see in the same order, so the sender's
    and the receiver's copies always agree, and the next message's receive, posted before it
    exists, is never smaller than what the sender puts in it.
    """

    def __init__(self) -> None:
        self.recent: deque[int] = deque(maxlen=WINDOW)
        self.bytes = INLINE_BYTES

    def record(self, payload_bytes: int, on_device: bool) -> None:
        """One more message of this direction went through (as its checked header says)."""
        self.recent.append(0 if on_device else payload_bytes)
        self.bytes = max(INLINE_BYTES, max(self.recent))


def _pad(n: int) -> int:
    return (n + 15) // 16 * 16


def encode(msg: Message, src_rank: int, op: int = 0, capacity: int = INLINE_BYTES
           ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``msg`` as (its first send, its separate payload or None, its payload bytes).

    The first send is the header with the payload behind it when the payload is on the CPU
    and at most ``capacity`` bytes, else the header alone.

    Raises:
        CommError: for more than ``MAX_TENSORS`` tensors or a tensor of more than 8 dims.
    """
    tensors, k = msg.tensors, msg.key
    if len(tensors) > MAX_TENSORS:
        raise CommError(f"a {k.describe()} holds {len(tensors)} tensors; at most "
                        f"{MAX_TENSORS} fit one message (pack them into fewer tensors)")
    one_tensor = msg.spec == _ONE_TENSOR
    spec = b"" if msg.spec is None or one_tensor else spec_to_bytes(msg.spec)
    raws: list[tuple[int, Any]] = []
    descs: list[tuple[int, ...]] = []
    offset = _pad(len(spec))
    device = torch.device("cpu")
    flags = msg.requires_grad
    for i, t in enumerate(tensors):
        if t is None:
            continue
        ndim = t.dim()
        if ndim > MAX_DIMS:
            raise CommError(f"a {k.describe()} holds a {ndim}-d tensor; at most {MAX_DIMS} dims")
        rg = int(flags[i]) if i < len(flags) else 0
        descs.append((i, 1, dtype_code(t.dtype), rg, ndim, *t.shape))
        if not raws:
            device = t.device
        raw = flat_bytes(t)
        raws.append((offset, raw))
        offset += _pad(raw.nbytes)
    inline = offset <= capacity and device.type == "cpu"
    head = (MAGIC, k.kind, k.step, k.mb, k.src_stage, k.dst_stage, src_rank, len(tensors),
            len(spec), offset, op, int(device.type != "cpu"), int(inline), int(one_tensor))
    if not inline:
        first, array = new_bytes(HEADER_BYTES)
        _header_into(array, head, descs)
        return first, _payload(spec, raws, offset, device, 0), offset
    # written through numpy: plain byte writes, no tensor op each (a few µs on cold caches)
    out, buffer = new_bytes(HEADER_BYTES + offset)
    _header_into(buffer, head, descs)
    end = HEADER_BYTES
    if spec:
        buffer[end:end + len(spec)] = memoryview(spec)
        end += len(spec)
    for at, raw in raws:
        at += HEADER_BYTES
        buffer[end:at] = 0  # the padding: no stale bytes on the wire
        end = at + raw.nbytes
        buffer[at:end] = raw
    buffer[end:] = 0
    return out, None, offset


def new_bytes(n: int) -> tuple[torch.Tensor, Any]:
    """A buffer of ``n`` bytes for gloo to send or receive, and numpy's array over it (what
    pipetrain writes and reads).

    torch owns the memory, not numpy: gloo's threads may drop a buffer at the process's exit
    (a receive kept posted for a peer's ABORT, a send of a failed step), and a tensor over a
    numpy array then needs the GIL of an interpreter that is shutting down, which aborts the
    process ("terminate called without an active exception", seen under torchrun).
    """
    tensor = torch.empty(n, dtype=torch.uint8)
    return tensor, tensor.numpy()


def flat_bytes(t: torch.Tensor) -> Any:
    """``t``'s bytes, flat: a numpy array on the CPU (byte copies without a tensor operation
    each; a copy only where ``t`` is not contiguous), else a uint8 tensor on its device."""
    if not t.is_cpu:
        return t.detach().reshape(-1).view(torch.uint8)
    if t.dtype in _NP_OF:  # (force: detached, conjugate and negative bits resolved)
        return t.numpy(force=True).reshape(-1).view(np.uint8)
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _header_into(buffer: Any, head: tuple[int, ...], descs: list[tuple[int, ...]]) -> None:
    """Write a header (its fixed fields, then each present tensor's) at the start of ``buffer``."""
    buffer[:HEADER_BYTES] = 0
    _HEAD.pack_into(buffer, 0, *head)
    for i, *desc in descs:
        _DESC[desc[3]].pack_into(buffer, (_FIXED + i * _PER_TENSOR) * 8, *desc)


def _payload(spec: bytes, raws: list[tuple[int, Any]], size: int,
             device: torch.device, start: int) -> torch.Tensor:
    """A buffer of ``size`` bytes holding the spec and the tensors from byte ``start`` on."""
    out = torch.empty(size, dtype=torch.uint8, device=device)
    end = start
    if spec:
        out[start:start + len(spec)] = torch.frombuffer(bytearray(spec), dtype=torch.uint8
                                                        ).to(device)
        end = start + len(spec)
    for at, raw in raws:
        if end < start + at:
            out[end:start + at].zero_()  # the padding: no stale bytes on the wire
        end = start + at + raw.nbytes
        out[start + at:end].copy_(torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw)
    if end < size:
        out[end:].zero_()
    return out


def new_frame(capacity: int = INLINE_BYTES) -> torch.Tensor:
    """An empty buffer to receive a header and up to ``capacity`` payload bytes into.

    Its header is zeroed: a send too short to hold a header leaves no stale one to be read.
    """
    return new_buffer(capacity)[0]


def new_buffer(capacity: int = INLINE_BYTES) -> tuple[torch.Tensor, Any]:
    """:func:`new_frame`, and a numpy array over the same memory (what a receiver reads)."""
    frame, buffer = new_bytes(HEADER_BYTES + capacity)
    buffer[:HEADER_BYTES] = 0
    return frame, buffer


def read_header(frame: Bytes) -> list[int]:
    """The header integers at the start of a received buffer (a tensor or its numpy array: the
    fixed fields, and those of the tensors it says it holds; the rest reads 0)."""
    buffer = frame if isinstance(frame, np.ndarray) else frame.numpy()
    values = list(_FIXED_FIELDS.unpack_from(buffer.data, 0))
    n = _tensors(values)
    values += _TENSOR_FIELDS[n].unpack_from(buffer.data, _FIXED * 8) if n else ()
    values += [0] * (HEADER_LEN - len(values))
    return values


def _tensors(header: Sequence[int]) -> int:
    """How many tensors' fields a header's reader reads (its claim, within bounds)."""
    return min(max(header[7], 0), MAX_TENSORS)


def described(header: Sequence[int]) -> int:
    """Where a read header's fields end: the fixed ones, then those of the tensors it says it
    holds (the bytes after are never read)."""
    return (_FIXED + _tensors(header) * _PER_TENSOR) * 8


def expected_bytes(header: Sequence[int]) -> int:
    """Payload size implied by the header's tensor descriptions (to cross-check its claim).

    Returns -1 for a header that describes no valid payload (too many tensors, a negative
    spec length, an unknown dtype code, a bad number of dims or a negative dim).
    """
    if not (0 <= header[7] <= MAX_TENSORS) or header[8] < 0:
        return -1
    total = _pad(header[8])
    for i in range(header[7]):
        base = _FIXED + i * _PER_TENSOR
        if not header[base]:
            continue
        code, ndim = header[base + 1], header[base + 3]
        if not (0 <= code < len(DTYPES)) or not (0 <= ndim <= MAX_DIMS):
            return -1
        numel = 1
        for d in header[base + 4: base + 4 + ndim]:
            if d < 0:
                return -1
            numel *= d
        total += _pad(numel * DTYPES[code].itemsize)
    return total


def inline_payload(header: Sequence[int], frame: Bytes) -> Bytes | None:
    """The payload bytes behind the header in ``frame`` (a tensor, or its numpy array), or
    None when it travels separately.

    Raises:
        CommError: when the header claims more bytes behind it than ``frame`` has room for.
    """
    if not header[12]:
        return None
    room = len(frame) - HEADER_BYTES
    if header[9] > room:
        raise CommError(f"the header claims {header[9]} payload bytes in the same message, but "
                        f"only {room} were agreed")
    return frame[HEADER_BYTES:HEADER_BYTES + header[9]]


Layout = list[tuple[int, int, torch.dtype, Sequence[int], bool] | None]
"""Per tensor of a message: its (offset, bytes, dtype, shape, requires_grad) in the payload,
or None where the message holds no tensor."""


def layout(header: Sequence[int]) -> Layout:
    """Where a validated header's tensors lie in its payload."""
    offset = _pad(header[8])
    out: Layout = []
    for i in range(header[7]):
        base = _FIXED + i * _PER_TENSOR
        if not header[base]:
            out.append(None)
            continue
        dtype, ndim = DTYPES[header[base + 1]], header[base + 3]
        shape = header[base + 4: base + 4 + ndim]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        out.append((offset, nbytes, dtype, shape, bool(header[base + 2])))
        offset += _pad(nbytes)
    return out


def read_spec(header: Sequence[int], payload: Bytes) -> Any:
    """The payload structure a validated header's message carries (None: a plain list)."""
    spec_len = header[8]
    if header[13]:
        return _ONE_TENSOR
    if not spec_len:
        return None
    data = payload[:spec_len]
    return spec_from_bytes(data.tobytes() if isinstance(data, np.ndarray)
                           else bytes(data.cpu().tolist()))


def views(key: Key, payload: Bytes, where: Layout, spec: Any) -> Message:
    """The message whose tensors lie in ``payload`` as ``where`` says (views, no copies).

    A numpy ``payload`` (a CPU receive) gives each tensor through numpy's slicing and one
    ``torch.from_numpy``: a third of the tensor ops of slicing a tensor."""
    tensors: list[torch.Tensor | None] = []
    flags: list[bool] = []
    raw = isinstance(payload, np.ndarray)
    for entry in where:
        if entry is None:
            tensors.append(None)
            flags.append(False)
            continue
        offset, nbytes, dtype, shape, requires_grad = entry
        if raw and dtype in _NP_OF:  # one numpy array over the bytes, of the right dtype
            tensors.append(torch.from_numpy(np.ndarray(shape, _NP_OF[dtype], payload, offset)))
        elif raw:
            tensors.append(torch.from_numpy(payload[offset: offset + nbytes]).view(dtype)
                           .view(shape))
        else:
            tensors.append(payload[offset: offset + nbytes].view(dtype).view(shape))
        flags.append(requires_grad)
    return Message(key, tensors, spec, flags)


def decode(header: Sequence[int], payload: Bytes) -> Message:
    """Rebuild the message from a validated header and its payload (views, no copies)."""
    key = Key(header[1], header[2], header[3], header[4], header[5])
    return views(key, payload, layout(header), read_spec(header, payload))
