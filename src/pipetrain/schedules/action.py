"""Action: one op (F, B, I or W) of one stage on one micro-batch, written ``<stage><op><mb>``.

An asynchronous schedule's actions also name the weight version they use, relative to the
step, written ``<stage><op><mb>@<version>`` (``0B-1@-1``: stage 0's backward of the previous
step's last micro-batch, on the previous step's weights); see
:mod:`pipetrain.schedules.generators.pipedream`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = ["Op", "Action"]


class Op(str, Enum):
    """The four operations a schedule places.

    F: forward.  B: full backward (input and weight gradients together).
    I: input-gradient backward (what the previous stage waits for).
    W: weight-gradient backward (nobody waits for it; it fills bubbles).
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741  (the letter is the glossary's)
    W = "W"

    def __str__(self) -> str:
        return self.value


_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(-?\d+)\s*(?:@\s*(-?\d+)\s*)?$")


@dataclass(frozen=True)
class Action:
    """One op of one stage (global index) on one micro-batch.

    >>> Action.parse("2I5")
    Action(stage=2, op=<Op.I: 'I'>, mb=5)
    >>> str(Action(3, Op.F, 0))
    '3F0'
    >>> str(Action.parse("0B-1@-1"))
    '0B-1@-1'
    """

    stage: int
    op: Op
    mb: int
    version: int | None = None
    """The weight version this action uses, relative to its step (asynchronous schedules);
    None: the step's one set of weights."""

    def __str__(self) -> str:
        text = f"{self.stage}{self.op.value}{self.mb}"
        return text if self.version is None else f"{text}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``<stage><op><mb>`` such as ``"3F0"``, ``"2W5"``, or with a version, ``"0B-1@-1"``.

        Raises:
            ValueError: if the text is not of that form.
        """
        match = _ACTION_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><op><mb> with op one of "
                "F, B, I, W, for example '3F0' or '2W5' (or '0B-1@-1' with a weight version)"
            )
        version = None if match.group(4) is None else int(match.group(4))
        return cls(int(match.group(1)), Op(match.group(2)), int(match.group(3)), version)


def F(stage: int, mb: int) -> Action:  # noqa: N802  (reads like the glossary)
    """Shorthand for a forward action."""
    return Action(stage, Op.F, mb)


def B(stage: int, mb: int) -> Action:  # noqa: N802  (the glossary's letter)
    """Shorthand for a full-backward action."""
    return Action(stage, Op.B, mb)


def I(stage: int, mb: int) -> Action:  # noqa: N802, E743  (the glossary's letter)
    """Shorthand for an input-gradient action."""
    return Action(stage, Op.I, mb)


def W(stage: int, mb: int) -> Action:  # noqa: N802  (the glossary's letter)
    """Shorthand for a weight-gradient action."""
    return Action(stage, Op.W, mb)
