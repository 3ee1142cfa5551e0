"""Elastic: start the ``pipetrain train`` workers locally, or be one of them under torchrun.

A local launch (:func:`launch_local`) hands ``--nproc`` workers to torch's elastic agent
(``torch.distributed.launcher.api.elastic_launch``), which forks them from a server that
imported torch and pipetrain once (:func:`~pipetrain.runtime.launch.start_context`). It looks at
them every ``MONITOR_S``, stops all of them once one has failed, and restarts the whole group up
to ``max_restarts`` times (each restart resumes from the newest committed checkpoint, because
``resume`` is on by default).
Under ``torchrun`` the agent is torchrun's and :func:`worker` runs directly in each process, so
the same command line scales out unchanged::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m pipetrain train --pp 4 --dp 4 --preset 1b

Security: torch.distributed has no authentication, so a local launch listens on 127.0.0.1
only. The agent's TCPStore would bind every interface (it ignores the host it is given), so
:func:`~pipetrain.runtime.launch.loopback_store` binds a socket to 127.0.0.1 first and hands its
file descriptor to a multi-tenant TCPStore, which the agent's static rendezvous then reuses.
Gloo and NCCL listen on the interface named by ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``,
set to the loopback interface unless the user chose one.

Fail-stop: a rank that raises writes its message (with a precise time) to the agent's error
file and exits 1; a killed rank is seen by the agent; a hung rank is detected by its peers'
bounded waits (``timeout``), which raise, naming it (the watchdog). The agent then stops every
other rank, and :class:`JobFailed` names the rank that failed first; when that was a timeout,
its last line is the watchdog's finding (which rank held everyone up, and where).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.errors import PipelineError
from pipetrain.runtime.failure import job_failure
from pipetrain.runtime.failure.watchdog import job_store
from pipetrain.runtime.launch import RANK_MODULES, loopback_store, start_context
from pipetrain.runtime.torch_distributed import PrefixStore, TCPStore
from pipetrain.train.config import TrainConfig
from pipetrain.train.launch import faults
from pipetrain.train.logs.events import NullReporter, Reporter
from pipetrain.train.sources.choice import kind_of

__all__ = ["JobFailed", "RunFn", "under_torchrun", "launch_local", "worker", "backend_for",
           "SHUTDOWN_GRACE"]

RunFn = Callable[[TrainConfig, Reporter], dict[str, Any]]
"""The training function every worker calls (default: ``pipetrain.train.loop.run``)."""
SHUTDOWN_GRACE = 5
"""Seconds the agent waits after SIGTERM before it SIGKILLs a worker it is stopping."""
MONITOR_S = 0.5
LAUNCHER_ENV = "PIPETRAIN_LAUNCHER"
"""Set to ``local`` for the workers ``pipetrain train`` starts itself (its verdict on a
failure is printed by the launcher)."""
"""How often the agent looks at its workers: a rank that saw a peer die or heard the job's
news (its watchdog looks every 0.5 s) has this long to say so before the agent stops it."""
_LOOPBACK = "127.0.0.1"


class JobFailed(PipelineError):
    """A training job failed on some rank and no restart was left; names the first failure."""


def under_torchrun(env: dict[str, str] | None = None) -> bool:
    """True when this process is already a worker (torchrun, or RANK and WORLD_SIZE set)."""
    env = dict(os.environ) if env is None else env
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def backend_for(device: str, local_world_size: int) -> str:
    """``nccl`` when the job computes on GPUs (one per local rank), else ``gloo``.

    ``auto`` is ``nccl`` with a GPU for every local rank and ``gloo`` on a node without any
    GPU; a node with some GPUs, but fewer than its ranks, is an error rather than a silent
    CPU run.

    Raises:
        ValueError: ``device`` is unknown, or ``cuda`` or ``auto`` with at least one GPU but
            fewer GPUs than local ranks (the message says what to pass instead).
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cpu" or (device == "auto" and gpus == 0):
        return "gloo"
    if gpus >= local_world_size:
        return "nccl"
    if device == "auto":
        raise ValueError(f"--device auto found {gpus} GPU{'s' * (gpus != 1)} on this node but "
                         f"{local_world_size} local ranks, and each rank needs its own GPU: "
                         f"pass --device cpu to run on CPU (gloo), or start at most {gpus} "
                         f"process{'es' * (gpus != 1)} per node (--nproc, torchrun's "
                         "--nproc-per-node)")
    raise ValueError(f"device='cuda' needs one GPU per local rank: {local_world_size} "
                     f"ranks but {gpus} GPUs; start fewer processes or use "
                     "--device cpu")


# -------------------------------------------------------------------------------- launcher


def launch_local(cfg: TrainConfig, run: RunFn | None = None, *,
                 tuned: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run ``cfg`` on ``cfg.nproc`` local processes; return rank 0's summary.

    Args:
        cfg: the run; ``nproc``, ``max_restarts``, ``device`` and ``out`` shape the launch.
        run: the training function (module-level, picklable); None: ``loop.run``.
        tuned: the settings that took the fine-tuning defaults, marked in the printed config
            (:func:`pipetrain.train.commands.train_command.resolved`).

    Raises:
        JobFailed: a rank failed and no restart was left; the message names the rank that
            failed first, how, and every other failure.
        ValueError: ``nproc`` below 1 or an impossible device choice.
    """
    if cfg.nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {cfg.nproc}")
    backend = backend_for(cfg.device, cfg.nproc)
    if run is None:
        kind_of(cfg).prepare(cfg)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with (loopback_store() as port, _worker_env(backend), _quiet_torch_logs(),
          tempfile.TemporaryDirectory(prefix="pipetrain-launch-") as logs):
        launcher = _elastic(cfg, port, logs)
        try:
            results = launcher(cfg, run, dict(os.environ), tuned)
        except ChildFailedError as e:
            raise JobFailed(_failure_report(e.failures, cfg.max_restarts)) from None
        except SignalException as e:  # Ctrl-C or kill: the agent has stopped every worker
            raise JobFailed(f"interrupted by {e.sigval.name}; every worker was stopped "
                            "(rerun the same command to resume from the newest checkpoint)"
                            ) from None
    summary: dict[str, Any] = results.get(0) or {}
    return summary


def _elastic(cfg: TrainConfig, port: int, logs: str) -> Any:
    """The agent's launcher; its error files go to ``logs`` (read back into JobFailed)."""
    import dataclasses

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch before 2.13 has no shutdown_timeout: its agent waits its own default grace
    grace: dict[str, Any] = ({"shutdown_timeout": SHUTDOWN_GRACE}
             if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {})
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="static", rdzv_endpoint=f"{_LOOPBACK}:{port}",
        rdzv_configs={"rank": 0, "timeout": max(60, int(cfg.timeout))},
        max_restarts=cfg.max_restarts, monitor_interval=MONITOR_S, start_method=_start_method(cfg),
        local_addr=_LOOPBACK, logs_specs=DefaultLogsSpecs(log_dir=logs), **grace)
    return elastic_launch(config, worker)


def _start_method(cfg: TrainConfig) -> str:
    """forkserver, whose server imports torch, pipetrain's training loop, torch's capture
    modules and the source's (for ``--hf`` transformers with the model's modeling module,
    which this process opened) once for every worker and restart, or spawn where there is
    none."""
    modules = ("pipetrain.train.loop", *RANK_MODULES, *kind_of(cfg).rank_modules(cfg))
    return str(start_context(modules).get_start_method())


@contextlib.contextmanager
def _worker_env(backend: str) -> Iterator[None]:
    """Environment the workers inherit: loopback interfaces, one thread per CPU rank."""
    loopback = _loopback_interface()
    wanted = {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback,
              LAUNCHER_ENV: "local"}
    if backend == "gloo":
        wanted["OMP_NUM_THREADS"] = "1"
    saved = {k: os.environ.get(k) for k in wanted}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Hide the agent's per-failure tracebacks; :class:`JobFailed` says it more plainly."""
    names = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")
    loggers = [logging.getLogger(name) for name in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.setLevel(level)


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), "lo")


# --------------------------------------------------------------------------------- failure


def _failure_report(failures: dict[int, Any], max_restarts: int) -> str:
    """Who failed first and how, then every other failure (``ProcessFailure`` by rank)."""
    ordered = sorted(failures.items(), key=lambda item: _failure_time(item[1]))
    first_rank, first = ordered[0]
    restarts = (f"after {max_restarts} restart{'s' * (max_restarts != 1)}" if max_restarts
                else "without restarts (--max-restarts 0)")
    lines = [f"the job failed {restarts}: rank {first_rank} failed first: {_how(first)}"]
    lines += [f"  then rank {rank}: {_how(f)}" for rank, f in ordered[1:]]
    cause = _watchdog_finding(_how(first))
    if cause:  # the first failure was a timeout: its watchdog named the rank holding all up
        lines.append(f"the cause, found by rank {first_rank}'s watchdog: {cause}")
    return "\n".join(lines)


def _watchdog_finding(message: str) -> str | None:
    """The ``watchdog:`` line of a timeout's message (``runtime.watchdog.diagnosed``)."""
    for line in message.splitlines():
        if line.strip().startswith("watchdog: "):
            return line.strip()[len("watchdog: "):]
    return None


def _failure_time(failure: Any) -> tuple[int, float]:
    """Sort key: a rank killed by a signal died first; then by the precise time of raising."""
    ours = failure.error_file_data.get("pipetrain", {}) if failure.error_file_data else {}
    precise = float(ours.get("time", failure.timestamp))
    return (0 if failure.exitcode < 0 else 1, precise)


def _how(failure: Any) -> str:
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()} (pid {failure.pid})"
    ours = failure.error_file_data.get("pipetrain", {}) if failure.error_file_data else {}
    message = ours.get("message") or failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    return f"exit code {failure.exitcode}: {str(message).strip()}"


# ---------------------------------------------------------------------------------- worker


def worker(cfg: TrainConfig, run: RunFn | None = None, env: dict[str, str] | None = None,
           tuned: tuple[str, ...] = ()) -> dict[str, Any]:
    """One rank of the job: join the group, train, leave; runs in every worker process.

    Expects the torchrun environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``). Prints the resolved config on global rank 0, builds the
    progress reporter there, calls ``run(cfg, reporter)`` (default ``loop.run``) and returns
    its summary. ``env``: the launching process's environment, for a worker forked from a
    server started earlier (:func:`_inherit`). ``tuned``: the settings that took the
    fine-tuning defaults, marked in the printed config.

    Raises:
        SystemExit: code 1 after any exception, once its message is printed (naming the rank)
            and written to the elastic agent's error file with its precise time.
    """
    if env is not None:
        _inherit(env)
    signal.signal(signal.SIGTERM, _on_stop)
    rank = int(os.environ.get("RANK", "0"))
    joined: list[Any] = []  # the job's store, once joined
    try:
        return _work(cfg, run, rank, joined, tuned)
    except BaseException as e:  # every failure becomes a clean exit 1
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        if _says(e, joined[0] if joined else None, cfg.verbose):
            _report_failure(e, rank, getattr(run, "command", "train"))
        else:
            _report_failure(e, rank, getattr(run, "command", "train"), printed=False)
        if joined:
            job_failure.leave(joined[0], rank, int(os.environ.get("WORLD_SIZE", "1")))
        raise SystemExit(1) from None


def _work(cfg: TrainConfig, run: RunFn | None, rank: int, joined: list[Any],
          tuned: tuple[str, ...] = ()) -> dict[str, Any]:
    if cfg.ft:  # one replica of several: its own out, torchft's notes held back
        cfg = _one_replica(cfg)
    if cfg.out and os.environ.get(faults.ENV):  # once per job: restarts keep the run id
        job = os.environ.get("TORCHELASTIC_RUN_ID", "job")
        os.environ.setdefault(faults.DIR_ENV, str(Path(cfg.out) / "faults" / job))
    backend = backend_for(cfg.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend == "gloo":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _init_group(backend, rank, timedelta(seconds=cfg.timeout))
    joined += [store for store in (job_store(),) if store is not None]
    quiet = not getattr(run, "reports", True)  # a job that is not training (generate)
    reporter = NullReporter() if quiet else _reporter(cfg, rank, tuned)
    try:
        return (run or _default_run())(cfg, reporter)
    finally:
        reporter.close()
        dist.destroy_process_group()


def _one_replica(cfg: TrainConfig) -> TrainConfig:
    """``--ft``: this replica writes under ``<out>/replica-<R>``; torchft says warnings and
    errors only (its own Rust log level, ``RUST_LOG``, and Python loggers) unless verbose."""
    import dataclasses

    from pipetrain.train.launch.replicas import replica_out

    if not cfg.verbose:
        os.environ.setdefault("RUST_LOG", "error")
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
    return dataclasses.replace(cfg, out=replica_out(cfg.out, cfg.ft_replica_id or 0))


def _on_stop(signum: int, frame: Any) -> None:
    """The agent's SIGTERM: a rank explaining a failure finishes saying what it saw (bounded
    by the news wait, within ``SHUTDOWN_GRACE``) and exits 1; any other rank stops now."""
    if job_failure.failing():
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _inherit(env: dict[str, str]) -> None:
    """Take the launcher's environment as of the launch: what the agent set for this worker
    stays, pipetrain's own switches (``PIPETRAIN_*``) follow the launcher exactly."""
    for key in [k for k in os.environ if k.startswith("PIPETRAIN_") and k not in env]:
        del os.environ[key]
    for key, value in env.items():
        if key.startswith("PIPETRAIN_"):
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)


def _default_run() -> RunFn:
    from pipetrain.train.loop import run

    return run


def _init_group(backend: str, rank: int, timeout: timedelta) -> None:
    """Join the process group through a store private to this restart attempt.

    The elastic agent keeps one store across restarts; a prefix per attempt keeps the keys of
    a failed attempt (peer addresses of dead processes) from being read by the next one.
    """
    world = int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=PrefixStore(f"pipetrain/{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)


def _reporter(cfg: TrainConfig, rank: int, tuned: tuple[str, ...] = ()) -> Reporter:
    if rank != 0:
        return NullReporter()
    from pipetrain.train.config import config_toml, format_config
    from pipetrain.train.logs.report import ProgressReporter

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        print(f"pipetrain train: restart {restart} of "
              f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS')}, resuming from the newest "
              f"committed checkpoint under {cfg.out} (if any)", flush=True)
    else:
        print(format_config(cfg, world=dist.get_world_size(), fine_tuned=tuned), flush=True)
        if cfg.out:  # empty: no files
            Path(cfg.out).mkdir(parents=True, exist_ok=True)
            (Path(cfg.out) / "config.toml").write_text(config_toml(cfg))
    return ProgressReporter(cfg)


def _says(error: BaseException, store: Any, verbose: bool) -> bool:
    """Whether this rank prints its failure. What each rank saw of a failed pipeline
    (a :class:`~pipetrain.errors.PipelineError`) it always says. An error several ranks raise
    alike (a model that cannot be built, a setting every rank refuses) is said once: by the
    launcher alone when it is ``pipetrain train``'s own without restarts (its verdict names
    the rank and the message), else by the first rank that raises it (a key in the job's
    store). ``verbose``: every rank says it."""
    if verbose or isinstance(error, (PipelineError, KeyboardInterrupt)):
        return True
    if (os.environ.get(LAUNCHER_ENV) == "local"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"):
        return False
    if store is None:
        return True
    alike = re.sub(r"\[rank \d+\]\s*", "", f"{type(error).__name__}: {error}")
    key = "pipetrain/failure/" + hashlib.blake2b(alike.encode(), digest_size=8).hexdigest()
    try:
        return int(store.add(key, 1)) == 1
    except Exception:  # noqa: BLE001 - the store may be gone with the job: say it
        return True


def _report_failure(error: BaseException, rank: int, command: str = "train",
                    printed: bool = True) -> None:
    """Print one line naming the rank (as ``pipetrain <command>``) unless not ``printed``,
    and write the agent's error file with precise time."""
    message = "interrupted" if isinstance(error, KeyboardInterrupt) else (
        f"{type(error).__name__}: {error}")
    if not str(error).startswith("[rank"):
        message = f"[rank {rank}] {message}"
    if printed:
        print(f"pipetrain {command}: {message}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": traceback.format_exc(),
                                      "timestamp": str(int(now))}},
            "pipetrain": {"time": now, "rank": rank, "message": message}}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data))
