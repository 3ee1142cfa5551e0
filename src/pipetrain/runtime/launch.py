"""Launch: start N local processes, one pipeline rank each, and collect what each returns.

``launch(fn, nprocs)`` spawns processes, initialises ``torch.distributed`` in each (NCCL when
every rank can have its own GPU, else gloo on CPU, with a warning when there are GPUs but too
few) with the rendezvous bound to 127.0.0.1, calls
``fn(ctx)`` and returns the per-rank results. A rank that raises or dies makes ``launch`` stop
the others and raise a :class:`PipelineError` with each failing rank's traceback.

The job's store lives in the launching process, as torchrun's lives in its agent: a rank
that fails and exits takes nothing with it that its peers still need (the watchdog's probes,
the job's news).
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import socket
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.errors import PipelineError
from pipetrain.runtime.failure.job_failure import STORE_HOST_ENV
from pipetrain.runtime.torch_distributed import TCPStore
from pipetrain.runtime.torch_private import DYNAMO, EXPORT_TRACE

__all__ = ["RankContext", "launch", "free_port", "loopback_store", "start_context"]

_LOOPBACK = "127.0.0.1"
RANK_MODULES = (DYNAMO, EXPORT_TRACE, "torch.fx.experimental.symbolic_shapes")
"""torch's modules every pipeline rank imports anyway: capture exports, and the first backward
imports symbolic shapes (with sympy). Imported once by the forkserver rather than by each
rank (what that saves: docs/benchmarks.md, the start of a launch)."""
PRELOAD = ("__main__", "pipetrain", *RANK_MODULES)
"""What the forkserver imports once for every rank it starts (``__main__`` only when it is a
script, whose functions the ranks then find as they would under spawn)."""
_ASKED: dict[str, None] = {}  # the modules asked for so far, in order


def start_context(preload: tuple[str, ...] = PRELOAD) -> Any:
    """How ranks are started: a forkserver that imported torch and ``preload`` once, so a rank
    starts without importing them again (on a laptop that import is most of a small job's
    start; docs/benchmarks.md has the figures); spawn where there is no forkserver (Windows).

    The server starts at the first launch of the process and serves every later one: it
    imports what every call before that start asked for.

    A forked rank inherits the server's environment, not the caller's: :func:`launch` hands
    each rank the caller's environment of the moment explicitly.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    _ASKED.update(dict.fromkeys(preload))
    ctx.set_forkserver_preload(list(_ASKED))  # takes effect when the server first starts
    return ctx


@dataclass(frozen=True)
class RankContext:
    """What each launched process learns about itself."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, outside the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is one it may hand out again at once, as the
    local end of any outgoing connection: a rank that dials the store before it listens can
    even connect the store's port to itself. Either way the store's bind fails with
    EADDRINUSE. Ports below the ephemeral range are never handed out by the kernel.
    """
    below = range(_FIRST_FREE, _first_ephemeral())
    for port in random.sample(below, min(200, len(below))):  # none where the range is low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((_LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: any
        s.bind((_LOOPBACK, 0))
        return int(s.getsockname()[1])


_FIRST_FREE = 20000  # above the registered services most machines run


def _first_ephemeral() -> int:
    """The kernel's first port for outgoing connections (Linux's default where unreadable)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@contextlib.contextmanager
def loopback_store() -> Iterator[int]:
    """A TCPStore server listening on 127.0.0.1 only, alive for the block; yields its port.

    TCPStore binds every interface (it ignores the host it is given), so a socket bound to
    127.0.0.1 is handed to it. ``multi_tenant``: a TCPStore(127.0.0.1, port, is_master=True)
    made later in this process, as torch's elastic agent makes one, reuses this server.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((_LOOPBACK, 0))
    sock.listen(256)
    port = int(sock.getsockname()[1])
    store = TCPStore(_LOOPBACK, port, is_master=True, multi_tenant=True,
                          master_listen_fd=sock.detach(), timeout=timedelta(seconds=60))
    try:
        yield port
    finally:
        del store


def _backend(nprocs: int, backend: str | None) -> str:
    """``backend``, or when None: ``nccl`` with a GPU per process, else ``gloo`` (warning when
    there are GPUs, but fewer than ``nprocs``: the ranks then compute on CPU)."""
    if backend is not None:
        return backend
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= nprocs:
        return "nccl"
    if gpus:
        warnings.warn(f"launch found {gpus} GPU{'s' * (gpus != 1)} for {nprocs} processes, "
                      "and NCCL needs one GPU per process: the ranks run on CPU with gloo; "
                      f"pass backend='gloo' to say so, or start at most {gpus}", stacklevel=3)
    return "gloo"


def _worker(fn: Callable[..., Any], rank: int, nprocs: int, port: int, backend: str,
            args: tuple[Any, ...], results: Any, threads: int, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)  # the launching process's, not the forkserver's
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR=_LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank))
    os.environ[STORE_HOST_ENV] = "launcher"
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    try:
        timeout = timedelta(seconds=120)
        store = TCPStore(_LOOPBACK, port, nprocs, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs,
                                timeout=timeout)
        if backend == "gloo":
            # gloo's mesh is whole on one side before the other: a rank whose fn returns at
            # once would close its sockets under a peer still connecting ("Connection closed
            # by peer" in init_process_group)
            dist.barrier()
        value = fn(RankContext(rank, nprocs, device, backend), *args)
        results.put((rank, True, value))
    except BaseException as e:  # noqa: BLE001  (reported to the parent)
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], nprocs: int, *args: Any, backend: str | None = None,
           timeout: float | None = None, threads: int = 1) -> list[Any]:
    """Run ``fn(ctx, *args)`` in ``nprocs`` fresh processes; return their results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). ``threads`` sets
    ``torch.set_num_threads`` in each process.

    Raises:
        PipelineError: if any rank raised, died, or ``timeout`` seconds passed.

    Example:
        >>> def hello(ctx): return ctx.rank
        >>> launch(hello, 2)  # doctest: +SKIP
        [0, 1]
    """
    ctx = start_context()
    results = ctx.Queue()
    chosen = _backend(nprocs, backend)
    got: dict[int, tuple[bool, Any]] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    with loopback_store() as port:
        procs = [ctx.Process(target=_worker, args=(fn, r, nprocs, port, chosen, args, results,
                                                    threads, dict(os.environ)), daemon=True)
                 for r in range(nprocs)]
        for p in procs:
            p.start()
        try:
            _collect(procs, results, got, deadline)
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    if failed:
        detail = "\n".join(f"--- rank {r} ---\n{failed[r]}" for r in _causes_first(failed))
        raise PipelineError(f"{len(failed)} of {nprocs} ranks failed:\n{detail}")
    return [got[r][1] for r in range(nprocs)]


def _causes_first(failed: dict[int, str]) -> list[int]:
    """The failed ranks, those that failed on their own (or died) before those that failed
    because a peer did: a long report, cut short by a terminal or a CI log, keeps the cause."""
    def relayed(r: int) -> bool:
        return failed[r].startswith(("PeerFailed:", "PeerClosed:"))
    return sorted(failed, key=lambda r: (relayed(r), r))


def _collect(procs: list[Any], results: Any, got: dict[int, tuple[bool, Any]],
             deadline: float | None) -> None:
    while len(got) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
            got[rank] = (ok, value)
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
        for r in dead:
            try:  # its result may still be in flight
                rank, ok, value = results.get(timeout=1.0)
                got[rank] = (ok, value)
            except queue.Empty:
                got[r] = (False, f"process exited with code {procs[r].exitcode} and no result")
        if deadline is not None and time.monotonic() > deadline:
            for r in range(len(procs)):
                got.setdefault(r, (False, "timed out (launch timeout)"))
            for p in procs:
                p.kill()
            return
