"""Planner: the fastest pipeline layout whose predicted peak memory fits every rank.

A layout is a schedule, its stages per rank, the micro-batches per step, a balance (layers per
stage) and a recomputation policy. For each one the planner predicts

    step time   simulate(schedule) with per-stage costs summed from the profiled layers of a
                micro-batch of that size, times the measured/profiled ratio of each op in a
                calibration run, plus a fitted cost per action (the runtime's own), plus the
                calibrated hop delay and the step's time outside the schedule (gradient
                norm, optimizer); ranks that share fewer cores than they are (CPU
                processes) share them in the simulation too. An asynchronous schedule
                (``pipedream-2bw``, offered only when asked for: :data:`ASYNCHRONOUS`) takes
                its steady-state period instead of a makespan, and a second weight version
                on each stage that keeps two
    peak bytes  per rank: the stages' parameters, gradients and AdamW moments (4 x their
                trainable bytes, + frozen bytes; sharded and gathered as
                :mod:`pipetrain.plan.shardcost` says under FSDP), plus the larger of
                - the backward's: the most activation bytes alive at once in the simulated
                  timeline (F holds its stage's input and activations of one micro-batch; I
                  keeps the gradients W needs; W or B frees them), plus one micro-batch's
                  working memory of the rank's largest stage during its backward, plus the
                  gradient of the rank's largest weight, made whole before it is added to
                  ``.grad``;
                - the optimizer step's: two temporaries the size of the largest weight
                  (torch's per-tensor AdamW, its CPU default), or one the size of all trainable
                  weights (its foreach kernels, the CUDA default)

With ``recompute="always"`` a stage keeps only its input between F and its backward, and the
backward first runs the forward again (its I, or B, costs one more F); what it rebuilds is
alive from the start of B until its end, or from the start of I until W ends.

Each pipeline rank may be several processes (:class:`~pipetrain.plan.shardcost.Sharding`: dp
replicas, FSDP shards, tensor-parallel ranks): their collectives add to the actions and the
step (:mod:`pipetrain.plan.shardcost`), a tensor-parallel layout is profiled as one rank's share of
each layer, and processes that share fewer cores than they are share them in the simulation
(``cores / processes per pipeline rank`` for each pipeline). Candidates
that do not fit the memory limit are kept but ranked after those that do; the rest go fastest
first, except that among those predicted within :data:`MARGIN` of the fastest, the one with
the fewest actions per rank goes first. Everything here is pure: the measurements come in as
:class:`Profiled` and :class:`Scale`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from pipetrain.plan.shardcost import (
    Collectives,
    LayerComm,
    Sharding,
    action_seconds,
    largest_grad,
    reduction_seconds,
    state_bytes,
    step_temporaries,
    updated_bytes,
)
from pipetrain.schedules.generators import REGISTRY, Target, _load_builtin, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, Simulation, peak_units, simulate
from pipetrain.schedules.steady_state import steady_state
from pipetrain.split.balance import plan_balance
from pipetrain.split.partition import stage_bounds
from pipetrain.split.profile import LayerCost

__all__ = ["Profiled", "Scale", "Candidate", "SCHEDULES", "ASYNCHRONOUS", "RECOMPUTE", "MARGIN",
           "search",
           "ranked", "microbatch_choices", "actions_per_rank", "stage_bytes"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2",
             "interleaved-zb", "zbv", "v-half", "v-min", "dualpipev", "zb-auto")
ASYNCHRONOUS = ("pipedream-2bw",)
"""Considered only when the user allows a delayed update (``pipetrain plan --allow-async``)."""
RECOMPUTE = ("never", "always")
MARGIN = 0.03
ONE = Sharding()
"""One process per pipeline rank."""
"""Predicted steps this close are a tie: the predictions' error on the machine that measured
them (``benchmarks/plan_accuracy.py``) is a few percent, and grows with the actions per step,
whose runtime cost is the least certain term; a tie goes to the layout with fewer actions."""


@dataclass(frozen=True)
class Profiled:
    """The model's layers measured on one micro-batch of ``rows`` sequences."""

    rows: int
    layers: tuple[LayerCost, ...]
    input_bytes: tuple[int, ...]
    """Per layer, the bytes of its input (what a recomputed stage keeps, for its first layer)."""
    comm: tuple[LayerComm, ...] = ()
    """Per layer, its FSDP units and tensor-parallel traffic; empty: one unit per layer and
    no tensor parallelism."""
    tp: int = 1
    """The layers are one of this many tensor-parallel ranks' shares."""

    def comms(self) -> tuple[LayerComm, ...]:
        return self.comm or tuple(LayerComm(units=(c.param_bytes,)) for c in self.layers)


@dataclass(frozen=True)
class Scale:
    """Measured over profiled time per op in a calibration run, and the step's other costs."""

    f: float = 1.0
    i: float = 1.0
    w: float = 1.0
    b: float = 1.0
    """A fused backward's time over the profiled I + W."""
    comm: float = 0.0
    """Seconds from a message's send to its use on an idle rank (the calibrated hop)."""
    overhead: float = 0.0
    """Seconds of a step outside the schedule's actions and their reductions (gradient norm,
    optimizer step), for ``overhead_bytes``."""
    overhead_bytes: float = 0.0
    """The trainable bytes the busiest rank's optimizer updated in ``overhead``; a layout
    updating fewer (sharded, split) takes that share of it. 0: ``overhead`` as it is."""
    gap: float = 0.0
    """Seconds every action costs beyond its op's measured span: the runtime's dispatch and
    message bookkeeping between actions, which grows with the actions per step (more
    micro-batches, more stages per rank)."""
    replay: float = 1.0
    """What recomputation adds to a backward, over the profiled F of the same layers (the
    replay, and the saved-tensor hooks' cost in F)."""
    cores: float | None = None
    """The cores all the job's processes share when fewer than they are (CPU processes; the
    simulation then shares a pipeline's part of them, :mod:`pipetrain.schedules.shared_cores`);
    None: a
    device each."""
    tp_talk: float = 1.0
    fsdp_talk: float = 1.0
    """Measured over predicted seconds of tensor parallel's and FSDP's collectives in their
    calibration runs (they include the DTensor and FSDP2 work around each)."""
    ep_talk: float = 1.0
    """The same for expert parallel's all-to-alls (they include the split sizes' exchange,
    reading them back, and waiting for the partner to arrive)."""
    foreach: bool = False
    """AdamW steps with torch's foreach kernels (its default on CUDA), whose temporaries are
    the size of all the weights they update at once, not two of the largest one's."""


@dataclass(frozen=True)
class Candidate:
    """One layout and what the planner predicts for it."""

    schedule: str
    stages_per_rank: int
    microbatches: int
    balance: tuple[int, ...]
    recompute: str
    predicted_step_s: float
    predicted_peak_bytes: tuple[int, ...]
    fits: bool
    simulation: Simulation = field(compare=False, repr=False)
    sharding: Sharding = ONE

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; a searched schedule (zb-auto) adds its action lists as
        ``schedule_text``, which ``pipetrain train --schedule FILE`` runs as they are."""
        found = {"schedule_text": self.simulation.schedule.to_text()
                 } if REGISTRY[self.schedule].search is not None else {}
        return {"schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "microbatches": self.microbatches, "balance": list(self.balance),
                "recompute": self.recompute, "predicted_step_s": self.predicted_step_s,
                "predicted_peak_bytes": list(self.predicted_peak_bytes), "fits": self.fits,
                "pp": self.simulation.schedule.n_ranks, **self.sharding.to_dict(), **found}


def microbatch_choices(rows_per_replica: int, p: int, most: int = 4) -> list[int]:
    """Micro-batch counts that split the replica's rows evenly: from p/2 up, the ``most``
    smallest (more micro-batches shrink the bubble but cost per-action overhead)."""
    counts = [m for m in range(max(1, p // 2), rows_per_replica + 1) if rows_per_replica % m == 0]
    return counts[:most] or [rows_per_replica]


def search(profiles: Sequence[Profiled], p: int, rows_per_replica: int, memory_limit: float,
           scale: Scale, *, schedules: Iterable[str] = SCHEDULES,
           recompute: Iterable[str] = RECOMPUTE, sharding: Sharding = ONE,
           collectives: Collectives | None = None) -> list[Candidate]:
    """Every layout over ``profiles`` (one per micro-batch size) on ``p`` pipeline ranks, each
    ``sharding``'s processes, ranked (:func:`ranked`). ``rows_per_replica``: the rows each
    data-parallel rank trains on per step. ``shared_ends``: the first and last layer share a
    weight (a tied embedding and head), which FSDP cannot shard on one rank: a schedule that
    puts both ends on one rank (a V) is left out under FSDP.

    Raises:
        ValueError: when no profile matches a micro-batch count of ``rows_per_replica``.
    """
    _load_builtin()
    by_rows = {prof.rows: prof for prof in profiles}
    found: dict[tuple[Any, ...], Candidate] = {}
    context = _Context(scale, sharding, collectives or Collectives.default())
    for prof in by_rows.values():
        if rows_per_replica % prof.rows:
            raise ValueError(f"a profile of {prof.rows} rows does not split "
                             f"{rows_per_replica} rows into equal micro-batches")
        m = rows_per_replica // prof.rows
        for name in schedules:
            for policy in recompute:
                for cand in _layouts(prof, name, p, m, policy, memory_limit, context):
                    key = (cand.schedule, cand.microbatches, cand.balance, cand.recompute)
                    found.setdefault(key, cand)
    return ranked(found.values())


def ranked(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Fitting layouts first, fastest first (then the lowest peak), except that among those
    predicted within :data:`MARGIN` of the fastest, the one with the fewest actions per rank
    goes first (then the fastest of those)."""
    order = sorted(candidates, key=lambda c: (not c.fits, c.predicted_step_s,
                                              max(c.predicted_peak_bytes)))
    if not order or not order[0].fits:
        return order
    bound = order[0].predicted_step_s * (1 + MARGIN)
    near = [c for c in order if c.fits and c.predicted_step_s <= bound]
    best = min(near, key=lambda c: (actions_per_rank(c.simulation.schedule),
                                    c.predicted_step_s))
    return [best, *(c for c in order if c is not best)]


def actions_per_rank(schedule: Schedule) -> int:
    """The most actions any rank runs in a step."""
    return max(len(actions) for actions in schedule.actions)


@dataclass(frozen=True)
class _Context:
    """What every layout of one search shares."""

    scale: Scale
    sharding: Sharding = ONE
    collectives: Collectives = Collectives()


def _layouts(prof: Profiled, name: str, p: int, m: int, policy: str, limit: float,
             ctx: _Context) -> list[Candidate]:
    v = REGISTRY[name].default_stages_per_rank
    if len(prof.layers) < p * v:
        return []
    try:
        schedule = make_schedule(name, p, m, v)
    except ValueError:
        return []  # the schedule's constraints exclude (p, m)
    layers = _with_policy(prof, policy)
    stand_ins = [nn.Identity() for _ in layers]  # measured costs given: nothing is profiled
    out = []
    for mode in ("time", "memory"):
        balance = plan_balance(stand_ins, schedule, mode, layer_costs=layers).balance
        out.append(evaluate(prof, schedule, balance, policy, limit, ctx.scale, ctx.sharding,
                            ctx.collectives) if name != "zb-auto"
                   else _fitted_zb_auto(prof, balance, policy, p, m, limit, ctx))
    return out


def _with_policy(prof: Profiled, policy: str) -> tuple[LayerCost, ...]:
    """The layers' costs as the balance sees them: recomputation moves the F into I."""
    if policy == "never":
        return prof.layers
    return tuple(replace(c, i=c.i + c.f, activation_bytes=prof.input_bytes[j])
                 for j, c in enumerate(prof.layers))


def evaluate(prof: Profiled, schedule: Schedule, balance: Sequence[int], policy: str,
             limit: float, scale: Scale, sharding: Sharding = ONE,
             collectives: Collectives | None = None) -> Candidate:
    """The predicted step time and per-rank peak bytes of one layout."""
    collectives = collectives or Collectives.default()
    bounds = stage_bounds(balance)
    cores = None if scale.cores is None else scale.cores / sharding.replicas
    costs = _costs(prof, bounds, policy, scale, sharding, collectives)
    shown = schedule if schedule.update is None else schedule.unroll(2)
    sim = simulate(shown, costs, scale.comm, cores=cores)
    step = sim.makespan
    peaks_ = rank_peaks(prof, shown, bounds, policy, sim, scale.foreach, sharding)
    if schedule.update is not None:  # asynchronous: a step is the steady period, and a stage
        steady = steady_state(schedule, costs, scale.comm)  # keeps a second weight version
        shared = 1.0 if cores is None else sim.makespan / max(
            simulate(shown, costs, scale.comm).makespan, 1e-12)  # what sharing cores costs
        step = steady.period * shared
        peaks_ = [x + (versions - 1) * sum(c.param_bytes - c.frozen_bytes
                                           for s in schedule.stages_of(r)
                                           for c in prof.layers[slice(*bounds[s])])
                  for r, (x, versions) in enumerate(zip(peaks_, steady.peak_versions))]
    peaks = tuple(round(x) for x in peaks_)
    outside = _outside(prof, schedule, bounds, scale, sharding, collectives)
    return Candidate(schedule.name, schedule.n_stages // schedule.n_ranks,
                     schedule.n_microbatches, tuple(balance), policy,
                     step + outside, peaks, max(peaks) <= limit, sim, sharding)


def _costs(prof: Profiled, bounds: Sequence[tuple[int, int]], policy: str, scale: Scale,
           sharding: Sharding = ONE, collectives: Collectives | None = None) -> Costs:
    def total(op: str, a: int, e: int) -> float:
        return float(sum(getattr(c, op) for c in prof.layers[a:e]))

    comms, coll = prof.comms(), collectives or Collectives.default()

    def talk(op: str) -> list[float]:  # the collectives inside each stage's op
        return [action_seconds(op, comms[a:e], sharding, coll, scale.tp_talk, scale.fsdp_talk,
                               scale.ep_talk)
                + scale.gap for a, e in bounds]

    f = [total("f", a, e) * scale.f + x for (a, e), x in zip(bounds, talk("F"), strict=True)]
    again = ([total("f", a, e) * scale.replay for a, e in bounds] if policy == "always"
             else [0.0] * len(f))
    i = [total("i", a, e) * scale.i + x + y
         for (a, e), x, y in zip(bounds, talk("I"), again, strict=True)]
    w = [total("w", a, e) * scale.w + x for (a, e), x in zip(bounds, talk("W"), strict=True)]
    b = [(total("i", a, e) + total("w", a, e)) * scale.b + x + y
         for (a, e), x, y in zip(bounds, talk("B"), again, strict=True)]
    return Costs(F=tuple(f), B=tuple(b), I=tuple(i), W=tuple(w))


def _outside(prof: Profiled, schedule: Schedule, bounds: Sequence[tuple[int, int]],
             scale: Scale, sharding: Sharding, collectives: Collectives) -> float:
    """A step's seconds outside the schedule: the slowest rank's reductions and optimizer."""
    comms, slowest = prof.comms(), 0.0
    for rank in range(schedule.n_ranks):
        spans = [slice(*bounds[s]) for s in schedule.stages_of(rank)]
        mine = [c for sl in spans for c in prof.layers[sl]]
        talk = reduction_seconds(mine, [c for sl in spans for c in comms[sl]], sharding,
                                 collectives)
        updated = updated_bytes(mine, [c for sl in spans for c in comms[sl]], sharding)
        share = updated / scale.overhead_bytes if scale.overhead_bytes else 1.0
        slowest = max(slowest, talk + scale.overhead * share)
    return slowest


def rank_peaks(prof: Profiled, schedule: Schedule, bounds: Sequence[tuple[int, int]],
               policy: str, sim: Simulation, foreach: bool = False,
               sharding: Sharding = ONE) -> list[float]:
    """Per rank, the predicted peak bytes (the terms of the module docstring)."""
    layers, comms = prof.layers, prof.comms()
    full, kept, replay, held = stage_bytes(prof, bounds, policy)
    peaks = []
    for rank in range(schedule.n_ranks):
        spans = [slice(*bounds[s]) for s in schedule.stages_of(rank)]
        mine = [c for sl in spans for c in layers[sl]]
        largest = largest_grad(mine, [c for sl in spans for c in comms[sl]], sharding)
        alive = peak_units(sim.timeline.of_rank(rank), sim.w_share, held, kept, replay)
        work = max(full[s] for s in schedule.stages_of(rank)) + largest
        state = state_bytes(mine, [c for sl in spans for c in comms[sl]], sharding)
        peaks.append(state + max(alive + work, step_temporaries(
            mine, sharding, foreach, [c for sl in spans for c in comms[sl]])))
    return peaks


def stage_bytes(prof: Profiled, bounds: Sequence[tuple[int, int]], policy: str
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage of one micro-batch: its activations (``full``), what its F keeps until the
    backward (``kept``: activations and input, or the input alone when recomputed), what a
    recomputed backward rebuilds (``replay``) and what I keeps until W (``held``; none on
    stage 0, which is fed data)."""
    layers = prof.layers
    full = [float(sum(c.activation_bytes for c in layers[a:e])) for a, e in bounds]
    given = [float(prof.input_bytes[a]) for a, _ in bounds]  # received (or fed), kept
    kept = [x + y for x, y in zip(full, given, strict=True)] if policy == "never" else given
    replay = [0.0] * len(full) if policy == "never" else full  # rebuilt by I or B
    held = [0.0] + [float(sum(c.i_held_bytes for c in layers[a:e])) for a, e in bounds[1:]]
    return full, kept, replay, held


def _fitted_zb_auto(prof: Profiled, balance: Sequence[int], policy: str, p: int, m: int,
                    limit: float, ctx: _Context) -> Candidate:
    """zb-auto under the loosest activation limit, from 2p stage-activations down, whose
    predicted peak bytes fit ``limit``; the tightest (1) when none does."""
    costs = _costs(prof, stage_bounds(balance), policy, ctx.scale, ctx.sharding,
                   ctx.collectives)
    cand = None
    for units in range(2 * p, 0, -1):
        try:
            schedule = make_schedule("zb-auto", p, m, 1,
                                     Target(float(units), costs, ctx.scale.comm))
        except ValueError:
            continue  # no schedule under so few units
        cand = evaluate(prof, schedule, balance, policy, limit, ctx.scale, ctx.sharding,
                        ctx.collectives)
        if cand.fits:
            break
    if cand is None:
        raise ValueError(f"zb-auto has no schedule for p={p}, m={m} under any limit")
    return cand
