"""Draw: a timeline as text, as a PNG, or as a Chrome/Perfetto trace.

Every picture is made from a :class:`~pipetrain.schedules.timeline.Timeline` alone, so a simulated
run (cost units, starting at 0) and a measured one (seconds, arbitrary start) draw the same way:
times are shifted to start at 0 and the timeline's own ``unit`` labels the axis.

    >>> from pipetrain.schedules.simulator import simulate
    >>> sim = simulate(make_schedule("1f1b", 4, 8))            # doctest: +SKIP
    >>> print(text_timeline(sim.timeline))                      # doctest: +SKIP
    >>> save_png(sim.timeline, "1f1b.png", title="1f1b")        # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.schedules.action import Op
from pipetrain.schedules.timeline import Span, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["text_timeline", "save_png", "chrome_trace", "save_trace"]

OP_NAMES = {Op.F: "forward", Op.B: "backward", Op.I: "input grad", Op.W: "weight grad"}
# Okabe-Ito colours (safe for the common colour-vision deficiencies), text colour on top.
OP_COLOURS = {Op.F: "#0072B2", Op.B: "#D55E00", Op.I: "#CC79A7", Op.W: "#009E73"}
_TEXT_ON = {Op.F: "white", Op.B: "white", Op.I: "black", Op.W: "white"}
_IDLE = "."
_MAX_WIDTH = 160  # default text width never exceeds this many characters of time
_REL_TOL = 1e-6
_DIGIT_EM = 0.62  # width of a digit in the PNG's font, in ems


# ----------------------------------------------------------------------------------- text


def text_timeline(timeline: Timeline, width: int | None = None) -> str:
    """Render ``timeline`` as one line per rank, idle time drawn as ``.``.

    When every action takes the same time and starts on a multiple of it, each action gets
    one column: its text (``0F1``), or ``F1`` / ``F`` when the full text would not fit.
    Otherwise characters are proportional to time and each action shows the longest of those
    forms that fits its length. In the short forms a lower-case op letter marks a rank's
    second (or later) stage.

    Args:
        timeline: simulated or measured spans.
        width: characters for the time axis; None fits every action's text where that
            takes at most 160 characters.

    Returns:
        The rank lines followed by a legend line, joined by newlines.

    Raises:
        ValueError: if ``width`` is given and is below 1.

    Example:
        >>> print(text_timeline(simulate(make_schedule("gpipe", 2, 2)).timeline))  # doctest: +SKIP
        rank 0 |0F0 0F1 ... ... 0B0 0B1|
        ...
    """
    if width is not None and width < 1:
        raise ValueError(f"width must be a positive number of characters, got {width}")
    if not timeline.spans:
        return "(empty timeline: no actions)"
    tl = timeline.shifted()
    limit = _MAX_WIDTH if width is None else width
    slot = _slot_size(tl)
    rows = _render_slots(tl, slot, limit) if slot is not None else None
    if slot is not None and rows is not None:
        scale_note = f"one column = {_qty(slot, tl.unit)}"
    else:
        cols = width if width is not None else _default_width(tl)
        rows = _render_proportional(tl, cols)
        scale_note = f"one character = {_qty(tl.makespan / cols, tl.unit)}"
    label_w = len(str(tl.n_ranks - 1))
    lines = [f"rank {r:>{label_w}} |{row}|" for r, row in enumerate(rows)]
    later_note = any(c in "fbiw" for row in rows for c in row)
    return "\n".join([*lines, _legend(tl, scale_note, later_note)])


def _num(x: float) -> str:
    return f"{x:.3g}"


def _qty(x: float, unit: str) -> str:
    return "1 unit" if unit == "units" and _num(x) == "1" else f"{_num(x)} {unit}"


def _slot_size(tl: Timeline) -> float | None:
    """The common duration when every span is one equal slot on a common grid, else None."""
    d = tl.spans[0].duration
    if d <= 0:
        return None
    for s in tl.spans:
        on_grid = abs(s.start / d - round(s.start / d)) < _REL_TOL
        if not math.isclose(s.duration, d, rel_tol=_REL_TOL) or not on_grid:
            return None
    return d


def _forms(span: Span, later: bool) -> tuple[str, str, str]:
    """An action's text from longest to shortest: ``4F1``, ``f1``, ``f`` (later stage)."""
    op = span.action.op.value.lower() if later else span.action.op.value
    return str(span.action), f"{op}{span.action.mb}", op


def _render_slots(tl: Timeline, slot: float, limit: int) -> list[str] | None:
    """One column per slot, in the longest form that fits ``limit``; None if none does."""
    n_slots = round(tl.makespan / slot)
    later = {r: _later_stages(tl, r) for r in range(tl.n_ranks)}
    forms = {s: _forms(s, s.action.stage in later[s.rank]) for s in tl.spans}
    for tier, sep in ((0, " "), (1, " "), (2, "")):
        cell = max(len(f[tier]) for f in forms.values())
        if n_slots * (cell + len(sep)) - len(sep) > limit:
            continue
        rows = []
        for r in range(tl.n_ranks):
            cells = [_IDLE * cell] * n_slots
            for s in tl.of_rank(r):
                cells[round(s.start / slot)] = forms[s][tier].ljust(cell)
            rows.append(sep.join(cells))
        return rows
    return None


def _default_width(tl: Timeline) -> int:
    # Give the shortest action room for its text plus one separating space.
    shortest = min((s.duration for s in tl.spans if s.duration > 0), default=tl.makespan)
    if shortest <= 0:
        return _MAX_WIDTH
    label = max(len(str(s.action)) for s in tl.spans)
    wanted = math.ceil(tl.makespan * (label + 1) / shortest - _REL_TOL)
    return max(20, min(_MAX_WIDTH, wanted))


def _render_proportional(tl: Timeline, cols: int) -> list[str]:
    scale = cols / tl.makespan if tl.makespan > 0 else 0.0
    rows = []
    for r in range(tl.n_ranks):
        buf = [_IDLE] * cols
        later = _later_stages(tl, r)
        for s in tl.of_rank(r):
            c0 = min(round(s.start * scale), cols - 1)
            c1 = min(max(round(s.end * scale), c0 + 1), cols)
            forms = _forms(s, s.action.stage in later)
            buf[c0:c1] = list(_block_text(forms, s.duration * scale, c1 - c0))
        rows.append("".join(buf))
    return rows


def _later_stages(tl: Timeline, rank: int) -> set[int]:
    """Stages on ``rank`` other than its lowest-numbered one."""
    stages = sorted({s.action.stage for s in tl.spans if s.rank == rank})
    return set(stages[1:])


def _block_text(forms: tuple[str, str, str], ideal: float, n: int) -> str:
    """The text of an ``n``-character block whose exact length is ``ideal`` characters.

    The form is chosen from ``ideal`` so that equal actions look alike despite rounding.
    A block too short for ``F1 `` is its op letter drawn out with ``-`` (``F--``), which
    needs no separator from its neighbours.
    """
    for text in (f"{forms[0]} ", f"{forms[1]} "):
        if len(text) <= min(ideal + _REL_TOL, n):
            return text.ljust(n)
    return forms[2].ljust(n, "-")


def _legend(tl: Timeline, scale_note: str, later_note: bool) -> str:
    ops = [op for op in Op if any(s.action.op is op for s in tl.spans)]
    names = ", ".join(f"{op.value} {OP_NAMES[op]}" for op in ops)
    later = "; lower case: the rank's later stage" if later_note else ""
    return (f"legend: <stage><op><mb>; {names}{later}; {_IDLE} idle; {scale_note}; "
            f"makespan {_qty(tl.makespan, tl.unit)}")


# ------------------------------------------------------------------------------------ png


def save_png(timeline: Timeline, path: str | Path, *, title: str | None = None) -> None:
    """Draw ``timeline`` as a Gantt chart (rank 0 on top) and write it as a PNG.

    Boxes are coloured by op and carry their micro-batch number when it fits; a rank's
    second (or later) stage is hatched; idle time stays blank. The subtitle gives the
    makespan and the bubble fraction.

    Args:
        timeline: simulated or measured spans.
        path: the PNG file to write.
        title: first title line, e.g. the schedule name and its sizes.

    Raises:
        ImportError: if matplotlib is not installed (``pip install pipetrain[plot]``).
    """
    figure_cls, canvas_cls = _matplotlib()
    tl = _display_units(timeline.shifted())
    fig = figure_cls(figsize=(_fig_width(tl), 1.5 + 0.42 * tl.n_ranks), dpi=150,
                     layout="constrained")
    canvas_cls(fig)
    ax = fig.add_subplot()
    _draw_boxes(ax, tl, fig.get_figwidth() * 0.8 * 72)
    _decorate(ax, tl, title)
    fig.savefig(Path(path), format="png")


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "save_png needs matplotlib: pip install pipetrain[plot]"
        ) from e
    return Figure, FigureCanvasAgg


def _display_units(tl: Timeline) -> Timeline:
    """Measured runs shorter than a second read better in milliseconds."""
    if tl.unit != "s" or tl.makespan >= 1.0:
        return tl
    spans = tuple(Span(s.rank, s.action, s.start * 1e3, s.end * 1e3) for s in tl.spans)
    return Timeline(tl.n_ranks, spans, "ms")


def _fig_width(tl: Timeline) -> float:
    return min(16.0, max(8.0, 0.16 * len(tl.spans) / max(tl.n_ranks, 1) + 4.0))


def _draw_boxes(ax: Axes, tl: Timeline, axis_points: float) -> None:
    points_per_unit = axis_points / tl.makespan if tl.makespan > 0 else 0.0
    fontsize = _label_size(tl, points_per_unit)
    for r in range(tl.n_ranks):
        later = _later_stages(tl, r)
        for s in tl.of_rank(r):
            second = s.action.stage in later
            colour = _darker(OP_COLOURS[s.action.op]) if second else OP_COLOURS[s.action.op]
            ax.barh(r, s.duration, left=s.start, height=0.78, color=colour,
                    edgecolor="white", linewidth=0.6)
            label = str(s.action.mb)
            if s.duration * points_per_unit >= fontsize * _DIGIT_EM * len(label) + 2:
                ax.text(s.start + s.duration / 2, r, label, ha="center", va="center",
                        fontsize=fontsize, fontweight="bold",
                        color="white" if second else _TEXT_ON[s.action.op])


def _label_size(tl: Timeline, points_per_unit: float) -> float:
    """The largest font (5.5 to 7.5 pt) at which every micro-batch number fits its box."""
    shortest = min((s.duration for s in tl.spans if s.duration > 0), default=0.0)
    digits = max(len(str(s.action.mb)) for s in tl.spans)
    fitting = (shortest * points_per_unit - 2) / (_DIGIT_EM * digits)
    return 7.5 if fitting < 5.5 else min(7.5, fitting)


def _darker(colour: str, amount: float = 0.45) -> str:
    """``colour`` mixed with black: the shade of a rank's second (or later) stage."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * (1 - amount)):02x}" for c in rgb)


def _legend_below(ax: Axes, tl: Timeline) -> None:
    from matplotlib.patches import Patch

    ops = [op for op in Op if any(s.action.op is op for s in tl.spans)]
    two = any(_later_stages(tl, r) for r in range(tl.n_ranks))
    handles = []
    for op in ops:  # column per op: its first-stage colour above its second-stage shade
        handles.append(Patch(facecolor=OP_COLOURS[op], label=f"{op.value}  {OP_NAMES[op]}"))
        if two:
            handles.append(Patch(facecolor=_darker(OP_COLOURS[op]),
                                 label=f"{op.value}  rank's 2nd stage"))
    ax.figure.legend(handles=handles, loc="outside lower center", ncol=len(ops),
                     frameon=False, fontsize=8, handlelength=1.2, columnspacing=1.6)


def _decorate(ax: Axes, tl: Timeline, title: str | None) -> None:
    ax.set_ylim(tl.n_ranks - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, tl.makespan)
    ax.set_yticks(range(tl.n_ranks), [f"rank {r}" for r in range(tl.n_ranks)])
    ax.set_xlabel(f"time ({tl.unit})")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    for r in range(tl.n_ranks):  # faint lanes make the blank bubbles read as gaps
        ax.axhspan(r - 0.42, r + 0.42, color="#f2f2f2", zorder=0, linewidth=0)
    _legend_below(ax, tl)
    subtitle = (f"makespan {_num(tl.makespan)} {tl.unit}  ·  "
                f"bubble {tl.bubble_fraction:.1%} of device time")
    ax.set_title(f"{title}\n{subtitle}" if title else subtitle, fontsize=10, loc="left")


# ---------------------------------------------------------------------------------- trace

_US_PER = {"s": 1e6, "ms": 1e3, "us": 1.0, "µs": 1.0, "ns": 1e-3}


def chrome_trace(timeline: Timeline) -> dict[str, object]:
    """The timeline as Chrome trace JSON (open in Perfetto or chrome://tracing).

    One process per rank (named ``rank r``), one complete ("X") event per action, named by
    its text, with ``stage``, ``mb`` and ``op`` in ``args``. Times start at 0 and are in
    microseconds: seconds and milliseconds convert exactly; an abstract unit (a simulation's
    cost units) is drawn as 1 unit = 1 ms, which ``otherData`` records.

    Example:
        >>> trace = chrome_trace(sim.timeline)  # doctest: +SKIP
        >>> trace["traceEvents"][0]["ph"]       # doctest: +SKIP
        'M'
    """
    scale = _US_PER.get(timeline.unit, 1e3)
    t0 = timeline.start
    events: list[dict[str, object]] = []
    for r in range(timeline.n_ranks):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
    for s in sorted(timeline.spans, key=lambda s: (s.rank, s.start)):
        a = s.action
        events.append({"ph": "X", "name": str(a), "cat": a.op.value, "pid": s.rank, "tid": 0,
                       "ts": (s.start - t0) * scale, "dur": s.duration * scale,
                       "args": {"stage": a.stage, "mb": a.mb, "op": a.op.value}})
    note = (f"times in {timeline.unit}, converted to microseconds" if timeline.unit in _US_PER
            else f"time unit {timeline.unit!r} is abstract; each one is drawn as 1 ms")
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"unit": timeline.unit, "note": note}}


def save_trace(timeline: Timeline, path: str | Path) -> None:
    """Write :func:`chrome_trace` of ``timeline`` to ``path`` as JSON."""
    Path(path).write_text(json.dumps(chrome_trace(timeline), indent=1) + "\n")
