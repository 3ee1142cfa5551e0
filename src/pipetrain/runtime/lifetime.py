"""Lifetime: the threads a pipeline starts, and what ends them before the interpreter does.

A pipeline's background threads (its watchdog, and after a failure the drains of its peers'
messages) spend their time in torch calls that release the GIL: a store request, a gloo wait.
CPython (3.11 and before) ends such a daemon thread when its call returns during the
interpreter's finalisation; the thread unwinds through C++ frames that catch everything, and
``std::terminate`` aborts the whole process ("terminate called without an active exception",
exit by SIGABRT). A gloo wait returns then whenever a peer's process exits first: a survivor of
a failure died so at exit, after it had raised the right error::

    interpreter exit ──► atexit: end() ──► every live owner's ``at_exit()`` (a failed
                                           transport closes its connections, so its drains'
                                           waits fail now; a watchdog is told to stop)
                                       ──► every pipetrain thread joined (bounded)
                     ──► finalisation: no pipetrain thread is left in a torch call

A pipeline's own ``close()`` (or its last reference going) ends the same threads earlier.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

__all__: list[str] = []

JOIN_S = 3.0  # how long the exit waits for pipetrain's threads, all together


class Owner(Protocol):
    """What owns pipetrain threads: told before the interpreter exits."""

    def at_exit(self) -> None: ...


_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()
_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start(target: Callable[..., object], args: tuple[Any, ...], name: str) -> threading.Thread:
    """Start a daemon thread that the interpreter's exit waits for (:func:`end`)."""
    thread = threading.Thread(target=target, args=args, daemon=True, name=name)
    _THREADS.add(thread)
    thread.start()
    return thread


def own(owner: Owner) -> None:
    """Tell ``owner`` (held weakly) before the interpreter exits."""
    _OWNERS.add(owner)


def alive() -> list[threading.Thread]:
    """pipetrain's threads still running in this process."""
    return [t for t in list(_THREADS) if t.is_alive()]


def end(seconds: float = JOIN_S) -> list[threading.Thread]:
    """Tell every owner, then wait (at most ``seconds`` in all) for pipetrain's threads to end;
    the ones still running after that."""
    for owner in list(_OWNERS):
        try:
            owner.at_exit()
        except Exception:  # noqa: BLE001  (best effort at exit: the rest still runs)
            continue
    deadline = time.monotonic() + seconds
    for thread in alive():
        thread.join(max(0.0, deadline - time.monotonic()))
    return alive()


atexit.register(end)
