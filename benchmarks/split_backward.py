"""Split backward cost: does I (input grads) + W (weight grads) cost no more than one full B?

Zero-bubble schedules replace each B by an I and a W. That only pays off if the split adds
little work, so this script times, on CPU, one pre-norm transformer block's forward F, full
backward B, I (``backward_input``) and W (``WeightWork.run``), and reports (I+W)/B (target
<= 1.1). Every timed backward gets a fresh forward; weight gradients are already allocated, as
for every micro-batch after the first of a step.

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
import torch.nn.functional as F
from torch import nn

from pipetrain.backward import backward_input


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv, self.proj = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.fc, self.out = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (h.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
                   for h in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median seconds of F, B, I and W over ``args.repeats`` runs (after warm-up)."""
    torch.manual_seed(0)
    block = Block(args.d_model, args.heads)
    params = list(block.parameters())
    x = torch.randn(args.batch, args.seq, args.d_model)
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
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
        _, work = backward_input([y], [grad], [leaf], params)
        t4 = time.perf_counter()
        work.run()
        t5 = time.perf_counter()
        if i >= args.warmup:
            for op, dt in (("F", t1 - t0), ("B", t2 - t1), ("I", t4 - t3), ("W", t5 - t4)):
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
    for op, name in [("F", "F"), ("B", "B"), ("I", "I"), ("W", "W")]:
        print(f"{name:<8}{med[op] * 1e3:>12.2f}{med[op] / med['B']:>8.2f}")
    print(f"{'I+W':<8}{(med['I'] + med['W']) * 1e3:>12.2f}{ratio:>8.2f}")
    verdict = "ok" if ratio <= 1.1 else "ABOVE TARGET"
    print(f"(I+W)/B = {ratio:.3f} (target <= 1.1: {verdict})")
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
