"""Receipts: which of a rank's sends a peer has surely received, read off the schedule.

A peer runs its action list in order, and an action takes its input message before it sends
its output. So once this rank holds a message a peer sent, the peer took every message of this
rank that its earlier actions consumed, and those sends are complete: their buffers can go at
once instead of at the end of the step (with 1F1B, rank 0's activation of mb k is proven
received by the gradient of mb k)::

    peer's list   F0   F1   B0 ──► gradient 0 to rank 0     (F0 took rank 0's activation 0)
    rank 0        ... receives gradient 0: activation 0's send is done, its buffer freed

An action takes all its messages before it sends any, also where it takes or sends several
(a traced model's direct routes, :mod:`pipetrain.runtime.transport.routes`).
"""

from __future__ import annotations

from pipetrain.runtime.transport.routes import Ports, Routes, linear_routes
from pipetrain.runtime.transport.wire import ACT, GRAD
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule

__all__: list[str] = []

Route = tuple[int, int, int, int]  # (kind, mb, src_stage, dst_stage) of a message in a step
Proofs = dict[Route, tuple[int, list[Route]]]


def delivery_proofs(schedule: Schedule, rank: int, train: bool = True,
                    routes: Routes | None = None) -> Proofs:
    """For each message a peer sends ``rank``: the peer, and ``rank``'s messages to it that
    the peer took before sending it (each listed once, under the first such message).
    ``routes`` (default: a chain) says which messages each action takes and sends."""
    ports = (linear_routes(schedule.n_stages) if routes is None else routes).ports
    out: Proofs = {}
    for peer, acts in enumerate(schedule.actions):
        if peer == rank:
            continue
        taken: list[Route] = []
        for a in acts:
            if a.op is Op.W or (not train and a.op is not Op.F):
                continue
            taken += _between(schedule, ports[a.stage], a, rank, inbound=True)
            sent = _between(schedule, ports[a.stage], a, rank, inbound=False)
            if sent and taken:
                out[sent[0]] = (peer, taken)
                taken = []
    return out


def _between(schedule: Schedule, ports: Ports, a: Action, rank: int, *, inbound: bool
             ) -> list[Route]:
    """The messages F or B/I ``a`` takes from ``rank`` (``inbound``), or sends to it, in order."""
    forward = a.op is Op.F
    kind = ACT if forward else GRAD
    if inbound:
        links = ports.act_in if forward else ports.grad_in
        return [(kind, a.mb, s, a.stage) for s, _ in links if schedule.rank_of(s) == rank]
    links = ports.act_out if forward else ports.grad_out
    return [(kind, a.mb, a.stage, d) for d, _ in links if schedule.rank_of(d) == rank]
