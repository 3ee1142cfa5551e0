"""Faults: inject a kill, exception, hang or NaN at a chosen (rank, step), once per job.

Tests and the soak script describe the faults in an environment variable, inherited by every
worker process (also across the launcher's restarts)::

    PIPETRAIN_FAULTS="kill@rank1:step7,nan@rank0:step3,raise@rank0:step5,hang@rank1:step4"

The training loop calls :func:`at_step` at the start of every step on every rank. Without
``PIPETRAIN_FAULTS`` it returns None and does nothing else. A fault fires once per job: before
acting it creates a marker file in ``PIPETRAIN_FAULTS_DIR`` (the ``pipetrain train`` worker
points it at ``<out>/faults/<run id>``, the same across the launcher's restarts), so a job
restarted from a checkpoint taken before the faulty step runs that step again without the
fault, while a new job in the same ``out`` gets its faults again. Without a marker directory
a fault fires once per process.

Kinds:

- ``kill``: SIGKILL this process (no cleanup, no message: what a lost machine looks like);
- ``raise``: raise :class:`InjectedFault` (an uncaught exception in the training code);
- ``hang``: sleep until killed (a stuck rank: peers must detect it by their own timeouts);
- ``nan``: :func:`at_step` returns ``"nan"``; the loop must make this rank's loss of this step
  NaN (e.g. ``loss = loss * float("nan")``), exercising the non-finite step policy.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["ENV", "DIR_ENV", "KINDS", "Fault", "InjectedFault", "parse", "at_step",
           "random_plan"]

ENV = "PIPETRAIN_FAULTS"
"""The environment variable holding the fault list."""
DIR_ENV = "PIPETRAIN_FAULTS_DIR"
"""The environment variable naming the directory of fired-fault markers."""
KINDS = ("kill", "raise", "hang", "nan")
"""The fault kinds, in the order :func:`random_plan` draws from."""

_ITEM = re.compile(r"^(?P<kind>[a-z]+)@rank(?P<rank>\d+):step(?P<step>\d+)$")
_fired_here: set[str] = set()  # faults fired by this process (used without a marker directory)


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` on ``rank`` at the start of ``step``."""

    kind: str
    rank: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind}@rank{self.rank}:step{self.step}"


def parse(text: str) -> list[Fault]:
    """The faults of a ``PIPETRAIN_FAULTS`` value (comma-separated ``KIND@rankR:stepS``).

    Raises:
        ValueError: an item is malformed or names an unknown kind.

    Example:
        >>> parse("kill@rank1:step7,nan@rank0:step3")
        [Fault(kind='kill', rank=1, step=7), Fault(kind='nan', rank=0, step=3)]
    """
    faults = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        match = _ITEM.match(item)
        if match is None or match["kind"] not in KINDS:
            raise ValueError(
                f"{ENV}: cannot read {item!r}; write KIND@rankR:stepS with KIND one of "
                f"{', '.join(KINDS)}, e.g. kill@rank1:step7")
        faults.append(Fault(match["kind"], int(match["rank"]), int(match["step"])))
    return faults


def at_step(step: int, rank: int) -> Literal["nan"] | None:
    """Fire the fault planned for ``rank`` at ``step``, if any and not fired before in the job.

    Call at the start of every step, on every rank (``rank`` is the global rank).

    Returns:
        ``"nan"`` when the caller must make this rank's loss of this step NaN; None otherwise
        (also after a ``raise`` or ``hang`` fault, which do not return, and ``kill``, which
        ends the process).

    Raises:
        InjectedFault: for a ``raise`` fault.
        ValueError: ``PIPETRAIN_FAULTS`` is malformed.
    """
    text = os.environ.get(ENV)
    if not text:
        return None
    for fault in parse(text):
        if fault.rank == rank and fault.step == step and _claim(fault):
            return _fire(fault)
    return None


def _claim(fault: Fault) -> bool:
    """True the first time ``fault`` fires in this job (marker file) or process."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        if str(fault) in _fired_here:
            return False
        _fired_here.add(str(fault))
        return True
    Path(directory).mkdir(parents=True, exist_ok=True)
    try:  # O_EXCL: exactly one creator, even across processes
        fd = os.open(Path(directory) / str(fault), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, f"pid {os.getpid()} time {time.time():.3f}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def _fire(fault: Fault) -> Literal["nan"] | None:
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously; never continue meanwhile
    if fault.kind == "raise":
        raise InjectedFault(f"[rank {fault.rank}] injected exception at step {fault.step} "
                            f"({ENV}={os.environ.get(ENV)})")
    if fault.kind == "hang":
        while True:  # until a peer's timeout or the launcher ends this process
            time.sleep(3600)
    return "nan"


def random_plan(seed: int, steps: int, world_size: int, count: int,
                kinds: tuple[str, ...] = KINDS) -> str:
    """A ``PIPETRAIN_FAULTS`` value with ``count`` faults drawn from ``seed``.

    Steps are distinct, in ``1 .. steps - 1``; ranks and kinds uniform.

    Raises:
        ValueError: more faults than steps to place them at, or an unknown kind.

    Example:
        >>> random_plan(0, 100, 4, 3)  # doctest: +SKIP
        'hang@rank3:step50,kill@rank0:step98,nan@rank2:step54'
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; choose from {list(KINDS)}")
    if not 0 <= count <= steps - 1:
        raise ValueError(f"cannot place {count} faults at distinct steps 1..{steps - 1}")
    rng = random.Random(seed)
    chosen = rng.sample(range(1, steps), count)
    faults = [Fault(rng.choice(kinds), rng.randrange(world_size), s) for s in chosen]
    return ",".join(str(f) for f in faults)
