"""Receiver: the messages peers send this rank, received by the main thread as actions need them.

The schedule says, for each peer, the exact sequence of messages it sends this rank in a step.
The receive of each peer's next message is kept posted (gloo's own socket thread fills it while
this rank computes); when an action needs a message, the main thread waits on that receive
itself, checks the header against the message it expects before touching the payload, decodes
it and posts the peer's next receive. A message that arrives ahead of its action (a peer sends
in another order than this rank consumes) is kept by key until asked for::

    start_step ──► post peer 0's message 0, peer 1's message 0, ...
    recv(key)  ──► kept? take it : wait on the sender's posted receive, check, decode,
                                   post its next; repeat until ``key`` came

A received message's tensors are views of its frame. The frame goes to the peer's spares, and
a later receive is posted into it once no tensor of that message is left (:func:`_free_frame`):
no allocation per message in a steady step.

No pipetrain thread touches a message: the one that needs it receives it. An ABORT frame from
a peer fails the wait with the peer's news (:class:`PeerFailed`). A receive whose wait failed
stays posted for good (``_UNCLAIMED``). :mod:`pipetrain.runtime.transport.comm` owns the sends.
"""

from __future__ import annotations

import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.runtime import lifetime
from pipetrain.runtime.transport.groups import Channel, rank_name
from pipetrain.runtime.transport.wire import (
    ABORT,
    FRAME_BYTES,
    HEADER_BYTES,
    KEEP,
    KEEP_BYTES,
    MAGIC,
    OPS,
    Capacity,
    Key,
    Layout,
    Message,
    described,
    expected_bytes,
    inline_payload,
    layout,
    new_buffer,
    read_header,
    read_spec,
    views,
)

__all__: list[str] = []

Plan = Sequence[tuple[int, int, int, int]]  # (kind, mb, src_stage, dst_stage) of each message
RELAY = -2  # the destination stage of an ABORT that passes on another rank's failure
Describe = Callable[[], str]


class KnownForm(NamedTuple):
    """The form of a peer's last message of one (kind, src stage, dst stage): a message of the
    same form needs no header checks nor spec decoding (:meth:`Receiver._known_form`)."""

    lead: bytes
    """The header's bytes after its magic and key, up to the spec (all but step and mb)."""
    size: int
    """Payload bytes."""
    spec_bytes: bytes
    """The encoded spec, compared with the new message's."""
    where: Layout
    """Where each tensor lies in the payload."""
    spec: Any
    """The decoded spec."""

_LEAD = struct.Struct("<6q")  # magic and key: what differs between messages alike
_CUT_TAG = 1 << 30  # above every pipeline's tags (17 + 3n ...): nothing is ever sent on it
_CUT_WAIT = timedelta(milliseconds=1)

_UNCLAIMED: list[Any] = []
"""Posted receives whose step failed, kept for good.

gloo must never see a posted receive's buffer freed: a message that arrives for it later (a
peer's relayed ABORT) then stalls that pair of ranks, and every later pipeline over them times
out. One frame per peer per failed pipeline stays allocated instead.
"""


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

    def cut(self, peer: int) -> None:
        """Close this rank's connections to ``peer`` now, in both groups: a receive posted
        on a tag no message uses, waited for 1 ms (gloo closes a connection whose wait timed
        out), fails every wait still pending on them. For the interpreter's exit after a
        failure (:mod:`~pipetrain.runtime.lifetime`): gloo has no other local way to end a
        posted receive."""
        for channel in {id(c): c for c in (self.up, self.down)}.values():
            frame = torch.empty(1, dtype=torch.uint8)
            _UNCLAIMED.append(frame)  # gloo may hold it until the process ends
            try:
                work = channel.recv([frame], peer, _CUT_TAG)
                if work is not None:
                    work.wait(_CUT_WAIT)
            except RuntimeError:
                continue


class Inbound:
    """One peer's messages to this rank in a step, received by the main thread when it needs one.

    The receive of the peer's next message is always posted (gloo fills it in the background,
    while this rank computes); taking a message checks it, decodes it and posts the next one.
    """

    def __init__(self, link: Link, peer: int, src: int) -> None:
        self.link, self.peer, self.src = link, peer, src
        self.capacity = Capacity()  # of this peer's messages to this rank, across steps
        self.keys: Sequence[Key] = ()  # the step's messages, in the order the peer sends them
        self.next = 0
        self.posted: tuple[torch.Tensor, Any, Any] | None = None
        """The receive posted for the peer's next message: its frame, gloo's work, and a numpy
        array over the frame's memory."""
        self.ended = False
        """The peer sent its ABORT or closed its connection: it sends this rank nothing more."""
        self.spare: list[tuple[torch.Tensor, Any]] = []
        """Frames received into before, each free again once no tensor of its message is left
        (:func:`_free_frame`)."""
        self.known: dict[tuple[int, int, int], KnownForm] = {}
        """Per route (kind, source and destination stage), the peer's last message on it sent
        behind its header: its header after the key (up to its last tensor's fields, all
        that :func:`~pipetrain.runtime.transport.wire.read_header` reads), payload bytes, spec
        bytes,
        layout and spec (a message alike takes no checks)."""

    def begin(self, keys: Sequence[Key], carry: bool = False) -> None:
        """Start a step whose messages from the peer are ``keys``: post the first receive.

        ``carry``: the peer's stream goes on from the step before (an asynchronous schedule,
        whose steps are not closed by a wait for every peer): the messages of that step not
        yet received come first, and their posted receive stays.
        """
        if carry and self.next < len(self.keys):
            self.keys, self.next = [*self.keys[self.next:], *keys], 0
            return
        if self.posted is not None:  # a receive of an earlier step that never completed
            _UNCLAIMED.append(self.posted)
        self.keys, self.next, self.ended = keys, 0, False
        self.posted = self._post() if keys else None

    def expects(self) -> Key | None:
        """The key of the peer's next message this step (None once all arrived)."""
        return self.keys[self.next] if self.next < len(self.keys) else None

    def receive(self, deadline: float, describe: str | Describe) -> Message:
        """The peer's next message (waited for until ``deadline``); posts the one after."""
        key, posted = self.expects(), self.posted
        if key is None or posted is None:
            raise CommError(f"{_text(describe)}: {rank_name(self.peer, self.src)} sends no more "
                            "messages this step")
        frame, work, buffer = posted
        self._wait(work, key, deadline, describe)
        self.posted = None
        self.next += 1
        msg = self._unpack(key, buffer, deadline)
        if self.next < len(self.keys):
            self.posted = self._post()  # after _unpack recorded this message in the capacity
        if buffer.size <= KEEP_BYTES:  # for a later receive, once its message is gone
            self.spare.append((frame, buffer))
            del self.spare[:-KEEP]
        return msg

    def drain(self, deadline: float) -> None:
        """Take the peer's messages until its ABORT, a failed receive or the end of its plan;
        then keep one receive posted for good, where a later ABORT from it lands. A peer that
        ended already (its ABORT was the message that failed this rank) sends nothing more:
        a receive waited for then would wait out the deadline, into the interpreter's exit."""
        if self.ended:
            return
        try:
            while self.expects() is not None:
                self.receive(deadline, "draining")
        except BaseException:  # noqa: BLE001  (its ABORT, or the receive failed and stays posted)
            return
        try:
            _UNCLAIMED.append(self._post())
        except (RuntimeError, CommError):
            return

    def _post(self) -> tuple[torch.Tensor, Any, Any]:
        frame, buffer = (_free_frame(self.spare, HEADER_BYTES + self.capacity.bytes)
                         or new_buffer(self.capacity.bytes))  # what the peer may send
        work = self.link.from_(self.peer).recv([frame], self.peer, self.link.frame_tag)
        if work is None:
            raise CommError(f"{self.link.me}: not part of the pipeline group")
        return frame, work, buffer

    def _where(self, key: Key) -> str:
        return (f"{self.link.me} receiving the {key.describe()} from "
                f"{rank_name(self.peer, self.src)}")

    def _unpack(self, key: Key, buffer: Any, deadline: float) -> Message:
        """The message in a received frame (``buffer``: numpy's array over it), checked."""
        known = self.known.get((key.kind, key.src_stage, key.dst_stage))
        if (known is not None and _LEAD.unpack_from(buffer.data, 0) == (MAGIC, *key)
                and buffer[_LEAD.size:_LEAD.size + len(known.lead)].tobytes() == known.lead
                and known.size <= buffer.size - HEADER_BYTES):
            return self._known_form(key, buffer, known, deadline)
        header = read_header(buffer)
        if header[0] != MAGIC:
            raise CommError(f"{self._where(key)}: received a message without pipetrain's magic "
                            "number")
        size = header[9]
        if not (0 <= size <= self.link.max_bytes) or expected_bytes(header) != size:
            raise CommError(f"{self._where(key)}: the header claims {size} payload bytes but "
                            f"describes {expected_bytes(header)} (limit {self.link.max_bytes}); "
                            "refusing it")
        try:
            payload: Any = inline_payload(header, buffer)
        except CommError as e:
            raise CommError(f"{self._where(key)}: {e}; refusing it") from None
        if payload is None:
            room = buffer.size - HEADER_BYTES
            if size <= room and not header[11]:  # an honest sender put it behind the header
                raise CommError(f"{self._where(key)}: the header sends {size} payload bytes "
                                f"separately although the agreed {room} hold them; refusing it")
            payload = self._receive_payload(key, header, size, deadline)
        elif buffer.size > FRAME_BYTES and 2 * size < buffer.size:
            payload = payload.copy()  # a small message in a large receive: free the rest now
        self.capacity.record(size, bool(header[11]))  # before the next receive is posted
        where, spec = layout(header), read_spec(header, payload)
        msg = views(Key(*header[1:6]), payload, where, spec)
        if msg.key == key and header[12]:
            self.known[(key.kind, key.src_stage, key.dst_stage)] = KnownForm(
                buffer[_LEAD.size:described(header)].tobytes(), size,
                bytes(buffer[HEADER_BYTES:HEADER_BYTES + header[8]]), where, spec)
        if msg.key.kind == ABORT:
            self.ended = True
            error = abort_error(self.peer, self.src, header, msg)
            raise Relayed(error) if msg.key.dst_stage == RELAY else error
        if msg.key != key:
            raise CommError(f"{self._where(key)}: received the {msg.key.describe()} instead; "
                            "the ranks disagree on the schedule or on the step (did a rank skip "
                            "a step?)")
        return msg

    def _known_form(self, key: Key, buffer: Any, known: KnownForm, deadline: float) -> Message:
        """A message whose header (but for its step and mb) and structure are those of the
        peer's last one, all checked then: its tensors are read where they lay then, and its
        spec is the last one's (read only: its leaves are JSON scalars)."""
        size, spec_bytes = known.size, known.spec_bytes
        if spec_bytes and buffer[HEADER_BYTES:HEADER_BYTES + len(spec_bytes)].tobytes() \
                != spec_bytes:
            del self.known[(key.kind, key.src_stage, key.dst_stage)]  # another structure
            return self._unpack(key, buffer, deadline)  # the full checks and decode
        payload = buffer[HEADER_BYTES:HEADER_BYTES + size]
        if buffer.size > FRAME_BYTES and 2 * size < buffer.size:
            payload = payload.copy()  # a small message in a large receive: free the rest now
        self.capacity.record(size, False)
        return views(key, payload, known.where, known.spec)

    def _receive_payload(self, key: Key, header: Sequence[int], size: int,
                         deadline: float) -> torch.Tensor:
        link = self.link
        on_device = bool(header[11]) and link.device.type != "cpu"
        payload = torch.empty(size, dtype=torch.uint8,
                              device=link.device if on_device else torch.device("cpu"))
        work = (dist.irecv(payload, src=self.src, group=link.device_groups[(self.peer, link.rank)],
                           tag=link.payload_tag) if on_device
                else link.from_(self.peer).recv([payload], self.peer, link.payload_tag))
        self._wait(work, key, deadline, self._where(key), (payload, work))
        return payload

    def _wait(self, work: Any, key: Key, deadline: float, describe: str | Describe,
              posted: tuple[torch.Tensor, Any] | None = None) -> None:
        """Wait for a posted receive until ``deadline``. One that fails stays posted for good
        (``_UNCLAIMED``): gloo may still write into it."""
        try:
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError as e:
            _UNCLAIMED.append(posted or self.posted)
            self.posted = None
            text = str(e)
            first = text.splitlines()[0][:200]
            self.ended = True  # either way gloo closed the connection: nothing more comes
            if "Timed out" in text or "timeout" in text.lower():
                raise CommError(f"{_text(describe)}: timed out waiting for the {key.describe()} "
                                f"from {rank_name(self.peer, self.src)} [{first}]") from None
            raise PeerClosed(f"{self._where(key)}: the peer closed the connection (did its "
                             f"process die?) [{first}]", self.peer) from None


class Inbox:
    """Every peer's messages to this rank: taken by key, in whatever order the actions need.

    A message that a peer sent before the one asked for is received on the way and kept here
    until its action asks. The job's news (:mod:`pipetrain.runtime.failure.job_failure`) is left in
    :attr:`error` by the watchdog's thread and raised at the next wait.
    """

    def __init__(self, inbounds: dict[int, Inbound], timeout: float) -> None:
        self.peers, self.timeout = inbounds, timeout
        self.arrived: dict[Key, Message] = {}
        self.error: BaseException | None = None
        self._plans: object = None
        self._last: tuple[int, ...] = ()
        self._sender: dict[tuple[int, int, int, int], int] = {}  # route: its peer

    def start(self, step: int, plans: Mapping[int, Plan], last: Mapping[int, Key],
              carry: tuple[int, int] | None = None) -> None:
        """Post the first receive of each peer's messages this step (see ``P2P.start_step``).

        ``carry``: an asynchronous schedule's ``(previous step, m)``. A planned message of
        ``mb < 0`` is then the previous step's ``m + mb``; messages of earlier steps not yet
        taken are kept, and each peer's stream goes on (:meth:`Inbound.begin`).
        """
        back, m = carry if carry is not None else (step, 0)
        if plans is not self._plans or tuple(last) != self._last:
            self._plans, self._last = plans, tuple(last)
            self._sender = {(k, mb % m if m else mb, s, d): peer for peer, plan in plans.items()
                            for k, mb, s, d in plan}
            self._sender.update({key.route(): peer for peer, key in last.items()})
        if carry is None:
            self.arrived.clear()
        for peer, plan in plans.items():
            ending = [last[peer]] if peer in last else []
            self.peers[peer].begin([*(Key(k, step, mb, s, d) if mb >= 0 else
                                      Key(k, back, mb + m, s, d) for k, mb, s, d in plan),
                                    *ending], carry is not None)

    def fail(self, error: BaseException) -> None:
        """News from outside (the watchdog's thread): raised at the next wait, first one wins."""
        if self.error is None:
            self.error = error

    def take(self, key: Key, describe: str | Describe) -> Message:
        """The message ``key``: kept if it arrived, else received, waiting at most the timeout."""
        msg = self.arrived.pop(key, None)
        if msg is not None:
            return msg
        peer = self._sender.get(key.route())
        if peer is None:  # a message of the step before, still to come (a carried stream)
            peer = next((p for p, inbound in self.peers.items()
                         if key in inbound.keys[inbound.next:]), None)
        if peer is None:
            raise CommError(f"{_text(describe)}: no peer sends the {key.describe()} in this "
                            "step (the ranks disagree on the schedule?)")
        inbound, deadline = self.peers[peer], time.monotonic() + self.timeout
        while True:
            if self.error is not None:
                raise self.error
            try:
                msg = inbound.receive(deadline, describe)
            except Relayed as e:
                raise e.error from None
            if msg.key == key:
                return msg
            self.arrived[msg.key] = msg

    def drain(self) -> None:
        """After this rank failed: take each peer's messages on a thread of its own until its
        ABORT (each rank that fails sends every peer one), so that no peer's send waits into
        its timeout (gloo then closes the connection for good); see :meth:`Inbound.drain`."""
        self.arrived.clear()
        deadline = time.monotonic() + self.timeout
        for peer, inbound in self.peers.items():
            lifetime.start(inbound.drain, (deadline,), f"pipetrain-drain-{peer}")

    def park(self) -> None:
        """Keep every receive still posted for good (gloo may still write into them)."""
        for inbound in self.peers.values():
            if inbound.posted is not None:
                _UNCLAIMED.append(inbound.posted)
                inbound.posted = None


def _holders(entry: tuple[torch.Tensor, Any]) -> int:
    """The references to a spare frame's numpy array, as counted here."""
    return sys.getrefcount(entry[1])


_FREE = _holders((torch.empty(0), np.empty(0, dtype=np.uint8)))
"""What :func:`_holders` counts for a frame nothing but its pool holds (measured, not assumed)."""
_COUNTED = getattr(sys, "_is_gil_enabled", lambda: True)()
"""Whether reference counts are exact here (not in a free-threaded build: no frame is reused)."""


def _free_frame(spare: list[tuple[torch.Tensor, Any]], size: int
                ) -> tuple[torch.Tensor, Any] | None:
    """A frame of ``size`` bytes from ``spare`` that no message's tensor uses any more, its
    header zeroed; None if there is none.

    A received message's tensors are views of its frame's memory, and each holds numpy's
    array over the frame (torch's storage of a ``from_numpy`` tensor keeps the array): while
    any of them (or a view of one, or autograd's saved copy of one) lives, the array has more
    references than its pool gives it.
    """
    for i, entry in enumerate(spare):
        if _COUNTED and entry[1].size == size and _holders(entry) <= _FREE:
            frame, buffer = spare.pop(i)
            buffer[:HEADER_BYTES] = 0  # no stale header is read as a message
            return frame, buffer
    return None


def _text(describe: str | Describe) -> str:
    return describe if isinstance(describe, str) else describe()


def abort_error(peer: int, src: int, header: Sequence[int], msg: Message) -> PeerFailed:
    t = msg.tensors[0]
    text = bytes(t.cpu().tolist()).decode(errors="replace") if t is not None else ""
    relayed = [f"{name}: " for name in ("PeerFailed", "RankFailed")]
    if header[5] == RELAY and text.startswith(tuple(relayed)):  # the origin's news, passed on
        text = text.split(": ", 1)[1]
        return PeerFailed(text if "[passed on by rank" in text
                          else f"{text} [passed on by {rank_name(peer, src)}]")
    op = OPS[header[10]] if 0 <= header[10] < len(OPS) else "?"
    stage, mb, step = header[4], header[3], header[2]
    where = (f"at stage {stage}, mb {mb}, action {stage}{op}{mb}" if stage >= 0
             else "outside any action")
    return PeerFailed(f"{rank_name(peer, src)} failed {where} (step {step}): {text}")
