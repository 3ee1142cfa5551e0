"""Quiet: the native libraries' routine notes on stderr held back from a run's console.

torch's profiler (kineto) writes ``USDT ... profiler_start``/``profiler_stop`` and ``STAGE``
lines straight to file descriptor 2, and its CPU allocator warns ``Memory block of unknown
size was allocated before the profiling started`` for every tensor older than the profiled
step: on every ``pipetrain train`` on CPU, whose memory is measured that way
(:mod:`pipetrain.train.memory`). :func:`held_notes` sends descriptor 2 to a file for the
block and then writes back every line that is not one of those notes, so nothing else is lost
(a thread's message written meanwhile comes out after the block, in order). ``--verbose``
(``cfg.verbose``) lets them through.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["NOTES", "fd_to", "held_notes"]

NOTES = re.compile(
    r"^(USDT|STAGE):.*ActivityProfiler|"
    r"CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling")
"""The lines held back: kineto's profiler notes, the CPU allocator's profiling warning."""


@contextlib.contextmanager
def fd_to(fd: int, target: int) -> Iterator[None]:
    """File descriptor ``fd`` (1 or 2) pointed at ``target`` for the block, then back:
    what native code writes there follows, as Python's own writes do."""
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.flush()
    saved = os.dup(fd)
    os.dup2(target, fd)
    try:
        yield
    finally:
        stream.flush()
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def held_notes(verbose: bool = False) -> Iterator[None]:
    """Run the block with :data:`NOTES` kept off stderr (all of stderr when ``verbose``)."""
    if verbose:
        yield
        return
    with tempfile.TemporaryFile() as held:
        try:
            with fd_to(2, held.fileno()):
                yield
        finally:
            held.seek(0)
            kept = [line for line in held.read().decode(errors="replace").splitlines(True)
                    if not NOTES.search(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
