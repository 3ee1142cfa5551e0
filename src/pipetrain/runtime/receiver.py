"""Receiver: one peer's messages to this rank, received on a long-lived thread of their own.

The thread is handed, at the start of each step, the exact sequence of messages the peer sends
this rank (from the schedule). It keeps the receive of the next message posted ahead of need,
sized by the direction's agreed capacity, checks each header against the message it expects
before touching the payload, and leaves the decoded message in the rank's mailbox. An ABORT
frame from the peer fails the mailbox with the peer's news (:class:`PeerFailed`).
:mod:`pipetrain.runtime.comm` owns the receivers and the sends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.runtime.groups import Channel, rank_name
from pipetrain.runtime.mailbox import Mailbox
from pipetrain.runtime.wire import (
    ABORT,
    FRAME_BYTES,
    HEADER_BYTES,
    MAGIC,
    OPS,
    Capacity,
    Key,
    Message,
    decode,
    expected_bytes,
    inline_payload,
    new_frame,
    read_header,
)

__all__: list[str] = []

Plan = Sequence[tuple[int, int, int, int]]  # (kind, mb, src_stage, dst_stage) of each message
RELAY = -2  # the destination stage of an ABORT that passes on another rank's failure


class PeerFailed(CommError):
    """A peer reported its own failure (ABORT); this rank only relays the news."""


class PeerClosed(CommError):
    """A peer's process closed its connection to this rank: it died, or its own wait for this
    rank timed out. ``peer``: its pipeline rank (-1 when unknown)."""

    def __init__(self, text: str, peer: int = -1) -> None:
        super().__init__(text)
        self.peer = peer


class Relayed(Exception):
    """A peer passed on another rank's failure: the origin's own ABORT reaches only the ranks
    it exchanges messages with, so this may be the first news of it here."""

    def __init__(self, error: PeerFailed) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Link:
    """What a receiver needs of the transport: groups, device, limits (no back-reference)."""

    rank: int
    me: str  # this rank, as the job knows it (P2P.name)
    up: Channel  # messages to a higher rank (the pipeline's gloo group), by group rank
    down: Channel  # messages to a lower rank (its twin)
    device_groups: dict[tuple[int, int], dist.ProcessGroup]
    device: torch.device
    timeout: float
    max_bytes: int
    frame_tag: int
    payload_tag: int

    def to(self, dst: int) -> Channel:
        """The gloo group of this rank's messages to rank ``dst``."""
        return self.up if dst > self.rank else self.down

    def from_(self, src: int) -> Channel:
        """The gloo group of rank ``src``'s messages to this rank."""
        return self.up if self.rank > src else self.down


class Receiver:
    """The messages of one peer: a long-lived thread, idle between steps.

    An idle thread holds no reference to the process groups (each step's job brings them), so
    a job that ends with ``destroy_process_group`` really frees them.
    """

    def __init__(self, peer: int, src: int, box: Mailbox) -> None:
        self.peer, self.src, self.box = peer, src, box
        self.capacity = Capacity()  # of this peer's messages to this rank, across steps
        self.jobs: queue.SimpleQueue[tuple[Link, int, Plan, Key] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"pipetrain-recv-{peer}")
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                Incoming(job[0], self.peer, self.src, self.box, self.capacity
                          ).step(*job[1:])
            except Relayed as e:  # the first error in the mailbox wins: the origin's, if here
                self.box.fail(e.error)
                return
            except BaseException as e:  # noqa: BLE001  (handed to the main thread)
                self.box.fail(e)
                return
            del job


class Incoming:
    """One step of one peer's messages: the receive of the next message is kept posted."""

    def __init__(self, link: Link, peer: int, src: int, box: Mailbox,
                 capacity: Capacity) -> None:
        self.link, self.peer, self.src, self.box = link, peer, src, box
        self.capacity = capacity

    def _post(self) -> tuple[torch.Tensor, Any]:
        frame = new_frame(self.capacity.bytes)  # what the peer's copy allows it to send
        group = self.link.from_(self.peer)
        return frame, group.recv([frame], self.peer, self.link.frame_tag)

    def receive(self, key: Key, posted: tuple[torch.Tensor, Any]) -> Message:
        """Wait for a message posted earlier, check it against ``key`` and decode it."""
        frame, work = posted
        self._wait(work, key)
        return self._unpack(key, frame)

    def step(self, step: int, plan: Plan, last: Key) -> None:
        """Receive ``plan``'s messages; post the receive of ``last`` and hand it over."""
        ahead = self._post()
        for kind, mb, src_stage, dst_stage in plan:
            key = Key(kind, step, mb, src_stage, dst_stage)
            msg = self.receive(key, ahead)
            ahead = self._post()  # the next message: the step's last one, at the end
            self.box.put(msg)
        self.box.hand_over(last, ahead)

    def _where(self, key: Key) -> str:
        return (f"{self.link.me} receiving the {key.describe()} from "
                f"{rank_name(self.peer, self.src)}")

    def _unpack(self, key: Key, frame: torch.Tensor) -> Message:
        header = read_header(frame)
        if header[0] != MAGIC:
            raise CommError(f"{self._where(key)}: received a message without pipetrain's magic "
                            "number")
        size = header[9]
        if not (0 <= size <= self.link.max_bytes) or expected_bytes(header) != size:
            raise CommError(f"{self._where(key)}: the header claims {size} payload bytes but "
                            f"describes {expected_bytes(header)} (limit {self.link.max_bytes}); "
                            "refusing it")
        try:
            payload = inline_payload(header, frame)
        except CommError as e:
            raise CommError(f"{self._where(key)}: {e}; refusing it") from None
        if payload is None:
            room = frame.numel() - HEADER_BYTES
            if size <= room and not header[11]:  # an honest sender put it behind the header
                raise CommError(f"{self._where(key)}: the header sends {size} payload bytes "
                                f"separately although the agreed {room} hold them; refusing it")
            payload = self._receive_payload(key, header, size)
        elif frame.numel() > FRAME_BYTES and 2 * size < frame.numel():
            payload = payload.clone()  # a small message in a large receive: free the rest now
        self.capacity.record(size, bool(header[11]))  # before the next receive is posted
        msg = decode(header, payload)
        if msg.key.kind == ABORT:
            error = abort_error(self.peer, self.src, header, msg)
            raise Relayed(error) if msg.key.dst_stage == RELAY else error
        if msg.key != key:
            raise CommError(f"{self._where(key)}: received the {msg.key.describe()} instead; "
                            "the ranks disagree on the schedule or on the step (did a rank skip "
                            "a step?)")
        return msg

    def _receive_payload(self, key: Key, header: Sequence[int], size: int) -> torch.Tensor:
        link = self.link
        on_device = bool(header[11]) and link.device.type != "cpu"
        payload = torch.empty(size, dtype=torch.uint8,
                              device=link.device if on_device else torch.device("cpu"))
        work = (dist.irecv(payload, src=self.src, group=link.device_groups[(self.peer, link.rank)],
                           tag=link.payload_tag) if on_device
                else link.from_(self.peer).recv([payload], self.peer, link.payload_tag))
        self._wait(work, key)
        return payload

    def _wait(self, work: Any, key: Key) -> None:
        if work is None:
            raise CommError(f"{self._where(key)}: this rank is not part of the pipeline group")
        try:
            work.wait(timedelta(seconds=self.link.timeout))
        except RuntimeError as e:
            text = str(e)
            where, first = self._where(key), text.splitlines()[0][:200]
            if "Timed out" in text or "timeout" in text.lower():
                raise CommError(f"{where}: timed out [{first}]") from None
            raise PeerClosed(f"{where}: the peer closed the connection (did its process die?) "
                             f"[{first}]", self.peer) from None


def abort_error(peer: int, src: int, header: Sequence[int], msg: Message) -> PeerFailed:
    t = msg.tensors[0]
    text = bytes(t.cpu().tolist()).decode(errors="replace") if t is not None else ""
    relayed = [f"{name}: " for name in ("PeerFailed", "JobFailed")]
    if header[5] == RELAY and text.startswith(tuple(relayed)):  # the origin's news, passed on
        text = text.split(": ", 1)[1]
        return PeerFailed(text if "[passed on by rank" in text
                          else f"{text} [passed on by {rank_name(peer, src)}]")
    op = OPS[header[10]] if 0 <= header[10] < len(OPS) else "?"
    stage, mb, step = header[4], header[3], header[2]
    where = (f"at stage {stage}, mb {mb}, action {stage}{op}{mb}" if stage >= 0
             else "outside any action")
    return PeerFailed(f"{rank_name(peer, src)} failed {where} (step {step}): {text}")
