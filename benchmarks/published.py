"""Published runs against ``pipetrain plan --cluster``'s prediction for the same job and layout.

Every figure comes from the command a user types: each row's ``pipetrain plan --cluster ...
--json`` (:meth:`pipetrain.plan.cluster.published_record.Published.command`, printed with
``--commands``; ``--configs DIR`` writes the models' ``config.json`` files it names). For every
run of :mod:`pipetrain.plan.cluster.published` (Megatron-LM's Table 1, the selective
recomputation paper's, the Zero Bubble paper's, torchtitan's, Llama 3's, MegaScale's,
BLOOM's, NVIDIA's NeMo recipes'), the
predicted figure in the metric the source published, their ratio, and the fastest layout the
search finds for the same GPUs, batch and memory::

    python benchmarks/published.py                 # every row, an hour (--no-search: seconds)
    python benchmarks/published.py --rows megatron- --json out.json
    python benchmarks/published.py --markdown table.md   # docs/planning.md's table

What each source's trainer did that the cost model must be told (not fitted) is the command's
``--trainer`` (:mod:`pipetrain.plan.cluster.trainers`): Megatron-LM in 2021 had no flash
attention, no sequence parallelism, no distributed optimizer and reduced its gradients after
the backward; the 2022 selective recomputation paper added sequence parallelism; the Zero
Bubble paper's runs kept attention's scores in memory, without a dropout over them (what its
published peak memory says: see its rows' ``assumed``), and ZB-2p is zb-auto under twice
1F1B's stage-activations (``--activation-limit``); the later trainers use flash attention and
overlap their gradient reduction. The "pub." column is the peak memory a source published.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipetrain.cli import main as pipetrain
from pipetrain.plan.cluster.cluster_command import recompute_label
from pipetrain.plan.cluster.published import Published, rows

PINS = ("--tp", "--pp", "--dp", "--fsdp", "--cp", "--ep", "--schedule", "--stages-per-rank",
        "--micro-batch-size", "--recompute", "--recompute-layers")
"""The flags of a row's command that pin its layout (the search leaves them out)."""


def run(argv: list[str]) -> dict[str, Any]:
    """``pipetrain`` with ``argv`` (a ``plan --cluster ... --json`` command): its JSON.

    Raises:
        RuntimeError: when the command fails (exit other than 0, or 3: nothing fits).
    """
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = pipetrain(argv)
    if code not in (0, 3):
        raise RuntimeError(f"pipetrain {shlex.join(argv)} exited {code}: {err.getvalue()}")
    return json.loads(out.getvalue())  # type: ignore[no-any-return]


def unpinned(argv: list[str]) -> list[str]:
    """``argv`` without the flags (and their values) that pin the layout."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in PINS:
            skip = True
        else:
            out.append(arg)
    return out


def compare(row: Published, with_search: bool, configs: Path | None = None) -> dict[str, Any]:
    """``row``'s command's prediction against its published figure (and the search's best
    layout for the same job, ``with_search``); the model's ``config.json`` is written to
    ``configs`` (default: a temporary directory)."""
    with tempfile.TemporaryDirectory() as scratch:
        config = (configs or Path(scratch)) / f"{row.key}.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(row.config(), indent=1))
        argv = row.command(str(config))
        got = run(argv)
        found = run(unpinned(argv))["best"] if with_search else None
    best = got["best"]
    predicted = float(best[row.metric])
    out: dict[str, Any] = {"key": row.key, "metric": row.metric, "published": row.value,
                           "predicted": predicted, "ratio": predicted / row.value,
                           "fits": best["fits"], "peak_gib": best["peak_bytes_per_gpu"] / 2**30,
                           "step_s": best["step_s"], "peak_bytes": best["peak_bytes_per_gpu"],
                           "published_peak_bytes": row.peak_memory,
                           "recompute": _recompute(best["layout"]),
                           "command": "pipetrain " + shlex.join(row.command(
                               str(config) if configs else ""))}
    if found is not None:
        out["search_step_s"] = found["step_s"]
        out["search_layout"] = found["layout"]
    return out


def _recompute(layout: dict[str, Any]) -> str:
    """A ``--json`` layout's recomputation as the command's table shows it."""
    return recompute_label(layout["recompute"], layout.get("recompute_layers", 0))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="keys or prefixes (default: all)")
    parser.add_argument("--no-search", action="store_true", help="skip the layout search")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--configs", type=Path,
                        help="write each row's config.json here (to run its command)")
    parser.add_argument("--commands", action="store_true",
                        help="print each row's command under it")
    parser.add_argument("--markdown", help="write docs/planning.md's table of the rows here")
    args = parser.parse_args(argv)
    started = time.time()
    print(f"{'run':<34}{'metric':<24}{'published':>10}{'predicted':>10}{'ratio':>7}"
          f"{'fits':>6}{'GiB':>6}{'pub.':>6} {'recompute':<10} "
          "search: step / published step, layout",
          flush=True)
    results = []
    for row in rows(args.rows or None):
        r = compare(row, not args.no_search, args.configs)
        results.append(r)
        found = ""
        if "search_step_s" in r:
            lay = r["search_layout"]
            found = (f"{r['search_step_s'] / r['step_s']:.3f}  tp{lay['tp']} pp{lay['pp']} "
                     f"dp{lay['dp']} fsdp{lay['fsdp']} cp{lay['cp']} {lay['schedule']} "
                     f"v{lay['stages_per_rank']} b{lay['micro_batch_size']} "
                     f"{_recompute(lay)}")
        print(f"{r['key']:<34}{r['metric']:<24}{r['published']:>10.4g}{r['predicted']:>10.4g}"
              f"{r['ratio']:>7.3f}{'yes' if r['fits'] else 'NO':>6}{r['peak_gib']:>6.1f}"
              f"{r['published_peak_bytes'] / 2**30 or float('nan'):>6.1f} "
              f"{r['recompute']:<10} {found}",
              flush=True)
        if args.commands:
            print(f"  $ {r['command']}", flush=True)
    ratios = [r["ratio"] for r in results]
    memory = [r["peak_bytes"] / r["published_peak_bytes"] for r in results
              if r["published_peak_bytes"]]
    if memory:
        print(f"peak memory (GiB: predicted, pub.: published where given): predicted / "
              f"published {min(memory):.2f}-{max(memory):.2f} over {len(memory)} rows")
    within = sum(abs(x - 1) <= 0.10 for x in ratios)
    print(f"{within} of {len(ratios)} within 10 %; median ratio {statistics.median(ratios):.3f}, "
          f"median |error| {statistics.median(abs(x - 1) for x in ratios):.3f}; "
          f"{time.time() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results, time.strftime("%Y-%m-%d")))
    return 0


_UNITS = {"hardware_tflops_per_gpu": "hardware TFLOP/s/GPU",
          "model_tflops_per_gpu": "model TFLOP/s/GPU", "mfu": "MFU",
          "tokens_per_s_per_gpu": "tokens/s/GPU", "step_s": "s/step"}


def markdown(results: list[dict[str, Any]], day: str) -> str:
    """docs/planning.md's table of ``results`` (``compare``'s), searched on ``day`` (a row not
    searched shows "-" in the last column)."""
    lines = ["| run | metric | published | predicted | ratio | fits | peak GiB: predicted "
             f"(published) | recompute | search's best ({day}): its step / the published "
             "layout's, what it changed |", "|---" * 9 + "|"]
    for r in results:
        peak = f"{r['peak_gib']:.1f}"
        if r["published_peak_bytes"]:
            peak += f" ({r['published_peak_bytes'] / 2**30:.1f})"
        found = "-"
        if "search_step_s" in r:
            lay = r["search_layout"]
            found = (f"{r['search_step_s'] / r['step_s']:.2f}: tp {lay['tp']}, pp {lay['pp']}, "
                     f"dp {lay['dp']}, fsdp {lay['fsdp']}, cp {lay['cp']}, {lay['schedule']} "
                     f"v {lay['stages_per_rank']}, b {lay['micro_batch_size']}, recompute "
                     f"{_recompute(lay)}")
        cells = [r["key"], _UNITS[r["metric"]], f"{r['published']:.4g}",
                 f"{r['predicted']:.4g}", f"{r['ratio']:.3f}", "yes" if r["fits"] else "no",
                 peak, r["recompute"], found]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
