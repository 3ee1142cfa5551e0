"""Kernels: how fast one GPU runs a layer's pieces: matrix multiplies by shape, attention, memory.

The figures come from ``benchmarks/gpu_kernels.py``, run on every GPU this project was lent and
kept in ``plan/data/`` with their date and device. A GPU with no table of its own borrows the
shape-dependence of the nearest measured one, scaled to its own published best matrix
multiply (the maximum achievable matmul FLOPS of Bekman's ml-engineering, "Maximum Achievable
Matmul FLOPS comparison table": A100 SXM 267.9 of 312 TFLOP/s, H100 SXM 792.1 of 989), and
its memory-bound work runs at the measured GPU's share of HBM bandwidth::

    gemm(m, n, k, layout)      seconds for (m x k) . (k x n) in bf16: layout "nt" is a forward,
                               "nn" an input gradient, "tn" a weight gradient (gpu_kernels.py)
    attention(...)             flash attention, causal: forward, or backward (2.5 x its FLOPs)
    memory(bytes, kind)        memory-bound work: bytes over HBM bandwidth x measured share

A shape between measured ones takes the geometric mean of its nearest measured neighbours'
efficiency in log2 space; a shape beyond the grid takes the edge's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from pipetrain.plan.cluster.hardware import Gpu

__all__ = ["Kernels", "MAMF"]

MAMF = {"A100-40GB": 267.9e12, "A100-80GB": 267.9e12, "H100-SXM": 792.1e12,
        "H200": 794.5e12, "H800": 792.1e12, "B200": 1745.0e12}
"""Best measured bf16 matmul FLOP/s per GPU (ml-engineering's MAMF tables; H800 as H100)."""
MEASURED = {"H200": "kernels-h200-2026-11-28.json"}
"""The tables of ``plan/data``, by GPU: measured here with benchmarks/gpu_kernels.py."""
_FLASH_BACKWARD = 2.5  # FlashAttention-2 (Dao 2023) counts a backward as 2.5 forwards' FLOPs


@dataclass
class Kernels:
    """The kernel speeds of ``gpu``, from ``table`` (gpu_kernels.py's JSON) measured on
    ``measured_on``."""

    gpu: Gpu
    table: dict[str, Any]
    measured_on: str
    _gemm: dict[str, list[tuple[float, float, float, float]]] = field(default_factory=dict)
    _rates: dict[tuple[int, int, int, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        best = max(r["tflops"] for r in self.table["gemm"]) * 1e12
        target = MAMF.get(self.gpu.name, best) if self.gpu.name != self.measured_on else best
        self.scale: float = float(target / best)
        """This GPU's best matmul over the measured one's."""
        for r in self.table["gemm"]:
            self._gemm.setdefault(r["layout"], []).append(
                (math.log2(r["m"]), math.log2(r["n"]), math.log2(r["k"]),
                 math.log(r["tflops"] * 1e12 * self.scale)))

    @classmethod
    def of(cls, gpu: Gpu) -> Kernels:
        """The kernels of ``gpu``: its own table, or the nearest measured GPU's, scaled."""
        return _kernels(gpu)

    def rate(self, m: float, n: float, k: float, layout: str = "nt") -> float:
        """FLOP/s of a bf16 matrix multiply of this shape."""
        key = (round(m), round(n), round(k), layout)
        if key not in self._rates:
            self._rates[key] = self._rate(m, n, k, layout)
        return self._rates[key]

    def _rate(self, m: float, n: float, k: float, layout: str) -> float:
        points = self._gemm.get(layout) or self._gemm["nt"]
        raw = (math.log2(max(m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1)))
        lo = [min(p[i] for p in points) for i in range(3)]
        hi = [max(p[i] for p in points) for i in range(3)]
        at = [min(max(x, a), b) for x, a, b in zip(raw, lo, hi)]
        near = sorted(points, key=lambda p: sum((p[i] - at[i]) ** 2 for i in range(3)))[:4]
        weights = [1.0 / (1e-9 + sum((p[i] - at[i]) ** 2 for i in range(3))) for p in near]
        return math.exp(sum(w * p[3] for w, p in zip(weights, near)) / sum(weights))

    def gemm(self, m: float, n: float, k: float, layout: str = "nt", fp8: bool = False
             ) -> float:
        """Seconds for an (m x k) . (k x n) bf16 matrix multiply; ``fp8``: in fp8 (e4m3, bf16
        out), at the measured fp8/bf16 speed-up of the nearest measured shape."""
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        rate = self.rate(m, n, k, layout)
        if fp8:
            rate *= self.fp8_speedup(m, n, k)
        return 2.0 * m * n * k / rate

    def fp8_speedup(self, m: float, n: float, k: float) -> float:
        """The measured fp8 rate over the bf16 rate of the nearest shape measured in both
        (``torch._scaled_mm`` with fast accumulation, as fp8 training recipes use)."""
        rows = [r for r in self.table.get("gemm_fp8", []) if r.get("fast_accum")]
        if not rows:
            raise ValueError(f"no fp8 matrix multiply was measured for {self.measured_on}")
        at = (math.log2(max(m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1)))
        near = min(rows, key=lambda r: sum((math.log2(r[x]) - a) ** 2
                                          for x, a in zip("mnk", at)))
        bf16 = self.rate(near["m"], near["n"], near["k"]) / self.scale
        return float(near["tflops"] * 1e12 / bf16)

    def attention(self, batch_heads: float, seq_q: float, seq_k: float, head_dim: int,
                  backward: bool = False) -> float:
        """Seconds for causal flash attention of ``seq_q`` queries against ``seq_k`` keys in
        ``batch_heads`` (batch x heads) independent problems."""
        flops = 4.0 * batch_heads * seq_q * seq_k * head_dim / 2  # causal: half the square
        if backward:
            flops *= _FLASH_BACKWARD
        return float(flops / self._attention_rate(seq_k, head_dim, backward))

    def _attention_rate(self, seq: float, head_dim: int, backward: bool) -> float:
        rows = [r for r in self.table["attention"] if r.get("backend") == "flash_attention"]
        dims = sorted({r["head_dim"] for r in rows}, key=lambda d: abs(d - head_dim))
        rows = sorted((r for r in rows if r["head_dim"] == dims[0]), key=lambda r: r["seq"])
        key = "bwd_tflops" if backward else "fwd_tflops"
        logs = [(math.log2(r["seq"]), r[key]) for r in rows]
        x = min(max(math.log2(max(seq, 1)), logs[0][0]), logs[-1][0])
        for (x0, y0), (x1, y1) in zip(logs, logs[1:]):
            if x0 <= x <= x1:
                rate = y0 + (y1 - y0) * ((x - x0) / (x1 - x0) if x1 > x0 else 0.0)
                return float(rate) * 1e12 * self.scale
        return float(logs[-1][1]) * 1e12 * self.scale

    def memory(self, size: float, kind: str = "elementwise") -> float:
        """Seconds for memory-bound work moving ``size`` bytes: ``kind`` "elementwise" (an add,
        an activation) or "norm" (layer or RMS norm, softmax), at the measured GPU's share of
        its HBM bandwidth."""
        names = {"elementwise": ("add", "gelu", "silu_mul"),
                 "norm": ("layer_norm", "rms_norm", "softmax")}[kind]
        rates = [r["gbps"] * 1e9 for r in self.table["memory"] if r["name"] in names]
        share = sum(rates) / len(rates) / _spec_hbm(self.measured_on, self.gpu)
        return float(size / (self.gpu.hbm_bw * share))


@cache
def _kernels(gpu: Gpu) -> Kernels:
    name = gpu.name if gpu.name in MEASURED else "H200"
    return Kernels(gpu, _load(MEASURED[name]), name)


def _spec_hbm(measured_on: str, gpu: Gpu) -> float:
    from pipetrain.plan.cluster.hardware import GPUS

    return GPUS[measured_on].hbm_bw if measured_on in GPUS else gpu.hbm_bw


@cache
def _load(name: str) -> dict[str, Any]:
    text = resources.files("pipetrain.plan").joinpath("data", name).read_text()
    data: dict[str, Any] = json.loads(text)
    return data
