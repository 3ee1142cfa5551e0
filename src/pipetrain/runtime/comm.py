"""Comm: stage-to-stage messages over torch.distributed point-to-point, checked, bounded, no pickle.

The receiver knows, from the schedule, the exact sequence of messages each peer sends it in a
step (:mod:`pipetrain.runtime.wire` gives their byte layout). One long-lived receiver thread per
peer (:mod:`pipetrain.runtime.receiver`) is handed that sequence at the start of each step; it keeps
the receive of the peer's next message posted ahead of need (communication overlaps compute), sized
by the direction's agreed capacity, so a message that fits arrives in one transfer. It checks
every header against what it expects before touching the payload, and leaves the decoded
message in a mailbox::

    main thread   start_step ──► jobs[peer] ──► receiver(peer): post message 0, wait
                                                    message k arrived: check its header,
                                                    payload (if separate), post message k+1,
                  recv(key) ◄── mailbox ◄────────── decode

Headers and CPU payloads travel over two gloo groups, one for messages to a higher rank and one
for those to a lower rank (:func:`~pipetrain.runtime.groups.twin_group`); payloads on a GPU travel
over one NCCL group per direction of each rank pair, so that a posted receive can never block a
send queued behind it on the same NCCL stream. Sends are asynchronous. The main thread waits
for a message with a deadline, so a dead, stuck or failed peer becomes a :class:`CommError`
instead of a hang. A rank that fails sends an ABORT frame to every peer, which makes them fail
at once with the origin named.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.runtime.delivery import Proofs
from pipetrain.runtime.groups import (
    frame_group,
    next_instance,
    pipeline_groups,
    rank_name,
    twin_group,
)
from pipetrain.runtime.mailbox import Describe, Mailbox
from pipetrain.runtime.receiver import (
    RELAY,
    Incoming,
    Link,
    PeerClosed,
    PeerFailed,
    Plan,
    Receiver,
    Relayed,
)
from pipetrain.runtime.wire import (
    ABORT,
    Capacity,
    Key,
    Message,
    encode,
)

__all__: list[str] = []

_TAG_BASE = 17  # pipeline n over a group: tags 17 + 3n (frames), 18 + 3n (payloads), 19 + 3n


_LEFTOVERS: list[Any] = []  # sends of failed steps: never waited for, never freed under gloo


class P2P:
    """Point-to-point transport of one rank: async sends, one long-lived receiver per peer."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, n_ranks: int,
                 device: torch.device, timeout: float, max_message_bytes: int) -> None:
        self.group, self.rank, self.n_ranks = group, rank, n_ranks
        self.device, self.timeout, self.max_bytes = device, timeout, max_message_bytes
        self.cpu_group, self.device_groups = pipeline_groups(group, n_ranks, device)
        self.mailbox = Mailbox()
        self.globals = [r if group is None else dist.get_global_rank(group, r)
                         for r in range(n_ranks)]
        """The global rank of each pipeline rank."""
        self.first_global = self.globals[0]
        self._sends: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        self._pending: dict[tuple[int, Key], list[tuple[Any, torch.Tensor, Any]]] = {}
        self._proofs: Proofs = {}
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
        self._receivers = {peer: Receiver(peer, self.globals[peer], self.mailbox)
                           for peer in range(n_ranks) if peer != rank}
        weakref.finalize(self, _close, list(self._receivers.values()), self._sends, timeout)

    def name(self, rank: int) -> str:
        """Pipeline rank ``rank`` as the job knows it (:func:`~.groups.rank_name`)."""
        return rank_name(rank, self.globals[rank])

    def start_step(self, step: int, plans: Mapping[int, Plan], last: Mapping[int, Key],
                   proofs: Proofs | None = None) -> None:
        """Start receiving one step: ``plans[peer]`` lists its messages in the order it sends,
        but for its last one, ``last[peer]``, which :meth:`receive_last` waits for itself.

        ``proofs`` (:func:`~pipetrain.runtime.delivery.delivery_proofs`) lets :meth:`recv` free the
        sends that a received message proves complete.
        """
        self._proofs = proofs or {}
        for peer, plan in plans.items():
            self._receivers[peer].jobs.put((self._link, step, plan, last[peer]))

    def receive_last(self, keys: Mapping[int, Key], describe: str) -> dict[int, Message]:
        """The last message of the step from each peer (see :meth:`start_step`).

        The receiver posted its receive once the peer's other messages were in, and this
        thread waits on it directly: one thread wake-up less at the end of every step.
        """
        out = {}
        for peer, key in keys.items():
            posted = self.mailbox.take_handed(key, time.monotonic() + self.timeout, describe)
            incoming = Incoming(self._link, peer, self.globals[peer], self.mailbox,
                                 self._receivers[peer].capacity)
            try:
                out[peer] = incoming.receive(key, posted)
            except Relayed as e:
                raise PeerFailed(f"{describe}: {e.error}") from None
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
        forms: dict[bool, tuple[torch.Tensor, torch.Tensor | None, int]] = {}  # by: one send
        for dst_rank in [dst] if isinstance(dst, int) else dst:
            capacity = self._capacity[dst_rank]
            first, payload, size = _encoded(msg, self.rank, op, capacity.bytes, forms)
            on_device = payload is not None and payload.device.type != "cpu"
            group = self._link.to(dst_rank)
            works: list[Any] = [group.send([first], dst_rank, self._tag)]  # as dist.isend
            if payload is not None:
                works.append(dist.isend(payload, dst=self.globals[dst_rank], tag=self._tag + 1,
                                        group=self.device_groups[(self.rank, dst_rank)])
                             if on_device else group.send([payload], dst_rank, self._tag + 1))
            entries = [(work, first, payload) for work in works]
            self._sends += entries
            self._pending[(dst_rank, msg.key)] = entries
            self.posted += len(works)
            capacity.record(size, on_device)

    def recv(self, key: Key, describe: str | Describe) -> Message:
        msg = self.mailbox.take(key, time.monotonic() + self.timeout, describe)
        proof = self._proofs.get((key.kind, key.mb, key.src_stage, key.dst_stage))
        if proof is not None:
            self._release(proof[0], [Key(r[0], key.step, *r[1:]) for r in proof[1]], describe)
        return msg

    def _release(self, dst: int, keys: Sequence[Key], describe: str | Describe) -> None:
        """Wait for (at once: the peer took them) and drop the sends of ``keys`` to ``dst``."""
        done = [entry for k in keys for entry in self._pending.pop((dst, k), [])]
        if not done:
            return
        deadline = time.monotonic() + self.timeout
        for w, _, _ in done:
            try:
                w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as e:
                where = describe if isinstance(describe, str) else describe()
                raise CommError(f"{where}: a send did not complete: {e}") from None
        ids = {id(entry) for entry in done}
        self._sends[:] = [entry for entry in self._sends if id(entry) not in ids]  # in place

    def settle(self, describe: str) -> None:
        """Wait for every send (within the timeout); raise a receiver's error.

        Every send is waited for within the step that made it: a send still in flight when a
        step returns would be finished (and freed) during the caller's next code, and a
        ``torch.profiler`` session started in between then crashes the process (seen with
        ``profile_memory=True``; see ``tests/test_regressions.py``).
        """
        deadline = time.monotonic() + self.timeout
        for w, _, _ in self._sends:
            try:
                w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as e:
                raise CommError(f"{describe}: a send did not complete: {e}") from None
        self._sends.clear()  # in place: the finaliser holds this list
        self._pending.clear()
        if self.mailbox.error is not None:
            raise self.mailbox.error

    def discard(self) -> None:
        """Stop tracking the sends in flight (after a failure: the step is lost).

        They are neither waited for (a wait that times out makes gloo close the connection to
        that peer for good) nor freed (gloo may still be reading them).
        """
        _LEFTOVERS.extend(self._sends)
        self._sends.clear()
        self._pending.clear()

    def close(self) -> None:
        """Let the last sends complete (bounded) and stop the receiver threads."""
        _close(list(self._receivers.values()), self._sends, self.timeout)

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
                works.append(self._link.to(peer).send([frame], peer, self._tag))
            except RuntimeError:
                continue
        deadline = time.monotonic() + 2.0
        for w in works:
            try:
                if w is not None:
                    w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError:
                pass


def _encoded(msg: Message, rank: int, op: int, capacity: int,
             forms: dict[bool, tuple[torch.Tensor, torch.Tensor | None, int]]
             ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``msg`` encoded for a destination of ``capacity``, reusing a form made for another."""
    if forms:
        _, payload, size = next(iter(forms.values()))
        one_send = size <= capacity and (payload is None or payload.device.type == "cpu")
        if one_send in forms:
            return forms[one_send]
    form = encode(msg, rank, op, capacity)
    forms[form[1] is None] = form
    return form


def _close(receivers: list[Receiver], sends: list[tuple[Any, Any, Any]],
           timeout: float) -> None:
    """Wait (bounded, errors ignored: the peer may be gone) for sends still in flight, so none
    is dropped before its peer takes it; stop the receivers."""
    deadline = time.monotonic() + timeout
    for w, _, _ in sends:
        try:
            w.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except RuntimeError:
            continue
    sends.clear()
    for r in receivers:
        r.jobs.put(None)
