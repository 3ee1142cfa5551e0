"""Validation: prove a schedule is well-formed, complete, locally ordered and deadlock-free.

Four checks run in order and the first one that fails raises a single
:class:`~pipetrain.errors.ScheduleError` listing every problem of that kind:

    1. shape       placement ranks exist; every action's stage is placed on the rank whose
                   list holds it; every mb is in 0 .. n_microbatches-1
    2. complete    every (stage, mb) has exactly one F and either one B or one I and one W
                   (a decoding schedule, forward-only, has exactly one F and nothing else)
    3. local order on its rank W(s, mb) follows I(s, mb) and B/I(s, mb) follows F(s, mb);
                   when stages s-1 and s share a rank, F(s-1, mb) precedes F(s, mb), and when
                   stages s and s+1 share a rank, B/I(s+1, mb) precedes B/I(s, mb)
    4. deadlock    :func:`pipetrain.schedules.dataflow.walk` finishes every rank's list

A schedule whose actions name weight versions also has every action of a (stage, mb) on one
version. An asynchronous window (``schedule.update``) is checked as a window first (each
step's micro-batches each forwarded and finished once, F and B only, the versions of its
update rule), then unrolled over three steps and a drain (:meth:`Schedule.unroll`) and
checked as above, with at most two weight versions alive on any stage (PipeDream-2BW), or at
most p and each forward on its stage's newest (PipeDream's weight stashing).

Check 3 is implied by check 4; it runs first because "W before I on rank 0" says more than
"rank 0 is stuck". Every message names rank, step (index in that rank's list) and action, and
ends with the rank-by-step grid with the offending cells marked.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pipetrain.schedules.dataflow as dataflow
from pipetrain.errors import ScheduleError
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.schedule import Schedule

__all__ = ["validate", "format_grid"]

Cell = tuple[int, int]  # (rank, step)
Problem = tuple[str, set[Cell]]  # one message line, the cells it marks

_MARK = "<<"
_ROW_MARK = "<-- ERROR HERE"
_MAX_LISTED = 12  # problems listed per error; the rest are counted
_FULL_GRID_ROWS = 60  # longer grids are shown only around the marked rows
_CONTEXT_ROWS = 4


def validate(schedule: Schedule) -> None:
    """Raise if ``schedule`` cannot run correctly; return None if it can.

    Args:
        schedule: the schedule to check.

    Raises:
        ScheduleError: naming rank, step and action of every problem of the first failing
            check (shape, completeness, local order, deadlock), followed by the grid.

    Example:
        >>> from pipetrain import make_schedule
        >>> validate(make_schedule("1f1b", 4, 8))  # passes silently
    """
    if schedule.update is not None:
        _validate_window(schedule)
        return
    checks = (("malformed", _check_shape), ("incomplete", _check_complete),
              ("mixes weight versions", _check_versions),
              ("out of order", _check_local_order), ("deadlocks", _check_deadlock))
    for verdict, check in checks:
        problems = check(schedule)
        if problems:
            raise ScheduleError(_message(schedule, verdict, problems))


def _validate_window(schedule: Schedule) -> None:
    """An asynchronous window: as a window, then unrolled (see the module docstring)."""
    problems = _check_window(schedule)
    if problems:
        raise ScheduleError(_message(schedule, "is not a valid asynchronous window", problems))
    unrolled = schedule.unroll(3)
    validate(unrolled)
    problems = _check_alive(unrolled, 2 if schedule.update == "2bw" else schedule.n_ranks)
    if problems:
        raise ScheduleError(_message(unrolled, "keeps too many weight versions", problems))
    if schedule.update == "stash":
        problems = _check_stashed(unrolled)
        if problems:
            raise ScheduleError(_message(unrolled, "breaks PipeDream's versions", problems))


def format_grid(
    schedule: Schedule, marks: set[Cell] | frozenset[Cell] = frozenset(),
    *, context: int | None = None,
) -> str:
    """The rank-by-step grid, one column per rank and one numbered row per step.

    Args:
        schedule: the schedule to draw.
        marks: ``(rank, step)`` cells to flag with ``<<``; their rows end in ``<-- ERROR HERE``.
        context: if given, show only rows within ``context`` steps of a mark (``...`` between).

    Example:
        >>> from pipetrain import make_schedule
        >>> print(format_grid(make_schedule("gpipe", 2, 1), {(1, 1)}))
        step  rank 0  rank 1
           0  0F0     1F0
           1  0B0     1B0<<   <-- ERROR HERE
    """
    depth = max((len(acts) for acts in schedule.actions), default=0)
    width = max([len(f"rank {schedule.n_ranks - 1}")]
                + [len(str(a)) + len(_MARK) for acts in schedule.actions for a in acts])
    lines = ["step  " + "  ".join(f"rank {r}".ljust(width) for r in range(schedule.n_ranks))]
    shown = _shown_rows(depth, {step for _, step in marks}, context)
    previous = -1
    for step in shown:
        if step > previous + 1:
            lines.append("   ...")
        lines.append(_grid_row(schedule, step, marks, width))
        previous = step
    if shown and shown[-1] < depth - 1:
        lines.append("   ...")
    return "\n".join(line.rstrip() for line in lines)


def _grid_row(schedule: Schedule, step: int, marks: set[Cell] | frozenset[Cell],
              width: int) -> str:
    cells = []
    for rank, acts in enumerate(schedule.actions):
        text = str(acts[step]) if step < len(acts) else "."
        cells.append((text + (_MARK if (rank, step) in marks else "")).ljust(width))
    row_marked = any((rank, step) in marks for rank in range(schedule.n_ranks))
    return f"{step:>4}  " + "  ".join(cells) + ("  " + _ROW_MARK if row_marked else "")


def _shown_rows(depth: int, marked: set[int], context: int | None) -> list[int]:
    if context is None or not marked:
        return list(range(depth))
    return [s for s in range(depth) if any(abs(s - m) <= context for m in marked)]


def _message(schedule: Schedule, verdict: str, problems: list[Problem]) -> str:
    marks = set().union(*(cells for _, cells in problems))
    lines = [f"schedule {schedule.name!r} {verdict}:"]
    lines += [f"  - {text}" for text, _ in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more")
    head = "\n".join(lines)
    depth = max((len(acts) for acts in schedule.actions), default=0)
    context = None if depth <= _FULL_GRID_ROWS else _CONTEXT_ROWS
    return f"{head}\n\n{format_grid(schedule, marks, context=context)}"


def _plain(a: Action) -> Action:
    """``a`` without its weight version (what completeness and order speak of)."""
    return a if a.version is None else Action(a.stage, a.op, a.mb)


def _cells(schedule: Schedule) -> Iterable[tuple[int, int, Action]]:
    for rank, acts in enumerate(schedule.actions):
        for step, action in enumerate(acts):
            yield rank, step, action


# -- 1. shape ------------------------------------------------------------------------------


def _check_shape(schedule: Schedule) -> list[Problem]:
    p, n_stages, m = schedule.n_ranks, schedule.n_stages, schedule.n_microbatches
    problems: list[Problem] = []
    if p < 1 or n_stages < 1 or m < 1:
        return [(f"schedule {schedule.name!r} has {p} ranks, {n_stages} stages and {m} "
                 "micro-batches; each must be at least 1", set())]
    if schedule.feedback is not None and not 1 <= schedule.feedback[0] <= schedule.feedback[1]:
        problems.append((f"feedback (lag, start) = {schedule.feedback}: the lag must be at "
                         "least 1 and at most start (a micro-batch is fed by an earlier one)",
                         set()))
    for stage, rank in enumerate(schedule.placement):
        if not 0 <= rank < p:
            problems.append((f"placement puts stage {stage} on rank {rank}, but ranks are "
                             f"0..{p - 1}", set()))
    for rank, step, a in _cells(schedule):
        where = f"rank {rank}, step {step}: {a}"
        if not 0 <= a.stage < n_stages:
            problems.append((f"{where} names stage {a.stage}, but stages are "
                             f"0..{n_stages - 1}", {(rank, step)}))
        elif schedule.placement[a.stage] != rank:
            problems.append((f"{where} runs stage {a.stage}, which is placed on rank "
                             f"{schedule.placement[a.stage]}; move it to that rank's list",
                             {(rank, step)}))
        if not 0 <= a.mb < m:
            problems.append((f"{where} names mb {a.mb}, but micro-batches are 0..{m - 1}",
                             {(rank, step)}))
    return problems


# -- 2. completeness -----------------------------------------------------------------------


def _check_complete(schedule: Schedule) -> list[Problem]:
    where: dict[Action, list[Cell]] = {}
    for rank, step, a in _cells(schedule):
        where.setdefault(_plain(a), []).append((rank, step))
    problems: list[Problem] = []
    for action, cells in where.items():
        if len(cells) > 1:
            at = ", ".join(f"rank {r} step {s}" for r, s in cells)
            problems.append((f"duplicate {action}: appears {len(cells)} times ({at})",
                             set(cells)))
    for stage in range(schedule.n_stages):
        for mb in range(schedule.n_microbatches):
            problems += _stage_mb_problems(schedule, stage, mb, where)
    return problems


def _stage_mb_problems(schedule: Schedule, stage: int, mb: int,
                       where: dict[Action, list[Cell]]) -> list[Problem]:
    count = Counter({op: len(where.get(Action(stage, op, mb), [])) for op in Op})
    rank = schedule.placement[stage]
    if count[Op.B] and (count[Op.I] or count[Op.W]):
        cells = {c for op in (Op.B, Op.I, Op.W) for c in where.get(Action(stage, op, mb), [])}
        return [(f"stage {stage}, mb {mb} has both a fused B and a split I/W backward on "
                 f"rank {rank}; use either {stage}B{mb} or {stage}I{mb} + {stage}W{mb}",
                 cells)]
    if schedule.feedback is not None:  # decoding: forward only
        extra = {c for op in (Op.B, Op.I, Op.W) for c in where.get(Action(stage, op, mb), [])}
        if extra:
            return [(f"stage {stage}, mb {mb} has a backward action in a decoding schedule "
                     "(its feedback makes it forward-only)", extra)]
        return [] if count[Op.F] else [(f"missing {Action(stage, Op.F, mb)} on rank {rank} "
                                        "(no step runs it)", set())]
    wanted = [Op.F] + ([Op.B] if count[Op.B] or not (count[Op.I] or count[Op.W])
                       else [Op.I, Op.W])
    return [(f"missing {Action(stage, op, mb)} on rank {rank} (no step runs it): every "
             "(stage, mb) needs one F and either one B or one I and one W", set())
            for op in wanted if count[op] == 0]


def _check_versions(schedule: Schedule) -> list[Problem]:
    """Every action of a (stage, mb) uses the version its F used."""
    version = {(a.stage, a.mb): a.version for _, _, a in _cells(schedule) if a.op is Op.F}
    return [(f"rank {rank}, step {step}: {a} uses version {a.version}, but its forward used "
             f"version {version[a.stage, a.mb]}", {(rank, step)})
            for rank, step, a in _cells(schedule)
            if a.op is not Op.F and version.get((a.stage, a.mb), a.version) != a.version]


# -- asynchronous windows ------------------------------------------------------------------


def _check_window(schedule: Schedule) -> list[Problem]:
    """An asynchronous window: each step's micro-batches forwarded once and finished once by a
    B, in this step (``mb``) or the next (``mb - m``), F and B only. Under 2BW every forward
    uses the step's version (0) and a B its forward's (0, or -1 for the step before's);
    PipeDream's versions are checked on the unrolled steps (:func:`_check_stashed`)."""
    if schedule.update not in ("2bw", "stash"):
        return [(f"update rule {schedule.update!r} is unknown; asynchronous windows have "
                 "update '2bw' or 'stash'", set())]
    two = schedule.update == "2bw"
    m = schedule.n_microbatches
    problems: list[Problem] = []
    seen: dict[tuple[Op, int, int], list[Cell]] = {}
    for rank, step, a in _cells(schedule):
        where = f"rank {rank}, step {step}: {a}"
        want = 0 if a.mb >= 0 else -1
        low = 0 if a.op is Op.F else -m
        if a.op not in (Op.F, Op.B):
            problems.append((f"{where}: an asynchronous window has F and B only",
                             {(rank, step)}))
        elif not low <= a.mb < m:
            problems.append((f"{where} names mb {a.mb}; a window's {a.op.value} names "
                             f"{low}..{m - 1}", {(rank, step)}))
        elif a.version is None or (two and a.version != want):
            problems.append((f"{where} uses version {a.version}; under 2BW it uses {want} "
                             "(the version of its step's forward)", {(rank, step)}))
        seen.setdefault((a.op, a.stage, a.mb % m), []).append((rank, step))
    for stage in range(schedule.n_stages):
        for mb in range(m):
            for op in (Op.F, Op.B):
                cells = seen.get((op, stage, mb), [])
                if len(cells) != 1:
                    problems.append((f"stage {stage}, mb {mb}: {len(cells)} {op.value} actions "
                                     f"in the window (one {op.value}{mb} or "
                                     f"{op.value}{mb - m} is needed)", set(cells)))
    return problems


def _check_stashed(schedule: Schedule) -> list[Problem]:
    """PipeDream (weight stashing): a stage's F runs on its newest version, one made after
    each of its backwards: its version is the count of the stage's B before it (a B's is its
    forward's, :func:`_check_versions`)."""
    problems: list[Problem] = []
    for rank, acts in enumerate(schedule.actions):
        done: dict[int, int] = {}
        for step, a in enumerate(acts):
            if a.op is Op.B:
                done[a.stage] = done.get(a.stage, 0) + 1
            elif a.op is Op.F and a.version != done.get(a.stage, 0):
                problems.append((f"rank {rank}, step {step}: {a} uses version {a.version}, but "
                                 f"stage {a.stage} made {done.get(a.stage, 0)} updates before "
                                 "it (one after each backward)", {(rank, step)}))
    return problems


def _check_alive(schedule: Schedule, limit: int) -> list[Problem]:
    """At most ``limit`` versions alive on any stage (:func:`dataflow.versions_alive`)."""
    return [(f"rank {rank}, step {step}: after {schedule.actions[rank][step]} a stage of rank "
             f"{rank} keeps {count} weight versions, more than {limit}", {(rank, step)})
            for rank, counts in enumerate(dataflow.versions_alive(schedule))
            for step, count in enumerate(counts) if count > limit]


# -- 3. local order ------------------------------------------------------------------------


def _check_local_order(schedule: Schedule) -> list[Problem]:
    problems: list[Problem] = []
    for rank, acts in enumerate(schedule.actions):
        step_of = {_plain(a): step for step, a in enumerate(acts)}
        for step, action in enumerate(acts):
            fed = schedule.fed_back(action)
            fed_rule = [] if fed is None else [(fed, "F needs the token its feedback takes")]
            for before, why in _must_precede(action, schedule.n_stages) + fed_rule:
                other = step_of.get(before)
                if other is not None and other > step:
                    problems.append((f"rank {rank}, step {step}: {action} runs before "
                                     f"{before} (step {other}); {why}",
                                     {(rank, step), (rank, other)}))
    return problems


def _must_precede(action: Action, n_stages: int) -> list[tuple[Action, str]]:
    """Actions that, when on the same rank as ``action``, must come earlier in its list."""
    s, mb = action.stage, action.mb
    if action.op is Op.W:
        return [(Action(s, Op.I, mb), "W needs the input gradient that I computes")]
    if action.op is Op.F:
        return [(Action(s - 1, Op.F, mb), "F needs the previous stage's activation")] if s else []
    own_f = (Action(s, Op.F, mb), f"{action.op.value} needs this stage's forward")
    if s == n_stages - 1:
        return [own_f]
    reason = f"{action.op.value} needs the next stage's input gradient"
    return [own_f, (Action(s + 1, Op.B, mb), reason), (Action(s + 1, Op.I, mb), reason)]


# -- 4. deadlock ---------------------------------------------------------------------------


def _check_deadlock(schedule: Schedule) -> list[Problem]:
    result = dataflow.walk(schedule)
    if result.complete:
        return []
    producer = {dataflow.produces(a): (r, s) for r, s, a in _cells(schedule)}
    problems: list[Problem] = []
    for rank, step in enumerate(result.stuck):
        if step == len(schedule.actions[rank]):
            continue  # this rank finished its list
        action = schedule.actions[rank][step]
        unmet = [producer[k] for k in dataflow.needs(action, schedule.n_stages, schedule)
                 if producer[k][1] >= result.stuck[producer[k][0]]]
        waits = " and ".join(_describe_wait(schedule, cell, result.stuck) for cell in unmet)
        problems.append((f"rank {rank}, step {step}: {action} waits for {waits}",
                         {(rank, step)}))
    return problems


def _describe_wait(schedule: Schedule, cell: Cell, stuck: tuple[int, ...]) -> str:
    # The completeness check guarantees every awaited key has exactly one producer.
    rank, step = cell
    blocked = schedule.actions[rank][stuck[rank]]
    return (f"{schedule.actions[rank][step]} on rank {rank} (its step {step}, but rank {rank} "
            f"is stuck at step {stuck[rank]} on {blocked})")
