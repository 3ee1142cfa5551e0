"""Watchdog: what each rank of a pipeline is doing, asked for when a wait times out.

A rank that stops making progress is seen by its peers only as silence: each of them times out
waiting for its own neighbour, and a timeout names the neighbour, not the rank that stopped.
Like the NCCL flight recorder's analysis, which points at the rank that never joined a
collective, the watchdog follows the pipeline's wait-for chain to its end::

    rank 3 timed out waiting for rank 2 ──► probe every rank through the job's store
    rank 2: waiting for rank 1 (2F3, 9.8 s) ─┐
    rank 1: computing 1F3 for 10.1 s  ◄──────┘  "stuck in its own stage code"

Each rank's main thread records what it does in an :class:`Activity` (two updates per action, a
clock read and a few attribute writes each). One daemon thread per rank looks in the job's
``torch.distributed`` store for a probe, and for the job's news
(:mod:`pipetrain.runtime.failure.job_failure`),
twice a second (two small requests: the steady state pays nothing else). When a rank times out it
posts a probe, every rank's thread answers with its activity, and the chain is followed from
the peer that was waited for: to a rank computing (stuck in its own stage code), to a rank
between steps (stuck in its caller's code), to a rank that does not answer (dead or frozen), or
round a cycle (ranks waiting for each other). A rank found dead or hung is counted out of the
failure by the rank that found it (:func:`pipetrain.runtime.failure.job_failure.count_out`): no
process waits for
it to say what it saw.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.runtime import lifetime
from pipetrain.runtime.failure import job_failure
from pipetrain.runtime.torch_distributed import default_store
from pipetrain.runtime.transport.receiver import PeerClosed

__all__: list[str] = []

_POLL_S = 0.5  # how often a rank looks for a probe (one small store request)
_ANSWER_S = 2.0 + _POLL_S  # how long a probe waits for the ranks' answers
_PROBE_GRACE_S = 0.25  # a peer whose wait timed out probes within this (it closed on us)


class Activity:
    """What this rank's main thread is doing: one action, waiting for peers or computing."""

    def __init__(self) -> None:
        self.action = ""
        self.step = -1
        self.state = "idle"
        self.peers: tuple[int, ...] = ()
        self.since = time.monotonic()

    def waiting(self, action: str, peers: tuple[int, ...], step: int) -> None:
        self.action, self.step, self.peers = action, step, peers
        self.state, self.since = "waiting", time.monotonic()

    def computing(self) -> None:
        self.state, self.since = "computing", time.monotonic()

    def idle(self) -> None:
        self.state, self.peers, self.since = "idle", (), time.monotonic()

    def report(self) -> dict[str, Any]:
        return {"action": self.action, "step": self.step, "state": self.state,
                "peers": list(self.peers), "seconds": round(time.monotonic() - self.since, 1)}


class Watchdog:
    """Answers probes about ``activity`` and sends them; one per pipeline transport.

    Args:
        store: the job's store (the default group's); None disables the watchdog.
        prefix: a key prefix of this pipeline's own, the same on all its ranks.
        rank, n_ranks: this rank and the size of the pipeline group.
        generation, timeout: the pipeline's
            (:attr:`~pipetrain.runtime.transport.comm.P2P.generation`) and
            its peers' wait bound.
        on_failure: called with :class:`~pipetrain.runtime.failure.job_failure.RankFailed` when the
            job's news
            arrives.
        name: how errors say pipeline rank r.
        ranks: the global rank of each pipeline rank (default: the same).
    """

    def __init__(self, store: Any, prefix: str, rank: int, n_ranks: int,
                 activity: Activity, generation: int = 0, timeout: float = 60.0,
                 on_failure: Callable[[BaseException], None] | None = None,
                 name: Callable[[int], str] = "rank {}".format,
                 ranks: Sequence[int] | None = None) -> None:
        self.store, self.prefix, self.rank, self.n_ranks = store, prefix, rank, n_ranks
        self.activity, self.generation, self.timeout = activity, generation, timeout
        self.name = name
        """Pipeline rank r as the job knows it (global rank in dp x pp)."""
        self.ranks = list(range(n_ranks)) if ranks is None else list(ranks)
        self.gone: set[int] = set()
        """Pipeline ranks a diagnosis found dead or hung: they will not count themselves out."""
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if store is not None:
            job_failure.built(generation)
            self.thread = lifetime.start(_answer, (store, prefix, rank, activity, self.stop,
                                                   generation, on_failure), "pipetrain-watchdog")
            lifetime.own(self)

    @classmethod
    def of(cls, transport: Any, activity: Activity) -> Watchdog:
        """The watchdog of a pipeline transport (:class:`~pipetrain.runtime.transport.comm.P2P`):
        its keys are
        the pipeline's own (first global rank and tag), the same on every rank of it; the
        job's news (:mod:`pipetrain.runtime.failure.job_failure`) fails the transport's waits."""
        prefix = f"pipetrain/runtime/watchdog/{transport.first_global}/{transport.spare_tag}/"
        inbox = weakref.ref(transport.inbox)  # the thread must not keep the transport alive

        def on_failure(error: BaseException) -> None:
            box = inbox()
            if box is not None:
                box.fail(error)

        dog = cls(job_store(), prefix, transport.rank, transport.n_ranks, activity,
                  transport.generation, transport.timeout, on_failure,
                  transport.name, transport.globals)
        weakref.finalize(transport, dog.stop.set)
        return dog

    def close(self) -> None:
        """Stop this rank's thread and wait for it (it ends within one store request). A
        pipeline that never failed wrote no key (only a timed-out wait probes); a failed one's
        stay, for its peers to read after this rank is gone."""
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(_ANSWER_S)

    def at_exit(self) -> None:
        """The interpreter exits: stop the thread (:mod:`~pipetrain.runtime.lifetime` waits)."""
        self.stop.set()

    def diagnose(self, waited_for: Sequence[int]) -> str:
        """Who stopped making progress, seen from a rank that waited for ``waited_for``."""
        if self.store is None:
            return ""
        try:
            reports = self._probe()
        except Exception as e:  # noqa: BLE001  (a diagnosis must never hide the error)
            return f"(the watchdog could not ask the other ranks: {e})"
        start = [p for p in waited_for if p != self.rank]
        stuck = holdup(reports, start, self.n_ranks)
        if stuck is not None:
            self.gone.add(stuck)
        return follow_waits(reports, start, self.n_ranks, self.name)

    def _probe(self) -> dict[int, dict[str, Any]]:
        n = self.store.add(f"{self.prefix}probes", 1)
        self.store.set(f"{self.prefix}probe/{n}", "1")
        keys = [f"{self.prefix}status/{n}/{r}" for r in range(self.n_ranks)]
        deadline = time.monotonic() + _ANSWER_S
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        reports = {}
        for r, key in enumerate(keys):  # a rank that failed already may have exited since
            for k in (key, f"{self.prefix}final/{r}"):
                if self.store.check([k]):
                    reports[r] = json.loads(self.store.get(k))
                    break
        return reports

    def first_failure(self) -> str | None:
        """The job's first failure, read from the store now (not waiting for this thread's
        next look): a rank posts it before it closes its connections."""
        if self.store is None:
            return None
        try:
            return job_failure.latest() or job_failure.read(self.store, self.generation)
        except Exception:  # noqa: BLE001  (the store's host may be gone too)
            return None

    def probes(self) -> int:
        """How many probes ranks of this pipeline have sent (0 if the store is gone)."""
        try:
            return int(self.store.add(f"{self.prefix}probes", 0)) if self.store else 0
        except Exception:  # noqa: BLE001  (the store may be gone)
            return 0

    def failed(self, error: BaseException) -> None:
        """Leave this rank's failure where later probes find it (its process may exit), post
        it as the job's news unless older news is there, count out the culprit it found dead
        or hung (no process waits for it), and count this rank out."""
        if self.store is None:
            return
        report = {**self.activity.report(), "state": "failed",
                  "error": f"{type(error).__name__}: {error}"[:2000]}
        me = dist.get_rank()
        try:
            self.store.set(f"{self.prefix}final/{self.rank}", json.dumps(report))
            if not isinstance(error, job_failure.RankFailed):
                job_failure.post(self.store, self.generation,
                          {**report, "rank": me, "pipeline_rank": self.rank})
            for r in self.culprits(error):
                job_failure.count_out(self.store, self.generation, self.ranks[r], "gone")
            job_failure.count_out(self.store, self.generation, me)
        except Exception:  # noqa: BLE001  (best effort: the store may be gone)
            return
        if job_failure.hosts_store(me):  # peers still time out and probe: give them time to
            job_failure.keep_store_at_exit(self.store, self.generation, dist.get_world_size(),
                                    self.timeout + _ANSWER_S + 2 * _POLL_S)

    def culprits(self, error: BaseException) -> set[int]:
        """The pipeline ranks this rank's failure found dead or hung: the end of a timed-out
        wait's chain (:func:`holdup`), or a peer that closed its connection, when no news
        explained why (the news would be a :class:`PeerFailed` instead)."""
        closed = {error.peer} if isinstance(error, PeerClosed) and error.peer >= 0 else set()
        return (self.gone | closed) - {self.rank}


def _answer(store: Any, prefix: str, rank: int, activity: Activity, stop: threading.Event,
            generation: int, on_failure: Callable[[BaseException], None] | None) -> None:
    """Answer each probe with ``activity`` and look for the job's news: two checks of the
    store every ``_POLL_S`` (a blocking wait would hold the store's connection, which the main
    thread shares, and c10d logs every wait that times out)."""
    n, told = 1, False
    while not stop.wait(_POLL_S):
        try:
            while store.check([f"{prefix}probe/{n}"]):  # every probe posted since
                store.set(f"{prefix}status/{n}/{rank}", json.dumps(activity.report()))
                n += 1
            text = None if told else job_failure.read(store, generation)
        except Exception:  # noqa: BLE001  (the store is gone: the job is ending)
            return
        if text is not None:
            told = True
            job_failure.heard(generation, text)
            if on_failure is not None:
                on_failure(job_failure.RankFailed(text))


def follow_waits(reports: dict[int, dict[str, Any]], start: Sequence[int], n_ranks: int,
          name: Callable[[int], str] = "rank {}".format) -> str:
    """Follow waits from ``start`` to the rank that holds everyone up; describe it.

    ``name(r)`` says pipeline rank ``r`` as the job knows it (``rank 3 (rank 1 of its
    pipeline)`` when replicas make the two differ).
    """
    path, r = _follow(reports, start, n_ranks)
    report = reports.get(r)
    if report is None:
        return _via(path, r, name) + (f"{name(r)} does not answer (its process died or "
                                      "is frozen)")
    what = f"{report['action']} of step {report['step']}"
    if report["state"] == "failed":
        return _via(path, r, name) + f"{name(r)} failed: {report['error']}"
    if report["state"] == "computing":
        return _via(path, r, name) + (f"{name(r)} is stuck in its own stage code: {what} "
                                      f"has run for {report['seconds']} s without finishing")
    if report["state"] != "waiting":
        return _via(path, r, name) + _outside(name(r), report)
    return (f"ranks {' -> '.join(map(str, path))} wait for each other "
            f"({name(r)}: {what}): the ranks disagree on the schedule")


def holdup(reports: dict[int, dict[str, Any]], start: Sequence[int], n_ranks: int
           ) -> int | None:
    """The rank at the end of :func:`follow_waits` when it is dead or hung (it does not answer, or
    is stuck in its stage code or its caller's): it will not count itself out of the
    failure. None for a rank that failed (it says so itself) or ranks waiting in a cycle."""
    _, r = _follow(reports, start, n_ranks)
    report = reports.get(r)
    return r if report is None or report["state"] not in ("failed", "waiting") else None


def _follow(reports: dict[int, dict[str, Any]], start: Sequence[int], n_ranks: int
            ) -> tuple[list[int], int]:
    """The waiting ranks a wait passes through from ``start``, and the rank it ends at: one
    not waiting (or not answering), or for ranks waiting in a cycle the last of them."""
    if not start:  # waited at the step's end, for every peer: the longest-running rank
        busy = [r for r in range(n_ranks) if reports.get(r, {}).get("state") == "computing"]
        start = busy or [r for r in range(n_ranks) if r not in reports] or list(reports)
    path: list[int] = []
    r = start[0]
    while True:
        report = reports.get(r)
        if report is None or report["state"] != "waiting":
            return path, r
        path.append(r)
        later = [p for p in report["peers"] if p not in path]
        if not later:
            return path, r
        r = later[0]


def _outside(rank: str, report: dict[str, Any]) -> str:
    """A rank between steps: its caller's own code (data, optimizer, logging) holds it."""
    if report["step"] < 0:
        return (f"{rank} has not begun its first step for {report['seconds']} s: it is stuck "
                "in its own code before the pipeline's first step")
    return (f"{rank} is outside the pipeline for {report['seconds']} s: it ended step "
            f"{report['step']} and has not begun the next, so its own code between steps "
            "(data loading, the optimizer, logging) is stuck")


def _via(path: list[int], end: int, name: Callable[[int], str]) -> str:
    """``rank 3 waits for rank 2; rank 2 waits for rank 1; `` for ``path`` [3, 2], end 1."""
    return "".join(f"{name(a)} waits for {name(b)}; " for a, b in zip(path, [*path[1:], end]))


def diagnosed(error: BaseException, watchdog: Watchdog | None) -> BaseException:
    """``error``, or for a timeout a :class:`CommError` that also names who held it up; for a
    peer that closed its connection, the job's news of why (a :class:`PeerFailed`, this rank
    only relays it) when the store holds it."""
    from pipetrain.runtime.transport.receiver import PeerFailed

    job_failure.start_failing()
    if isinstance(error, CommError) and "closed the connection" in str(error):
        text = _failure_within(watchdog, _ANSWER_S + 2 * _POLL_S)
        if text is None or text in str(error):
            return error
        return PeerFailed(f"{text}\n  (seen here as: {error})")  # the cause first
    if (watchdog is None or not isinstance(error, CommError) or isinstance(error, PeerFailed)
            or "timed out" not in str(error)):
        return error
    activity = watchdog.activity
    peers = activity.peers if activity.state == "waiting" else ()
    found = watchdog.diagnose(peers)
    return CommError(f"{error}\n  watchdog: {found}") if found else error


def _failure_within(watchdog: Watchdog | None, seconds: float) -> str | None:
    """The job's news, waited for while a peer is finding out why: gloo closes a connection
    when its own wait times out, before that rank has probed the others and posted the
    cause. A peer that died probes nothing: after ``_PROBE_GRACE_S`` without a probe, None."""
    if watchdog is None or watchdog.store is None:
        return None
    start = time.monotonic()
    text = watchdog.first_failure()
    while text is None:
        elapsed = time.monotonic() - start
        if elapsed > seconds or (elapsed > _PROBE_GRACE_S and watchdog.probes() == 0):
            return None
        time.sleep(0.05)
        text = watchdog.first_failure()
    return text


def job_store() -> Any:
    """The store of the default process group (None outside an initialised job, or with
    ``PIPETRAIN_WATCHDOG=0``)."""
    if not job_failure.enabled():
        return None
    try:
        return default_store()
    except (RuntimeError, ValueError):  # no default group (older torch: RuntimeError)
        return None
