"""Pipeline args: what the Pipeline constructor resolves and refuses beside building stages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import PartitionError, PipelineError
from pipetrain.runtime import rng as rng_streams
from pipetrain.schedules.generators import make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.balance import MODES, BalancePlan, LayerCost, plan_balance, profile_layers
from pipetrain.split.layers import profiling_sample
from pipetrain.split.lazy import LayerSpec
from pipetrain.split.trace import TracedSplit

__all__: list[str] = []


def asynchronous_fits(schedule: Schedule, tied: Sequence[Any]) -> None:
    """Refuse what an asynchronous schedule does not run with on this model (what it does
    not run with whatever the model: :class:`~pipetrain.pipeline_config.PipelineConfig`)."""
    if schedule.update == "stash" and tied:
        raise ValueError(
            f"'pipedream' updates each stage after each of its backwards, stage by stage a "
            f"different number of micro-batches late: the copies of a weight tied between "
            f"stages ({tied[0].name!r}) would take the halves of its gradient at different times "
            f"and drift apart. Use 'pipedream-2bw' (one update per step, the halves summed) "
            f"or a synchronous schedule, or untie the weight")


def carries_rng(given: bool | None, traced: TracedSplit | None,
                 layers: Sequence[tuple[str, nn.Module | LayerSpec]]) -> bool:
    """Whether micro-batches carry their random streams (given, or: whether the model draws)."""
    if given is not None:
        return bool(given)
    if traced is not None:
        return any(traced.draws)
    return any(isinstance(m, nn.Module) and rng_streams.module_draws(m)
               for _, m in layers)


def broadcast_costs(costs: list[LayerCost] | None, n: int, group: dist.ProcessGroup | None
                     ) -> list[LayerCost]:
    table = torch.zeros(n, 8, dtype=torch.float64)
    if costs is not None:
        table = torch.tensor([[c.f, c.i, c.w, c.param_bytes, c.activation_bytes, c.frozen_bytes,
                               c.i_held_bytes, c.largest_grad_bytes] for c in costs],
                             dtype=torch.float64)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast(table, src=src, group=group)
    return [LayerCost(r[0], r[1], r[2], *(int(b) for b in r[3:])) for r in table.tolist()]


def resolve_schedule(schedule: str | Schedule, n_ranks: int, microbatches: int | None,
             stages_per_rank: int | None) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.n_ranks != n_ranks:
            raise ValueError(f"schedule {schedule.name!r} has {schedule.n_ranks} ranks but the "
                             f"pipeline group has {n_ranks}")
        resolved = schedule
    else:  # microbatches given: PipelineConfig
        resolved = make_schedule(schedule, n_ranks, microbatches or 0, stages_per_rank)
    from pipetrain.schedules.validate import validate

    validate(resolved)
    return resolved


def device_of(device: torch.device | str | None, group: dist.ProcessGroup | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pipeline_ranks(group: dist.ProcessGroup | None, local_ranks: int | None) -> tuple[int, int]:
    """The pipeline's number of ranks and this process's rank in it (0 for ``local_ranks``)."""
    if local_ranks is not None:
        return local_ranks, 0
    if not dist.is_initialized():
        raise PipelineError(
            "torch.distributed is not initialised: start the processes with pt.launch or "
            "torchrun, or pass local_ranks=N to run all ranks in this process"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def auto_balance(layers: list[tuple[str, nn.Module | LayerSpec]], mode: Any, sample: Any,
                 schedule: Schedule, local: bool, rank: int, group: dist.ProcessGroup | None
                 ) -> BalancePlan:
    """Automatic balance: rank 0 profiles, every rank plans from the same layer costs."""
    modules = [m for _, m in layers]
    if not all(isinstance(m, nn.Module) for m in modules):
        raise PartitionError(f"balance={mode!r} needs the layers built (it measures them); "
                             "with LayerSpec or meta layers pass balance=[...] explicitly")
    if isinstance(mode, str) and mode not in MODES:
        raise ValueError(f"unknown balance mode {mode!r}; choose one of {list(MODES)}, a "
                         "cost function, or a list of layers per stage")
    built = [m for m in modules if isinstance(m, nn.Module)]
    sample = profiling_sample(built, mode, sample)
    costs = None
    if mode != "params" and (local or rank == 0):
        if sample is None:
            raise ValueError(f"balance={mode!r} profiles every layer on a sample micro-batch: "
                             "pass example_inputs= (the first layer's input)")
        costs = profile_layers(built, sample)
    if mode != "params" and not local:
        costs = broadcast_costs(costs, len(built), group)
    return plan_balance(built, schedule, mode, sample, layer_costs=costs)
