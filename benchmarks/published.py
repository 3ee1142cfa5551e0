"""Published runs against ``pipetrain plan --cluster``'s prediction for the same job and layout.

For every run of :mod:`pipetrain.plan.cluster.published` (Megatron-LM's Table 1, the selective
recomputation paper's, the Zero Bubble paper's, torchtitan's, Llama 3's, MegaScale's), the
predicted figure in the metric the source published, their ratio, and the fastest layout the
search finds for the same GPUs, batch and memory::

    python benchmarks/published.py                 # every row, ten minutes (--no-search: seconds)
    python benchmarks/published.py --rows megatron- --json out.json

What each source's trainer did that the cost model must be told (not fitted): Megatron-LM in
2021 had no flash attention, no sequence parallelism, no distributed optimizer and reduced its
gradients after the backward; the 2022 selective recomputation paper added sequence
parallelism; the Zero Bubble paper's runs kept attention's scores in memory, without a
dropout over them (what its published peak memory says: see its rows' ``assumed``), and ZB-2p
is zb-auto under twice 1F1B's stage-activations; the later trainers use flash attention and
overlap their gradient reduction. The "pub." column is the peak memory a source published.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from pipetrain.plan.cluster.arch import Arch
from pipetrain.plan.cluster.hardware import gpu
from pipetrain.plan.cluster.job import Job, Layout, Prediction, predict
from pipetrain.plan.cluster.published import Published, rows
from pipetrain.plan.cluster.search import Pins, search

OLD_MEGATRON = ("megatron-", "megascale-")  # 2021's Megatron-LM: see the module docstring


def job_of(row: Published) -> Job:
    """The job of ``row``, with what its trainer did."""
    m = row.model
    arch = Arch(layers=m["layers"], hidden=m["hidden"], heads=m["heads"],
                kv_heads=m["kv_heads"], ffn=m["ffn"], vocab=m["vocab"],
                gated=m["ffn"] != 4 * m["hidden"], experts=m.get("experts", 0),
                top_k=m.get("top_k", 0), name=row.key)
    old = row.key.startswith(("megatron-", "korthikanti-"))
    zb = row.key.startswith("zb-")  # see the module docstring
    return Job(arch, gpu(row.gpu), row.gpus, m["seq_len"], row.global_batch,
               precision=row.precision, flash_attention=not old and not zb,
               attention_dropout=not zb,
               sequence_parallel=not row.key.startswith("megatron-"),
               distributed_optimizer=not old, overlap_grad_reduce=not old)


def layout_of(row: Published) -> Layout:
    dp = row.dp * row.fsdp
    return Layout(tp=row.tp, pp=row.pp, dp=row.dp, fsdp=row.fsdp, cp=row.cp, ep=row.ep,
                  schedule=row.schedule if row.pp > 1 else "1f1b",
                  stages_per_rank=row.stages_per_rank,
                  microbatches=row.global_batch // (dp * row.micro_batch),
                  micro_batch_size=row.micro_batch, recompute=row.recompute,
                  activation_limit=row.activation_limit)


def figure(p: Prediction, metric: str) -> float:
    return float(p.step_s if metric == "step_s" else getattr(p, metric))


def compare(row: Published, with_search: bool) -> dict[str, Any]:
    job = job_of(row)
    got = predict(job, layout_of(row))
    predicted = figure(got, row.metric)
    out: dict[str, Any] = {"key": row.key, "metric": row.metric, "published": row.value,
                           "predicted": predicted, "ratio": predicted / row.value,
                           "fits": got.fits, "peak_gib": got.peak_bytes_per_gpu / 2**30,
                           "step_s": got.step_s, "peak_bytes": got.peak_bytes_per_gpu,
                           "published_peak_bytes": row.peak_memory}
    if with_search:
        best = search(job, Pins(), limit=1)[0]
        out["search_step_s"] = best.step_s
        out["search_layout"] = {k: v for k, v in vars(best.layout).items()}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="keys or prefixes (default: all)")
    parser.add_argument("--no-search", action="store_true", help="skip the layout search")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    started = time.time()
    print(f"{'run':<34}{'metric':<24}{'published':>10}{'predicted':>10}{'ratio':>7}"
          f"{'fits':>6}{'GiB':>6}{'pub.':>6}  search: step / published step, layout",
          flush=True)
    results = []
    for row in rows(args.rows or None):
        r = compare(row, not args.no_search)
        results.append(r)
        found = ""
        if "search_step_s" in r:
            lay = r["search_layout"]
            found = (f"{r['search_step_s'] / r['step_s']:.3f}  tp{lay['tp']} pp{lay['pp']} "
                     f"dp{lay['dp']} fsdp{lay['fsdp']} cp{lay['cp']} {lay['schedule']} "
                     f"v{lay['stages_per_rank']} b{lay['micro_batch_size']} "
                     f"{lay['recompute']}")
        print(f"{r['key']:<34}{r['metric']:<24}{r['published']:>10.4g}{r['predicted']:>10.4g}"
              f"{r['ratio']:>7.3f}{'yes' if r['fits'] else 'NO':>6}{r['peak_gib']:>6.1f}"
              f"{r['published_peak_bytes'] / 2**30 or float('nan'):>6.1f}  {found}",
              flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
