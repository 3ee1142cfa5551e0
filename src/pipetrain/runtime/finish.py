"""Finish: the end-of-step exchange, after which every rank knows the step succeeded everywhere.

Each rank, once its last action ran, sends every other rank one small end-of-step message::

    done(step, rank) = [its action times: start, end, start, end, ... (float64)]
                       + [the batch loss]          (only from the rank holding the last stage)

and waits for everyone else's. A rank therefore returns from a step only when every rank
finished it (a failure anywhere reaches everyone as an ABORT instead), every rank has the loss,
and the measured timeline of all ranks is at hand; its ``Span`` objects are built only when
someone reads ``StepResult.timeline``.

An asynchronous schedule's step (:mod:`pipetrain.runtime.windows`) must not wait so: its ranks
run skewed, the first stage ends a step while the last is still on it, and a wait for every
rank would cost the pipeline its fill again each step. Its rank sends its end-of-step message
and takes everyone's message of the step *before* (:func:`exchange_window`), long arrived; a
drain, which empties the pipeline, takes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipetrain.runtime.comm import P2P
from pipetrain.runtime.executor import StepData
from pipetrain.runtime.wire import DONE, Key, Message
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.timeline import Span, Timeline

__all__: list[str] = []


def done_key(step: int, sender: int) -> Key:
    """The end-of-step message ``sender`` sends every other rank (its mb field names it)."""
    return Key(DONE, step, sender, -1, -1)


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


def _send_done(transport: P2P, schedule: Schedule, rank: int, data: StepData
               ) -> tuple[torch.Tensor | None, list[int]]:
    """Send every other rank this rank's end-of-step message; its loss and those ranks."""
    loss = total_loss(data)
    tensors: list[torch.Tensor | None] = [torch.tensor(data.times, dtype=torch.float64)]
    if loss is not None:
        tensors.append(loss.detach().reshape(()).cpu())
    peers = [peer for peer in range(schedule.n_ranks) if peer != rank]
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
    """Send this rank's end-of-step message, receive everyone else's; the loss and the times."""
    where = f"[rank {rank}] end of step {data.step}"
    loss, peers = _send_done(transport, schedule, rank, data)
    result = StepTimes(schedule, data.train, own, data.times)
    sent = _take_done(transport, schedule, data.step, peers, where, result)
    # every peer finished, so it took every message this rank sent it, except perhaps these
    # end-of-step messages, which it has posted the receive of: this wait is short
    transport.settle(where)
    return loss if sent is None else sent, result


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
