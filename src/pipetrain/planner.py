"""Planner: the fastest pipeline layout whose predicted peak memory fits every rank.

A layout is a schedule, its stages per rank, the micro-batches per step, a balance (layers per
stage) and a recomputation policy. For each one the planner predicts

    step time   simulate(schedule) with per-stage costs summed from the profiled layers of a
                micro-batch of that size, times the measured/profiled ratio of each op in a
                calibration run, plus a fitted cost per action (the runtime's own), plus the
                calibrated hop delay and the step's time outside the schedule (gradient
                norm, optimizer); ranks that share fewer cores than they are (CPU
                processes) share them in the simulation too
    peak bytes  per rank: the stages' parameters, gradients and AdamW moments (4 x their
                trainable bytes, + frozen bytes), plus the larger of
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
alive from the start of B until its end, or from the start of I until W ends. Candidates
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

from pipetrain.balance import plan_balance
from pipetrain.generators import REGISTRY, Target, _load_builtin, make_schedule
from pipetrain.partition import stage_bounds
from pipetrain.profile import LayerCost
from pipetrain.schedule import Schedule
from pipetrain.simulate import Costs, Simulation, peak_units, simulate

__all__ = ["Profiled", "Scale", "Candidate", "SCHEDULES", "RECOMPUTE", "MARGIN", "search",
           "microbatch_choices", "actions_per_rank"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2",
             "interleaved-zb", "zbv", "v-half", "v-min", "dualpipev", "zb-auto")
RECOMPUTE = ("never", "always")
MARGIN = 0.03
"""Predicted steps this close are a tie: the predictions' error on the machine that measured
them (``benchmarks/plan_accuracy.py``) is a few percent, and grows with the actions per step,
whose runtime cost is the least certain term; a tie goes to the layout with fewer actions."""
STATE_MULTIPLIER = 4.0  # fp32 weights, gradients and AdamW's two moments


@dataclass(frozen=True)
class Profiled:
    """The model's layers measured on one micro-batch of ``rows`` sequences."""

    rows: int
    layers: tuple[LayerCost, ...]
    input_bytes: tuple[int, ...]
    """Per layer, the bytes of its input (what a recomputed stage keeps, for its first layer)."""


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
    """Seconds of a step outside the schedule's actions (norm, optimizer, reductions)."""
    gap: float = 0.0
    """Seconds every action costs beyond its op's measured span: the runtime's dispatch and
    message bookkeeping between actions, which grows with the actions per step (more
    micro-batches, more stages per rank)."""
    replay: float = 1.0
    """What recomputation adds to a backward, over the profiled F of the same layers (the
    replay, and the saved-tensor hooks' cost in F)."""
    cores: float | None = None
    """The cores the ranks share when fewer than the ranks (CPU processes; the simulation
    then shares them, :mod:`pipetrain.sharing`); None: a device each."""
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; a searched schedule (zb-auto) adds its action lists as
        ``schedule_text``, which ``pipetrain train --schedule FILE`` runs as they are."""
        found = {"schedule_text": self.simulation.schedule.to_text()
                 } if REGISTRY[self.schedule].search is not None else {}
        return {"schedule": self.schedule, "stages_per_rank": self.stages_per_rank,
                "microbatches": self.microbatches, "balance": list(self.balance),
                "recompute": self.recompute, "predicted_step_s": self.predicted_step_s,
                "predicted_peak_bytes": list(self.predicted_peak_bytes), "fits": self.fits,
                **found}


def microbatch_choices(rows_per_replica: int, p: int, most: int = 4) -> list[int]:
    """Micro-batch counts that split the replica's rows evenly: from p/2 up, the ``most``
    smallest (more micro-batches shrink the bubble but cost per-action overhead)."""
    counts = [m for m in range(max(1, p // 2), rows_per_replica + 1) if rows_per_replica % m == 0]
    return counts[:most] or [rows_per_replica]


def search(profiles: Sequence[Profiled], p: int, rows_per_replica: int, memory_limit: float,
           scale: Scale, *, schedules: Iterable[str] = SCHEDULES,
           recompute: Iterable[str] = RECOMPUTE) -> list[Candidate]:
    """Every layout over ``profiles`` (one per micro-batch size), ranked.

    Raises:
        ValueError: when no profile matches a micro-batch count of ``rows_per_replica``.
    """
    _load_builtin()
    by_rows = {prof.rows: prof for prof in profiles}
    found: dict[tuple[Any, ...], Candidate] = {}
    for prof in by_rows.values():
        if rows_per_replica % prof.rows:
            raise ValueError(f"a profile of {prof.rows} rows does not split "
                             f"{rows_per_replica} rows into equal micro-batches")
        m = rows_per_replica // prof.rows
        for name in schedules:
            for policy in recompute:
                for cand in _layouts(prof, name, p, m, policy, memory_limit, scale):
                    key = (cand.schedule, cand.microbatches, cand.balance, cand.recompute)
                    found.setdefault(key, cand)
    ranked = sorted(found.values(), key=lambda c: (not c.fits, c.predicted_step_s,
                                                   max(c.predicted_peak_bytes)))
    return _fewest_actions_first(ranked)


def _fewest_actions_first(ranked: list[Candidate]) -> list[Candidate]:
    """Move to the front, among fitting layouts predicted within :data:`MARGIN` of the
    fastest, the one with the fewest actions per rank (then the fastest of those)."""
    if not ranked or not ranked[0].fits:
        return ranked
    bound = ranked[0].predicted_step_s * (1 + MARGIN)
    near = [c for c in ranked if c.fits and c.predicted_step_s <= bound]
    best = min(near, key=lambda c: (actions_per_rank(c.simulation.schedule),
                                    c.predicted_step_s))
    return [best, *(c for c in ranked if c is not best)]


def actions_per_rank(schedule: Schedule) -> int:
    """The most actions any rank runs in a step."""
    return max(len(actions) for actions in schedule.actions)


def _layouts(prof: Profiled, name: str, p: int, m: int, policy: str, limit: float,
             scale: Scale) -> list[Candidate]:
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
        out.append(evaluate(prof, schedule, balance, policy, limit, scale) if name != "zb-auto"
                   else _fitted_zb_auto(prof, balance, policy, p, m, limit, scale))
    return out


def _with_policy(prof: Profiled, policy: str) -> tuple[LayerCost, ...]:
    """The layers' costs as the balance sees them: recomputation moves the F into I."""
    if policy == "never":
        return prof.layers
    return tuple(replace(c, i=c.i + c.f, activation_bytes=prof.input_bytes[j])
                 for j, c in enumerate(prof.layers))


def evaluate(prof: Profiled, schedule: Schedule, balance: Sequence[int], policy: str,
             limit: float, scale: Scale) -> Candidate:
    """The predicted step time and per-rank peak bytes of one layout."""
    bounds = stage_bounds(balance)
    sim = simulate(schedule, _costs(prof, bounds, policy, scale), scale.comm,
                   cores=scale.cores)
    peaks = tuple(round(x) for x in rank_peaks(prof, schedule, bounds, policy, sim,
                                               scale.foreach))
    return Candidate(schedule.name, schedule.n_stages // schedule.n_ranks,
                     schedule.n_microbatches, tuple(balance), policy,
                     sim.makespan + scale.overhead, peaks, max(peaks) <= limit, sim)


def _costs(prof: Profiled, bounds: Sequence[tuple[int, int]], policy: str,
           scale: Scale) -> Costs:
    def total(op: str, a: int, e: int) -> float:
        return float(sum(getattr(c, op) for c in prof.layers[a:e]))

    gap = scale.gap
    f = [total("f", a, e) * scale.f + gap for a, e in bounds]
    again = ([total("f", a, e) * scale.replay for a, e in bounds] if policy == "always"
             else [0.0] * len(f))
    i = [total("i", a, e) * scale.i + gap + x for (a, e), x in zip(bounds, again, strict=True)]
    w = [total("w", a, e) * scale.w + gap for a, e in bounds]
    b = [(total("i", a, e) + total("w", a, e)) * scale.b + gap + x
         for (a, e), x in zip(bounds, again, strict=True)]
    return Costs(F=tuple(f), B=tuple(b), I=tuple(i), W=tuple(w))


def rank_peaks(prof: Profiled, schedule: Schedule, bounds: Sequence[tuple[int, int]],
               policy: str, sim: Simulation, foreach: bool = False) -> list[float]:
    """Per rank, the predicted peak bytes (the terms of the module docstring)."""
    layers = prof.layers
    full = [sum(c.activation_bytes for c in layers[a:e]) for a, e in bounds]
    given = [prof.input_bytes[a] for a, _ in bounds]  # received (or fed), kept for backward
    kept = [x + y for x, y in zip(full, given, strict=True)] if policy == "never" else given
    replay = [0.0] * len(full) if policy == "never" else full  # rebuilt by I or B
    held = [0.0] + [float(sum(c.i_held_bytes for c in layers[a:e])) for a, e in bounds[1:]]
    peaks = []
    for rank in range(schedule.n_ranks):
        mine = [c for s in schedule.stages_of(rank) for c in layers[slice(*bounds[s])]]
        largest = max((c.largest_grad_bytes for c in mine), default=0)
        alive = peak_units(sim.timeline.of_rank(rank), sim.w_share, held, kept, replay)
        work = max(full[s] for s in schedule.stages_of(rank)) + largest
        step = (sum(c.param_bytes - c.frozen_bytes for c in mine) if foreach
                else 2 * largest)
        peaks.append(sum(_state_bytes(c) for c in mine) + max(alive + work, step))
    return peaks


def _state_bytes(c: LayerCost) -> float:
    return (c.param_bytes - c.frozen_bytes) * STATE_MULTIPLIER + c.frozen_bytes


def _fitted_zb_auto(prof: Profiled, balance: Sequence[int], policy: str, p: int, m: int,
                    limit: float, scale: Scale) -> Candidate:
    """zb-auto under the loosest activation limit, from 2p stage-activations down, whose
    predicted peak bytes fit ``limit``; the tightest (1) when none does."""
    costs = _costs(prof, stage_bounds(balance), policy, scale)
    cand = None
    for units in range(2 * p, 0, -1):
        try:
            schedule = make_schedule("zb-auto", p, m, 1, Target(float(units), costs, scale.comm))
        except ValueError:
            continue  # no schedule under so few units
        cand = evaluate(prof, schedule, balance, policy, limit, scale)
        if cand.fits:
            break
    if cand is None:
        raise ValueError(f"zb-auto has no schedule for p={p}, m={m} under any limit")
    return cand
