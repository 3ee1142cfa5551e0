"""pt.launch: ranks forked from a server that imported torch once still see the caller's
environment of the moment, and find functions of the caller's modules."""

from __future__ import annotations

import os

import pytest

import pipetrain as pt
from pipetrain.runtime.launch import start_context


def _env(ctx: pt.RankContext, name: str) -> tuple[int, str | None, int]:
    import torch

    return ctx.rank, os.environ.get(name), torch.get_num_threads()


def test_each_launch_hands_its_ranks_the_environment_of_the_moment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    forkserver = "forkserver" in multiprocessing.get_all_start_methods()
    assert start_context().get_start_method() == ("forkserver" if forkserver else "spawn")
    monkeypatch.setenv("PIPETRAIN_TEST_VALUE", "first")
    assert pt.launch(_env, 2, "PIPETRAIN_TEST_VALUE") == [(0, "first", 1), (1, "first", 1)]
    monkeypatch.setenv("PIPETRAIN_TEST_VALUE", "second")  # the server started before this
    assert pt.launch(_env, 2, "PIPETRAIN_TEST_VALUE") == [(0, "second", 1), (1, "second", 1)]
    monkeypatch.delenv("PIPETRAIN_TEST_VALUE")
    assert pt.launch(_env, 2, "PIPETRAIN_TEST_VALUE", threads=2) == [(0, None, 2), (1, None, 2)]


def test_a_free_port_is_one_the_kernel_never_hands_to_an_outgoing_connection() -> None:
    import socket

    from pipetrain.runtime.launch import _first_ephemeral, free_port

    if _first_ephemeral() <= 20000:
        pytest.skip("this kernel's ephemeral range leaves no ports below it")
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < _first_ephemeral() for p in ports), ports
    for port in ports:  # each one binds
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def _preloaded(ctx: pt.RankContext) -> list[bool]:
    import sys

    from pipetrain.runtime.launch import RANK_MODULES

    return [name in sys.modules for name in RANK_MODULES]


def test_a_rank_starts_with_torchs_capture_modules_imported_by_the_forkserver() -> None:
    import multiprocessing

    from pipetrain.runtime.launch import RANK_MODULES

    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no forkserver: spawned ranks import what they use")
    assert pt.launch(_preloaded, 2) == [[True] * len(RANK_MODULES)] * 2


def test_a_failure_report_lists_the_ranks_that_caused_it_before_those_that_relayed_it() -> None:
    from pipetrain.runtime.launch import _causes_first

    failed = {0: "PeerFailed: rank 3 failed at stage 1", 1: "PeerClosed: rank 2 closed",
              2: "process exited with code -11 and no result", 3: "StageError: [rank 3 ...]"}
    assert _causes_first(failed) == [2, 3, 0, 1]
