"""Job: a training job's step time, throughput and memory on GPUs it does not run on.

For one layout (tp x pp x dp x fsdp x cp x ep, a schedule, micro-batches), each pipeline stage's
F, I and W come from :mod:`.layer_cost` (matrix multiplies at the measured efficiency of their
shapes, flash attention, memory-bound work, the collectives on the critical path); the
schedule's own simulator (:func:`pipetrain.schedules.simulator.simulate`) lays them out, with each
pipeline hop's send as the delay between ranks; then what follows the pipeline::

    step = pipeline makespan                      (the simulator, this schedule's action lists;
                                                   FSDP's per-layer gathers and scatters in each
                                                   F and backward where they outlast the compute
                                                   they overlap)
         + gradient reduction over dp x fsdp x cp (overlapped with the backward but its last
                                                   bucket: one stage-layer's gradients)
         + FSDP's first all-gather                (later ones prefetched under compute)
         + the optimizer step                     (memory-bound: every state byte read, written)

    peak bytes = the busiest rank's weights (its stages' layers and one vocabulary matrix),
                 gradients, AdamW states (sharded by fsdp x cp; the optimizer's by dp x fsdp x
                 cp when distributed) + the stage-activations the simulator finds alive at
                 once x what one keeps + the last stage's fp32 logits + (fp8) the running
                 layer's fp8 weights + a fixed 2 GiB for CUDA's and NCCL's own buffers

Ranks are placed tp innermost, then cp, dp and fsdp, pp outermost (Megatron-LM's order): a
group whose ranks all fit in one node talks over NVLink, any other over the NIC.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Any

from pipetrain.plan.cluster import fp8
from pipetrain.plan.cluster.arch import Arch
from pipetrain.plan.cluster.collectives import Fabric, Link
from pipetrain.plan.cluster.hardware import Gpu
from pipetrain.plan.cluster.kernels import Kernels
from pipetrain.plan.cluster.layer_cost import BF16, LayerCost, Shard, head_cost, layer_cost
from pipetrain.schedules.generators import Target, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, Simulation, simulate
from pipetrain.schedules.validate import validate

__all__ = ["Job", "Layout", "Prediction", "predict", "simulation"]

RESERVED_BYTES = 2 * 2**30
"""CUDA's context, NCCL's buffers and the allocator's slack per GPU (an assumption)."""
MAX_SIMULATED = 3_000  # actions; a longer schedule is extrapolated from two shorter ones


@dataclass(frozen=True)
class Layout:
    """How a job is cut over its GPUs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    fsdp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    recompute: str = "never"
    activation_limit: float = 0.0
    """zb-auto's limit on the stage-activations one rank holds (0: pp, ZB-1p's; 2 pp is
    ZB-2p's); ignored by every other schedule."""
    recompute_layers: int = 0
    """Of each stage's layers, this many recomputed wholly and the rest as ``recompute`` says
    (Megatron-LM's ``--recompute-method block --recompute-num-layers``); 0: all as
    ``recompute``."""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.fsdp * self.cp


@dataclass(frozen=True)
class Job:
    """What is trained, on what: the model, the GPUs, the sequence and the batch."""

    arch: Arch
    gpu: Gpu
    gpus: int
    seq: int
    global_batch: int
    """Sequences per step."""
    precision: str = "bf16"
    """"bf16", or "fp8": the layers' matrix multiplies in fp8 (MFU stays over the bf16 peak)."""
    distributed_optimizer: bool = True
    """AdamW's states sharded over the data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: bool = True
    grad_bytes: int = 4
    """Bytes per gradient element as reduced (fp32 main gradients)."""
    state_bytes: int = 12
    """AdamW's bytes a parameter: fp32 weights and two fp32 moments (12), or all in bf16 (6)."""
    memory_limit: float = 0.0
    """Bytes per GPU; 0: the GPU's own."""
    flash_attention: bool = True
    """False: attention's s x s scores in memory (trainers before 2022)."""
    attention_dropout: bool = True
    """Without flash attention: a dropout over the scores (Megatron-LM's default, 0.1)."""
    sequence_parallel: bool = True
    """Norms and residuals split by tp too (Korthikanti et al. 2022); False: replicated."""
    cp_exchange: str = "ring"
    """How cp ranks attend: "ring" or "all-to-all" (:mod:`.trainers`)."""

    def __post_init__(self) -> None:
        if self.precision == "fp8" and self.gpu.fp8_flops is None:
            raise ValueError(f"--precision fp8 needs fp8 tensor cores, which the "
                             f"{self.gpu.name} does not have: use bf16")


@dataclass(frozen=True)
class Prediction:
    """One layout's predicted step, throughput and memory."""

    layout: Layout
    step_s: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    peak_bytes_per_gpu: float
    fits: bool
    parts: dict[str, float]
    """Seconds of the step by cause: pipeline, grad_reduce, fsdp_gather, optimizer; and within
    the pipeline, the busiest rank's compute and communication."""

    def to_dict(self) -> dict[str, Any]:
        layout = asdict(self.layout)
        for key in ("activation_limit", "recompute_layers"):  # the contract's keys otherwise
            if not layout[key]:
                del layout[key]
        return {"layout": layout, "step_s": self.step_s,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu, "mfu": self.mfu,
                "peak_bytes_per_gpu": self.peak_bytes_per_gpu, "fits": self.fits,
                "parts": dict(self.parts)}


def predict(job: Job, layout: Layout, rough: bool = False) -> Prediction:
    """The step of ``job`` cut as ``layout`` (see the module docstring). ``rough``: the
    pipeline's makespan and peak from a closed form instead of the simulator (:func:`_rough`),
    for a search to choose what to simulate."""
    arch, gpu = job.arch, job.gpu
    kernels, fabric = Kernels.of(gpu), Fabric.of(gpu)
    per_stage, layers, head, costs, hop = _pipeline(job, layout)
    n_stages = len(per_stage)
    makespan, peak_units = (_rough(layout.schedule, layout.pp, layout.microbatches,
                                   layout.stages_per_rank, costs, hop) if rough else
                            _timeline(layout, costs, hop))
    params_here = _params_here(arch, layout, per_stage)
    ranks, shards = _grad_ranks(layout), _shards(layout)
    reduce_link, shard_link = fabric.group(ranks, layout.tp), _shard_link(fabric, layout)
    grads = params_here * job.grad_bytes
    weights = params_here * BF16  # gathered after a sharded update
    if layout.fsdp > 1:  # scattered over fsdp x cp (per micro-batch, or once a step when
        # pipelined: :func:`_sharded`); then the replicas all-reduce their shards
        reduce = fabric.group(layout.dp, layout.tp * layout.cp).all_reduce(
            grads / shards, layout.dp)
        if layout.pp > 1:
            reduce += shard_link.reduce_scatter(grads, shards)
    elif job.distributed_optimizer:
        reduce = reduce_link.reduce_scatter(grads, ranks) + reduce_link.all_gather(weights, ranks)
    else:
        reduce = reduce_link.all_reduce(grads, ranks)
    exposed = reduce / max(per_stage) if job.overlap_grad_reduce else reduce
    first = (_layer_params(arch, layout) + arch.vocab * arch.hidden / layout.tp) * BF16
    gather = (shard_link.all_gather(first, shards)  # the embedding's and the first layer's,
              if layout.fsdp > 1 else 0.0)  # before anything overlaps them
    optimizer = kernels.memory(params_here / _optimizer_shards(job, layout)  # states read and
                               * (job.state_bytes * 2 + job.grad_bytes * 2))  # written, grads
    step = makespan + exposed + gather + optimizer
    model = arch.model_flops(job.seq) * job.global_batch * job.seq
    hardware = _hardware_flops(arch, job.seq, layout, per_stage) * job.global_batch * job.seq
    peak = _peak(job, layout, params_here, peak_units, per_stage, layers, head)
    limit = job.memory_limit or gpu.hbm_bytes
    busy = (sum(costs[op][s] for op in "FIW" for s in range(n_stages)) / layout.pp
            * layout.microbatches)
    return Prediction(
        layout, step, job.global_batch * job.seq / step / job.gpus,
        model / step / job.gpus / 1e12, hardware / step / job.gpus / 1e12,
        model / step / job.gpus / gpu.bf16_flops, peak, peak <= limit,
        {"pipeline": makespan, "grad_reduce": exposed, "fsdp_gather": gather,
         "optimizer": optimizer, "busy_per_rank": busy, "bubble": makespan - busy})


def _pipeline(job: Job, layout: Layout) -> tuple[
        list[int], list[LayerCost], LayerCost, dict[str, tuple[float, ...]], float]:
    """Layers per stage, each stage's layers' costs (a stage's first ``recompute_layers``
    recomputed wholly), the head's cost, every stage's F, I, W and B, and one pipeline hop's
    delay."""
    arch, fabric = job.arch, Fabric.of(job.gpu)
    kernels = Kernels.of(job.gpu)
    shard = Shard(layout.tp, layout.cp, layout.ep,
                  fabric.group(layout.tp, 1), fabric.group(layout.cp, layout.tp),
                  fabric.group(layout.ep, layout.tp * layout.cp),
                  sequence_parallel=job.sequence_parallel, fp8=job.precision == "fp8",
                  flash=job.flash_attention, attention_dropout=job.attention_dropout,
                  cp_exchange=job.cp_exchange)
    def cost(recompute: str) -> LayerCost:
        return _sharded(layer_cost(arch, kernels, layout.micro_batch_size, job.seq, shard,
                                   recompute), job, layout, fabric)

    layer = cost(layout.recompute)
    whole = cost("always") if layout.recompute_layers else layer
    head = head_cost(arch, kernels, layout.micro_batch_size, job.seq, shard)
    per_stage = _layers_per_stage(arch.layers, layout.pp * layout.stages_per_rank)
    layers = [_blend(whole, layer, min(layout.recompute_layers, n), n) for n in per_stage]
    tokens = layout.micro_batch_size * job.seq / layout.cp
    hop = fabric.hop(layout.tp * layout.cp * layout.dp * layout.fsdp).send(
        tokens * arch.hidden * BF16 / layout.tp)
    return per_stage, layers, head, _stage_costs(per_stage, layers, head), hop


def _blend(whole: LayerCost, rest: LayerCost, k: int, n: int) -> LayerCost:
    """A stage's average layer when ``k`` of its ``n`` layers are recomputed wholly."""
    if k == 0 or n == 0:
        return rest
    mix = [(getattr(whole, f.name) * k + getattr(rest, f.name) * (n - k)) / n
           for f in fields(LayerCost)]
    return LayerCost(*mix)


def _hardware_flops(arch: Arch, seq: int, layout: Layout, per_stage: list[int]) -> float:
    """FLOPs per token the devices run under ``layout``'s recomputation (of each stage's
    layers, ``recompute_layers`` wholly)."""
    base = arch.hardware_flops(seq, layout.recompute)
    whole = sum(min(layout.recompute_layers, n) for n in per_stage)
    if not whole:
        return base
    return base + (arch.hardware_flops(seq, "always") - base) * whole / sum(per_stage)


def _params_here(arch: Arch, layout: Layout, per_stage: list[int]) -> float:
    """The parameters of the busiest rank: its ``stages_per_rank`` stages of the most layers,
    and one vocabulary matrix (the embedding on the first rank, the output projection on the
    last; both on one rank without a pipeline, unless they are tied)."""
    vocab = arch.vocab * arch.hidden / layout.tp * (2 if layout.pp == 1 and not arch.tied
                                                    else 1)
    return max(per_stage) * layout.stages_per_rank * _layer_params(arch, layout) + vocab


def _grad_ranks(layout: Layout) -> int:
    """The ranks a stage's gradients are averaged over: the data-parallel ones and the cp
    ranks that hold the other slices of the same sequences (every trainer reduces over both)."""
    return layout.dp * layout.fsdp * layout.cp


def _shards(layout: Layout) -> int:
    """The ranks FSDP shards a stage's weights over: ``fsdp x cp`` (torchtitan's and
    pipetrain's ``dp_shard_cp``), 1 without FSDP."""
    return layout.fsdp * layout.cp if layout.fsdp > 1 else 1


def _optimizer_shards(job: Job, layout: Layout) -> int:
    """The ranks AdamW's states are sharded over: FSDP's, or every rank the gradients are
    averaged over under a distributed optimizer (Megatron-core's spans dp x cp)."""
    return _grad_ranks(layout) if job.distributed_optimizer else _shards(layout)


def _shard_link(fabric: Fabric, layout: Layout) -> Link:
    """The link of FSDP's group: its cp ranks sit next to each other (stride tp), its fsdp
    ranks beyond the cp and dp ones (tp innermost, then cp, dp and fsdp)."""
    if layout.cp > 1 and layout.dp == 1:
        return fabric.group(layout.fsdp * layout.cp, layout.tp)
    return fabric.group(layout.fsdp * layout.cp, layout.tp * layout.cp * layout.dp)


def _sharded(layer: LayerCost, job: Job, layout: Layout, fabric: Fabric) -> LayerCost:
    """``layer`` under FSDP without a pipeline (resharded after each layer's forward, as FSDP2
    by default): its parameters all-gathered before its F and again before its backward, its
    gradients reduce-scattered after, each micro-batch, over the fsdp group; each overlaps the
    compute of the layer before it, so only what exceeds that compute is added. A pipelined
    stage keeps its parameters gathered and its gradients whole across the step's micro-batches
    (torch's pipelining under FSDP2; Llama 3 kept its parameters gathered too, Dubey et al.
    2024 section 3.3.2): one gather and one reduce-scatter a step, and the whole stage's
    weights and gradients in memory."""
    if layout.fsdp <= 1 or layout.pp > 1:  # pipelined: gathered once a step (_peak)
        return layer
    link, shards = _shard_link(fabric, layout), _shards(layout)
    size = _layer_params(job.arch, layout) * BF16
    gather = link.all_gather(size, shards)
    scatter = link.reduce_scatter(size / BF16 * job.grad_bytes, shards)
    f = max(0.0, gather - layer.f)
    b = max(0.0, gather + scatter - layer.i - layer.w)
    return replace(layer, f=layer.f + f, i=layer.i + b, f_comm=layer.f_comm + f,
                   i_comm=layer.i_comm + b)


def simulation(job: Job, layout: Layout) -> Simulation:
    """The simulated pipeline of ``layout`` to draw: at its own micro-batches when short
    enough to simulate, else at the fewest that show its steady state (2 pp)."""
    _, _, _, costs, hop = _pipeline(job, layout)
    m = layout.microbatches
    if layout.pp * m * layout.stages_per_rank * 3 > MAX_SIMULATED:
        m = 2 * layout.pp
    return _simulate(layout.schedule, layout.pp, layout.stages_per_rank, m,
                     _frozen(costs), hop, layout.activation_limit)


def _layers_per_stage(layers: int, n_stages: int) -> list[int]:
    if n_stages > layers:
        raise ValueError(f"{n_stages} pipeline stages (pp x stages per rank) exceed the "
                         f"model's {layers} layers: lower --pp or --stages-per-rank")
    base, extra = divmod(layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def _layer_params(arch: Arch, layout: Layout) -> float:
    """One layer's parameters on one GPU: matrices split by tp, experts by ep too."""
    if not arch.moe:
        return arch.layer_params() / layout.tp
    experts = arch.experts * arch.mlp_params(arch.ffn)
    return (arch.layer_params() - experts) / layout.tp + experts / layout.tp / layout.ep


def _stage_costs(per_stage: list[int], layers: list[LayerCost], head: LayerCost
                 ) -> dict[str, tuple[float, ...]]:
    last = len(per_stage) - 1
    out: dict[str, tuple[float, ...]] = {}
    for op in "fiw":
        out[op.upper()] = tuple(n * getattr(layer, op) + (getattr(head, op) if s == last
                                                          else 0.0)
                                for s, (n, layer) in enumerate(zip(per_stage, layers)))
    out["B"] = tuple(i + w for i, w in zip(out["I"], out["W"]))
    return out


def _rough(name: str, pp: int, m: int, v: int, costs: dict[str, tuple[float, ...]],
           hop: float) -> tuple[float, float]:
    """A closed form of the makespan and peak: the busiest rank's work over all micro-batches
    plus one fill and drain of the pipeline (a micro-batch's F and backward through every
    other rank, over v for interleaved placements; zero-bubble schedules fill the drain with
    W), and pp x v stage-activations alive (m x v for GPipe)."""
    per_rank = [sum(costs[op][s] for op in "FIW" for s in range(r, pp * v, pp))
                for r in range(pp)]
    one = (sum(costs["F"]) + sum(costs["B"])) / (pp * v)  # a stage's F and B, on average
    if name.startswith(("zb", "dualpipe", "interleaved-zb")):
        one -= sum(costs["W"]) / (pp * v)
    fill = (pp - 1) * (one / v + 2 * hop)
    return max(per_rank) * m + fill, float(min(m, pp) * v if name != "gpipe" else m * v)


Frozen = tuple[tuple[str, tuple[float, ...]], ...]


def _frozen(costs: dict[str, tuple[float, ...]]) -> Frozen:
    """``costs`` as a key: rounded, sorted by op."""
    return tuple((op, tuple(round(x, 12) for x in c)) for op, c in sorted(costs.items()))


def _timeline(layout: Layout, costs: dict[str, tuple[float, ...]], hop: float
              ) -> tuple[float, float]:
    """The schedule's makespan and its largest count of stage-activations alive on one rank;
    a schedule too long to simulate is extrapolated linearly in m from two shorter ones
    (both quantities are affine in m once m is a few times pp)."""
    name, pp, v, m = layout.schedule, layout.pp, layout.stages_per_rank, layout.microbatches
    key = (_frozen(costs), round(hop, 12), layout.activation_limit)
    if pp * m * v * 3 <= MAX_SIMULATED:
        return _simulated(name, pp, v, m, *key)
    a = 2 * pp
    b = 3 * pp
    ta, ua = _simulated(name, pp, v, a, *key)
    tb, ub = _simulated(name, pp, v, b, *key)
    return ta + (tb - ta) * (m - a) / (b - a), ua + (ub - ua) * (m - a) / (b - a)


@lru_cache(maxsize=4096)
def _simulated(name: str, pp: int, v: int, m: int, costs: Frozen, hop: float, limit: float
               ) -> tuple[float, float]:
    sim = _simulate(name, pp, v, m, costs, hop, limit)
    return sim.makespan, max(sim.peak_activations)


def _simulate(name: str, pp: int, v: int, m: int, costs: Frozen, hop: float, limit: float
              ) -> Simulation:
    schedule = _schedule(name, pp, m, v, costs, hop, limit)
    split = schedule.split_backward
    c = dict(costs)
    return simulate(schedule, Costs(F=c["F"], I=c["I"] if split else None,
                                    W=c["W"] if split else None, B=None if split else c["B"]),
                    comm=hop, validated=True)


@lru_cache(maxsize=256)
def _schedule(name: str, pp: int, m: int, v: int, costs: Frozen, hop: float, limit: float
              ) -> Schedule:
    """The schedule, generated and validated once for every layout that simulates it;
    zb-auto searched for these stage costs, this hop and ``limit`` stage-activations (0: pp)."""
    if name == "zb-auto":
        c = dict(costs)
        target = Target(memory_limit=limit or None, costs=Costs(F=c["F"], I=c["I"], W=c["W"]),
                        comm=hop)
        schedule = make_schedule(name, pp, m, target=target)
    else:
        schedule = make_schedule(name, pp, m, stages_per_rank=v) if v > 1 else \
            make_schedule(name, pp, m)
    validate(schedule)
    return schedule


def _peak(job: Job, layout: Layout, params_here: float, units: float, per_stage: list[int],
          layers: list[LayerCost], head: LayerCost) -> float:
    whole = layout.pp > 1 and layout.fsdp > 1  # gathered for the step: see _sharded
    state = params_here * ((BF16 + job.grad_bytes) / (1 if whole else _shards(layout))
                           + job.state_bytes / _optimizer_shards(job, layout))
    activations = units * max(n * layer.kept for n, layer in zip(per_stage, layers))
    running = _layer_params(job.arch, layout) * fp8.WEIGHT_BYTES if job.precision == "fp8" \
        else 0.0
    return state + activations + head.kept + running + RESERVED_BYTES


def with_microbatches(job: Job, layout: Layout) -> Layout:
    """``layout`` with as many micro-batches as the global batch gives each replica."""
    per_replica = job.global_batch / (layout.dp * layout.fsdp)
    m = per_replica / layout.micro_batch_size
    if m != int(m) or m < 1:
        raise ValueError(f"a global batch of {job.global_batch} sequences does not split into "
                         f"{layout.dp * layout.fsdp} replicas of micro-batches of "
                         f"{layout.micro_batch_size}: choose a batch divisible by "
                         f"{layout.dp * layout.fsdp * layout.micro_batch_size}")
    return replace(layout, microbatches=int(m))

