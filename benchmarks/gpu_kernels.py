"""GPU kernel figures for a first-principles cluster cost model: GEMM, attention and memory-bound.

Usage::

    python3 benchmarks/gpu_kernels.py --out FILE.json [--quick] [--device cuda] [--budget 130]
    python3 benchmarks/gpu_kernels.py --device cpu --quick --out /tmp/x.json  # smoke test
    python3 benchmarks/gpu_kernels.py --plan [--quick]  # estimated H100 time per section, no run

On one device it times bf16 GEMMs in the three layouts a layer's F, I and W use (and fp8
``torch._scaled_mm`` where the GPU has it), causal flash attention forward and backward, and
memory-bound kernels; each figure is the median of several batches of back-to-back calls, each
batch sized to take >= 1.5 ms. Each section has a deadline inside ``--budget`` seconds (what one
section leaves over goes to the next); past it, its remaining shapes are skipped with a note. The
JSON file is rewritten as the run goes, so a run cut short keeps what it measured. Needs only
the standard library and torch; on CPU every shape is tiny (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch.nn.attention import SDPBackend, sdpa_kernel

Record = dict[str, Any]
Case = Callable[[], Record]

TARGET_S = 1.5e-3  # a timed batch of calls lasts at least this long: launch overhead is noise
MAX_CALLS = 2000  # calls per batch at most
MAX_OPERAND_BYTES = 2.5e9  # a GEMM's three bf16 operands together at most
SOFTMAX_COLS = 32768
BF16 = torch.bfloat16
# Share of --budget each section may use, in run order (the essentials first). Deadlines are
# cumulative: time one section leaves over goes to the next.
SHARES = {"gemm nt": 0.24, "attention": 0.1, "memory": 0.06, "gemm nn": 0.18, "gemm tn": 0.18,
          "gemm_fp8": 0.1, "attention cudnn": 0.08}
# --plan's nominal H100 SXM rates: ~700 of 989 TFLOP/s dense bf16 peak, ~3 of 3.35 TB/s HBM3.
# PyTorch's flash backend is FlashAttention-2, which reaches about 35% of H100's peak
# (Shah et al. 2024, FlashAttention-3, arXiv:2407.08608, abstract): about 350 TFLOP/s.
PLAN_TFLOPS, PLAN_ATTN_TFLOPS, PLAN_GBPS, PLAN_CASE_S = 700e12, 350e12, 3e12, 3e-3
# FlashAttention-2 counts the backward pass as 2.5x the forward's FLOPs: 5 matmuls (with the
# recomputation of the scores) against the forward's 2 (Dao 2023, arXiv:2307.08691, section 4.1;
# the same rule is in flash-attention's benchmarks/benchmark_flash_attention.py).
BWD_FACTOR = 2.5
# name: (bytes moved as a multiple of one tensor, how they are counted)
MEMORY_OPS = {
    "copy": (2, "read src, write dst"),
    "add": (3, "read a and b, write out"),
    "gelu": (2, "read x, write y"),
    "silu_mul": (3, "read a and b, write out: the fused minimum; eager runs 2 kernels moving 5"),
    "layer_norm": (2, "read x, write y (weight, bias and statistics ignored)"),
    "rms_norm": (2, "read x, write y (weight and statistics ignored)"),
    "softmax": (2, f"read x, write y; rows of {SOFTMAX_COLS} columns"),
}


def timed(fn: Callable[[], object], calls: int, dev: torch.device) -> float:
    """Seconds ``calls`` back-to-back calls of ``fn`` take (on CUDA: device time by events)."""
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def measure(fn: Callable[[], object], dev: torch.device, reps: int) -> float:
    """Median seconds per call: a warm-up call, a batch grown to >= TARGET_S, ``reps`` batches."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    calls = 1
    while (dt := timed(fn, calls, dev)) < TARGET_S / 2 and calls < MAX_CALLS:
        calls = min(MAX_CALLS, math.ceil(calls * TARGET_S / max(dt, TARGET_S / 100)))
    return statistics.median(timed(fn, calls, dev) / calls for _ in range(reps))


def randn(*shape: int, dev: torch.device, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.randn(*shape, device=dev, dtype=dtype)


def gemm_case(m: int, n: int, k: int, layout: str, dev: torch.device, reps: int) -> Record:
    """One bf16 GEMM: nt y = x @ W^T (F), nn dx = dy @ W (I), tn dW = dy^T @ x (W)."""
    x, w, dy = randn(m, k, dev=dev), randn(n, k, dev=dev), randn(m, n, dev=dev)
    # Each layout writes into the one operand it does not read.
    a, b, out = {"nt": (x, w.t(), dy), "nn": (dy, w, x), "tn": (dy.t(), x, w)}[layout]
    s = measure(lambda: torch.mm(a, b, out=out), dev, reps)
    return {"m": m, "n": n, "k": k, "layout": layout, "dtype": "bfloat16", "seconds": s,
            "tflops": 2 * m * n * k / s / 1e12}


def fp8_case(m: int, n: int, k: int, fast: bool, dev: torch.device, reps: int) -> Record:
    """y = x @ W^T in float8_e4m3fn: x row-major, W^T column-major, unit scales, bf16 out."""
    x = randn(m, k, dev=dev, dtype=torch.float32).to(torch.float8_e4m3fn)
    w = randn(n, k, dev=dev, dtype=torch.float32).to(torch.float8_e4m3fn)
    one = torch.ones((), device=dev, dtype=torch.float32)
    s = measure(lambda: torch._scaled_mm(x, w.t(), one, one, out_dtype=BF16,
                                         use_fast_accum=fast), dev, reps)
    return {"m": m, "n": n, "k": k, "layout": "nt", "dtype": "float8_e4m3fn", "out_dtype":
            "bfloat16", "fast_accum": fast, "seconds": s, "tflops": 2 * m * n * k / s / 1e12}


def attention_flops(b: int, h: int, s: int, d: int) -> float:
    """Causal forward: QK^T and PV, 2*s*s*d multiply-adds each per head, half under the mask."""
    return 4 * b * h * s * s * d / 2


def attention_case(b: int, h: int, s: int, d: int, backend: SDPBackend | None,
                   dev: torch.device, reps: int) -> Record:
    """Causal SDPA forward alone, then forward+backward; backward = the difference."""
    q, k, v = (randn(b, h, s, d, dev=dev).requires_grad_() for _ in range(3))
    grad = randn(b, h, s, d, dev=dev)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with sdpa_kernel(backend) if backend is not None else nullcontext():
        fwd_s = measure(fwd, dev, reps)
        both_s = measure(lambda: torch.autograd.grad(fwd(), (q, k, v), grad), dev, reps)
    flops = attention_flops(b, h, s, d)
    bwd_s = max(both_s - fwd_s, 1e-12)
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": True, "dtype": "bfloat16",
            "backend": backend.name.lower() if backend is not None else "default",
            "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_flops": flops, "bwd_flops": BWD_FACTOR * flops,
            "fwd_tflops": flops / fwd_s / 1e12, "bwd_tflops": BWD_FACTOR * flops / bwd_s / 1e12}


def memory_case(name: str, shape: tuple[int, int], dev: torch.device, reps: int) -> Record:
    """One memory-bound kernel on bf16 tensors of ``shape``; GB/s from MEMORY_OPS's byte count."""
    a, b = randn(*shape, dev=dev), randn(*shape, dev=dev)
    ones = torch.ones(shape[-1], device=dev, dtype=BF16)
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: b.copy_(a), "add": lambda: torch.add(a, b, out=b),
        "gelu": lambda: F.gelu(a), "silu_mul": lambda: F.silu(a) * b,
        "layer_norm": lambda: F.layer_norm(a, shape[-1:], ones, ones),
        "rms_norm": lambda: F.rms_norm(a, shape[-1:], ones),
        "softmax": lambda: torch.softmax(a.view(-1, SOFTMAX_COLS), dim=-1)}
    s = measure(fns[name], dev, reps)
    factor, rule = MEMORY_OPS[name]
    nbytes = factor * a.numel() * a.element_size()
    return {"name": name, "shape": list(shape), "dtype": "bfloat16", "bytes": nbytes,
            "bytes_rule": f"{factor} x tensor: {rule}", "seconds": s, "gbps": nbytes / s / 1e9}


def gemm_grid(tiny: bool, quick: bool) -> list[tuple[int, int, int]]:
    """(m, n, k) shapes, every other size first, so a pass cut short still spans the grid."""
    if tiny:
        ms, nks = [64, 128], [64, 128, 256]
    elif quick:
        ms, nks = [2048, 8192], [1024, 4096, 16384]
    else:
        ms = [512, 1024, 2048, 4096, 8192, 16384]
        nks = [256, 512, 1024, 2048, 4096, 8192, 16384, 28672]
    grid = [(m, n, k) for m, n, k in itertools.product(ms, nks, nks)
            if 2 * (m * k + n * k + m * n) <= MAX_OPERAND_BYTES]
    coarse = set(ms[1::2]), set(nks[::2])
    return sorted(grid, key=lambda s: not (s[0] in coarse[0] and {s[1], s[2]} <= coarse[1]))


def sizes(tiny: bool, quick: bool) -> dict[str, Any]:
    """The other shapes: fp8 (m, n, k), attention (b, h, s, d), memory tensor and copy."""
    if tiny:
        return {"fp8": [], "attn": [(1, 2, s, 64) for s in (128, 256)],
                "tensor": (256, 1024), "copy": (8, 1 << 20)}
    seqs, dims = ([2048, 8192], [128]) if quick else ([1024, 2048, 4096, 8192, 16384], [64, 128])
    fp8 = list(itertools.product([2048, 8192], *[[1024, 4096, 8192, 16384]] * 2))
    return {"fp8": fp8[::4] if quick else fp8,  # attention: batch x seq = 16384 tokens a call
            "attn": [(max(1, 16384 // s), 32, s, d) for d in dims for s in seqs],
            "tensor": (8192, 8192), "copy": (1024, 1 << 20)}  # copy: 2 GiB of bf16


def sections(dev: torch.device, tiny: bool, quick: bool, reps: int,
             attn_backend: SDPBackend | None) -> list[tuple[str, str, list[Case] | str]]:
    """(section, JSON key, its cases or why it is skipped), in SHARES's order."""
    sz, part = sizes(tiny, quick), functools.partial
    gemm = {lay: [part(gemm_case, *s, lay, dev, reps) for s in gemm_grid(tiny, quick)]
            for lay in ("nt", "nn", "tn")}
    attn = {bk: [part(attention_case, *s, bk, dev, reps) for s in sz["attn"]]
            for bk in (attn_backend, SDPBackend.CUDNN_ATTENTION)}
    mem = [part(memory_case, n, sz["copy" if n == "copy" else "tensor"], dev, reps)
           for n in MEMORY_OPS]
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    fp8: list[Case] | str = [part(fp8_case, *s, fast, dev, reps) for fast in (False, True)
                             for s in sz["fp8"]] if cap is not None and cap >= (8, 9) else \
        f"skipped: needs a CUDA device of compute capability >= 8.9 (this one: {cap})"
    cudnn = attn[SDPBackend.CUDNN_ATTENTION] if cap is not None else "skipped: CUDA only"
    return [("gemm nt", "gemm", gemm["nt"]), ("attention", "attention", attn[attn_backend]),
            ("memory", "memory", mem), ("gemm nn", "gemm", gemm["nn"]),
            ("gemm tn", "gemm", gemm["tn"]), ("gemm_fp8", "gemm_fp8", fp8),
            ("attention cudnn", "attention", cudnn)]


def spin_up(dev: torch.device, seconds: float = 1.0) -> None:
    """Run large GEMMs for ``seconds`` so the first measurements do not meet idle clocks."""
    a = randn(4096, 4096, dev=dev)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        timed(lambda: a @ a, 10, dev)


def brief(rec: Record) -> str:
    return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in rec.items() if k not in ("dtype", "out_dtype", "bytes_rule"))


class Run:
    """The JSON document, rewritten to ``path`` as it grows."""

    def __init__(self, path: Path, header: Record) -> None:
        self.path, self.last_write = path, 0.0
        self.doc: Record = {"schema": 1, "header": header, "gemm": [], "gemm_fp8": [],
                            "attention": [], "memory": [], "notes": []}

    def note(self, text: str) -> None:
        print(f"note: {text}", flush=True)
        self.doc["notes"].append(text)

    def write(self) -> None:
        self.last_write = time.perf_counter()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.path)

    def sweep(self, section: str, key: str, cases: list[Case], deadline: float) -> None:
        """Run ``cases`` into ``doc[key]`` until ``deadline``; note failures and skipped cases."""
        errors: dict[str, int] = {}
        for i, case in enumerate(cases):
            if time.perf_counter() > deadline:
                self.note(f"{section}: deadline reached, {len(cases) - i} of {len(cases)} "
                          "cases skipped")
                break
            try:
                rec = case()
            except (RuntimeError, ValueError, TypeError) as e:  # OOM, no kernel for this device
                msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                errors[msg] = errors.get(msg, 0) + 1
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            self.doc[key].append(rec)
            if (i + 1) % max(1, len(cases) // 12) == 0 or i + 1 == len(cases):
                print(f"  {section} [{i + 1}/{len(cases)}] {brief(rec)}", flush=True)
            if time.perf_counter() - self.last_write > 5:
                self.write()
        for msg, count in errors.items():
            self.note(f"{section}: {count} case(s) failed: {msg}")
        self.write()


def first_line(cmd: list[str]) -> str | None:
    """First line of a command's output; None if it fails."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=True)
        return done.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def header(dev: torch.device, args: argparse.Namespace, reps: int) -> Record:
    cuda = dev.type == "cuda"
    props = torch.cuda.get_device_properties(dev) if cuda else None
    smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    return {"device_name": torch.cuda.get_device_name(dev) if cuda else "cpu",
            "compute_capability": [props.major, props.minor] if props else None,
            "total_memory_bytes": props.total_memory if props else None,
            "sm_count": props.multi_processor_count if props else None,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "cudnn_version": torch.backends.cudnn.version() if cuda else None,
            "driver_version": first_line(smi) if cuda else None,
            "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": first_line(["git", "-C", str(Path(__file__).resolve().parent),
                                      "rev-parse", "HEAD"]),
            "quick": args.quick, "budget_s": args.budget,
            "timing": f"median of {reps} batches of back-to-back calls, each batch >= "
                      f"{TARGET_S * 1e3:g} ms, after a warm-up call; "
                      f"{'CUDA events' if cuda else 'perf_counter'}"}


def plan(tiny: bool, quick: bool, reps: int) -> dict[str, float]:
    """Seconds each section should take at the PLAN_ rates: warm-up, calibration, reps, setup."""
    def cost(call_s: float) -> float:
        return call_s + (2 + reps) * max(call_s, TARGET_S) + PLAN_CASE_S

    sz = sizes(tiny, quick)
    gemm = sum(cost(2 * m * n * k / PLAN_TFLOPS) for m, n, k in gemm_grid(tiny, quick))
    attn = sum(cost(f * attention_flops(*s) / PLAN_ATTN_TFLOPS)
               for s in sz["attn"] for f in (1, 1 + BWD_FACTOR))
    mem = sum(cost(f * 2 * math.prod(sz["copy" if n == "copy" else "tensor"]) / PLAN_GBPS)
              for n, (f, _) in MEMORY_OPS.items())
    fp8 = 2 * sum(cost(2 * m * n * k / PLAN_TFLOPS) for m, n, k in sz["fp8"])
    return {"gemm nt": gemm, "attention": attn, "memory": mem, "gemm nn": gemm,
            "gemm tn": gemm, "gemm_fp8": fp8, "attention cudnn": 0.0 if tiny else attn}


def summarize(doc: Record) -> None:
    def tf(rs: list[Record]) -> str:
        top = max(rs, key=lambda r: r["tflops"])
        return (f"best {top['tflops']:.3g} TFLOP/s ({top['m']}x{top['n']}x{top['k']}), "
                f"median {statistics.median(r['tflops'] for r in rs):.3g}, {len(rs)} shapes")

    print(f"\nsummary: {doc['header']['device_name']}", flush=True)
    for layout in ("nt", "nn", "tn"):
        if rs := [r for r in doc["gemm"] if r["layout"] == layout]:
            print(f"  gemm bf16 {layout}: {tf(rs)}")
    for fast in (False, True):
        if rs := [r for r in doc["gemm_fp8"] if r["fast_accum"] == fast]:
            print(f"  gemm fp8 fast_accum={fast}: {tf(rs)}")
    for r in doc["attention"]:
        print(f"  attention {r['backend']} b={r['batch']} h={r['heads']} s={r['seq']} "
              f"d={r['head_dim']}: fwd {r['fwd_tflops']:.3g}, bwd {r['bwd_tflops']:.3g} TFLOP/s")
    for r in doc["memory"]:
        print(f"  memory {r['name']} {r['shape']}: {r['gbps']:.3g} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON file to write (required unless --plan)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="a smaller grid, fewer repetitions")
    p.add_argument("--budget", type=float, default=130.0, help="seconds for all sections")
    p.add_argument("--plan", action="store_true", help="print the estimated times, run nothing")
    args = p.parse_args()
    tiny, reps = args.device == "cpu", 3 if args.quick else 7
    if args.plan:
        est = plan(tiny, args.quick, reps)
        for name, s in est.items():
            print(f"{name:16} {s:6.1f} s  (deadline share {SHARES[name] * args.budget:5.1f} s)")
        print(f"{'total':16} {sum(est.values()):6.1f} s, plus start-up (import, CUDA init)")
        return
    if args.out is None or args.budget <= 0:
        p.error("--out is required and --budget must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: use --device cpu for a smoke test")
    t0 = time.perf_counter()
    dev = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    run = Run(args.out, header(dev, args, reps))
    if tiny:
        torch.set_num_threads(1)
        run.note("cpu: tiny shapes on one thread, a smoke test of the script, not a measurement")
    run.note("each shape runs for tens of ms at most: clocks are those of a short burst, which "
             "a long run under its power limit may not hold")
    backend: SDPBackend | None = SDPBackend.FLASH_ATTENTION
    try:
        attention_case(1, 1, 128, 64, backend, dev, 1)
    except RuntimeError as e:
        backend = None
        run.note(f"attention: no flash backend here ({(str(e).splitlines() or [''])[0][:200]}); "
                 "timed the default backend instead")
    run.write()
    if dev.type == "cuda":
        spin_up(dev)
    ends = (t0 + args.budget * c for c in itertools.accumulate(SHARES.values()))
    for (section, key, cases), deadline in zip(sections(dev, tiny, args.quick, reps, backend),
                                               ends):
        print(f"{section} (at {time.perf_counter() - t0:.0f} s)", flush=True)
        if isinstance(cases, str):
            run.note(f"{section}: {cases}")
        else:
            run.sweep(section, key, cases, deadline)
    run.note(f"total wall time {time.perf_counter() - t0:.1f} s")
    run.write()
    summarize(run.doc)


if __name__ == "__main__":
    main()
