"""Comm: stage-to-stage messages over torch.distributed point-to-point, checked, bounded, no pickle.

The receiver knows, from the schedule, the exact sequence of messages each peer sends it in a
step (:mod:`pipetrain.runtime.transport.wire` gives their byte layout). The receive of each peer's
next
message is kept posted ahead of need (communication overlaps compute), sized by the
direction's agreed capacity, so a message that fits arrives in one transfer; the main thread
waits on it when an action needs it (:mod:`pipetrain.runtime.transport.receiver`), checks its header
against what it expects before touching the payload, and posts the next::

    main thread   start_step: post each peer's message 0
                  send(...)   ──► async; its buffer goes back to the route once a later
                                  message proves it taken (:mod:`.encoder`)
                  recv(key)   ──► wait on the sender's posted receive, check, decode, post the
                                  next (into a frame no message uses any more, if one is spare)

Headers and CPU payloads travel over two gloo groups, one for messages to a higher rank and one
for those to a lower rank (:func:`~pipetrain.runtime.transport.groups.twin_group`); payloads on a
GPU travel
over one NCCL group per direction of each rank pair, so that a posted receive can never block a
send queued behind it on the same NCCL stream. Sends are asynchronous. The main thread waits
for a message with a deadline, so a dead, stuck or failed peer becomes a :class:`CommError`
instead of a hang. A rank that fails sends an ABORT frame to every peer; it lands in the
receive each keeps posted for this rank, which makes the one waiting on it fail at once with
the origin named, and pass the news on to its own peers.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import CommError, PipelineError
from pipetrain.runtime import lifetime
from pipetrain.runtime.transport.encoder import Encoded, Encoder
from pipetrain.runtime.transport.groups import (
    frame_group,
    next_instance,
    pipeline_groups,
    rank_name,
    release,
    twin_group,
)
from pipetrain.runtime.transport.receipts import Proofs, Route
from pipetrain.runtime.transport.receiver import (
    RELAY,
    Describe,
    Inbound,
    Inbox,
    Link,
    PeerClosed,
    PeerFailed,
    Plan,
)
from pipetrain.runtime.transport.wire import (
    ABORT,
    Capacity,
    Key,
    Message,
    encode,
)

__all__: list[str] = []

Pending = tuple[Any, torch.Tensor, Any, Any]  # a send: gloo's work, its buffers, its home
_TAG_BASE = 17  # pipeline n over a group: tags 17 + 3n (frames), 18 + 3n (payloads), 19 + 3n


_LEFTOVERS: list[Any] = []  # sends of failed steps: never waited for, never freed under gloo


class P2P:
    """Point-to-point transport of one rank: async sends, receives posted ahead per peer."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, n_ranks: int,
                 device: torch.device, timeout: float, max_message_bytes: int) -> None:
        self.group, self.rank, self.n_ranks = group, rank, n_ranks
        self.device, self.timeout, self.max_bytes = device, timeout, max_message_bytes
        self._patience = timedelta(seconds=timeout)  # a proven send's wait (it returns at once)
        self.cpu_group, self.device_groups, made = pipeline_groups(group, n_ranks, device)
        self.globals = [r if group is None else dist.get_global_rank(group, r)
                         for r in range(n_ranks)]
        """The global rank of each pipeline rank."""
        self.first_global = self.globals[0]
        self._pending: dict[tuple[int, Route], list[Pending]] = {}
        """The sends in flight, by destination and route (kind, mb, src_stage, dst_stage)."""
        self._proofs: Proofs = {}
        self._carried: dict[tuple[int, Route], list[Pending]] = {}
        """An asynchronous schedule's sends of the last step, waited for after the next."""
        self.encode = Encoder(rank)
        """Encodes this rank's messages, each route's header written once (:mod:`.encoder`)."""
        self.posted = 0
        """How many point-to-point sends this transport posted (one or two per message)."""
        self._capacity = {peer: Capacity() for peer in range(n_ranks) if peer != rank}
        """Per peer, the capacity of this rank's messages to it (the receiver's copy agrees)."""
        frames = frame_group(self.cpu_group)
        self.generation = next_instance(self.globals)
        """How many pipelines this process built over these ranks before this one."""
        self._tag = _TAG_BASE + 3 * self.generation
        self.spare_tag = self._tag + 2
        """A tag of this pipeline's own for exchanges outside the schedule (tied gradients)."""
        twin = twin_group(self.globals, rank, self.generation, timeout) if n_ranks > 1 else None
        self._link = Link(rank, self.name(rank), frames, frames if twin is None else twin,
                           self.device_groups, device, timeout,
                           max_message_bytes, self._tag, self._tag + 1)
        self.inbox = Inbox({peer: Inbound(self._link, peer, self.globals[peer])
                            for peer in range(n_ranks) if peer != rank}, timeout)
        self.failed = False
        """A step failed: the peers' messages are being drained, and sends may never complete."""
        self._closer = weakref.finalize(self, _close, self.inbox, self._pending, self._carried,
                                        timeout, [*made, *([] if twin is None else [twin])])
        lifetime.own(self)

    def name(self, rank: int) -> str:
        """Pipeline rank ``rank`` as the job knows it (:func:`~.groups.rank_name`)."""
        return rank_name(rank, self.globals[rank])

    def start_step(self, step: int, plans: Mapping[int, Plan], last: Mapping[int, Key],
                   proofs: Proofs | None = None, carry: tuple[int, int] | None = None) -> None:
        """Start receiving one step: ``plans[peer]`` lists its messages in the order it sends,
        and ``last[peer]`` is its end-of-step message, after them (a peer not in ``last``
        sends none to this rank: :func:`~pipetrain.runtime.step_end.ending_keys`).

        ``proofs`` (:func:`~pipetrain.runtime.transport.receipts.delivery_proofs`) lets
        :meth:`recv` free the
        sends that a received message proves complete. ``carry`` (an asynchronous schedule's
        previous step and m) keeps the streams of the step before going (:meth:`Inbox.start`).
        """
        self._proofs = proofs or {}
        self.inbox.start(step, plans, last, carry)

    def receive_last(self, keys: Mapping[int, Key], describe: str) -> dict[int, Message]:
        """The last message of the step from each peer (see :meth:`start_step`)."""
        out = {}
        for peer, key in keys.items():
            try:
                out[peer] = self.inbox.take(key, describe)
            except PeerFailed as e:
                raise PeerFailed(f"{describe}: {e}") from None
            except PeerClosed as e:
                raise PeerClosed(f"{describe}: {e}", e.peer) from None
            except CommError as e:
                raise type(e)(f"{describe}: {e}") from None
        return out

    def send(self, dst: int | Sequence[int], msg: Message, op: int = 0) -> None:
        """Send ``msg`` to rank ``dst``, or the same message to several ranks.

        The payload goes behind the header in one send when it fits the destination's capacity;
        else it follows as a second send, and that capacity grows for the next messages. The
        message is encoded at most once per form (one send, or two).
        """
        forms: dict[bool, Encoded] = {}  # by: one send
        dsts = [dst] if isinstance(dst, int) else dst
        for dst_rank in dsts:
            try:
                self._send(dst_rank, msg, op, forms, len(dsts) == 1)
            except PipelineError:
                raise
            except RuntimeError as e:  # gloo refuses a send on a connection the peer closed
                first = str(e).splitlines()[0][:200]
                raise PeerClosed(f"{self.name(self.rank)} sending the {msg.key.describe()} to "
                                 f"{self.name(dst_rank)}: the peer closed the connection (did "
                                 f"its process die?) [{first}]", dst_rank) from None

    def _send(self, dst_rank: int, msg: Message, op: int, forms: dict[bool, Encoded],
              alone: bool) -> None:
        """Post ``msg``'s send(s) to ``dst_rank`` (``alone``: to no other rank)."""
        capacity = self._capacity[dst_rank]
        first, payload, size, home = _encoded(msg, self.encode, op, capacity.bytes, forms)
        group = self._link.to(dst_rank)
        work = group.send([first], dst_rank, self._tag)  # as dist.isend
        held = self._pending.setdefault((dst_rank, msg.key.route()), [])
        # a buffer of one send goes back to its route once the send completed
        held.append((work, first, payload, home if alone else None))
        on_device = payload is not None and payload.device.type != "cpu"
        if payload is not None:
            held.append((dist.isend(payload, dst=self.globals[dst_rank], tag=self._tag + 1,
                                    group=self.device_groups[(self.rank, dst_rank)])
                         if on_device else group.send([payload], dst_rank, self._tag + 1),
                         first, payload, None))
        self.posted += 1 + (payload is not None)
        capacity.record(size, on_device)

    def recv(self, key: Key, describe: str | Describe) -> Message:
        msg = self.inbox.take(key, describe)
        proof = self._proofs.get(key.route())
        if proof is not None:
            self._release(proof[0], proof[1], describe)
        return msg

    def _release(self, dst: int, routes: Sequence[Route], describe: str | Describe) -> None:
        """Wait for (at once: the peer took them) and drop the sends of ``routes`` to ``dst``."""
        pending = self._pending
        for route in routes:
            for w, first, _, home in pending.pop((dst, route), ()):
                try:
                    w.wait(self._patience)
                except RuntimeError as e:
                    where = describe if isinstance(describe, str) else describe()
                    raise self._unsent(where, dst, e) from None
                if home is not None:
                    Encoder.done(first, home)

    def _unsent(self, where: str, dst: int, error: RuntimeError) -> CommError:
        """A send to ``dst`` that did not complete: timed out, or the peer closed the
        connection (:class:`PeerClosed`, which the job's news then explains)."""
        first = str(error).splitlines()[0][:200]
        if "timed out" in first.lower():
            return CommError(f"{where}: a send to {self.name(dst)} did not complete: {first}")
        return PeerClosed(f"{where}: a send to {self.name(dst)} did not complete: the peer "
                          f"closed the connection (did its process die?) [{first}]", dst)

    def settle(self, describe: str) -> None:
        """Wait for every send (within the timeout); raise a receiver's error.

        Every send is waited for within the step that made it: a send still in flight when a
        step returns would be finished (and freed) during the caller's next code, and a
        ``torch.profiler`` session started in between then crashes the process (seen with
        ``profile_memory=True``; see ``tests/test_regressions.py``).
        """
        deadline = time.monotonic() + self.timeout
        for (dst, _), entries in self._pending.items():
            for w, first, _, home in entries:
                try:
                    w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
                except RuntimeError as e:
                    raise self._unsent(describe, dst, e) from None
                if home is not None:
                    Encoder.done(first, home)
        self._pending.clear()  # in place: the finaliser holds this dict
        if self.inbox.error is not None:
            raise self.inbox.error

    def settle_before(self, describe: str, everything: bool = False) -> None:
        """An asynchronous schedule's end of step: wait for the sends of the step before (the
        peers take them during this step) and keep this step's in flight: a gloo send
        completes only once its receiver posts the receive, which for a message the next
        step takes is during that step. ``everything``: this step's too (a drain)."""
        if everything:
            for key, entries in self._carried.items():
                self._pending.setdefault(key, []).extend(entries)
            self._carried.clear()
            self.settle(describe)
            return
        current = dict(self._pending)
        self._pending.clear()  # both in place: the finaliser holds them
        self._pending.update(self._carried)
        self._carried.clear()
        self._carried.update(current)
        self.settle(describe)

    def discard(self) -> None:
        """Stop tracking the sends in flight (after a failure: the step is lost), and drain the
        peers' messages until their ABORTs (:meth:`~.receiver.Inbox.drain`).

        The sends are neither waited for (a wait that times out makes gloo close the connection
        to that peer for good) nor freed (gloo may still be reading them).
        """
        self.failed = True
        for held in (self._pending, self._carried):
            for entries in held.values():
                _LEFTOVERS.extend(entries)
            held.clear()
        self.inbox.drain()

    def carried(self) -> int:
        """How many of an asynchronous schedule's sends wait for the next step (or a drain)."""
        return sum(len(entries) for entries in self._carried.values())

    def close(self) -> None:
        """Let the last sends complete (bounded), then end the groups this transport made
        (its twin, and on GPUs its pair groups); once only."""
        self._closer()

    def at_exit(self) -> None:
        """The interpreter exits: after a failure, close this rank's connections to every
        peer now (:meth:`~.receiver.Link.cut`), so that no drain or ABORT thread is still
        in a gloo wait when the interpreter finalises (:mod:`.lifetime`)."""
        if self.failed:
            for peer in range(self.n_ranks):
                if peer != self.rank:
                    self._link.cut(peer)

    def abort(self, step: int, stage: int, mb: int, op: int, text: str,
              relay: bool = False) -> None:
        """Tell every peer this rank failed (best effort, bounded), so they fail fast too.

        A rank that fails because a peer did (``relay``) sends one too: every receiver of the
        failed step then gets one ABORT from each peer and stops, instead of waiting until its
        timeout (after which gloo would close that connection for good).
        """
        raw = bytearray(text.encode()[:4096] or b" ")
        msg = Message(Key(ABORT, step, mb, stage, RELAY if relay else -1),
                      [torch.frombuffer(raw, dtype=torch.uint8)])
        works = []
        for peer in range(self.n_ranks):
            if peer == self.rank:
                continue
            try:
                frame, _, _ = encode(msg, self.rank, op)  # 4096 bytes fit every receive
                works.append((self._link.to(peer).send([frame], peer, self._tag), frame))
            except RuntimeError:
                continue
        _LEFTOVERS.extend(works)  # never freed: a peer may take them late
        # a peer takes an ABORT when it next waits for this rank's message, maybe after its
        # current action: waited for on a thread (a timed-out wait would close the connection
        # for good), and for at most 2 s here, so that a process about to exit sends them first
        waiter = lifetime.start(_wait_all, (works,), "pipetrain-abort")
        waiter.join(2.0)


def _encoded(msg: Message, encoder: Encoder, op: int, capacity: int,
             forms: dict[bool, Encoded]) -> Encoded:
    """``msg`` encoded for a destination of ``capacity``, reusing a form made for another."""
    if forms:
        _, payload, size, _ = next(iter(forms.values()))
        one_send = size <= capacity and (payload is None or payload.device.type == "cpu")
        if one_send in forms:
            return forms[one_send]
    form = encoder(msg, op, capacity)
    forms[form[1] is None] = form
    return form


def _wait_all(works: list[tuple[Any, torch.Tensor]]) -> None:
    for w, _ in works:
        try:
            if w is not None:
                w.wait()
        except RuntimeError:
            continue


def _close(inbox: Inbox, pending: dict[Any, list[Pending]],
           carried: dict[Any, list[Pending]], timeout: float, groups: list[Any]) -> None:
    """Wait (bounded, errors ignored: the peer may be gone) for sends still in flight, so none
    is dropped before its peer takes it; keep any receive still posted for good. An
    asynchronous schedule's sends for a next step (``carried``: the pipeline was dropped
    without a drain) are kept, not waited for: no peer may ever take them. Then end
    ``groups``, the ones the transport made."""
    deadline = time.monotonic() + timeout
    for entries in pending.values():
        for w, *_ in entries:
            try:
                w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:
                continue
    pending.clear()
    for entries in carried.values():
        _LEFTOVERS.extend(entries)  # gloo may still read them
    carried.clear()
    inbox.park()
    release([g for g in groups if isinstance(g, dist.ProcessGroup)])
    for backend in groups:  # the twin: a gloo backend of ours, outside torch's registry
        if not isinstance(backend, dist.ProcessGroup):
            backend.shutdown()
    groups.clear()
