"""Wire: the byte layout of one stage-to-stage message, a fixed-size frame and maybe a payload.

Every message starts with one frame of ``FRAME_BYTES`` bytes; a payload that does not fit in
the frame (or lives on a GPU) follows as a second message::

    frame    [header: 256 x int64 | inline payload, up to INLINE_BYTES]
    header   [magic, kind, step, mb, src_stage, dst_stage, src_rank, n_tensors,
              spec_bytes, payload_bytes, op, on_device, inline, one_tensor, 0, 0,  per tensor:
              present, dtype, requires_grad, ndim, dim0..dim7]
    payload  [JSON spec | pad | tensor 0 bytes | pad | tensor 1 bytes | ...]   (16-byte aligned)

(``one_tensor``: the payload is one tensor, the usual activation or gradient, and its spec is
implied.) Frames have one size, so a receiver can post the receive of the next frame before the
sender has produced it; gloo moves the bytes of a send only once the matching receive is posted,
so a message that fits in its frame arrives in one transfer instead of a header/payload round
trip. Nothing is pickled: the payload's structure travels as JSON, tensors as raw bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from pipetrain.errors import CommError
from pipetrain.payload import DTYPES, dtype_code, spec_from_bytes, spec_to_bytes

__all__: list[str] = []

HEADER_LEN = 256
HEADER_BYTES = HEADER_LEN * 8
FRAME_BYTES = 8192
INLINE_BYTES = FRAME_BYTES - HEADER_BYTES
_FIXED = 16
_PER_TENSOR = 12
MAX_TENSORS = (HEADER_LEN - _FIXED) // _PER_TENSOR
MAX_DIMS = 8
MAGIC = 0x70697065  # "pipe"
ACT, GRAD, DONE, ABORT = 1, 2, 3, 4
KIND_NAMES = {ACT: "activation", GRAD: "gradient", DONE: "end-of-step", ABORT: "abort"}
OPS = "FBIW"

_HEAD = struct.Struct("<14q")
_HEADER = struct.Struct(f"<{HEADER_LEN}q")
_DESC = [struct.Struct(f"<{4 + n}q") for n in range(MAX_DIMS + 1)]
_ONE_TENSOR = {"t": 0}  # the spec of a payload that is one tensor: the common case


class Key(NamedTuple):
    """Identity of one message: what it carries, for which step, micro-batch and stages."""

    kind: int
    step: int
    mb: int
    src_stage: int
    dst_stage: int

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


def _pad(n: int) -> int:
    return (n + 15) // 16 * 16


def encode(msg: Message, src_rank: int, op: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frame of ``msg`` (CPU) and its separate payload, or None when the payload is inline.

    Raises:
        CommError: for more than ``MAX_TENSORS`` tensors or a tensor of more than 8 dims.
    """
    tensors, k = msg.tensors, msg.key
    if len(tensors) > MAX_TENSORS:
        raise CommError(f"a {k.describe()} holds {len(tensors)} tensors; at most "
                        f"{MAX_TENSORS} fit one message (pack them into fewer tensors)")
    one_tensor = msg.spec == _ONE_TENSOR
    spec = b"" if msg.spec is None or one_tensor else spec_to_bytes(msg.spec)
    buf = bytearray(FRAME_BYTES)
    raws: list[tuple[int, torch.Tensor]] = []
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
        _DESC[ndim].pack_into(buf, (_FIXED + i * _PER_TENSOR) * 8, 1, dtype_code(t.dtype), rg,
                              ndim, *t.shape)
        if not raws:
            device = t.device
        raw = t.detach().contiguous().view(-1).view(torch.uint8)
        raws.append((offset, raw))
        offset += _pad(raw.numel())
    inline = offset <= INLINE_BYTES and device.type == "cpu"
    _HEAD.pack_into(buf, 0, MAGIC, k.kind, k.step, k.mb, k.src_stage, k.dst_stage, src_rank,
                    len(tensors), len(spec), offset, op, int(device.type != "cpu"), int(inline),
                    int(one_tensor))
    if inline:
        buf[HEADER_BYTES:HEADER_BYTES + len(spec)] = spec
    frame = torch.frombuffer(buf, dtype=torch.uint8)
    if inline:
        for at, raw in raws:
            frame[HEADER_BYTES + at:HEADER_BYTES + at + raw.numel()].copy_(raw)
        return frame, None
    return frame, _payload(spec, raws, offset, device)


def _payload(spec: bytes, raws: list[tuple[int, torch.Tensor]], size: int,
             device: torch.device) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8, device=device)
    if spec:
        out[:len(spec)] = torch.frombuffer(bytearray(spec), dtype=torch.uint8).to(device)
    for at, raw in raws:
        out[at:at + raw.numel()].copy_(raw)
    return out


def new_frame() -> tuple[bytearray, torch.Tensor]:
    """An empty frame to receive into: its bytes (to read the header) and a tensor on them."""
    buf = bytearray(FRAME_BYTES)
    return buf, torch.frombuffer(buf, dtype=torch.uint8)


def read_header(frame: bytearray | bytes) -> tuple[int, ...]:
    """The header integers at the start of a frame."""
    return _HEADER.unpack_from(frame)


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


def inline_payload(header: Sequence[int], frame: torch.Tensor) -> torch.Tensor | None:
    """The payload bytes inside ``frame``, or None when the payload travels separately."""
    if not header[12]:
        return None
    return frame[HEADER_BYTES:HEADER_BYTES + header[9]]


def decode(header: Sequence[int], payload: torch.Tensor) -> Message:
    """Rebuild the message from a validated header and its payload (views, no copies)."""
    key = Key(header[1], header[2], header[3], header[4], header[5])
    spec_len = header[8]
    spec = ({"t": 0} if header[13] else
            spec_from_bytes(bytes(payload[:spec_len].cpu().tolist())) if spec_len else None)
    offset = _pad(spec_len)
    tensors: list[torch.Tensor | None] = []
    flags: list[bool] = []
    for i in range(header[7]):
        base = _FIXED + i * _PER_TENSOR
        if not header[base]:
            tensors.append(None)
            flags.append(False)
            continue
        dtype, ndim = DTYPES[header[base + 1]], header[base + 3]
        shape = header[base + 4: base + 4 + ndim]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        tensors.append(payload[offset: offset + nbytes].view(dtype).view(shape))
        flags.append(bool(header[base + 2]))
        offset += _pad(nbytes)
    return Message(key, tensors, spec, flags)

