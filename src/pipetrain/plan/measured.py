"""Measured: what ``pipetrain plan`` measures on the ranks to scale its predictions.

One local launch (as ``pipetrain train``) at the calibration layout (the fewest pipeline ranks
searched, the rest replicas) trains 3 steps each of zb-h1, 1f1b and 1f1b recomputed: the
measured/profiled ratio of each op, the hop delay, the step's time outside the schedule, the
runtime's cost per action and what recomputation adds (:mod:`pipetrain.schedules.calibration`); the
same launch then times all-reduce, all-gather, reduce-scatter and all-to-all over groups of each
size the layouts use (:func:`pipetrain.plan.shardcost.measure_collectives`). When the layouts
shard, one more launch each trains 3 steps of 1f1b under tensor parallelism, under FSDP
(reshard "part") and under expert parallelism, and the measured/predicted cost of their
collectives is fitted (``Scale.tp_talk``, ``Scale.fsdp_talk``, ``Scale.ep_talk``): DTensor's
and FSDP2's work around each collective, and the all-to-alls' bookkeeping and waits, are not
in the collectives' own times.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

from pipetrain.plan.shardcost import KINDS
from pipetrain.train.config import TrainConfig
from pipetrain.train.launch.quiet import fd_to

__all__ = ["on_cuda", "shared_cores", "calibrate_on_ranks"]

CALIBRATION_SCHEDULES = ("zb-h1", "1f1b")
Layout = tuple[int, Any]



def on_cuda(cfg: TrainConfig) -> bool:
    """The ranks compute on GPUs (NCCL)."""
    from pipetrain.train.launch.elastic import backend_for

    return backend_for(cfg.device, cfg.nproc) == "nccl"


def shared_cores(cfg: TrainConfig) -> float | None:
    """The cores this machine's ranks share (one thread each), when fewer than the ranks of a
    CPU run; None when each rank has its own device or core."""
    if on_cuda(cfg):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return float(cores) if cores and cores < cfg.nproc else None


def calibrate_on_ranks(cfg: TrainConfig, calib: Layout, profiles: dict[tuple[int, int], Any],
                       cores: float | None, layouts: list[Layout]) -> tuple[Any, Any]:
    """Measured/profiled ratios from 3 steps of each calibration schedule on the ranks (the
    ``calib`` layout), each step p micro-batches of the middle profile's size (fewer than the
    run's: the ratios and the per-action cost do not depend on how many, and the steps are
    shorter); and the collectives of every group size ``layouts`` use, timed there."""
    from pipetrain.plan.planner import Scale
    from pipetrain.plan.shardcost import reduction_seconds
    from pipetrain.train.launch.elastic import launch_local

    pp, sharding = calib
    profs = profiles[pp, 1]
    prof = profs[len(profs) // 2]
    m = min(cfg.batch_size // sharding.data // prof.rows, pp)
    base = dataclasses.replace(cfg, pp=pp, dp=sharding.dp, microbatches=m,
                               batch_size=prof.rows * m * sharding.dp, steps=3,
                               balance="params")
    groups = sorted({k for _, s in layouts
                     for k in (s.dp, s.fsdp, s.tp, s.dp * s.fsdp, s.ep, s.data // s.ep)})
    kinds = KINDS if any(s.ep > 1 for _, s in layouts) else KINDS[:3]  # all-to-all: ep's
    with fd_to(1, 2):  # the ranks print their config; stdout stays the plan's
        measured = launch_local(base, partial(_calibration_runs, groups=groups, kinds=kinds))
    runs, collectives = measured["runs"], measured["collectives"]
    per_pipeline = None if cores is None else cores / sharding.replicas
    split, fused, again = (_calibrated(run, per_pipeline) for run in runs)
    f, i, w, b = (_ratio(split, prof, "f", ("f",)), _ratio(split, prof, "i", ("i",)),
                  _ratio(split, prof, "w", ("w",)), _ratio(fused, prof, "b", ("i", "w")))
    busiest = _busiest(prof, split["balance"], split["schedule"])
    reduce_s = reduction_seconds(busiest, [], sharding, collectives)
    overhead = statistics.mean([split["overhead"], fused["overhead"]])
    scale = Scale(f=f, i=i, w=w, b=b, comm=split["comm"], overhead=max(0.0, overhead - reduce_s),
                  overhead_bytes=sum(c.param_bytes - c.frozen_bytes for c in busiest),
                  cores=cores)
    fit = partial(_fitted, prof=prof, sharding=sharding)
    scale = dataclasses.replace(scale, gap=fit("gap", [split, fused], scale=scale, most=0.05))
    scale = dataclasses.replace(scale, replay=fit("replay", [again], scale=scale, most=8.0))
    return _talk(cfg, pp, layouts, profiles, scale, collectives), collectives


def _tp_only(s: Any) -> bool:
    return bool(s.tp > 1 and s.fsdp == 1 and s.dp == 1)


def _fsdp_only(s: Any) -> bool:
    return bool(s.fsdp > 1 and s.tp == 1 and s.dp == 1 and s.reshard == "part")


def _ep_only(s: Any) -> bool:
    return bool(s.ep > 1 and s.fsdp == 1 and s.tp == 1)


TALK: dict[str, Callable[[Any], bool]] = {"tp_talk": _tp_only, "fsdp_talk": _fsdp_only,
                                          "ep_talk": _ep_only}
MOST = {"tp_talk": 50.0, "fsdp_talk": 50.0, "ep_talk": 200.0}
"""The largest factor each may take: an all-to-all on shared CPU cores also waits for its
partner to be scheduled, measured at ten times its timed cost and more."""
"""The layouts whose calibration run fits each factor of the collectives' cost."""


def _talk(cfg: TrainConfig, pp: int, layouts: list[Layout],
          profiles: dict[tuple[int, int], Any], scale: Any, collectives: Any) -> Any:
    """``scale`` with ``tp_talk``, ``fsdp_talk`` and ``ep_talk`` fitted to 3 steps of 1f1b
    under each (one launch each: a mesh of FSDP or tensor parallelism comes first in a
    process), for the layouts at ``pp`` pipeline ranks that search it."""
    from pipetrain.train.launch.elastic import launch_local

    for name, chooses in TALK.items():
        sharding = next((s for p, s in layouts if p == pp and chooses(s)), None)
        if sharding is None:
            continue
        profs = profiles[pp, sharding.tp]
        prof = profs[len(profs) // 2]
        m = min(cfg.batch_size // sharding.data // prof.rows, pp)
        base = dataclasses.replace(
            cfg, pp=pp, dp=sharding.dp, fsdp=sharding.fsdp, tp=sharding.tp, ep=sharding.ep,
            fsdp_reshard=sharding.reshard, sequence_parallel=False, microbatches=m,
            batch_size=prof.rows * m * sharding.data, steps=3, balance="params",
            schedule="1f1b")
        with fd_to(1, 2):
            run = launch_local(base, _one_run)
        cores = None if scale.cores is None else scale.cores / sharding.replicas
        scale = dataclasses.replace(scale, **{name: _fitted(
            name, [_calibrated(run, cores)], prof, scale, MOST[name], sharding, collectives)})
    return scale


def _one_run(cfg: TrainConfig, reporter: Any) -> dict[str, Any]:
    return _calibration_run(cfg)


def _busiest(prof: Any, balance: list[int], schedule: Any) -> list[Any]:
    """The layers of the rank holding the most trainable bytes."""
    from pipetrain.split.partition import stage_bounds

    bounds = stage_bounds(balance)
    ranks = [[c for s in schedule.stages_of(r) for c in prof.layers[slice(*bounds[s])]]
             for r in range(schedule.n_ranks)]
    return max(ranks, key=lambda layers: sum(c.param_bytes - c.frozen_bytes for c in layers))


def _fitted(field: str, runs: list[dict[str, Any]], prof: Any, scale: Any,
            most: float, sharding: Any = None, collectives: Any = None) -> float:
    """The value of ``Scale.<field>``, in [0, most], whose predicted steps of ``runs`` add up to
    their measured ones (bisection: the prediction grows with it).

    ``gap``: the spans miss the runtime's work between actions, which the steps include.
    ``replay``: recomputation's cost is not all in the spans (the replay runs before a
    backward waits for its gradient)."""
    from pipetrain.plan.planner import evaluate
    from pipetrain.plan.shardcost import Sharding

    measured = sum(statistics.median(t.makespan for t in run["timelines"]) for run in runs)

    def predicted(value: float) -> float:
        trial = dataclasses.replace(scale, **{field: value}, overhead=0.0)
        return sum(evaluate(prof, run["schedule"], run["balance"], run["recompute"], 0.0,
                            trial, sharding or Sharding(), collectives).simulation.makespan
                   for run in runs)

    lo, hi = 0.0, most
    if predicted(lo) >= measured:
        return lo
    if predicted(hi) <= measured:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _calibrated(run: dict[str, Any], cores: float | None) -> dict[str, Any]:
    """A calibration run's costs (work at full speed when the ranks shared ``cores``) and hop."""
    from pipetrain.schedules.calibration import calibrate

    calib = calibrate(run["timelines"], run["schedule"], cores=cores)
    return {**run, "costs": calib.costs.to_dict(), "comm": calib.comm}


def _ratio(result: dict[str, Any], prof: Any, op: str, profiled: tuple[str, ...]) -> float:
    """Measured seconds of ``op`` over all stages, over the profiled seconds of the same layers."""
    from pipetrain.split.partition import stage_bounds

    bounds = stage_bounds(result["balance"])
    want = sum(getattr(c, o) for a, e in bounds for c in prof.layers[a:e] for o in profiled)
    got = sum(result["costs"][op.upper()])
    return got / want if want > 0 else 1.0


def _calibration_runs(cfg: TrainConfig, reporter: Any, groups: list[int],
                      kinds: tuple[str, ...]) -> dict[str, Any]:
    """On every rank, in one launch: :func:`_calibration_run` of ``cfg`` under zb-h1, 1f1b,
    and 1f1b recomputed; then the ``kinds`` of collectives over groups of each of ``groups``
    ranks."""
    from pipetrain.plan.shardcost import measure_collectives

    variants = [dataclasses.replace(cfg, schedule=name) for name in CALIBRATION_SCHEDULES]
    variants.append(dataclasses.replace(cfg, schedule="1f1b", recompute="always"))
    runs = [_calibration_run(variant) for variant in variants]
    return {"runs": runs, "collectives": measure_collectives(groups, kinds=kinds)}


def _calibration_run(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps; the timelines of those after the first."""
    from pipetrain.train.loop import train_step
    from pipetrain.train.setup import build

    trainer = build(cfg)
    stats = [s for s in (train_step(trainer, step) for step in range(cfg.steps))
             if s is not None][1:]  # (None: an --ft step not committed; not run here)
    overhead = statistics.median(s.seconds - s.timeline.makespan for s in stats)
    return {"timelines": [s.timeline for s in stats], "schedule": trainer.pipe.schedule,
            "overhead": max(0.0, overhead), "balance": list(trainer.pipe.balance),
            "recompute": cfg.recompute}
