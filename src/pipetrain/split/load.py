"""Load: torch.export's loader, without the work it repeats for every node it reads.

A rank that loads rank 0's shared program (:mod:`pipetrain.split.shared_capture`) runs
``torch.export.load``, whose deserializer repeats two things for every object it reads:

- it asks ``typing.get_type_hints`` for the schema class it turns the object's JSON into;
- it parses each symbolic size's expression (``s0*s1``) with ``sympy.sympify``, the same few
  expressions again and again.

:func:`load_program` answers both from what this process worked out before. A class's hints
depend only on the class and the schema module's names. An expression is parsed again only
where its parse could differ: a kept parse is used when every symbol in it is the very object
the deserializer's names give now (a name it did not know then, or knows as another symbol
now, parses anew). Each is done by handing torch's serializer module, for the load's length,
a ``typing`` and a ``sympy`` that answer so and pass everything else on; where a torch
release reads them otherwise, nothing changes. ``tests/test_load.py`` checks that the program
is ``torch.export.load``'s.
"""

from __future__ import annotations

import contextlib
import io
import threading
import typing
from collections.abc import Iterator
from typing import Any

import sympy
import torch

__all__ = ["load_program"]


class _HintsOnce:
    """``typing`` whose ``get_type_hints`` works a class's hints out once per process."""

    def __init__(self) -> None:
        self._kept: dict[tuple[Any, int], tuple[Any, dict[str, Any]]] = {}  # with the
        # namespace itself, whose id would otherwise be free to name another

    def __getattr__(self, name: str) -> Any:
        return getattr(typing, name)

    def get_type_hints(self, obj: Any, globalns: dict[str, Any] | None = None,
                       localns: dict[str, Any] | None = None,
                       include_extras: bool = False) -> dict[str, Any]:
        if localns is not None or include_extras:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns))
        kept = self._kept.get(key)
        if kept is None:
            kept = self._kept[key] = (globalns, typing.get_type_hints(obj, globalns))
        return kept[1]


class _ParsedOnce:
    """``sympy`` whose ``sympify`` of a string with ``locals`` reuses an earlier parse of the
    same string whose every free symbol is the one ``locals`` names so now (one load's)."""

    def __init__(self) -> None:
        self._kept: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(sympy, name)

    def sympify(self, a: Any, *args: Any, locals: dict[str, Any] | None = None,  # noqa: A002
                **kwargs: Any) -> Any:
        if not isinstance(a, str) or locals is None or args or kwargs:
            return sympy.sympify(a, *args, locals=locals, **kwargs)
        kept = self._kept.get(a)
        if kept is not None and all(locals.get(s.name) is s for s in kept.free_symbols):
            return kept
        parsed = self._kept[a] = sympy.sympify(a, locals=locals)
        return parsed


_HINTS = _HintsOnce()
_ONE_AT_A_TIME = threading.Lock()


@contextlib.contextmanager
def _lean(serialize: Any) -> Iterator[None]:
    """Hand ``serialize`` the answering ``typing`` and ``sympy`` while the block runs."""
    if (getattr(serialize, "typing", None) is not typing
            or getattr(serialize, "sympy", None) is not sympy):  # another torch: as it is
        yield
        return
    serialize.typing, serialize.sympy = _HINTS, _ParsedOnce()
    try:
        yield
    finally:
        serialize.typing, serialize.sympy = typing, sympy


def load_program(data: bytes) -> torch.export.ExportedProgram:
    """``torch.export.load`` of ``data`` (what ``torch.export.save`` wrote): the same program,
    in less CPU time. GPT ``small``, CPU seconds on 2 cores, before and after: 0.50-0.74 and
    0.47 with every size symbolic, 0.25 and 0.17 at fixed shapes (``python
    benchmarks/capture.py --preset small`` prints the load; ``docs/own-model.md``).
    """
    from torch._export.serde import serialize

    with _ONE_AT_A_TIME, _lean(serialize):
        return torch.export.load(io.BytesIO(data))
