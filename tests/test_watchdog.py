"""The watchdog's diagnosis, from given reports (no processes): who holds everyone up."""

from __future__ import annotations

from typing import Any

from pipetrain.errors import CommError
from pipetrain.runtime.failure.watchdog import Activity, Watchdog, follow_waits, holdup
from pipetrain.runtime.transport.groups import rank_name
from pipetrain.runtime.transport.receiver import PeerClosed, PeerFailed


def _r(state: str, action: str = "1F3", step: int = 4, peers: tuple[int, ...] = (),
       seconds: float = 9.5, **extra: Any) -> dict[str, Any]:
    return {"state": state, "action": action, "step": step, "peers": list(peers),
            "seconds": seconds, **extra}


def test_the_chain_ends_at_the_rank_computing() -> None:
    reports = {0: _r("waiting", "0B0", peers=(1,)), 1: _r("waiting", "1F3", peers=(2,)),
               2: _r("computing", "2F3", seconds=10.1), 3: _r("waiting", "3F2", peers=(2,))}
    assert follow_waits(reports, [1], 4) == ("rank 1 waits for rank 2; rank 2 is stuck in its own "
                                      "stage code: 2F3 of step 4 has run for 10.1 s without "
                                      "finishing")


def test_a_rank_that_does_not_answer_or_failed_is_named() -> None:
    assert follow_waits({0: _r("waiting", peers=(1,))}, [1], 2) == (
        "rank 1 does not answer (its process died or is frozen)")
    failed = {1: _r("failed", error="RuntimeError: boom")}
    assert follow_waits(failed, [1], 2) == "rank 1 failed: RuntimeError: boom"


def test_a_rank_between_steps_is_told_from_one_in_its_stage_code() -> None:
    idle = {1: _r("idle", "1W7", step=3, seconds=4.2)}
    text = follow_waits(idle, [1], 2)
    assert text.startswith("rank 1 is outside the pipeline for 4.2 s: it ended step 3")
    assert "own code between steps" in text
    assert "before the pipeline's first step" in follow_waits({1: _r("idle", "", step=-1)}, [1], 2)


def test_ranks_waiting_for_each_other_disagree_on_the_schedule() -> None:
    reports = {0: _r("waiting", "0F1", peers=(1,)), 1: _r("waiting", "1F0", peers=(0,))}
    assert follow_waits(reports, [0], 2).startswith("ranks 0 -> 1 wait for each other")


def test_waiting_at_the_step_end_starts_from_the_busy_rank() -> None:
    reports = {0: _r("idle"), 1: _r("computing", "1F3"), 2: _r("idle")}
    assert follow_waits(reports, [], 3).startswith("rank 1 is stuck in its own stage code")


def test_global_names_where_replicas_make_them_differ() -> None:
    assert rank_name(1, 1) == "rank 1"
    assert rank_name(1, 3) == "rank 3 (rank 1 of its pipeline)"
    name = {0: "rank 2 (rank 0 of its pipeline)", 1: "rank 3 (rank 1 of its pipeline)"}
    reports = {0: _r("waiting", "0B0", peers=(1,)), 1: _r("computing")}
    assert follow_waits(reports, [1], 2, name.__getitem__).startswith(
        "rank 3 (rank 1 of its pipeline) is stuck")


def test_the_holdup_is_a_rank_dead_or_stuck_never_one_that_speaks_for_itself() -> None:
    waiting = {0: _r("waiting", "0B0", peers=(1,)), 1: _r("waiting", "1F3", peers=(2,))}
    assert holdup({**waiting, 2: _r("computing")}, [1], 3) == 2  # stuck in its stage code
    assert holdup(waiting, [1], 3) == 2  # does not answer: dead or frozen
    assert holdup({**waiting, 2: _r("idle", "2W7")}, [1], 3) == 2  # stuck in its caller's code
    assert holdup({**waiting, 2: _r("failed", error="E")}, [1], 3) is None  # counts itself out
    cycle = {0: _r("waiting", "0F1", peers=(1,)), 1: _r("waiting", "1F0", peers=(0,))}
    assert holdup(cycle, [0], 2) is None  # all alive, each times out itself


def test_a_failure_counts_out_the_peer_that_closed_on_it_or_the_holdup_found() -> None:
    dog = Watchdog(None, "test/", 1, 4, Activity())
    assert dog.culprits(PeerClosed("rank 1 receiving ...: the peer closed the connection", 2)
                        ) == {2}  # no news explained it: the peer died
    assert dog.culprits(PeerFailed("rank 0 failed ...")) == set()  # the origin speaks for itself
    dog.gone.add(3)  # a timed-out wait's chain ended at rank 3, stuck
    assert dog.culprits(CommError("timed out")) == {3}
