"""Delivery proofs: which sends a received message proves complete, read off the schedule."""

from __future__ import annotations

import pytest

import pipetrain.schedules as ps
from helpers.models import MULTI, SCHEDULES
from pipetrain.runtime.executor import message_plans
from pipetrain.runtime.transport.receipts import delivery_proofs
from pipetrain.runtime.transport.wire import ACT, GRAD


def test_1f1b_a_gradient_proves_its_activation_received() -> None:
    schedule = ps.make_schedule("1f1b", 2, 4)
    assert delivery_proofs(schedule, 0) == {(GRAD, k, 1, 0): (1, [(ACT, k, 0, 1)])
                                            for k in range(4)}
    # rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3: its activations 2 and 3 follow the gradients 0 and 1
    assert delivery_proofs(schedule, 1) == {(ACT, 2, 0, 1): (0, [(GRAD, 0, 1, 0)]),
                                            (ACT, 3, 0, 1): (0, [(GRAD, 1, 1, 0)])}
    assert delivery_proofs(schedule, 0, train=False) == {}  # rank 1 sends rank 0 nothing


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("n_ranks,m", [(2, 4), (3, 6), (4, 8)])
def test_every_proof_is_a_message_of_the_step_proven_once(name: str, n_ranks: int, m: int
                                                          ) -> None:
    schedule = ps.make_schedule(name, n_ranks, m, 2 if name in MULTI else None)
    for train in (True, False):
        for rank in range(n_ranks):
            inbound = message_plans(schedule, rank, train)
            proven = []
            for route, (peer, sends) in delivery_proofs(schedule, rank, train).items():
                assert route in inbound[peer]  # the peer really sends it to this rank
                outbound = message_plans(schedule, peer, train)[rank]
                assert all(s in outbound for s in sends)  # this rank really sends these
                proven += [(peer, s) for s in sends]
            assert len(proven) == len(set(proven))
