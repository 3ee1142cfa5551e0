"""Replica launch: ``pipetrain train --ft`` on one machine, a Lighthouse and an agent per replica.

``pipetrain train --nproc 4 --pp 2 --dp 2 --ft`` starts torchft's Lighthouse in this process
(on 127.0.0.1) and one ``pipetrain train --ft-replica-id R`` process per replica, each a local
launch of ``nproc / dp`` workers under its own elastic agent, exactly what a cluster runs as one
torchrun per replica (docs/cluster.md)::

    pipetrain train --ft (this process: Lighthouse)
      ├── replica 0: elastic agent ── ranks 0, 1   (its own world, store and restarts)
      └── replica 1: elastic agent ── ranks 0, 1

A replica that fails is restarted by its own agent (``--max-restarts``: 3 unless given, 0 lets
it go) while the others go on; the launch ends when every replica has ended, and names each
replica that stopped for good with its own launch's verdict. Replica 0 prints the config and
the progress bar; every replica writes under ``<out>/replica-<R>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, NamedTuple

from pipetrain.train.config import TrainConfig, config_toml
from pipetrain.train.launch.elastic import JobFailed
from pipetrain.train.launch.replicas import replica_out, require_torchft
from pipetrain.train.sources.choice import kind_of

__all__ = ["launch_replicas", "JOIN_TIMEOUT_MS", "HEARTBEAT_TIMEOUT_MS"]

JOIN_TIMEOUT_MS = 1000
"""How long the local Lighthouse waits for a replica that beats but has not asked to join
(torchft_lighthouse's ``--join_timeout_ms``; its default is 60 s, for clusters)."""
HEARTBEAT_TIMEOUT_MS = 2000
"""After how long without a heartbeat the local Lighthouse counts a replica gone (torchft's
default: 5 s)."""


def launch_replicas(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``cfg`` (``ft``, ``dp`` replicas of ``nproc / dp`` processes each) on this machine;
    return replica 0's summary (or the first finished replica's).

    Raises:
        ValueError: torchft is missing, or ``nproc`` does not divide by ``dp``.
        JobFailed: a replica failed for good (its restarts spent); names it, and which
            replicas finished.
    """
    require_torchft()
    if cfg.nproc % cfg.dp:
        raise ValueError(f"--ft: --nproc {cfg.nproc} must divide into --dp {cfg.dp} replicas")
    kind_of(cfg).prepare(cfg)
    if not cfg.verbose:  # torchft's own log (Rust): warnings and errors only
        os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=cfg.ft_min_replicas,
                                  join_timeout_ms=JOIN_TIMEOUT_MS,
                                  heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    url = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    try:
        ends = _run_replicas(cfg, url)
    finally:
        lighthouse.shutdown()
    return _verdict(cfg, ends)


class _Ended(NamedTuple):
    """How a replica's launch ended: its exit code and the verdict it printed last."""

    code: int
    why: str


def _run_replicas(cfg: TrainConfig, url: str) -> list[_Ended]:
    """Start every replica's launch and wait for all of them; how each ended."""
    with tempfile.TemporaryDirectory(prefix="pipetrain-ft-") as tmp:
        procs: list[subprocess.Popen[str]] = []
        tees: list[_Tee] = []
        try:
            for r in range(cfg.dp):
                child = dataclasses.replace(cfg, nproc=cfg.nproc // cfg.dp, ft_replica_id=r,
                                            ft_lighthouse=url, progress=cfg.progress and r == 0)
                path = Path(tmp) / f"replica-{r}.toml"
                path.write_text(config_toml(child))
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pipetrain", "train", "--config", str(path)],
                    stdout=None if r == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                    text=True))
                tees.append(_Tee(procs[-1]))
            codes = [p.wait() for p in procs]
            return [_Ended(code, tee.joined()) for code, tee in zip(codes, tees, strict=True)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(10)


class _Tee:
    """Passes a replica's stderr through to this process's, keeping the last verdict it
    printed (its launch's ``pipetrain train: ...`` line, with the lines under it)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.verdict: list[str] = []
        self._thread = threading.Thread(target=self._pass, args=(proc,), daemon=True)
        self._thread.start()

    def _pass(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None  # opened with stderr=PIPE
        for line in proc.stderr:
            sys.stderr.write(line)
            if line.startswith("pipetrain train: "):
                self.verdict = [line.removeprefix("pipetrain train: ").rstrip()]
            elif self.verdict and line.startswith("  "):
                self.verdict.append(line.rstrip())
        sys.stderr.flush()

    def joined(self) -> str:
        """The verdict, once the replica's stderr is closed."""
        self._thread.join()
        return "\n".join(self.verdict)


def _verdict(cfg: TrainConfig, ends: list[_Ended]) -> dict[str, Any]:
    """Replica 0's summary when every replica finished; else which stopped for good, why."""
    failed = [r for r, end in enumerate(ends) if end.code != 0]
    done = [r for r, end in enumerate(ends) if end.code == 0]
    if failed:
        restarts = (f" after {cfg.max_restarts} restart{'s' * (cfg.max_restarts != 1)} "
                    f"(--max-restarts {cfg.max_restarts})" if cfg.max_restarts
                    else ", not restarted (--max-restarts 0 lets a failed replica go)")
        lines = [f"replica {r} stopped for good{restarts}, exit code {ends[r].code}: "
                 f"{ends[r].why or 'its error is above'}" for r in failed]
        if done:
            lines.append(f"replica{'s' * (len(done) > 1)} {', '.join(map(str, done))} "
                         f"finished (under {replica_out(cfg.out, done[0])})" if cfg.out
                         else f"replica{'s' * (len(done) > 1)} {', '.join(map(str, done))} "
                         "finished")
        raise JobFailed("\n".join(lines))
    if not cfg.out:
        return {}
    path = Path(replica_out(cfg.out, done[0])) / "summary.json"
    summary: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    return summary
