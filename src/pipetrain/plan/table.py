"""Table: the ranked layouts a plan found, as both ``pipetrain plan`` forms print them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["print_candidates"]


def print_candidates(shown: Sequence[Any], title: str, layout: Callable[[Any], str], *,
                     tokens: int | None = None, caption: str | None = None,
                     step_digits: int = 3) -> None:
    """One row per candidate (a planner ``Candidate`` or a ``ModulePlan``): layout, schedule,
    stages per rank, micro-batches, balance, recompute, predicted step (and tokens/s when
    ``tokens`` per step is given), predicted peak per rank and whether it fits."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    speed = ("tokens/s",) if tokens else ()
    for name in ("layout", "schedule", "v", "m", "balance", "recompute", "step s", *speed,
                 "peak per rank (MiB)", "fits"):
        table.add_column(name, justify="right" if name in ("v", "m", "step s", *speed)
                         else "left")
    for c in shown:
        rate = (f"{tokens / c.predicted_step_s:,.0f}",) if tokens else ()
        table.add_row(layout(c), c.schedule, str(c.stages_per_rank), str(c.microbatches),
                      ",".join(map(str, c.balance)), c.recompute,
                      f"{c.predicted_step_s:.{step_digits}f}", *rate,
                      " ".join(f"{b / 2**20:.1f}" for b in c.predicted_peak_bytes),
                      "yes" if c.fits else "NO")
    Console().print(table)
