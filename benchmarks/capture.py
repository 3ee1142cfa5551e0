"""Capture: export+split cost of a meta GPT by size; captured-split vs layer-list step time;
what a rank that loads rank 0's shared export pays instead of exporting (split/shared_capture.py),
with every dimension symbolic (the default) and at fixed shapes (``dynamic=False``)."""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import gptbench as gb
import torch
from torch import nn

import pipetrain as pt
from pipetrain.models.gpt import PRESETS, GPTConfig, gpt_layers, lm_loss
from pipetrain.split.capture import capture
from pipetrain.split.trace import split_model


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def meta_gpt(cfg: GPTConfig) -> nn.Module:
    """The whole GPT as one module, on meta: no parameter memory."""
    with torch.device("meta"):
        return nn.Sequential(*gpt_layers(cfg))


def block_points(cfg: GPTConfig) -> list[str]:
    """Three split points at block boundaries (the Sequential's names: 0 embeds, 1..n blocks)."""
    n = cfg.n_layers
    return list(dict.fromkeys(str(1 + n * k // 4) for k in (1, 2, 3)))


def _capture_child(preset: str, conn: Any) -> None:
    """In a forked child: capture and split ``preset`` on meta; the peak RSS it adds."""
    try:
        cfg = PRESETS[preset]
        model, ids = meta_gpt(cfg), torch.zeros(2, cfg.seq_len, dtype=torch.long)
        before = _rss_mib()
        t0 = time.perf_counter()
        cap = capture(model, (ids,))
        t1 = time.perf_counter()
        split = split_model(model, block_points(cfg), (ids,), captured=cap)
        t2 = time.perf_counter()
        conn.send({"preset": preset, "params": cfg.n_params, "layers": cfg.n_layers,
                   "nodes": len(cap.graph.nodes), "stages": len(split.stages),
                   "export_s": cap.seconds, "capture_s": t1 - t0, "split_s": t2 - t1,
                   "rss_growth_mib": _rss_mib() - before,
                   "fp32_weights_gib": 4 * cfg.n_params / 2**30})
    except BaseException as e:  # noqa: BLE001  (report any failure, do not hang the parent)
        import traceback
        conn.send({"preset": preset, "error": traceback.format_exc(), "exc": repr(e)})
    finally:
        conn.close()


def capture_costs(presets: Sequence[str]) -> tuple[float, list[dict[str, Any]]]:
    """Warm export up once here (its first call loads half of torch), then measure each size
    in a forked child of this warm process, so every size starts from the same RSS."""
    t0 = time.perf_counter()
    capture(meta_gpt(PRESETS["tiny"]), (torch.zeros(2, 8, dtype=torch.long),))
    first = time.perf_counter() - t0
    ctx, rows = mp.get_context("fork"), []
    for preset in presets:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_capture_child, args=(preset, send))
        proc.start()
        send.close()
        try:
            rows.append(recv.recv())
        except EOFError:  # the child died without a word (a crash, the OOM killer)
            rows.append({"preset": preset, "error": "child died", "exc": "child died"})
        proc.join()
    return first, rows


def capture_table(first: float, rows: list[dict[str, Any]]) -> str:
    lines = [f"first export in the process (warm-up, tiny): {first:.2f} s",
             f"{'preset':8s}{'params':>15s}{'fp32 GiB':>10s}{'layers':>8s}{'nodes':>7s}"
             f"{'capture s':>11s}{'(export s)':>11s}{'split s':>9s}{'RSS +MiB':>10s}", "-" * 89]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['preset']:8s}  FAILED: {r['exc']}")
            continue
        lines.append(f"{r['preset']:8s}{r['params']:>15,}{r['fp32_weights_gib']:>10.2f}"
                     f"{r['layers']:>8d}{r['nodes']:>7d}{r['capture_s']:>11.2f}"
                     f"{r['export_s']:>11.2f}{r['split_s']:>9.3f}{r['rss_growth_mib']:>10.1f}")
    return "\n".join(lines)


def shared_costs(cfg: GPTConfig, dynamic: bool = True) -> dict[str, Any]:
    """One GPT exported (``dynamic``: every dimension symbolic, else at fixed shapes), its
    program saved without weights (as rank 0 shares it), and loaded into a capture on another
    copy of the model (as every other rank of the group builds its own): seconds of each
    (CPU seconds: what the ranks sharing a machine pay), the payload's size, and whether the
    graphs print alike."""
    import inspect

    from pipetrain.split.capture import _bind, export, from_program
    from pipetrain.split.shared_capture import _load, _payload

    torch.manual_seed(0)
    model, other = nn.Sequential(*gpt_layers(cfg)), nn.Sequential(*gpt_layers(cfg))
    ids = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    signature = inspect.signature(model.forward)
    bound = _bind(signature, (ids,))
    start = time.process_time()
    program, _ = export(model, bound, dynamic)
    export_s = time.process_time() - start
    mine = from_program(program, model, signature, bound, export_s, dynamic=dynamic)
    t0 = time.process_time()
    payload = _payload(program, model, mine, "")
    t1 = time.process_time()
    theirs, why = _load(payload, other, signature, bound, "", dynamic)
    t2 = time.process_time()
    return {"export_s": export_s, "save_s": t1 - t0, "load_s": t2 - t1,
            "payload_kib": len(payload) / 1024, "weights_kib": 4 * cfg.n_params / 1024,
            "same_graph": theirs is not None and str(theirs.graph) == str(mine.graph),
            "why": why}


def step_times(cfg: GPTConfig, batch: int, m: int, warmup: int, steps: int) -> dict[str, Any]:
    """Median step seconds of the same GPT as a layer list (balance) and as one captured
    module (split_points at the same boundary), timed alternately; losses and grads compared."""
    n_layers = cfg.n_layers + 2  # embedding, blocks, head
    balance = [n_layers // 2, n_layers - n_layers // 2]
    point = str(balance[0])  # the first layer of stage 1, by its name in nn.Sequential
    torch.manual_seed(0)
    layers = gpt_layers(cfg)
    torch.manual_seed(0)
    layers2 = gpt_layers(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    t0 = time.perf_counter()
    listed = pt.Pipeline(nn.Sequential(*layers), "1f1b", m, lm_loss, local_ranks=2,
                         balance=balance)
    t1 = time.perf_counter()
    traced = pt.Pipeline(nn.Sequential(*layers2), "1f1b", m, lm_loss, local_ranks=2,
                         split_points=[point], example_inputs=(x[: max(2, batch // m)],))
    t2 = time.perf_counter()
    torch.manual_seed(0)
    pt.Pipeline(nn.Sequential(*gpt_layers(cfg)), "1f1b", m, lm_loss, local_ranks=2,
                split_points=[point], example_inputs=(x[: max(2, batch // m)],))
    t3 = time.perf_counter()  # the same structure again: the capture is recalled
    runs = {"list": (listed, x), "captured": (traced, traced.pack(x))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    grad_diff = 0.0
    for i in range(warmup + steps):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for name in order:
            pipe, inputs = runs[name]
            gb.clear_grads(list(pipe.parameters()))
            start = time.perf_counter()
            result = pipe.step(inputs, y)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
            losses[name].append(float(result.loss))  # type: ignore[arg-type]
        if i == 0:
            ref = {n: p.grad.clone() for n, p in listed.named_parameters() if p.grad is not None}
            got = dict(traced.named_parameters())
            grad_diff = (gb.grad_difference(ref, iter(got.items())) if set(got) == set(ref)
                         else float("nan"))  # nan: the two name the parameters differently
    med = {k: statistics.median(v) for k, v in times.items()}
    spread = {k: (min(v), max(v)) for k, v in times.items()}
    return {"layers": n_layers, "balance": balance, "split_point": point, "batch": batch,
            "m": m, "steps": steps, "build_list_s": t1 - t0, "build_captured_s": t2 - t1,
            "build_recalled_s": t3 - t2,
            "median_list_s": med["list"], "median_captured_s": med["captured"],
            "ratio": med["captured"] / med["list"], "times": times, "spread": spread,
            "losses_list": losses["list"],
            "losses_captured": losses["captured"],
            "losses_equal": losses["list"] == losses["captured"],
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses["list"],
                                                             losses["captured"])),
            "grad_rel_diff_step0": grad_diff}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,medium,1b", help="presets captured on meta")
    parser.add_argument("--preset", default="small", help="GPT preset of the step comparison")
    parser.add_argument("--seq-len", type=int, help="override the preset's seq_len")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--m", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each, alternated")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", help="write the figures and machine description here")
    parser.add_argument("--tiny", action="store_true", help="tiny,small capture; tiny steps")
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes, args.preset, args.warmup, args.steps = "tiny,small", "tiny", 1, 5
    torch.set_num_threads(args.threads)  # 2 threads ran 20x slower here (vCPU contention)
    mach = gb.machine()
    print(f"torch {mach['torch']} | {mach['platform']}, {mach['processor']}, {mach['cpus']} CPUs"
          f", {torch.get_num_threads()} threads")
    print("\n== capture + split of the whole GPT on meta (split at 3 block boundaries) ==")
    first, rows = capture_costs(args.sizes.split(","))
    print(capture_table(first, rows))
    for r in rows:
        if "error" in r:
            print(f"\n{r['preset']}: {r['error']}")
    cfg = PRESETS[args.preset]
    if args.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len)
    print(f"\n== one export per pipeline group: {args.preset}, rank 0 exports and saves its "
          "program without the weights, another rank loads it ==")
    shared = shared_costs(cfg)
    fixed = shared_costs(cfg, dynamic=False)
    for label, c in (("symbolic", shared), ("fixed shapes", fixed)):
        print(f"{label:12s} CPU: export {c['export_s']:.2f} s | save {c['save_s']:.2f} s | "
              f"load {c['load_s']:.2f} s | payload {c['payload_kib']:.0f} KiB (fp32 weights "
              f"{c['weights_kib']:.0f} KiB) | same graph: {c['same_graph']} {c['why']}")
    print(f"\n== 1f1b step, 2 local ranks: {args.preset} (seq {cfg.seq_len}), batch "
          f"{args.batch}, m={args.m}, {args.warmup} warm-up + {args.steps} steps each ==")
    s = step_times(cfg, args.batch, args.m, args.warmup, args.steps)
    print(f"build: layer list {s['build_list_s']:.2f} s, captured {s['build_captured_s']:.2f} s"
          f" (split after layer {s['balance'][0] - 1}: balance {s['balance']} / "
          f"split_points ['{s['split_point']}']), the same structure again "
          f"{s['build_recalled_s']:.2f} s (its capture recalled)")
    for label, key in (("layer list", "list"), ("captured", "captured")):
        lo, hi = s["spread"][key]
        print(f"{label:14s}{1e3 * s[f'median_{key}_s']:>9.1f} ms median  "
              f"(min {1e3 * lo:.1f}, max {1e3 * hi:.1f})")
    print(f"{'captured/list':14s}{s['ratio']:>9.3f}")
    print(f"losses equal: {s['losses_equal']} (max |diff| {s['max_loss_diff']:.3g} over "
          f"{len(s['losses_list'])} steps; loss {s['losses_list'][0]:.6f}); "
          f"grads step 0: max rel diff {s['grad_rel_diff_step0']:.3g}")
    if args.json:
        gb.save_json(args.json, {"capture": {"first_export_s": first, "sizes": rows},
                                 "shared": shared, "shared_fixed": fixed, "step": s})
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
