"""Search: every layout of a job's GPUs that the flags leave open, predicted and ranked.

A flag given pins its dimension; every other is searched::

    tp    divisors of the GPUs per node that divide the heads and the key-value heads
    cp    1, 2, 4, 8, 16 dividing the sequence (context parallelism: a ring, or an all-to-all
          over heads, whose cp must divide each tp rank's heads: the trainer's, .trainers)
    pp    divisors of what is left, up to the layers
    dp x fsdp  what is left: all replicated (dp), all sharded (fsdp), or within a node
               sharded and replicated across (HSDP)
    ep    divisors of the experts that divide dp x fsdp (expert parallelism: predicted only)
    schedule, stages per rank   1f1b, interleaved-1f1b (v = 2), zb-h1, zbv (v = 2) where pp > 1
    micro-batch size            1, 2, 4, 8 dividing a replica's share of the batch
    recompute                   never, or where never does not fit: first selective, where
                                it saves memory (attention's scores without flash attention),
                                then the fewest of each stage's layers recomputed wholly that
                                fit (Megatron-LM's block method), then all of them

Context parallelism is searched from 8192 tokens a sequence up, 16 from 65536.

Every candidate is first predicted with a closed form of its pipeline (:func:`.cluster._rough`);
the best :data:`SIMULATED` of those, and the best of each shape (tp, pp, dp, fsdp, cp, ep), are
predicted again through the schedule simulator, and ranked by step time among those that fit
the memory limit, then the rest; the best :data:`PARTIAL` of those that recompute every layer
are tried with the fewest layers a stage recomputed that fit, and ranked again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from pipetrain.plan.cluster.job import Job, Layout, Prediction, predict, with_microbatches

__all__ = ["Pins", "search", "check_layout", "check_pins"]

SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))
RECOMPUTE = ("never", "selective", "op", "always")  # what --recompute accepts
"""``op`` is torchtitan's per-op policy (predicted only: pipetrain trains the others); the
search tries never, selective and always, and ``op`` where pinned."""
SIMULATED = 32
"""How many of the layouts a closed form ranks best are simulated and ranked again."""
PARTIAL = 8
"""How many of the best simulated layouts that recompute every layer are tried with the fewest
layers a stage recomputed that fit (:func:`_fewest_whole`)."""


@dataclass(frozen=True)
class Pins:
    """The layout choices the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    fsdp: int | None = None
    cp: int | None = None
    ep: int | None = None
    schedule: str | None = None
    stages_per_rank: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    recompute_layers: int | None = None
    """Of each stage's layers, how many are recomputed wholly (searched when --recompute is
    not given: see :func:`_fitting`)."""
    activation_limit: float = 0.0
    """zb-auto's stage-activations per rank (0: pp)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(job: Job, layout: Layout) -> None:
    """Raise ValueError, saying how to fix it, for a layout the job cannot take."""
    arch = job.arch
    if layout.gpus != job.gpus:
        raise ValueError(f"tp {layout.tp} x pp {layout.pp} x dp {layout.dp} x fsdp "
                         f"{layout.fsdp} x cp {layout.cp} = {layout.gpus} GPUs, not the "
                         f"{job.gpus} of --gpus: make the product {job.gpus}")
    if arch.heads % layout.tp or arch.kv_heads % layout.tp:
        raise ValueError(f"--tp {layout.tp} must divide the model's {arch.heads} attention "
                         f"heads and {arch.kv_heads} key-value heads")
    if layout.pp * layout.stages_per_rank > arch.layers:
        raise ValueError(f"pp {layout.pp} x {layout.stages_per_rank} stages per rank exceeds "
                         f"the model's {arch.layers} layers: lower --pp")
    if job.seq % layout.cp:
        raise ValueError(f"--cp {layout.cp} must divide the sequence of {job.seq} tokens")
    most = -(-arch.layers // (layout.pp * layout.stages_per_rank))
    if not 0 <= layout.recompute_layers < most:
        raise ValueError(f"--recompute-layers {layout.recompute_layers} must be 0 to "
                         f"{most - 1}, fewer than each stage's {most} layers (all of them "
                         f"is --recompute always)")
    _check_heads(job, layout.tp, layout.cp)
    if layout.ep > 1 and (not arch.moe or arch.experts % layout.ep
                          or (layout.dp * layout.fsdp) % layout.ep):
        raise ValueError(f"--ep {layout.ep} must divide the model's {arch.experts} experts "
                         f"and dp x fsdp = {layout.dp * layout.fsdp}")
    with_microbatches(job, layout)


def _check_heads(job: Job, tp: int, cp: int) -> None:
    """Context parallelism over heads (all-to-all) needs each tp rank's heads to divide."""
    heads = job.arch.heads // tp
    if cp > 1 and job.cp_exchange == "all-to-all" and heads % cp:
        raise ValueError(f"--cp {cp} exchanges heads for tokens (--cp-exchange all-to-all, "
                         f"the trainer's): the {heads} heads of each tp rank must divide by it; "
                         f"choose a cp that divides them, or --cp-exchange ring")


def _shapes(job: Job, pins: Pins) -> Iterator[Layout]:
    arch, node = job.arch, job.gpu.gpus_per_node
    tps = [pins.tp] if pins.tp else [t for t in _divisors(node)
                                     if arch.heads % t == 0 and arch.kv_heads % t == 0]
    cps = [pins.cp] if pins.cp else [c for c in (1, 2, 4, 8, 16) if job.seq % c == 0
                                     and (c == 1 or job.seq >= 8192)
                                     and (c < 16 or job.seq >= 65536)]
    for tp, cp in itertools.product(tps, cps):
        if job.gpus % (tp * cp):
            continue
        rest = job.gpus // (tp * cp)
        pps = [pins.pp] if pins.pp else [p for p in _divisors(rest) if p <= arch.layers]
        for pp in pps:
            if rest % pp:
                continue
            data = rest // pp
            for dp, fsdp in _data(data, tp * cp, node, pins):
                for ep in ([pins.ep] if pins.ep else
                           [e for e in _divisors(data) if arch.experts % e == 0]
                           if arch.moe else [1]):
                    yield Layout(tp=tp, pp=pp, dp=dp, fsdp=fsdp, cp=cp, ep=ep)


def _data(data: int, inner: int, node: int, pins: Pins) -> list[tuple[int, int]]:
    if pins.dp and pins.fsdp:
        return [(pins.dp, pins.fsdp)]
    if pins.dp:
        return [(pins.dp, data // pins.dp)] if data % pins.dp == 0 else []
    if pins.fsdp:
        return [(data // pins.fsdp, pins.fsdp)] if data % pins.fsdp == 0 else []
    within = max(1, min(data, node // inner)) if inner < node else 1
    options = {(data, 1), (1, data)}
    if 1 < within < data and data % within == 0:
        options.add((data // within, within))
    return sorted(options)


def _variants(job: Job, shape: Layout, pins: Pins) -> Iterator[Layout]:
    schedules = ([(pins.schedule, pins.stages_per_rank or (2 if pins.schedule in
                                                           ("interleaved-1f1b", "zbv") else 1))]
                 if pins.schedule else SCHEDULES if shape.pp > 1 else [("1f1b", 1)])
    replica = job.global_batch // (shape.dp * shape.fsdp)
    sizes = [pins.micro_batch_size] if pins.micro_batch_size else [
        b for b in (1, 2, 4, 8) if replica % b == 0]
    for (name, v), b in itertools.product(schedules, sizes):
        if pins.stages_per_rank and not pins.schedule:
            v = pins.stages_per_rank
        yield replace(shape, schedule=name, stages_per_rank=v, micro_batch_size=b,
                      recompute=pins.recompute or "never",
                      recompute_layers=pins.recompute_layers or 0,
                      activation_limit=pins.activation_limit)


def _fitting(job: Job, layout: Layout, pins: Pins, rough: bool = False,
             partial: bool = False) -> Prediction:
    """``layout``'s prediction; recomputed when it does not fit otherwise (unless pinned):
    selectively first where that saves memory (attention's s x s scores, without flash
    attention), then (``partial``) the fewest of each stage's layers wholly that fit, then
    all."""
    got = predict(job, layout, rough)
    if got.fits or pins.recompute or layout.recompute == "always":
        return got
    if not job.flash_attention and layout.recompute == "never":
        got = predict(job, replace(layout, recompute="selective"), rough)
        if got.fits:
            return got
    fewer = _fewest_whole(job, got.layout) if partial else None
    return fewer or predict(job, replace(layout, recompute="always", recompute_layers=0),
                              rough)


def _fewest_whole(job: Job, layout: Layout) -> Prediction | None:
    """``layout`` with the fewest of each stage's layers recomputed wholly that fits, fewer
    than all of them; None if none does. Memory falls as that number grows: a bisection, first
    through the closed form, which bounds it from below, then through the simulator."""
    most = -(-job.arch.layers // (layout.pp * layout.stages_per_rank)) - 1
    low = _fewest(1, most, lambda k: predict(job, replace(layout, recompute_layers=k),
                                             rough=True).fits)
    found: dict[int, Prediction] = {}

    def fits(k: int) -> bool:
        found[k] = predict(job, replace(layout, recompute_layers=k))
        return found[k].fits

    k = _fewest(low, most, fits)
    got = found.get(k) or predict(job, replace(layout, recompute_layers=k))
    return got if got.fits else None


def _fewest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The smallest k in [low, high] that ``fits`` (monotone: false, then true), else high."""
    while low < high:
        k = (low + high) // 2
        if fits(k):
            high = k
        else:
            low = k + 1
    return low


def check_pins(job: Job, pins: Pins) -> None:
    """Raise ValueError, saying how to fix it, for a pinned dimension no layout can take."""
    arch = job.arch
    if pins.tp and (arch.heads % pins.tp or arch.kv_heads % pins.tp):
        raise ValueError(f"--tp {pins.tp} must divide the model's {arch.heads} attention "
                         f"heads and {arch.kv_heads} key-value heads")
    if pins.recompute_layers and pins.recompute in (None, "always"):
        raise ValueError("--recompute-layers K recomputes K of each stage's layers wholly and "
                         "the rest as --recompute says: give --recompute never, selective "
                         "or op with it")
    if pins.pp and pins.pp * (pins.stages_per_rank or 1) > arch.layers:
        raise ValueError(f"--pp {pins.pp} exceeds the model's {arch.layers} layers: lower it")
    if pins.cp and job.seq % pins.cp:
        raise ValueError(f"--cp {pins.cp} must divide the sequence of {job.seq} tokens")
    if pins.cp:
        _check_heads(job, pins.tp or 1, pins.cp)
    if pins.ep and pins.ep > 1 and (not arch.moe or arch.experts % pins.ep):
        raise ValueError(f"--ep {pins.ep} must divide the model's experts ({arch.experts})")
    fixed = 1
    for name in ("tp", "pp", "dp", "fsdp", "cp"):
        fixed *= getattr(pins, name) or 1
    if job.gpus % fixed:
        raise ValueError(f"the pinned dimensions multiply to {fixed}, which does not divide "
                         f"the {job.gpus} GPUs of --gpus")


def search(job: Job, pins: Pins, limit: int = 0) -> list[Prediction]:
    """Every layout the pins leave open, predicted; fitting ones first, fastest first."""
    check_pins(job, pins)
    rough: list[Prediction] = []
    errors: list[str] = []
    for shape in _shapes(job, pins):
        for layout in _variants(job, shape, pins):
            try:
                check_layout(job, layout)
                rough.append(_fitting(job, with_microbatches(job, layout), pins, rough=True))
            except ValueError as e:
                errors.append(str(e))
    if not rough:
        raise ValueError("no layout of these GPUs is possible"
                         + (f": {errors[0]}" if errors else ": check --gpus and the pins"))
    rough.sort(key=lambda p: (not p.fits, p.step_s))
    chosen = {p.layout: p for p in rough[:SIMULATED]}
    for p in rough:  # and the roughly best of each shape: the closed form ranks shapes worst
        chosen.setdefault(replace(p.layout, schedule="", stages_per_rank=0,
                                  micro_batch_size=0, microbatches=0, recompute="",
                                  recompute_layers=0), p)
    unique = {id(p): p for p in chosen.values()}.values()
    found = [_fitting(job, p.layout, pins) for p in unique]
    found.sort(key=lambda p: (not p.fits, p.step_s))
    for i, p in enumerate(found[:PARTIAL]):  # the best few recomputed wholly: fewer layers?
        if p.layout.recompute == "always" and not pins.recompute:
            found[i] = _fitting(job, replace(p.layout, recompute="never"), pins, partial=True)
    found.sort(key=lambda p: (not p.fits, p.step_s))
    return found[:limit] if limit else found
