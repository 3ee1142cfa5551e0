"""Report: the reporting rank's live progress, JSON-lines log, summary and pictures of a run.

:class:`ProgressReporter` is the :class:`~pipetrain.train.logs.events.Reporter` that global rank 0
hands to the training loop. It writes into ``cfg.out``:

- ``log.jsonl``: every record as one JSON object per line, as it arrives (appended across
  restarts, so a resumed run's log holds the whole curve);
- ``loss.png``: train loss per step and eval loss, drawn from ``log.jsonl`` at the end (a
  step replayed after a restart counts once, its latest value);
- ``timeline.png``: the measured timeline of one step above the simulator's prediction, and
  ``timeline.json``: both as one Chrome/Perfetto trace;
- ``summary.json``: the ``end`` record's fields with the files written;
- with ``--log``, TensorBoard's or W&B's files (:mod:`pipetrain.train.logs.sinks`).

On a terminal the progress is a live rich bar (step, loss, tokens/s, measured bubble); when
stdout is not a terminal, or ``cfg.progress`` is False, it is about ten plain lines instead.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from pipetrain.schedules import draw
from pipetrain.schedules.simulator import Simulation
from pipetrain.schedules.timeline import Timeline
from pipetrain.train.config import TrainConfig
from pipetrain.train.logs.sinks import open_sinks, parse, scalars
from pipetrain.train.placement import format_rank_map

__all__ = ["ProgressReporter", "describe_layout", "latest_run", "read_log", "save_loss_png",
           "save_timeline_png", "timeline_trace"]

_PLAIN_LINES = 10  # progress lines printed without a terminal
_NOT_IN_TABLE = ("sample", "config")  # printed before, or too long for a table row


class ProgressReporter:
    """The reporter of global rank 0: progress on the console, files under ``cfg.out``.

    Example:
        >>> reporter = ProgressReporter(TrainConfig(out="runs/x", steps=3))  # doctest: +SKIP
        >>> reporter.record("step", {"step": 0, "loss": 5.5})                # doctest: +SKIP
        >>> reporter.close()                                                 # doctest: +SKIP
    """

    def __init__(self, cfg: TrainConfig, *, console: Console | None = None) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out) if cfg.out else None  # empty: show progress, write no file
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self._log: IO[str] | None = (None if self.out is None else
                                     (self.out / "log.jsonl").open("a", encoding="utf-8"))
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._bubbles: dict[str, float] = {}
        self._first_step = True  # the first step of this attempt always gets a plain line
        self._files: list[str] = ["log.jsonl"]
        self._sinks = open_sinks(cfg, self.out) if self.out is not None and cfg.log else []
        self._files += [f"{name}/" for name in parse(cfg.log)] if self._sinks else []

    # -------------------------------------------------------------------- Reporter protocol

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        """Log the record, then show it: start/step move the progress, end prints the summary."""
        entry = {"kind": kind, "time": fields.get("time", time.time()), **fields}
        if self._log is not None:
            self._log.write(json.dumps(_finite(entry)) + "\n")
            self._log.flush()
        numbers = scalars(kind, fields) if self._sinks else {}
        for sink in self._sinks if numbers else ():
            sink.write(numbers, int(fields.get("step", 0)))
        show = getattr(self, f"_on_{kind}", None)
        if show is not None:
            show(fields)

    def timeline(self, step: int, measured: Timeline, simulated: Simulation,
                 costs_step: int) -> None:
        """Draw the measured step above the simulator's prediction; write PNG and trace."""
        self._bubbles = {"timeline_step": step, "timeline_costs_step": costs_step,
                         "timeline_bubble_measured": measured.bubble_fraction,
                         "timeline_bubble_simulated": simulated.bubble_fraction}
        predicted = simulated.timeline
        if self.out is None:
            return
        if predicted.unit == "units":  # costs read off the measured step: the measured unit
            predicted = Timeline(predicted.n_ranks, predicted.spans, measured.unit)
        trace = timeline_trace(measured, predicted)
        (self.out / "timeline.json").write_text(json.dumps(trace) + "\n")
        self._files.append("timeline.json")
        try:
            save_timeline_png(measured, predicted, self.out / "timeline.png",
                              title=f"{simulated.schedule.name}  step {step}  (simulated: costs "
                                    f"of step {costs_step})")
            self._files.append("timeline.png")
        except ImportError as e:  # matplotlib is optional for the library, not for pictures
            self._print(f"no timeline.png: {e}")

    def close(self) -> None:
        """Stop the live display and close the log (safe to call twice)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._log is not None:
            self._log.close()
            self._log = None
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            sink.close()

    # ----------------------------------------------------------------------------- records

    def _on_start(self, fields: dict[str, Any]) -> None:
        parts = [describe_layout(fields.get("layout", {}))]
        if "params" in fields:
            parts.append(f"{fields['params']:,} parameters")
        if fields.get("start_step"):
            parts.append(f"resuming at step {fields['start_step']}")
        self._print("start: " + ", ".join(p for p in parts if p))
        order = fields.get("layout", {}).get("mesh_order")
        for line in format_rank_map(fields.get("ranks") or [], order):
            self._print(line)
        for rank, load in enumerate(fields.get("load") or []):
            grew = (load["peak_rss_bytes"] - load["rss_before_bytes"]) / 2**20
            self._print(f"rank {rank}: weights {load['weights']}, read "
                        f"{load['bytes_read'] / 2**20:.1f} MiB for its "
                        f"{load['share_bytes'] / 2**20:.1f} MiB share of the model's "
                        f"{load['model_bytes'] / 2**20:.1f} MiB; peak resident memory "
                        f"{load['peak_rss_bytes'] / 2**20:.0f} MiB (+{grew:.1f} MiB building it)")
        if self.cfg.progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tok/s  "
                           "bubble {task.fields[bubble]}"),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console)
            done = int(fields.get("start_step", 0))
            self._task = self._progress.add_task("train", total=self.cfg.steps, completed=done,
                                                 loss="-", rate="-", bubble="-")
            self._progress.start()

    def _on_step(self, fields: dict[str, Any]) -> None:
        step = int(fields.get("step", 0))
        loss, rate, bubble = (_fmt(fields.get("loss"), ".4f"),
                              _fmt(fields.get("tokens_per_s"), ",.0f"),
                              _fmt(fields.get("bubble"), ".2f"))
        skipped = " (skipped)" if fields.get("skipped") else ""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step + 1, loss=loss + skipped,
                                  rate=rate, bubble=bubble)
            return
        every = max(1, self.cfg.steps // _PLAIN_LINES)
        first, self._first_step = self._first_step, False
        if first or step % every == 0 or step == self.cfg.steps - 1:
            self._print(f"step {step:>{len(str(self.cfg.steps))}}/{self.cfg.steps}  loss {loss}"
                        f"{skipped}  {rate} tok/s  bubble {bubble}")

    def _on_data(self, fields: dict[str, Any]) -> None:
        from pipetrain.train.data.examples import describe

        self._print(describe(fields))

    def _on_eval(self, fields: dict[str, Any]) -> None:
        self._print(f"eval  step {fields.get('step')}  loss {_fmt(fields.get('eval_loss'), '.4f')}")

    def _on_checkpoint(self, fields: dict[str, Any]) -> None:
        self._print(f"checkpoint  step {fields.get('step')}  {fields.get('path')}")

    def _on_hf(self, fields: dict[str, Any]) -> None:
        self._print(f"hf  step {fields.get('step')}  {fields.get('path')}")

    def _on_sample(self, fields: dict[str, Any]) -> None:
        self._print("sample:\n" + str(fields.get("text", "")))

    def _on_end(self, fields: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.out is None:
            self.console.print(_summary_table({**fields, **self._bubbles}))
            return
        self._save_loss()
        summary = {**fields, **self._bubbles, "out": str(self.out),
                   "files": sorted(set(self._files + ["summary.json"]))}
        (self.out / "summary.json").write_text(json.dumps(_finite(summary), indent=1) + "\n")
        self.console.print(_summary_table(summary))

    def _save_loss(self) -> None:
        if self.out is None:
            return
        try:
            save_loss_png(read_log(self.out / "log.jsonl"), self.out / "loss.png")
            self._files.append("loss.png")
        except ImportError as e:
            self._print(f"no loss.png: {e}")

    def _print(self, text: str) -> None:
        (self._progress.console if self._progress is not None else self.console).print(
            text, markup=False, highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------- files


def read_log(path: Path) -> list[dict[str, Any]]:
    """The latest run's records of ``log.jsonl``, a step replayed after a restart once.

    The latest run starts at the last ``start`` record of a fresh job: one at step 0 whose
    ``run_id`` differs from the run before it's (or that has none). A restart of the same job
    (same ``run_id``, even from step 0 when no checkpoint was committed yet) and a later job
    resuming from a checkpoint go on with the same run. Of the records that name a step
    (step, eval, checkpoint), only each kind's latest for each step is kept. The records come
    in step order: a checkpoint of k steps, an attempt's start at step k, step k, its eval;
    a record naming no step (sample, end) stays behind the record it followed in the log.

    Example::

        losses = {r["step"]: r["loss"] for r in read_log(out / "log.jsonl")
                  if r["kind"] == "step"}
    """
    records = latest_run([json.loads(line) for line in Path(path).read_text().splitlines()
                          if line])
    latest = {(r.get("kind"), r["step"]): i for i, r in enumerate(records) if "step" in r}
    kept = [r for i, r in enumerate(records)
            if "step" not in r or latest[(r.get("kind"), r["step"])] == i]
    keys, key = [], (0, 0)
    for r in kept:
        if "step" in r or r.get("kind") == "start":
            at = int(r.get("step", r.get("start_step") or 0))
            key = (at, _AT_STEP.get(str(r.get("kind")), 4))
        keys.append(key)
    return [r for _, r in sorted(zip(keys, kept), key=lambda pair: pair[0])]  # stable


_AT_STEP = {"checkpoint": 0, "start": 1, "step": 2, "eval": 3}  # order among one step's records


def latest_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records from the latest fresh job's start on, every attempt's (see read_log)."""
    begin, run_id = 0, None
    for i, r in enumerate(records):
        if r.get("kind") != "start":
            continue
        if not r.get("start_step") and (r.get("run_id") is None or r.get("run_id") != run_id):
            begin = i
        run_id = r.get("run_id")
    return records[begin:]


def save_loss_png(records: list[dict[str, Any]], path: Path) -> None:
    """Train loss per step (latest value of a replayed step) and eval loss, as a PNG.

    Raises:
        ImportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("loss.png needs matplotlib: pip install matplotlib") from e
    train = {r["step"]: r["loss"] for r in records
             if r.get("kind") == "step" and r.get("loss") is not None}
    evals = {r["step"]: r["eval_loss"] for r in records
             if r.get("kind") == "eval" and r.get("eval_loss") is not None}
    fig = Figure(figsize=(7, 4), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = sorted(train)
    ax.plot(steps, [train[s] for s in steps], color="#0072B2", linewidth=1, label="train")
    if evals:
        at = sorted(evals)
        ax.plot(at, [evals[s] for s in at], "o-", color="#D55E00", label="eval (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.savefig(Path(path), format="png")


def save_timeline_png(measured: Timeline, simulated: Timeline, path: Path, *,
                      title: str) -> None:
    """The measured timeline above the simulated one, as one PNG.

    Raises:
        ImportError: matplotlib (and its Pillow) is not installed.
    """
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        top, bottom = Path(tmp) / "measured.png", Path(tmp) / "simulated.png"
        draw.save_png(measured, top, title=f"{title}: measured")
        draw.save_png(simulated, bottom,
                      title=f"{title}: the simulator's prediction")
        with Image.open(top) as a, Image.open(bottom) as b:
            both = Image.new("RGB", (max(a.width, b.width), a.height + b.height), "white")
            both.paste(a, (0, 0))
            both.paste(b, (0, a.height))
            both.save(path, format="PNG")


def timeline_trace(measured: Timeline, simulated: Timeline) -> dict[str, object]:
    """One Chrome trace: processes ``rank r measured`` then ``rank r simulated``."""
    trace = draw.chrome_trace(measured)
    other = draw.chrome_trace(simulated)
    events: list[dict[str, Any]] = list(trace["traceEvents"])  # type: ignore[call-overload]
    for event in other["traceEvents"]:  # type: ignore[attr-defined]
        events.append({**event, "pid": event["pid"] + measured.n_ranks})
    for event in events:
        if event.get("name") == "process_name":
            kind = "measured" if event["pid"] < measured.n_ranks else "simulated"
            rank = event["pid"] % measured.n_ranks if measured.n_ranks else 0
            event["args"] = {"name": f"rank {rank} {kind}"}
        if event.get("name") == "process_sort_index":
            event["args"] = {"sort_index": event["pid"]}
    return {**trace, "traceEvents": events,
            "otherData": {"measured": trace["otherData"], "simulated": other["otherData"]}}


# -------------------------------------------------------------------------------- helpers


def describe_layout(layout: dict[str, Any]) -> str:
    """``2 ranks (dp 1 x pp 2), zbv, 8 micro-batches, 4 stages (2 per rank), ...`` (the mesh
    order after the degrees, where it places the ranks: ``4 ranks (dp 2 x pp 2, pp-outer)``;
    context parallelism with the tokens each rank holds: ``dp 1 x cp 2, 32 tokens of each
    sequence per rank x pp 2``)."""
    parts = []
    if {"world", "dp", "pp"} <= layout.keys():
        shards = f" x fsdp {layout['fsdp']}" if "fsdp" in layout else ""
        split = f" x tp {layout['tp']}" if "tp" in layout else ""
        if "cp" in layout:  # context parallel: the slice of each sequence a rank holds
            tokens = layout.get("tokens_per_rank")
            held = f", {tokens} tokens of each sequence per rank" if tokens else ""
            shards += f" x cp {layout['cp']}{held}"
        order = f", {layout['mesh_order']}" if "mesh_order" in layout else ""
        parts.append(f"{layout['world']} ranks (dp {layout['dp']}{shards} x pp {layout['pp']}"
                     f"{split}{order})")
    if "schedule" in layout:
        parts.append(str(layout["schedule"]))
    if "microbatches" in layout:
        parts.append(f"{layout['microbatches']} micro-batches")
    if "stages" in layout:
        per = layout.get("stages_per_rank")
        parts.append(f"{layout['stages']} stages" + (f" ({per} per rank)" if per else ""))
    if "balance" in layout:
        parts.append(f"layers per stage {_text(layout['balance'])}")
    if "precision" in layout:
        parts.append(str(layout["precision"]))
    return ", ".join(parts)


def _summary_table(summary: dict[str, Any]) -> Table:
    table = Table(title="pipetrain train: summary", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in summary.items():
        if key in _NOT_IN_TABLE:
            continue
        shown = describe_layout(value) if key == "layout" else _text(value)
        table.add_row(key.replace("_", " "), shown)
    return table


def _text(value: Any) -> str:
    if isinstance(value, float):
        return _fmt(value, ",.0f" if abs(value) >= 1e4 else ".4g")
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, list | tuple):
        return ", ".join(_text(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_text(v)}" for k, v in value.items())
    return str(value)


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as None, so that every line is standard JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
