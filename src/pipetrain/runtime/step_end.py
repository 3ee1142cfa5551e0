"""Step end: the end-of-step exchange, after which every rank knows the step succeeded everywhere.

The rank holding stage 0, the *root*, ends most steps last (the first stage's backward is the
end of every flush schedule's critical path). Each other rank, once its last action ran, sends
the root one small end-of-step message; the root, once it has them all, sends every other rank
one message holding them all::

    done(step, rank) = [its action times: start, end, start, end, ... (float64)]
                       + [the batch loss]          (only from the rank holding the last stage)
    done(step, root) = [every rank's count of times (int64) | all their times, rank by rank]
                       + [the batch loss]

A rank therefore returns from a step only when every rank finished it (a failure anywhere
reaches everyone as an ABORT instead), every rank has the loss, and the measured timeline of
all ranks is at hand; its ``Span`` objects are built only when someone reads
``StepResult.timeline``. Each rank but the root sends and takes one message, whatever p: 2(p-1)
messages a step in all, where one from every rank to every rank would be p(p-1).

An asynchronous schedule's step (:mod:`pipetrain.runtime.async_steps`) must not wait so: its ranks
run skewed, the first stage ends a step while the last is still on it, and a wait for any other
rank would cost the pipeline its fill again each step. Its rank sends every other rank its
end-of-step message and takes everyone's message of the step *before* (:func:`exchange_window`),
long arrived; a drain, which empties the pipeline, takes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipetrain.errors import CommError
from pipetrain.runtime.executor import StepData
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.wire import DONE, Key, Message
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.timeline import Span, Timeline

__all__: list[str] = []


def done_key(step: int, sender: int) -> Key:
    """The end-of-step message ``sender`` sends (its mb field names it)."""
    return Key(DONE, step, sender, -1, -1)


def ending_keys(schedule: Schedule, rank: int, step: int, window: bool) -> dict[int, Key]:
    """The end-of-step message each peer sends ``rank`` (after its planned ones): every peer's
    in an asynchronous schedule's step (``window``) and to the root, else only the root's."""
    root = schedule.rank_of(0)
    return {peer: done_key(step, peer) for peer in range(schedule.n_ranks)
            if peer != rank and (window or rank == root or peer == root)}


@dataclass(frozen=True)
class StepTimes:
    """Measured start/end times of one step's actions, turned into a Timeline only when read."""

    schedule: Schedule
    train: bool
    own: Sequence[tuple[int, Action]]
    """The (rank, action) pairs this process ran, in the order of ``own_times``."""
    own_times: Sequence[float]
    """Flat [start, end, start, end, ...] of ``own``."""
    peer_times: dict[int, torch.Tensor] = field(default_factory=dict)
    """Each other rank's flat times, for the actions of its list that ran."""

    def timeline(self) -> Timeline:
        spans = _spans(self.own, self.own_times)
        for peer, times in sorted(self.peer_times.items()):
            ran = [(peer, a) for a in self.schedule.actions[peer]
                   if self.train or a.op is Op.F]
            spans += _spans(ran, times.tolist())
        return Timeline(self.schedule.n_ranks, tuple(spans), "s")


def _spans(ran: Sequence[tuple[int, Action]], times: Sequence[float]) -> list[Span]:
    return [Span(rank, a, times[2 * j], times[2 * j + 1])
            for j, (rank, a) in enumerate(ran[:len(times) // 2])]


def total_loss(data: StepData) -> torch.Tensor | None:
    """The sum of the weighted micro-batch losses, in micro-batch order."""
    if not data.losses:
        return None
    order = sorted(data.losses)
    total = data.losses[order[0]]
    for mb in order[1:]:
        total = total + data.losses[mb]
    return total


def _send_done(transport: P2P, schedule: Schedule, rank: int, data: StepData,
               to: list[int] | None = None) -> tuple[torch.Tensor | None, list[int]]:
    """Send this rank's end-of-step message to the ranks ``to`` (default: every other rank);
    its loss and those ranks."""
    loss = total_loss(data)
    tensors: list[torch.Tensor | None] = [torch.tensor(data.times, dtype=torch.float64)]
    if loss is not None:
        tensors.append(loss.detach().reshape(()).cpu())
    peers = [peer for peer in range(schedule.n_ranks) if peer != rank] if to is None else to
    transport.send(peers, Message(done_key(data.step, rank), tensors))
    data.done_sent = True
    return loss, peers


def _take_done(transport: P2P, schedule: Schedule, step: int, peers: list[int], where: str,
               result: StepTimes | None) -> torch.Tensor | None:
    """Every peer's end-of-step message of ``step``: their times into ``result`` (if given),
    and the loss the last stage's rank sent."""
    holder, loss = schedule.rank_of(schedule.n_stages - 1), None
    received = transport.receive_last({peer: done_key(step, peer) for peer in peers}, where)
    for peer, msg in received.items():
        if result is not None and msg.tensors and msg.tensors[0] is not None:
            result.peer_times[peer] = msg.tensors[0]
        if peer == holder and len(msg.tensors) > 1 and msg.tensors[1] is not None:
            loss = msg.tensors[1].clone()
    return loss


def exchange(transport: P2P, schedule: Schedule, rank: int, data: StepData,
             own: Sequence[tuple[int, Action]]) -> tuple[torch.Tensor | None, StepTimes]:
    """A step's end through the root (see the module): the loss and every rank's times."""
    where = f"[rank {rank}] end of step {data.step}"
    root = schedule.rank_of(0)
    result = StepTimes(schedule, data.train, own, data.times)
    if rank == root:
        loss = _gather(transport, schedule, rank, data, result, where)
    else:
        loss, _ = _send_done(transport, schedule, rank, data, [root])
        sent = transport.receive_last({root: done_key(data.step, root)}, where)[root]
        loss = _scatter_read(sent, schedule, rank, result, loss)
    # every peer finished, so it took every message this rank sent it, except perhaps these
    # end-of-step messages, which it has posted the receive of: this wait is short
    transport.settle(where)
    return loss, result


def _gather(transport: P2P, schedule: Schedule, rank: int, data: StepData, result: StepTimes,
            where: str) -> torch.Tensor | None:
    """The root's end of step: every peer's message in, one message with them all out."""
    peers = [peer for peer in range(schedule.n_ranks) if peer != rank]
    own = total_loss(data)
    sent = _take_done(transport, schedule, data.step, peers, where, result)
    loss = own if sent is None else sent
    times = [torch.tensor(data.times, dtype=torch.float64) if r == rank
             else result.peer_times[r] for r in range(schedule.n_ranks)]
    counts = torch.tensor([t.numel() for t in times], dtype=torch.int64)
    tensors: list[torch.Tensor | None] = [counts, torch.cat(times)]
    if loss is not None:
        tensors.append(loss.detach().reshape(()).cpu())
    transport.send(peers, Message(done_key(data.step, rank), tensors))
    data.done_sent = True
    return loss


def _scatter_read(msg: Message, schedule: Schedule, rank: int, result: StepTimes,
                  loss: torch.Tensor | None) -> torch.Tensor | None:
    """Every other rank's times from the root's end-of-step message; the loss it carries
    (``loss``: this rank's own, where it holds the last stage)."""
    counts, times = msg.tensors[0], msg.tensors[1]
    if counts is None or times is None or counts.numel() != schedule.n_ranks:
        raise CommError(f"[rank {rank}] the end-of-step message of the root holds no times of "
                        f"{schedule.n_ranks} ranks (the ranks disagree on the schedule?)")
    at = 0
    for peer, n in enumerate(counts.tolist()):
        if peer != rank:
            result.peer_times[peer] = times[at:at + n]
        at += n
    sent = msg.tensors[2] if len(msg.tensors) > 2 else None
    return loss if sent is None or loss is not None else sent.clone()


def exchange_window(transport: P2P, schedule: Schedule, rank: int, data: StepData,
                    own: Sequence[tuple[int, Action]], earlier: int | None, drain: bool
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, StepTimes]:
    """An asynchronous schedule's end of step: send this rank's end-of-step message, take
    every peer's of step ``earlier`` (None: none is owed), and with ``drain`` this step's
    too. Returns this rank's own loss (the last stage's rank), the loss of step ``earlier``
    and the times (every rank's only for a drain)."""
    where = f"[rank {rank}] end of step {data.step}"
    loss, peers = _send_done(transport, schedule, rank, data)
    result = StepTimes(schedule, data.train, own, data.times)
    before = None if earlier is None else _take_done(transport, schedule, earlier, peers,
                                                     where, None)
    if drain:  # (a drain may carry the number of the step before it: taken in that order)
        sent = _take_done(transport, schedule, data.step, peers, where, result)
        loss = loss if sent is None else sent
    transport.settle_before(where, everything=drain)
    return loss, before, result
