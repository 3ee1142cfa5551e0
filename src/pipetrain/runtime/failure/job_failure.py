"""Job failure: the first failure of a job, posted in the job's store and read by every rank.

A pipeline's ABORT frames reach the ranks of that pipeline only. The ranks of the other
data-parallel replicas exchange no pipeline messages with it: they would sit in their gradient
all-reduce until the process group's timeout. So the first rank to fail also posts its failure
in the job's ``torch.distributed`` store, under the pipeline's generation (the n-th pipeline
each replica built); each rank's watchdog thread looks for it twice a second (dp 2 x pp 2,
placed pipeline-outermost: replica 0 is ranks 0 and 2, replica 1 ranks 1 and 3)::

    rank 1 fails ──► store["pipetrain/runtime/news/0"] = {rank 1, 1F3, step 4, RuntimeError(...)}
                                  ▲ read every 0.5 s by each rank's watchdog thread
    rank 3 (replica 1, as rank 1), computing      ──► its next wait raises the news
    rank 2 (replica 0), in a dp all-reduce               ──► :func:`wait` raises the news

Nothing is read or written on the steady path but the watchdog thread's one small request;
a collective waited for through :func:`wait` polls a process-local value.

The store lives in one process: under a plain ``init_process_group("env://")`` that is rank 0.
Rank 0, when it fails, keeps its process (and the store) up at exit until every rank of the
job is counted out of the failure (:func:`count_out`) or the peers' timeouts have passed, so
they can still read the news and ask the watchdog (:func:`keep_store_at_exit`). A rank counts
itself out once it has said what it saw; a survivor counts out the culprit it found dead or
hung, which never will, so that no process waits for it::

    store["pipetrain/news/0/out/2"] = "out"    rank 2 said what it saw
    store["pipetrain/news/0/out/1"] = "gone"   rank 1 died or hangs (rank 2's diagnosis)
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.transport.groups import rank_name
from pipetrain.runtime.transport.receiver import PeerFailed

__all__ = ["RankFailed", "wait", "all_reduce"]

STORE_HOST_ENV = "PIPETRAIN_STORE_HOST"
"""Set to ``launcher`` by a launcher whose own process hosts the job's store."""
OFF_ENV = "PIPETRAIN_WATCHDOG"
"""Set to ``0`` to run without the watchdog and the news (to measure what they cost)."""


def enabled() -> bool:
    """Whether watchdogs and news run (``PIPETRAIN_WATCHDOG=0`` turns both off)."""
    return os.environ.get(OFF_ENV, "1") != "0"


class RankFailed(PeerFailed):
    """Another rank of the job failed, possibly in another pipeline; this rank read the news.

    (Not :class:`pipetrain.train.launch.elastic.JobFailed`: that is the launcher giving up.)"""


EXPLAIN_S = 1.5
"""How long a collective that failed (a peer closed its connections) waits for news of why."""

_heard: dict[int, str] = {}  # generation -> the news, as text
_newest = [-1]  # the newest generation this process built a pipeline of
_failing = [False]  # this process is finding out and saying why its step failed


def failing() -> bool:
    """Whether this process is in the middle of explaining a failure (:func:`start_failing`)."""
    return _failing[0]


def start_failing() -> None:
    """Mark this process as explaining a failure: a launcher's stop signal waits for it
    (:func:`pipetrain.train.launch.elastic.worker`), so the rank says what it saw first."""
    _failing[0] = True
_lock = threading.Lock()


def key(generation: int) -> str:
    return f"pipetrain/runtime/news/{generation}"


def post(store: Any, generation: int, report: dict[str, Any]) -> None:
    """Post ``report`` (rank, action, step, error) unless a failure was posted before."""
    store.compare_set(key(generation), "", json.dumps(report))


def read(store: Any, generation: int) -> str | None:
    """The generation's news as text (None if there is none)."""
    if not store.check([key(generation)]):
        return None
    return describe(json.loads(store.get(key(generation))))


def describe(report: dict[str, Any]) -> str:
    """``rank 1 failed at stage 1, mb 3, action 1F3 (step 4): RuntimeError: ...``"""
    from pipetrain.schedules.action import Action

    try:
        action = Action.parse(report["action"])
        where = f"at stage {action.stage}, mb {action.mb}, action {action}"
    except ValueError:
        where = "outside any action"
    rank = rank_name(report.get("pipeline_rank", report["rank"]), report["rank"])
    return f"{rank} failed {where} (step {report['step']}): {report['error']}"


def built(generation: int) -> None:
    """A pipeline of ``generation`` was built here: older news no longer concerns this rank."""
    with _lock:
        _newest[0] = max(_newest[0], generation)
        _failing[0] = False


def heard(generation: int, text: str) -> None:
    with _lock:
        _heard.setdefault(generation, text)


def latest() -> str | None:
    """The news of this process's newest pipeline generation, if any arrived."""
    with _lock:
        return _heard.get(_newest[0])


def wait(work: Any, what: str, poll: bool = True) -> None:
    """Wait for a collective (``async_op=True`` work), raising :class:`RankFailed` as soon as
    the job's news arrives: a failed replica never joins, and its peers must not wait for it.

    ``poll=False`` (a collective of CUDA tensors) is a plain ``work.wait()``: under NCCL it
    only orders streams, and NCCL's own timeout covers a peer that never joins.
    """
    if poll and _newest[0] >= 0 and enabled():  # a watchdog runs here: news can come
        pause = 2e-5  # doubling to 1 ms: a quick collective is seen at once, a long wait
        while not work.is_completed():  # wakes 1000 times a second, not 5000
            text = latest()
            if text is not None:
                raise RankFailed(f"{what}: {text}")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    try:
        work.wait()
    except RuntimeError as e:  # a peer's process closed its connections: say why, if known
        deadline = time.monotonic() + EXPLAIN_S
        while latest() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        text = latest()
        if text is None:
            raise
        raise RankFailed(f"{what}: {text}") from e


def all_reduce(tensor: torch.Tensor, what: str, **kwargs: Any) -> None:
    """``dist.all_reduce`` of ``tensor`` in place, waited for through :func:`wait`."""
    wait(dist.all_reduce(tensor, async_op=True, **kwargs), f"[rank {dist.get_rank()}] {what}",
         poll=tensor.device.type == "cpu")


# ------------------------------------------------------------------ keeping the store up


def hosts_store(global_rank: int) -> bool:
    """Whether this process hosts the job's store: rank 0 of a plain ``env://`` job."""
    return (global_rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            and os.environ.get(STORE_HOST_ENV) != "launcher")


def out_key(generation: int, rank: int) -> str:
    """Where global rank ``rank`` is counted out of ``generation``'s failure."""
    return f"{key(generation)}/out/{rank}"


def count_out(store: Any, generation: int, rank: int, why: str = "out") -> None:
    """Count global rank ``rank`` out of ``generation``'s failure (best effort): ``"out"``,
    itself, once it said what it saw; ``"gone"``, a culprit a survivor found dead or hung."""
    try:
        store.set(out_key(generation, rank), why)
    except Exception:  # noqa: BLE001  (the store may be gone)
        pass


def leave(store: Any, rank: int, world: int, seconds: float = EXPLAIN_S) -> None:
    """Count this failed rank out of its newest pipeline's failure, then wait until all
    ``world`` ranks are (at most ``seconds``): under an agent that stops every worker as
    soon as one exits, the first rank to fail would otherwise stop its peers before they
    have heard the news and said what they saw. A rank that is itself stuck never counts
    out; it costs the wait's bound once. Nor does a rank found dead count here: the agent
    reports one failure per look, and a survivor that left at once could be reported as the
    first to fail instead of the rank that died."""
    generation = _newest[0]
    if generation < 0 or not enabled():
        return
    count_out(store, generation, rank)
    _wait_out(store, generation, world, time.monotonic() + seconds, gone=False)


def _wait_out(store: Any, generation: int, world: int, deadline: float,
              gone: bool = True) -> None:
    """Until all ``world`` ranks are counted out of ``generation``'s failure (those found
    dead or hung too, if ``gone``), or ``deadline`` (monotonic), or the store is gone."""
    keys = [out_key(generation, r) for r in range(world)]
    while time.monotonic() < deadline:
        try:
            if store.check(keys) and (gone or b"gone" not in store.multi_get(keys)):
                return
        except Exception:  # noqa: BLE001  (the store may be gone)
            return
        time.sleep(0.05)


_kept: list[tuple[Any, int, int, float]] = []


def keep_store_at_exit(store: Any, generation: int, world: int, seconds: float) -> None:
    """At exit, keep this process (which hosts the store) up until all ``world`` ranks are
    counted out of ``generation``'s failure, or for ``seconds`` from now."""
    if not _kept:
        atexit.register(_linger)
    _kept.append((store, generation, world, time.monotonic() + seconds))


def _linger() -> None:
    for store, generation, world, deadline in _kept:
        _wait_out(store, generation, world, deadline)
    _kept.clear()
