"""Comm: stage-to-stage messages over torch.distributed point-to-point, checked, bounded, no pickle.

Every message is a fixed-size int64 header followed by one uint8 payload::

    header  [magic, kind, step, mb, src_stage, dst_stage, src_rank, n_tensors,
             spec_bytes, payload_bytes, op, on_device, 0...,  then per tensor:
             present, dtype, requires_grad, ndim, dim0..dim7]
    payload [JSON spec | pad | tensor 0 bytes | pad | tensor 1 bytes | ...]   (16-byte aligned)

The receiver knows, from the schedule, the exact sequence of messages each peer will send it
in a step, so one receiver thread per peer posts each receive ahead of need (communication
overlaps compute) and checks every header against what it expects before touching the payload.
Headers and CPU payloads travel over a gloo group; payloads on a GPU travel over one NCCL group
per direction of each rank pair, so that a posted receive can never block a send queued behind
it on the same NCCL stream. Sends are asynchronous. The main thread waits for a message with a
deadline, so a dead, stuck or failed peer becomes a :class:`CommError` instead of a hang. A
rank that fails sends an ABORT header to every peer, which makes them fail at once with the
origin named.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.payload import DTYPES, dtype_code, spec_from_bytes, spec_to_bytes

__all__: list[str] = []

HEADER_LEN = 256
_FIXED = 16
_PER_TENSOR = 12
MAX_TENSORS = (HEADER_LEN - _FIXED) // _PER_TENSOR
MAX_DIMS = 8
_MAGIC = 0x70697065  # "pipe"
_TAG_HEADER, _TAG_PAYLOAD = 17, 18
ACT, GRAD, DONE, ABORT = 1, 2, 3, 4
KIND_NAMES = {ACT: "activation", GRAD: "gradient", DONE: "end-of-step", ABORT: "abort"}
OPS = "FBIW"


@dataclass(frozen=True)
class Key:
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


def encode(msg: Message, src_rank: int, op: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Header (CPU) and payload (on the device of the message's tensors) for ``msg``."""
    tensors = msg.tensors
    device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if len(tensors) > MAX_TENSORS:
        raise CommError(f"a {msg.key.describe()} holds {len(tensors)} tensors; at most "
                        f"{MAX_TENSORS} fit one message (pack them into fewer tensors)")
    spec = spec_to_bytes(msg.spec) if msg.spec is not None else b""
    h = [0] * HEADER_LEN
    k = msg.key
    h[:11] = [_MAGIC, k.kind, k.step, k.mb, k.src_stage, k.dst_stage, src_rank, len(tensors),
              len(spec), 0, op]
    parts: list[torch.Tensor] = []
    offset = _pad(len(spec))
    if spec:
        parts.append(_bytes_tensor(spec, offset, device))
    for i, t in enumerate(tensors):
        base = _FIXED + i * _PER_TENSOR
        if t is None:
            continue
        if t.dim() > MAX_DIMS:
            raise CommError(f"a {k.describe()} holds a {t.dim()}-d tensor; at most {MAX_DIMS} dims")
        rg = msg.requires_grad[i] if i < len(msg.requires_grad) else False
        h[base:base + 4 + t.dim()] = [1, dtype_code(t.dtype), int(rg), t.dim(), *t.shape]
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        nbytes = raw.numel()
        offset += nbytes
        if _pad(nbytes) != nbytes:
            parts.append(torch.zeros(_pad(nbytes) - nbytes, dtype=torch.uint8, device=device))
            offset += _pad(nbytes) - nbytes
    h[9] = offset
    h[11] = int(device.type != "cpu")
    header = torch.tensor(h, dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.uint8, device=device)
    payload = torch.cat([p.to(device) for p in parts]) if parts else empty
    return header, payload


def _bytes_tensor(data: bytes, size: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(size, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def expected_bytes(header: list[int]) -> int:
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


def decode(header: list[int], payload: torch.Tensor) -> Message:
    """Rebuild the message from a validated header and its payload."""
    key = Key(header[1], header[2], header[3], header[4], header[5])
    spec_len = header[8]
    spec = spec_from_bytes(bytes(payload[:spec_len].cpu().tolist())) if spec_len else None
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
        t = payload[offset: offset + nbytes].view(dtype).view(shape)
        tensors.append(t)
        flags.append(bool(header[base + 2]))
        offset += _pad(nbytes)
    return Message(key, tensors, spec, flags)


class PeerFailed(CommError):
    """A peer reported its own failure (ABORT); this rank only relays the news."""


class Mailbox:
    """Messages that arrived, and the first error any receiver hit, guarded by one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[Key, Message] = {}
        self.error: BaseException | None = None

    def put(self, msg: Message) -> None:
        with self.cond:
            self.items[msg.key] = msg
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def take(self, key: Key, deadline: float, describe: str) -> Message:
        with self.cond:
            while key not in self.items:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommError(f"{describe}: timed out waiting for the {key.describe()}")
                self.cond.wait(left)
            return self.items.pop(key)


class P2P:
    """Point-to-point transport of one rank: async sends, one receiver thread per peer per step."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, n_ranks: int,
                 device: torch.device, timeout: float, max_message_bytes: int) -> None:
        self.group, self.rank, self.n_ranks = group, rank, n_ranks
        self.device, self.timeout, self.max_bytes = device, timeout, max_message_bytes
        self.cpu_group, self.device_groups = _groups(group, n_ranks, device)
        self.mailbox = Mailbox()
        self._sends: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self._threads: list[threading.Thread] = []

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def start_step(self, expected: dict[int, list[Key]]) -> None:
        """Post the receives of one step: ``expected[peer]`` in the order that peer sends."""
        self.mailbox = Mailbox()
        self._threads = [
            threading.Thread(target=self._receive, args=(peer, keys, self.mailbox), daemon=True,
                             name=f"pipetrain-recv-{peer}")
            for peer, keys in expected.items() if keys
        ]
        for t in self._threads:
            t.start()

    def send(self, dst_rank: int, msg: Message, op: int = 0) -> None:
        header, payload = encode(msg, self.rank, op)
        dst = self._global(dst_rank)
        w1 = dist.isend(header, dst=dst, group=self.cpu_group, tag=_TAG_HEADER)
        w2 = dist.isend(payload, dst=dst, group=self._payload_group(self.rank, dst_rank, payload),
                        tag=_TAG_PAYLOAD)
        self._sends.append((w1, header, payload))
        self._sends.append((w2, header, payload))

    def _payload_group(self, src: int, dst: int, payload: torch.Tensor
                       ) -> dist.ProcessGroup | None:
        return self.device_groups[(src, dst)] if payload.device.type != "cpu" else self.cpu_group

    def recv(self, key: Key, describe: str) -> Message:
        return self.mailbox.take(key, time.monotonic() + self.timeout, describe)

    def finish_step(self, describe: str) -> None:
        """Wait for every send and receiver thread of this step, within the timeout."""
        deadline = time.monotonic() + self.timeout
        for w, _, _ in self._sends:
            try:
                w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as e:
                raise CommError(f"{describe}: a send did not complete: {e}") from None
        self._sends.clear()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise CommError(f"{describe}: receiver {t.name} still waiting at step end")
        if self.mailbox.error is not None:
            raise self.mailbox.error

    def abort(self, step: int, stage: int, mb: int, op: int, text: str) -> None:
        """Tell every peer this rank failed (best effort, bounded), so they fail fast too."""
        raw = bytearray(text.encode()[:4096] or b" ")
        msg = Message(Key(ABORT, step, mb, stage, -1), [torch.frombuffer(raw, dtype=torch.uint8)])
        works = []
        for peer in range(self.n_ranks):
            if peer == self.rank:
                continue
            try:
                header, payload = encode(msg, self.rank, op)
                dst = self._global(peer)
                works.append(dist.isend(header, dst=dst, group=self.cpu_group, tag=_TAG_HEADER))
                works.append(dist.isend(payload, dst=dst, group=self.cpu_group, tag=_TAG_PAYLOAD))
            except RuntimeError:
                continue
        deadline = time.monotonic() + 2.0
        for w in works:
            try:
                if w is not None:
                    w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:
                pass

    # -- receiver thread -------------------------------------------------------------------
    def _receive(self, peer: int, keys: list[Key], box: Mailbox) -> None:
        src = self._global(peer)
        for key in keys:
            try:
                msg = self._receive_one(src, peer, key)
            except BaseException as e:  # noqa: BLE001  (handed to the main thread)
                box.fail(e)
                return
            if msg is None:
                return
            box.put(msg)

    def _receive_one(self, src: int, peer: int, key: Key) -> Message | None:
        where = f"rank {self.rank} receiving the {key.describe()} from rank {peer}"
        header_t = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._wait(dist.irecv(header_t, src=src, group=self.cpu_group, tag=_TAG_HEADER), where)
        header = header_t.tolist()
        if header[0] != _MAGIC:
            raise CommError(f"{where}: received a header without pipetrain's magic number")
        size = header[9]
        if not (0 <= size <= self.max_bytes) or expected_bytes(header) != size:
            raise CommError(f"{where}: the header claims {size} payload bytes but describes "
                            f"{expected_bytes(header)} (limit {self.max_bytes}); refusing it")
        on_device = bool(header[11]) and self.device.type != "cpu"
        payload = torch.empty(size, dtype=torch.uint8,
                              device=self.device if on_device else torch.device("cpu"))
        group = self.device_groups[(peer, self.rank)] if on_device else self.cpu_group
        self._wait(dist.irecv(payload, src=src, group=group, tag=_TAG_PAYLOAD), where)
        msg = decode(header, payload)
        if msg.key.kind == ABORT:
            raise _abort_error(peer, header, msg)
        if msg.key != key:
            raise CommError(f"{where}: received the {msg.key.describe()} instead; the ranks "
                            "disagree on the schedule or on the step (did a rank skip a step?)")
        return msg

    def _wait(self, work: Any, where: str) -> None:
        if work is None:
            raise CommError(f"{where}: this rank is not part of the pipeline group")
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            text = str(e)
            reason = ("timed out" if "Timed out" in text or "timeout" in text.lower()
                      else "the peer closed the connection (did its process die?)")
            raise CommError(f"{where}: {reason} [{text.splitlines()[0][:200]}]") from None


def _groups(group: dist.ProcessGroup | None, n_ranks: int, device: torch.device
            ) -> tuple[dist.ProcessGroup | None, dict[tuple[int, int], dist.ProcessGroup]]:
    """A gloo group for headers, and on GPUs one NCCL group per ordered pair of ranks."""
    if device.type == "cpu" and dist.get_backend(group) == "gloo":
        return group, {}
    members = [dist.get_global_rank(group, r) if group is not None else r for r in range(n_ranks)]
    me = dist.get_rank(group)
    cpu_group = dist.new_group(members, backend="gloo", use_local_synchronization=True)
    pairs: dict[tuple[int, int], dist.ProcessGroup] = {}
    for a in range(n_ranks):
        for b in range(n_ranks):
            if a != b and me in (a, b):
                pg = dist.new_group([members[a], members[b]], use_local_synchronization=True)
                if pg is not None:
                    pairs[(a, b)] = pg
    return cpu_group, pairs


def _abort_error(peer: int, header: list[int], msg: Message) -> PeerFailed:
    t = msg.tensors[0]
    text = bytes(t.cpu().tolist()).decode(errors="replace") if t is not None else ""
    op = OPS[header[10]] if 0 <= header[10] < len(OPS) else "?"
    stage, mb, step = header[4], header[3], header[2]
    where = (f"at stage {stage}, mb {mb}, action {stage}{op}{mb}" if stage >= 0
             else "outside any action")
    return PeerFailed(f"rank {peer} failed {where} (step {step}): {text}")
