"""The job's first failure, its news (no processes): first failure wins, its text, and collectives
it interrupts."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from pipetrain.runtime.failure import job_failure
from pipetrain.train.launch.elastic import _failure_report, _watchdog_finding


def _store() -> Any:
    return dist.HashStore()


def test_the_first_failure_posted_wins_and_reads_as_text() -> None:
    store = _store()
    assert job_failure.read(store, 7) is None
    job_failure.post(store, 7, {"rank": 3, "pipeline_rank": 1, "action": "1F3", "step": 4,
                         "error": "RuntimeError: boom"})
    job_failure.post(store, 7, {"rank": 0, "action": "0B0", "step": 4, "error": "later"})
    assert job_failure.read(store, 7) == ("rank 3 (rank 1 of its pipeline) failed at stage 1, "
                                          "mb 3, action 1F3 (step 4): RuntimeError: boom")
    assert job_failure.read(store, 8) is None  # another pipeline generation has none
    assert job_failure.describe({"rank": 2, "action": "", "step": 0, "error": "E"}) == (
        "rank 2 failed outside any action (step 0): E")


class _Work:
    """A collective that completes after ``seconds`` (or never), maybe with an error."""

    def __init__(self, seconds: float | None, error: str | None = None) -> None:
        self.done_at = None if seconds is None else time.monotonic() + seconds
        self.error = error

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.error:
            raise RuntimeError(self.error)
        return True


@pytest.fixture()
def generation() -> Any:
    saved = (dict(job_failure._heard), job_failure._newest[0])
    job_failure.built(10**6)  # a watchdog of this (fresh) generation runs here
    yield 10**6
    job_failure._heard.clear()
    job_failure._heard.update(saved[0])
    job_failure._newest[0] = saved[1]


def test_news_interrupts_a_collective_that_would_never_finish(generation: int) -> None:
    job_failure.wait(_Work(0.01), "all-reduce")  # no news: it waits for the collective
    job_failure.heard(generation - 1, "old news")  # an earlier pipeline's failure: not this one's
    job_failure.wait(_Work(0.0), "all-reduce")
    job_failure.heard(generation, "rank 3 failed at stage 1")
    with pytest.raises(job_failure.RankFailed, match=r"^\[rank 0\] all-reduce: rank 3 failed"):
        job_failure.wait(_Work(None), "[rank 0] all-reduce")


def test_a_collective_error_is_explained_by_the_news(generation: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(job_failure, "EXPLAIN_S", 0.05)
    with pytest.raises(RuntimeError, match="Connection closed"):
        job_failure.wait(_Work(0.0, "Connection closed by peer"), "x")  # no news within 1.5 s
    job_failure.heard(generation, "rank 2 failed")
    with pytest.raises(job_failure.RankFailed, match="rank 2 failed") as info:
        job_failure.wait(_Work(0.0, "Connection closed by peer"), "x", poll=False)
    assert "Connection closed" in str(info.value.__cause__)


def test_only_rank_0_of_a_plain_env_job_hosts_the_store(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.delenv(job_failure.STORE_HOST_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert job_failure.hosts_store(0) and not job_failure.hosts_store(1)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert not job_failure.hosts_store(0)


def test_the_launcher_report_ends_with_the_watchdog_finding() -> None:
    class Failure:
        exitcode, timestamp = 1, 0
        error_file_data = {"pipetrain": {"time": 1.0, "message":
                                         "CommError: timed out\n  watchdog: rank 1 is stuck"}}
        message = ""

    report = _failure_report({0: Failure()}, 0)
    assert report.splitlines()[-1] == "the cause, found by rank 0's watchdog: rank 1 is stuck"
    assert _watchdog_finding("no finding") is None


def test_the_store_host_lingers_until_every_rank_is_out_or_the_deadline() -> None:
    store = _store()
    job_failure.keep_store_at_exit(store, 5, 3, seconds=30.0)
    for _ in range(2):
        job_failure.count_out(store, 5, 0)  # this rank, once or twice: it is out
    job_failure.count_out(store, 5, 1)
    job_failure.count_out(store, 5, 2, "gone")  # a culprit a survivor found dead or hung
    assert store.get(job_failure.out_key(5, 2)) == b"gone"
    start = time.monotonic()
    job_failure._linger()  # every rank counted out: no wait (far below the 30 s deadline)
    assert time.monotonic() - start < 15.0 and job_failure._kept == []
    job_failure.keep_store_at_exit(store, 6, 3, seconds=0.3)
    job_failure.count_out(store, 6, 0)
    job_failure.count_out(store, 6, 0)
    start = time.monotonic()
    job_failure._linger()  # one rank of three out: until the deadline, not before
    assert time.monotonic() - start >= 0.3


def test_a_failed_rank_leaves_once_its_peers_are_out_or_after_the_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(job_failure.OFF_ENV, raising=False)
    store = _store()
    job_failure.built(7)
    job_failure.count_out(store, 7, 0)  # one peer heard the news and counted out
    start = time.monotonic()
    job_failure.leave(store, 1, 2, seconds=30.0)  # this rank makes two of two: no wait
    assert time.monotonic() - start < 15.0
    assert store.check([job_failure.out_key(7, 1)])
    job_failure.built(8)
    start = time.monotonic()
    job_failure.leave(store, 0, 3, seconds=0.3)  # a stuck peer never counts out: the bound
    assert time.monotonic() - start >= 0.3
    job_failure.count_out(store, 8, 1)
    job_failure.count_out(store, 8, 2, "gone")  # found dead: the agent must see it first
    start = time.monotonic()
    job_failure.leave(store, 0, 3, seconds=0.3)
    assert time.monotonic() - start >= 0.3


@pytest.mark.parametrize("failing", [True, False])
def test_a_stop_signal_waits_for_a_rank_that_is_explaining_a_failure(failing: bool) -> None:
    import signal
    import subprocess
    import sys

    code = ("import os, signal\nfrom pipetrain.runtime.failure import job_failure\n"
            "from pipetrain.train.launch import elastic\n"
            "signal.signal(signal.SIGTERM, elastic._on_stop)\n"
            f"if {failing}: job_failure.start_failing()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\nprint('said what it saw')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    if failing:
        assert done.returncode == 0 and "said what it saw" in done.stdout, done.stderr
    else:
        assert done.returncode == -signal.SIGTERM and done.stdout == ""
