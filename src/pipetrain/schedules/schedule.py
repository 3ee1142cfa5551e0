"""Schedule: the stage-to-rank placement plus one ordered action list per rank, as plain data.

Glossary (one word per concept, used everywhere in pipetrain):

    rank   a process; ranks are numbered 0 .. n_ranks-1 within the pipeline group
    stage  a contiguous part of the model, global index 0 .. n_stages-1 (data flows 0 -> last)
    mb     micro-batch index 0 .. n_microbatches-1
    op     F (forward), B (full backward), I (input-gradient backward), W (weight-gradient)
    p, m, v  counts: ranks, micro-batches, stages per rank (n_stages = p * v)

A schedule never refers to modules, devices or process groups: it is generated from integers,
printed, parsed back, validated and simulated, and the runtime executes exactly these lists.

A decoding schedule (:mod:`pipetrain.schedules.generators.decode`) adds one more rule, its
``feedback``: the token the last stage picks for one micro-batch is the input of a later one.

Text form (CSV, one column per rank; ``#`` lines are comments; empty, ``.`` or ``-`` cells are
padding; columns may also be separated by whitespace instead of commas; a decoding schedule
has a ``# feedback: lag=L start=S`` line)::

    # schedule: 1f1b
    rank 0,rank 1
    0F0,.
    0F1,1F0
    ...
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipetrain.errors import ScheduleError
from pipetrain.schedules.action import Action, Op

__all__ = ["Schedule"]

_PAD = {"", ".", "-"}


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``actions[rank]`` is the ordered list that rank executes.

    ``placement[stage]`` is the rank holding that stage. Build one with
    :func:`pipetrain.make_schedule`, :meth:`from_text`, or directly from lists of actions.
    """

    name: str
    n_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    feedback: tuple[int, int] | None = None
    """Autoregressive decoding, as ``(lag, start)``: the forward of stage 0 on micro-batch
    ``mb >= start`` takes the output of the last stage's forward on ``mb - lag`` (the token it
    picked). Such a schedule is forward-only. None: micro-batches are independent."""

    @classmethod
    def from_lists(
        cls, name: str, n_microbatches: int, placement: Sequence[int],
        actions: Sequence[Sequence[Action]], feedback: tuple[int, int] | None = None,
    ) -> Schedule:
        """Freeze plain lists into a schedule (no validation beyond shape; see ``validate``)."""
        return cls(name, n_microbatches, tuple(placement), tuple(tuple(a) for a in actions),
                   feedback)

    def fed_back(self, action: Action) -> Action | None:
        """The last stage's forward whose output ``action`` takes as its input (decoding's
        feedback), or None."""
        if self.feedback is None or action.op is not Op.F or action.stage != 0:
            return None
        lag, start = self.feedback
        return Action(self.n_stages - 1, Op.F, action.mb - lag) if action.mb >= start else None

    @property
    def n_ranks(self) -> int:
        return len(self.actions)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages placed on ``rank``, in increasing order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    @property
    def split_backward(self) -> bool:
        """True when the schedule uses I/W instead of fused B."""
        return any(a.op in (Op.I, Op.W) for acts in self.actions for a in acts)

    def to_text(self) -> str:
        """The CSV grid: a comment line, a header of ranks, then one row per step."""
        depth = max((len(a) for a in self.actions), default=0)
        lines = [f"# schedule: {self.name}"]
        if self.feedback is not None:
            lines.append(f"# feedback: lag={self.feedback[0]} start={self.feedback[1]}")
        lines.append(",".join(f"rank {r}" for r in range(self.n_ranks)))
        for step in range(depth):
            cells = [str(a[step]) if step < len(a) else "." for a in self.actions]
            lines.append(",".join(cells))
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.to_text()

    @classmethod
    def from_text(cls, text: str, name: str | None = None) -> Schedule:
        """Parse the grid written by :meth:`to_text` (or by hand).

        The placement is inferred from which rank's column each stage appears in; the number
        of micro-batches is one more than the largest mb seen.

        Raises:
            ScheduleError: on an unparsable cell or a stage appearing on two ranks.
        """
        found_name, rows = _grid_rows(text)
        feedback = _feedback(text)
        if not rows:
            raise ScheduleError("schedule text has no rank header and no actions")
        header, body = rows[0][1], rows[1:]
        n_ranks = len(header)
        if _is_action_row(header):  # no header line: the first row already holds actions
            body, n_ranks = rows, max(len(row) for _, row in rows)
        columns: list[list[Action]] = [[] for _ in range(n_ranks)]
        for line_no, row in body:
            if len(row) > n_ranks:
                raise ScheduleError(
                    f"line {line_no}: {len(row)} cells but the header names {n_ranks} ranks"
                )
            for rank, cell in enumerate(row):
                if cell in _PAD:
                    continue
                try:
                    columns[rank].append(Action.parse(cell))
                except ValueError as e:
                    raise ScheduleError(f"line {line_no}, rank {rank}: {e}") from None
        placement = _infer_placement(columns)
        n_mb = 1 + max((a.mb for col in columns for a in col), default=-1)
        return cls.from_lists(name or found_name or "custom", n_mb, placement, columns,
                              feedback)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_text())

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        """Read a schedule grid from a file (see :meth:`from_text`)."""
        return cls.from_text(Path(path).read_text())


def _grid_rows(text: str) -> tuple[str | None, list[tuple[int, list[str]]]]:
    name: str | None = None
    rows: list[tuple[int, list[str]]] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            if key.strip() == "schedule" and value.strip():
                name = value.strip()
            continue
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")] if "," in line else line.split()
        if not rows and not _is_action_row(cells):
            # header: "rank 0, rank 1" or "r0 r1"; only its width matters
            cells = [c for c in cells if c] if "," in line else _merge_rank_words(cells)
        rows.append((line_no, cells))
    return name, rows


def _feedback(text: str) -> tuple[int, int] | None:
    """The ``# feedback: lag=L start=S`` line's integers, or None without one."""
    for raw in text.splitlines():
        key, _, value = raw.strip().lstrip("#").partition(":")
        if not raw.strip().startswith("#") or key.strip() != "feedback":
            continue
        found = re.fullmatch(r"\s*lag\s*=\s*(\d+)\s+start\s*=\s*(\d+)\s*", value)
        if found is None:
            raise ScheduleError(f"cannot parse {raw.strip()!r}: expected '# feedback: lag=L "
                                "start=S' with two integers")
        return int(found.group(1)), int(found.group(2))
    return None


def _is_action_row(cells: list[str]) -> bool:
    try:
        return any([Action.parse(c) for c in cells if c not in _PAD])
    except ValueError:
        return False


def _merge_rank_words(words: list[str]) -> list[str]:
    # "rank 0 rank 1" written with spaces: pair each "rank" with its number.
    if words and all(w.lower() == "rank" for w in words[0::2]):
        return [f"{a} {b}" for a, b in zip(words[0::2], words[1::2], strict=False)]
    return words


def _infer_placement(columns: list[list[Action]]) -> list[int]:
    owner: dict[int, int] = {}
    for rank, col in enumerate(columns):
        for action in col:
            prev = owner.setdefault(action.stage, rank)
            if prev != rank:
                raise ScheduleError(
                    f"stage {action.stage} appears on rank {prev} and on rank {rank} "
                    f"(action {action}); a stage lives on exactly one rank"
                )
    n_stages = 1 + max(owner, default=-1)
    missing = [s for s in range(n_stages) if s not in owner]
    if missing:
        raise ScheduleError(
            f"stages {missing} have no actions on any rank; every stage 0..{n_stages - 1} "
            "needs its F and backward actions"
        )
    return [owner[s] for s in range(n_stages)]
