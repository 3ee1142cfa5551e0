"""Shard cost: what dp, FSDP, tensor and expert parallelism add to a layout's bytes and seconds.

Each pipeline rank of a layout is ``dp x fsdp x tp`` processes (:class:`Sharding`), and ``ep`` of
its ``dp x fsdp`` data-parallel ranks share each MoE layer's experts. The planner
(:mod:`pipetrain.plan.planner`) profiles the layers one tensor-parallel rank computes (each split
matrix 1/tp of its size, :func:`pipetrain.parallel.tensor_parallel.local_layer`), so their times and
activations are already a tp rank's; this module adds the rest::

    bytes    the parameter state per rank: the weights and AdamW's two moments sharded over
             fsdp, the step's gradients whole (they accumulate on the gathered weights until
             the stage's reduction, :mod:`pipetrain.parallel.sharded`), and the weights gathered at
             once: every layer's (reshard "step"), the largest layer's ("layer") or the largest
             part's ("part"); without FSDP, 4 x the trainable bytes as before
    seconds  in each action, its collectives: tensor parallel's all-reduces (one after each
             row-wise matrix in F, one of each column-wise matrix's input gradient in I or B)
             and FSDP's all-gather of every unit the action computes (F, I, B and W each
             gather and reshard after, unless reshard is "step"); per step, outside the
             schedule: the gradients' reduction (all-reduce over dp in 25 MiB buckets, or
             reduce-scatter over fsdp and all-reduce of the shards over dp) and, for reshard
             "step", each unit's one gather; with ep, in each MoE layer's F, I and B two
             all-to-alls over ep of the micro-batch's (token, expert) rows (dispatch and
             combine: every pair's hidden state, as if the router spread them evenly), and
             the experts' gradients all-reduced over the data-parallel ranks holding the same
             experts, not all of them

A collective costs ``latency + bytes x per_byte`` seconds, fitted per kind and group size from
two sizes timed on the job's own ranks (:func:`measure_collectives`, run by ``pipetrain plan``'s
calibration), or :meth:`Collectives.default` (a guess) without calibration. Sequence
parallelism is predicted as without it: an upper bound on activations (it splits only the
norms' and residuals') and on traffic (its all-gather and reduce-scatter move what the
all-reduce did).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetrain.split.profile import LayerCost

__all__ = ["Sharding", "LayerComm", "Collectives", "KINDS", "state_bytes", "gathered_bytes",
           "step_temporaries", "updated_bytes", "largest_grad",
           "action_seconds", "reduction_seconds", "measure_collectives"]

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
BUCKET_BYTES = 25 << 20  # as pipetrain.train.mesh.GradReducer
DEFAULT_LATENCY, DEFAULT_BANDWIDTH = 1e-4, 2e9
"""Uncalibrated guesses: 100 us per collective, 2 GB/s per rank on the wire (a ring moves
2 (k-1)/k of the bytes in an all-reduce, (k-1)/k in the others)."""
SIZES = (1 << 16, 1 << 22)
"""Bytes timed per collective to fit latency and per-byte cost: 64 KiB and 4 MiB."""


@dataclass(frozen=True)
class Sharding:
    """How many processes hold each pipeline rank's stages, and how."""

    dp: int = 1
    """Replicas, each all its stages' state (gradients all-reduced)."""
    fsdp: int = 1
    """Shards of each weight, gradient and optimizer moment (FSDP2)."""
    tp: int = 1
    """Ranks that split each layer's matrices (tensor parallel; same rows)."""
    reshard: str = "part"
    """FSDP2's unit of gathering (:data:`pipetrain.parallel.sharded.RESHARD`)."""
    ep: int = 1
    """Data-parallel ranks that share each MoE layer's experts (expert parallel)."""

    @property
    def replicas(self) -> int:
        """Processes per pipeline rank."""
        return self.dp * self.fsdp * self.tp

    @property
    def data(self) -> int:
        """Ways each step's batch is split (tp ranks see the same rows)."""
        return self.dp * self.fsdp

    def label(self) -> str:
        """E.g. ``dp2``, ``fsdp2 part``, ``tp2``, ``dp2 fsdp2 layer``; ``-`` for one process."""
        words = [f"{k}{v}" for k, v in (("dp", self.dp), ("fsdp", self.fsdp), ("tp", self.tp),
                                        ("ep", self.ep)) if v > 1]
        if self.fsdp > 1:
            words.append(self.reshard)
        return " ".join(words) or "-"

    def to_dict(self) -> dict[str, int | str]:
        return {"dp": self.dp, "fsdp": self.fsdp, "tp": self.tp, "fsdp_reshard": self.reshard,
                "ep": self.ep}


@dataclass(frozen=True)
class LayerComm:
    """One layer's traffic-bearing sizes (a tensor-parallel rank's slice, one micro-batch)."""

    units: tuple[int, ...] = ()
    """Bytes of its FSDP2 units under reshard "part": each large part, then the rest."""
    tp_f: tuple[int, ...] = ()
    """Bytes all-reduced over tp in its F: each row-wise matrix's output."""
    tp_i: tuple[int, ...] = ()
    """Bytes all-reduced over tp in its I: each column-wise matrix's input gradient."""
    experts: int = 0
    """Bytes of its experts' weights (all of them; an MoE layer's), else 0."""
    a2a: int = 0
    """Bytes of its (token, expert) rows' hidden states, which expert parallelism's dispatch
    sends (and its combine returns) in one all-to-all each."""


@dataclass(frozen=True)
class Collectives:
    """Seconds of a collective of ``bytes`` over ``ranks``: ``latency + bytes x per_byte``."""

    fitted: dict[str, tuple[float, float]] = field(default_factory=dict)
    """``"kind/ranks"`` -> (latency, per_byte), measured; anything else takes the default."""

    def seconds(self, kind: str, ranks: int, nbytes: float) -> float:
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        latency, per_byte = self.fitted.get(f"{kind}/{ranks}", _default(kind, ranks))
        return latency + nbytes * per_byte

    @classmethod
    def default(cls) -> Collectives:
        return cls()


def _default(kind: str, ranks: int) -> tuple[float, float]:
    moved = (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
    return DEFAULT_LATENCY, moved / DEFAULT_BANDWIDTH


# -- bytes --------------------------------------------------------------------------------


def state_bytes(layers: Sequence[LayerCost], comm: Sequence[LayerComm],
                sharding: Sharding) -> float:
    """One rank's parameter state over its ``layers`` (the module docstring's bytes)."""
    experts = _spread(comm, sharding)
    trainable = sum(c.param_bytes - c.frozen_bytes for c in layers) - experts
    frozen = sum(c.frozen_bytes for c in layers)
    spread = 4.0 * experts / sharding.ep
    if sharding.fsdp == 1:
        return 4.0 * trainable + frozen + spread
    shards = (3.0 * trainable + frozen) / sharding.fsdp
    return shards + trainable + gathered_bytes(layers, comm, sharding.reshard) + spread


def gathered_bytes(layers: Sequence[LayerCost], comm: Sequence[LayerComm],
                   reshard: str) -> float:
    """The most weight bytes FSDP2 holds gathered at once over ``layers``."""
    if reshard == "step":
        return float(sum(c.param_bytes for c in layers))
    if reshard == "layer":
        return float(max((c.param_bytes for c in layers), default=0))
    return float(max((u for c in comm for u in c.units), default=0))


def step_temporaries(layers: Sequence[LayerCost], sharding: Sharding, foreach: bool,
                     comm: Sequence[LayerComm] = ()) -> float:
    """AdamW's temporaries: the size of all the (sharded) weights it updates at once
    (foreach kernels), or two of the largest one's (per tensor)."""
    if foreach:
        return updated_bytes(layers, comm, sharding)
    return 2.0 * largest_grad(layers, comm, sharding) / sharding.fsdp


def largest_grad(layers: Sequence[LayerCost], comm: Sequence[LayerComm],
                 sharding: Sharding) -> float:
    """The largest gradient one rank makes whole: a MoE layer's is taken to be its experts'
    stacked matrix, 1/ep of it under expert parallelism."""
    spread = [sharding.ep if i < len(comm) and comm[i].experts else 1
              for i in range(len(layers))]
    return max((c.largest_grad_bytes / k for c, k in zip(layers, spread, strict=True)),
               default=0.0)


def updated_bytes(layers: Sequence[LayerCost], comm: Sequence[LayerComm],
                  sharding: Sharding) -> float:
    """The trainable bytes one rank's optimizer updates: its FSDP shards, its experts."""
    experts = _spread(comm, sharding)
    trainable = sum(c.param_bytes - c.frozen_bytes for c in layers) - experts
    return trainable / sharding.fsdp + experts / sharding.ep


def _spread(comm: Sequence[LayerComm], sharding: Sharding) -> float:
    """The expert weights' bytes when expert parallelism spreads them (else 0: they are
    weights like the others, FSDP shards them)."""
    return float(sum(c.experts for c in comm)) if sharding.ep > 1 else 0.0


# -- seconds -------------------------------------------------------------------------------


def action_seconds(op: str, comm: Sequence[LayerComm], sharding: Sharding,
                   collectives: Collectives, tp_scale: float = 1.0,
                   fsdp_scale: float = 1.0, ep_scale: float = 1.0) -> float:
    """The collectives inside one ``op`` (F, I, W or B) of a stage of layers ``comm``; the
    tensor-parallel, FSDP and expert-parallel parts times ``tp_scale``, ``fsdp_scale`` and
    ``ep_scale`` (what a layout's calibration run measured over this prediction: the DTensor
    and FSDP2 work around each collective, the all-to-alls' bookkeeping and waits)."""
    total = 0.0
    if sharding.tp > 1:
        sizes = [b for c in comm for b in (c.tp_f if op == "F" else c.tp_i if op in "IB"
                                           else ())]
        total += tp_scale * sum(collectives.seconds("all_reduce", sharding.tp, b)
                                for b in sizes)
    if sharding.fsdp > 1 and sharding.reshard != "step":
        total += fsdp_scale * sum(collectives.seconds("all_gather", sharding.fsdp, u)
                                  for u in _units(comm, sharding.reshard))
    if sharding.ep > 1 and op in "FIB":
        total += ep_scale * sum(2 * collectives.seconds("all_to_all", sharding.ep, c.a2a)
                                for c in comm if c.a2a)
    return total


def reduction_seconds(layers: Sequence[LayerCost], comm: Sequence[LayerComm],
                      sharding: Sharding, collectives: Collectives) -> float:
    """One rank's collectives outside the schedule in a step (see the module docstring)."""
    experts = _spread(comm, sharding)
    total = _all_reduced(experts / sharding.ep, sharding.data // sharding.ep, collectives)
    if sharding.fsdp == 1:
        trainable = sum(c.param_bytes - c.frozen_bytes for c in layers) - experts
        return total + _all_reduced(trainable, sharding.dp, collectives)
    units = _units(comm, sharding.reshard)
    total += sum(collectives.seconds("reduce_scatter", sharding.fsdp, u) for u in units)
    total += sum(collectives.seconds("all_reduce", sharding.dp, u / sharding.fsdp)
                 for u in units)
    if sharding.reshard == "step":
        total += sum(collectives.seconds("all_gather", sharding.fsdp, u) for u in units)
    return total


def _all_reduced(nbytes: float, ranks: int, collectives: Collectives) -> float:
    """Gradients of ``nbytes`` all-reduced over ``ranks`` in buckets (GradReducer's)."""
    buckets = math.ceil(nbytes / BUCKET_BYTES)
    return sum(collectives.seconds("all_reduce", ranks, nbytes / buckets)
               for _ in range(buckets))


def _units(comm: Sequence[LayerComm], reshard: str) -> list[int]:
    """FSDP2's units over the layers: each layer whole, or each of its parts."""
    if reshard == "part":
        return [u for c in comm for u in c.units if u]
    return [s for c in comm if (s := sum(c.units))]


# -- measuring -----------------------------------------------------------------------------


def measure_collectives(sizes: Sequence[int], repeats: int = 3,
                        kinds: Sequence[str] = KINDS[:3]) -> Collectives:
    """Time each of ``kinds`` of collective over groups of each of ``sizes`` consecutive ranks
    (call on every rank of an initialised job at once; each size must divide the world;
    all-to-all only where a layout spreads experts). Every group
    runs at once, as a layout's would; this rank's medians are fitted."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    fitted: dict[str, tuple[float, float]] = {}
    for k in sorted(set(sizes)):
        if k <= 1 or world % k:
            continue
        groups = [dist.new_group(list(range(s, s + k))) for s in range(0, world, k)]
        group = groups[rank // k]
        for kind in kinds:
            times = [_timed(kind, n, k, group, repeats) for n in SIZES]
            per_byte = max(0.0, (times[1] - times[0]) / (SIZES[1] - SIZES[0]))
            fitted[f"{kind}/{k}"] = (max(0.0, times[0] - per_byte * SIZES[0]), per_byte)
    return Collectives(fitted)


def _timed(kind: str, nbytes: int, k: int, group: Any, repeats: int) -> float:
    """Median seconds of one collective of ``nbytes`` (whole tensor) over ``group``."""
    import torch as t
    import torch.distributed as d

    n = nbytes // 4 // k * k
    whole, piece, spare = t.ones(n), t.ones(n // k), t.ones(n)

    def run() -> None:
        if kind == "all_reduce":
            d.all_reduce(whole, group=group)
        elif kind == "all_to_all":
            d.all_to_all_single(spare, whole, group=group)
        elif kind == "all_gather":
            d.all_gather_single(whole, piece, group=group)
        else:
            d.reduce_scatter_single(piece, whole, group=group)

    run()  # warm-up
    times = []
    for _ in range(repeats):
        d.barrier(group=group)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
