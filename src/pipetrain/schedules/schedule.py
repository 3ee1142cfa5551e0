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

An asynchronous schedule (``update``, :mod:`pipetrain.schedules.generators.pipedream`) is one
steady-state window of a pipeline that never flushes: its backward actions may name the
previous step's micro-batches (``mb < 0``: the previous step's ``m + mb``) and every F and B
names its weight version relative to the step. :meth:`Schedule.phase` gives what a step runs
(the first step fills the pipeline, a drain empties it) and :meth:`Schedule.unroll` the
whole run of ``k`` steps as one flushed schedule with absolute micro-batches and versions.

Text form (CSV, one column per rank; ``#`` lines are comments; empty, ``.`` or ``-`` cells are
padding; columns may also be separated by whitespace instead of commas; a decoding schedule
has a ``# feedback: lag=L start=S`` line, an asynchronous one a ``# update: 2bw`` line)::

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
    :func:`pipetrain.schedules.make_schedule`, :meth:`from_text`, or directly from lists of actions.
    """

    name: str
    n_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    feedback: tuple[int, int] | None = None
    """Autoregressive decoding, as ``(lag, start)``: the forward of stage 0 on micro-batch
    ``mb >= start`` takes the output of the last stage's forward on ``mb - lag`` (the token it
    picked). Such a schedule is forward-only. None: micro-batches are independent."""
    update: str | None = None
    """An asynchronous window's weight-update rule (``"2bw"``: PipeDream-2BW, one new
    version per step from the gradients of the step before; ``"stash"``: PipeDream, one per
    backward, from its gradient on the stashed version); None: a flush ends each step."""

    @property
    def versions_per_step(self) -> int:
        """How many weight versions a stage makes per step (0 for a flushed schedule)."""
        return {None: 0, "2bw": 1}.get(self.update, self.n_microbatches)

    @classmethod
    def from_lists(
        cls, name: str, n_microbatches: int, placement: Sequence[int],
        actions: Sequence[Sequence[Action]], feedback: tuple[int, int] | None = None,
        update: str | None = None,
    ) -> Schedule:
        """Freeze plain lists into a schedule (no validation beyond shape; see ``validate``)."""
        return cls(name, n_microbatches, tuple(placement), tuple(tuple(a) for a in actions),
                   feedback, update)

    def phase(self, which: str) -> Schedule:
        """What one step of an asynchronous window runs: ``"fill"`` (the first step: no
        earlier micro-batches to finish), ``"steady"`` (the window itself) or ``"drain"``
        (the backward actions that finish the last step's micro-batches).

        Raises:
            ValueError: for a schedule without ``update`` or another ``which``.
        """
        if self.update is None or which not in ("fill", "steady", "drain"):
            raise ValueError(f"phase({which!r}) is for an asynchronous schedule's 'fill', "
                             f"'steady' or 'drain'; {self.name!r} has update={self.update!r}")
        if which == "steady":
            return self
        fill = which == "fill"
        return Schedule.from_lists(f"{self.name} ({which})", self.n_microbatches,
                                   self.placement, [[a for a in acts if (a.mb >= 0) == fill]
                                                    for acts in self.actions], None, self.update)

    def unroll(self, steps: int) -> Schedule:
        """``steps`` steps of an asynchronous window and the drain after them, as one flushed
        schedule of ``steps * m`` micro-batches with absolute micro-batches and versions
        (step ``t``'s F of ``mb`` is ``t*m + mb`` at version ``t*k + version``, ``k`` the
        versions made per step; a version below 0 is the first, 0).

        Raises:
            ValueError: for a schedule without ``update`` or ``steps < 1``.
        """
        if self.update is None or steps < 1:
            raise ValueError(f"unroll({steps}) needs an asynchronous schedule and steps >= 1; "
                             f"{self.name!r} has update={self.update!r}")
        m = self.n_microbatches
        lists: list[list[Action]] = [[] for _ in self.actions]
        for t in range(steps + 1):
            for rank, acts in enumerate(self.actions):
                lists[rank] += [Action(a.stage, a.op, t * m + a.mb,
                                       max(0, t * self.versions_per_step + (a.version or 0)))
                                for a in acts
                                if t * m + a.mb >= 0 and (t < steps or a.mb < 0)]
        return Schedule.from_lists(f"{self.name} x{steps}", steps * m, self.placement, lists)

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
        if self.update is not None:
            lines.append(f"# update: {self.update}")
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
        feedback, update = _feedback(text), _comment(text, "update")
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
                              feedback, update)

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


def _comment(text: str, key: str) -> str | None:
    """The value of a ``# key: value`` line, or None without one."""
    for raw in text.splitlines():
        found, _, value = raw.strip().lstrip("#").partition(":")
        if raw.strip().startswith("#") and found.strip() == key and value.strip():
            return value.strip()
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
