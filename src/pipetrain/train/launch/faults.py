"""Faults: inject a kill, exception, hang, NaN or wrong shape at a (rank, step), once per job.

Tests and the soak script describe the faults in an environment variable, inherited by every
worker process (also across the launcher's restarts)::

    PIPETRAIN_FAULTS="kill@rank1:step7,nan@rank0:step3,raise@rank0:step5,hang@rank1:step4"
    PIPETRAIN_FAULTS="shape@rank0:step9"

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
  NaN (e.g. ``loss = loss * float("nan")``), exercising the non-finite step policy;
- ``shape``: :func:`at_step` returns ``"shape"``; the loop runs the step's pipeline under
  :func:`wrong_shape`, which gives one of this rank's stage outputs a wrong shape (a bug in
  user code or a corrupted message): the stage that consumes it must fail with an error naming
  rank, stage and micro-batch, and every rank must stop at once.

``benchmarks/soak.py`` draws many of these from a seed (:func:`random_plan`), trains through
them with restarts and checks that every one was survived (figures in the README).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from pipetrain.runtime.torch_private import pytree

if TYPE_CHECKING:
    from pipetrain.pipeline import Pipeline

__all__ = ["ENV", "DIR_ENV", "KINDS", "Fault", "InjectedFault", "parse", "at_step",
           "random_plan", "wrong_shape", "shape_target"]

ENV = "PIPETRAIN_FAULTS"
"""The environment variable holding the fault list."""
DIR_ENV = "PIPETRAIN_FAULTS_DIR"
"""The environment variable naming the directory of fired-fault markers."""
KINDS = ("kill", "raise", "hang", "nan", "shape")
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


Instruction = Literal["nan", "shape"]
"""What :func:`at_step` asks the caller to do to this step."""


def at_step(step: int, rank: int) -> Instruction | None:
    """Fire the fault planned for ``rank`` at ``step``, if any and not fired before in the job.

    Call at the start of every step, on every rank (``rank`` is the global rank).

    Returns:
        ``"nan"`` when the caller must make this rank's loss of this step NaN, ``"shape"`` when
        it must run this step under :func:`wrong_shape`; None otherwise (also after a
        ``raise`` or ``hang`` fault, which do not return, and ``kill``, which ends the
        process).

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


def _fire(fault: Fault) -> Instruction | None:
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # SIGKILL is delivered asynchronously; never continue meanwhile
    if fault.kind == "raise":
        raise InjectedFault(f"[rank {fault.rank}] injected exception at step {fault.step} "
                            f"({ENV}={os.environ.get(ENV)})")
    if fault.kind == "hang":
        while True:  # until a peer's timeout or the launcher ends this process
            time.sleep(3600)
    return "shape" if fault.kind == "shape" else "nan"


def random_plan(seed: int, steps: int, world_size: int, count: int,
                kinds: tuple[str, ...] = KINDS) -> str:
    """A ``PIPETRAIN_FAULTS`` value with ``count`` faults drawn from ``seed``.

    Steps are distinct, in ``1 .. steps - 1``; ranks uniform; each kind of ``kinds`` comes
    ``count // len(kinds)`` or one more times (so every kind is drawn once ``count`` allows).

    Raises:
        ValueError: more faults than steps to place them at, or an unknown kind.

    Example:
        >>> random_plan(0, 100, 4, 3)  # doctest: +SKIP
        'hang@rank3:step50,kill@rank0:step98,nan@rank2:step54'
    """
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"fault kinds must be some of {list(KINDS)}, got {list(kinds)}")
    if not 0 <= count <= steps - 1:
        raise ValueError(f"cannot place {count} faults at distinct steps 1..{steps - 1}")
    rng = random.Random(seed)
    chosen = rng.sample(range(1, steps), count)
    drawn = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(drawn)
    faults = [Fault(kind, rng.randrange(world_size), s) for kind, s in zip(drawn, chosen)]
    return ",".join(str(f) for f in faults)


def shape_target(pipe: Pipeline) -> int:
    """The stage whose output a ``shape`` fault spoils on this process.

    The lowest stage held here whose next stage is on another rank (its output crosses the
    wire, so the receiving rank meets the wrong shape), else the last stage (its output goes
    into the loss, next to the targets).
    """
    held = sorted(pipe.stages)
    placement = pipe.schedule.placement
    sending = [s for s in held if s + 1 < len(placement) and placement[s + 1] != placement[s]]
    return sending[0] if sending else held[-1]


@contextlib.contextmanager
def wrong_shape(pipe: Pipeline, enabled: bool = True) -> Iterator[None]:
    """While open, the output of stage :func:`shape_target` has a wrong shape (``shape`` fault).

    A forward hook on the stage's last layer changes every floating-point output tensor: one
    more feature along the last dimension when the output goes to the next stage (a layer
    reading it then fails on its width), one row fewer along dim 0 on the last stage (the
    runtime's rows check against the targets fails). Either way a clear error that names
    rank, stage and micro-batch, never a silently different step.

    Example::

        with faults.wrong_shape(pipe, instruction == "shape"):
            pipe.step(inputs, targets)   # raises PipelineError on every rank
    """
    if not enabled:
        yield
        return
    stage = pipe.stages[shape_target(pipe)]
    last = stage.is_last

    def spoil(module: torch.nn.Module, args: object, output: object) -> object:
        return pytree.tree_map_only(  # keeps the output's type (a Hugging Face ModelOutput)
            torch.Tensor, lambda t: _misshape(t, last) if t.is_floating_point() else t, output)

    handle = stage.module[-1].register_forward_hook(spoil)
    try:
        yield
    finally:
        handle.remove()


def _misshape(t: torch.Tensor, last: bool) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1, 1)
    if last:
        return t[:-1] if t.size(0) > 1 else torch.cat([t, t])
    return torch.cat([t, t[..., -1:]], dim=-1)
