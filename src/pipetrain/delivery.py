"""Delivery: which of a rank's sends a peer has surely received, read off the schedule.

A peer runs its action list in order, and an action takes its input message before it sends
its output. So once this rank holds a message a peer sent, the peer took every message of this
rank that its earlier actions consumed, and those sends are complete: their buffers can go at
once instead of at the end of the step (with 1F1B, rank 0's activation of mb k is proven
received by the gradient of mb k)::

    peer's list   F0   F1   B0 ──► gradient 0 to rank 0     (F0 took rank 0's activation 0)
    rank 0        ... receives gradient 0: activation 0's send is done, its buffer freed
"""

from __future__ import annotations

from pipetrain.action import Action, Op
from pipetrain.schedule import Schedule
from pipetrain.wire import ACT, GRAD

__all__: list[str] = []

Route = tuple[int, int, int, int]  # (kind, mb, src_stage, dst_stage) of a message in a step
Proofs = dict[Route, tuple[int, list[Route]]]


def delivery_proofs(schedule: Schedule, rank: int, train: bool = True) -> Proofs:
    """For each message a peer sends ``rank``: the peer, and ``rank``'s messages to it that
    the peer took before sending it (each listed once, under the first such message)."""
    out: Proofs = {}
    for peer, acts in enumerate(schedule.actions):
        if peer == rank:
            continue
        taken: list[Route] = []
        for a in acts:
            if not train and a.op is not Op.F:
                continue
            taken += _between(schedule, a, src=rank, dst=peer, inbound=True)
            sent = _between(schedule, a, src=peer, dst=rank, inbound=False)
            if sent and taken:
                out[sent[0]] = (peer, taken)
                taken = []
    return out


def _between(schedule: Schedule, a: Action, *, src: int, dst: int, inbound: bool
             ) -> list[Route]:
    """The message ``a`` takes from ``src`` (``inbound``), or sends to ``dst``, if any."""
    last = schedule.n_stages - 1
    if a.op is Op.W:
        return []
    forward = a.op is Op.F
    if inbound:
        other = a.stage - 1 if forward else a.stage + 1
        if 0 <= other <= last and schedule.rank_of(other) == src:
            return [(ACT, a.mb, other, a.stage) if forward else (GRAD, a.mb, other, a.stage)]
        return []
    other = a.stage + 1 if forward else a.stage - 1
    if 0 <= other <= last and schedule.rank_of(other) == dst:
        return [(ACT if forward else GRAD, a.mb, a.stage, other)]
    return []
