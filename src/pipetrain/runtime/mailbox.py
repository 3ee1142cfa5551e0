"""Mailbox: where receiver threads leave messages for the main thread, with deadlines.

Receiver threads ``put`` decoded messages (or ``hand_over`` a receive they posted for the main
thread to wait on itself) and ``fail`` with the first error one of them hits; the main thread
``take``s a message by its key, waiting on one condition until it is there, a receiver failed,
or the deadline passed (a :class:`~pipetrain.errors.CommError` naming what it waited for).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from pipetrain.errors import CommError
from pipetrain.runtime.wire import Key, Message

__all__: list[str] = []

Describe = Callable[[], str]

_UNCLAIMED: list[Any] = []
"""Posted receives handed over but never waited for (their step failed), kept for good.

gloo must never see a posted receive's buffer freed: a message that arrives for it later (a
peer's relayed ABORT) then stalls that pair of ranks, and every later pipeline over them times
out. One frame per peer per failed pipeline stays allocated instead.
"""


def _park(handed: dict[Key, Any]) -> None:
    _UNCLAIMED.extend(handed.values())
    handed.clear()


class Mailbox:
    """Messages that arrived, and the first error any receiver hit, guarded by one condition."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: dict[Key, Message] = {}
        self.error: BaseException | None = None
        self.handed: dict[Key, Any] = {}  # receives posted for the main thread to wait on
        weakref.finalize(self, _park, self.handed)

    def put(self, msg: Message) -> None:
        with self.cond:
            self.items[msg.key] = msg
            self.cond.notify()

    def hand_over(self, key: Key, posted: Any) -> None:
        """A receive already posted for ``key``, which the main thread will wait on itself."""
        with self.cond:
            self.handed[key] = posted
            self.cond.notify()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def take(self, key: Key, deadline: float, describe: str | Describe) -> Message:
        """The message ``key`` once it is here; raises a receiver's error or at ``deadline``."""
        msg: Message = self._take(self.items, key, deadline, describe)
        return msg

    def take_handed(self, key: Key, deadline: float, describe: str) -> Any:
        """The receive handed over for ``key`` (see :meth:`hand_over`), once it is."""
        return self._take(self.handed, key, deadline, describe)

    def _take(self, store: dict[Key, Any], key: Key, deadline: float,
              describe: str | Describe) -> Any:
        with self.cond:
            while key not in store:
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    where = describe if isinstance(describe, str) else describe()
                    raise CommError(f"{where}: timed out waiting for the {key.describe()}")
                self.cond.wait(left)
            return store.pop(key)
