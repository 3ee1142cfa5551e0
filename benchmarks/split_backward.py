"""Split backward cost: does I (input grads) + W (weight grads) cost no more than one full B?

Zero-bubble schedules replace each B by an I and a W. That only pays off if the split adds
little work, so this script times, on CPU, one pre-norm transformer block's forward F, full
backward B, I (``backward_input``) and W (``WeightWork.run``), and reports (I+W)/B (target
<= 1.1). Every timed backward gets a fresh forward; weight gradients are already allocated, as
for every micro-batch after the first of a step. I0, a plain ``autograd.grad`` of the input
alone, is the same arithmetic as I: I - I0 is what the split costs in I (walking the graph,
hooks at the cut).

    python benchmarks/split_backward.py --d-model 512 --heads 8 --seq 256 --batch 8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from pipetrain.models.gpt import Block, GPTConfig
from pipetrain.runtime.backward import backward_input


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of F, B, I and W over ``args.repeats`` runs (after warm-up)."""
    torch.manual_seed(0)
    block = Block(GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=1,
                            seq_len=args.seq))
    x = torch.randn(args.batch, args.seq, args.d_model)
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": [], "I0": []}
    for i in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        leaf = x.detach().requires_grad_()
        y = block(leaf)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        leaf = x.detach().requires_grad_()
        y = block(leaf)
        t3 = time.perf_counter()
        _, work = backward_input([y], [grad], [leaf])
        t4 = time.perf_counter()
        work.run()
        t5 = time.perf_counter()
        leaf = x.detach().requires_grad_()
        y = block(leaf)
        t6 = time.perf_counter()
        torch.autograd.grad(y, leaf, grad)
        t7 = time.perf_counter()
        if i >= args.warmup:
            for op, dt in (("F", t1 - t0), ("B", t2 - t1), ("I", t4 - t3), ("W", t5 - t4),
                           ("I0", t7 - t6)):
                times[op].append(dt)
    return {op: statistics.median(ts) for op, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
    torch.set_num_threads(args.threads)

    machine = f"{platform.platform()}, {platform.processor() or platform.machine()}, " \
              f"{os.cpu_count()} CPUs"
    print(f"torch {torch.__version__} | {machine} | {torch.get_num_threads()} thread(s)")
    print(f"block: d_model {args.d_model}, heads {args.heads}, seq {args.seq}, "
          f"batch {args.batch}; median of {args.repeats} runs after {args.warmup} warm-up")
    med = measure(args)
    ratio = (med["I"] + med["W"]) / med["B"]
    print(f"{'op':<8}{'median ms':>12}{'/ B':>8}")
    for op, name in [("F", "F"), ("B", "B"), ("I", "I"), ("W", "W"), ("I0", "I0")]:
        print(f"{name:<8}{med[op] * 1e3:>12.2f}{med[op] / med['B']:>8.2f}")
    print(f"{'I+W':<8}{(med['I'] + med['W']) * 1e3:>12.2f}{ratio:>8.2f}")
    verdict = "ok" if ratio <= 1.1 else "ABOVE TARGET"
    print(f"(I+W)/B = {ratio:.3f} (target <= 1.1: {verdict}); "
          f"I - I0 = {(med['I'] - med['I0']) * 1e3:.2f} ms")
    if args.json:
        result = {"torch": torch.__version__, "machine": machine, "threads": args.threads,
                  "config": {k: getattr(args, k) for k in
                             ("d_model", "heads", "seq", "batch", "warmup", "repeats")},
                  "median_s": med, "ratio_iw_over_b": ratio}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
