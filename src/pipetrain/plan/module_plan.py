"""Module plan: profile a user's own module's units, search layouts, return Pipeline kwargs.

    plans = plan_module(model, x, loss_fn, y, ranks=4, memory_limit=16 * 2**30)
    pipe = pt.Pipeline(model, **plans[0].pipeline_kwargs(), loss_fn=loss_fn)

``model`` is any ``nn.Module``, captured as ``Pipeline(model, split_points="auto")``
captures it (:mod:`pipetrain.split.autosplit`: one unit per child, containers opened), or a
list of layers (an ``nn.Sequential`` or ``nn.ModuleList`` counts as one), each a unit. The
units are profiled in this process (:func:`pipetrain.split.profile.profile_layers`) on one
micro-batch of every size the search tries, and :func:`pipetrain.plan.planner.search`
predicts every layout of ``ranks`` pipeline ranks (one process each: no dp, FSDP or tensor
parallelism) from the profile alone, as ``pipetrain plan --no-calibrate`` does: nothing runs
on the ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.pipeline_config import PipelineConfig
from pipetrain.plan.planner import (
    RECOMPUTE,
    SCHEDULES,
    Candidate,
    Profiled,
    Scale,
    microbatch_choices,
    search,
)
from pipetrain.schedules.generators import REGISTRY, _load_builtin

__all__ = ["ModulePlan", "plan_module", "profile_module"]

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class ModulePlan:
    """One layout of a user's module, what the planner predicts for it, and how to build it."""

    candidate: Candidate
    """The planner's layout and prediction (:class:`pipetrain.plan.planner.Candidate`)."""
    profile: Profiled
    """The units profiled on one micro-batch of this layout's size (what
    :func:`pipetrain.plan.budget.memory_target` reads)."""
    example_inputs: Any
    """What ``Pipeline`` captures the model with (a tuple or dict of ``forward``'s arguments);
    None for a layer list, which is not captured."""

    @property
    def schedule(self) -> str:
        return self.candidate.schedule

    @property
    def microbatches(self) -> int:
        return self.candidate.microbatches

    @property
    def stages_per_rank(self) -> int:
        return self.candidate.stages_per_rank

    @property
    def balance(self) -> tuple[int, ...]:
        return self.candidate.balance

    @property
    def recompute(self) -> str:
        return self.candidate.recompute

    @property
    def predicted_step_s(self) -> float:
        return self.candidate.predicted_step_s

    @property
    def predicted_peak_bytes(self) -> tuple[int, ...]:
        return self.candidate.predicted_peak_bytes

    @property
    def fits(self) -> bool:
        return self.candidate.fits

    @property
    def searched(self) -> bool:
        """The schedule was searched for this model (zb-auto): :meth:`pipeline_kwargs` gives
        the :class:`~pipetrain.schedules.schedule.Schedule` itself, not its name."""
        return REGISTRY[self.schedule].search is not None

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``pt.Pipeline(model, **kwargs, loss_fn=...)`` for this
        layout: ``schedule`` (a name, or for zb-auto the searched Schedule), ``microbatches``,
        ``stages_per_rank`` (with a name), ``balance`` (units per stage), ``recompute``, and
        for a captured model ``split_points="auto"`` with ``example_inputs``. Add the rest
        (``loss_fn``, ``local_ranks`` or ``group``, ``device``)."""
        kwargs: dict[str, Any] = (
            {"schedule": self.candidate.simulation.schedule} if self.searched else
            {"schedule": self.schedule, "stages_per_rank": self.stages_per_rank})
        kwargs.update(microbatches=self.microbatches, balance=list(self.balance),
                      recompute=self.recompute)
        if self.example_inputs is not None:
            kwargs.update(split_points="auto", example_inputs=self.example_inputs)
        return kwargs

    def pipeline_config(self, **rest: Any) -> PipelineConfig:
        """This layout as the :class:`~pipetrain.pipeline_config.PipelineConfig` that
        ``pt.Pipeline.from_config(model, ...)`` takes: :meth:`pipeline_kwargs` with ``rest``
        (``loss_fn``, ``local_ranks`` or ``group``, ``device``), checked by its rules."""
        return PipelineConfig(**self.pipeline_kwargs(), **rest)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the planner's :meth:`~pipetrain.plan.planner.Candidate.to_dict`."""
        return self.candidate.to_dict()


def plan_module(model: nn.Module | Sequence[nn.Module], example_inputs: Any, loss_fn: LossFn,
                target: Any, ranks: int, memory_limit: float, *,
                schedules: Iterable[str] = SCHEDULES, recompute: Iterable[str] = RECOMPUTE,
                microbatches: Iterable[int] | None = None, split_dim: int = 0,
                scale: Scale | None = None, threads: int | None = 1) -> list[ModulePlan]:
    """The layouts of ``model`` on ``ranks`` pipeline ranks, best first, each with its predicted
    step time and peak bytes per rank, and whether that peak fits ``memory_limit``.

    The prediction comes from the profile alone, without calibration on the ranks (as
    ``pipetrain plan --no-calibrate``): each op's time as profiled here, one device per rank,
    no message delay and no time outside the schedule, unless ``scale`` says otherwise
    (:class:`~pipetrain.plan.planner.Scale`; ``Scale(cores=2.0)`` for CPU ranks that share two
    cores). The profile runs where the model's parameters are; on CPU with ``threads``
    intra-op threads (default 1, as each of pipetrain's CPU ranks computes: ``pt.launch`` and
    ``pipetrain train`` give each rank one; None keeps this process's setting).
    Every candidate is kept; those over the limit come last (:func:`~pipetrain.plan.planner.
    ranked`), so ``plans[0].fits`` says whether any layout fits.

    Args:
        model: an ``nn.Module`` (captured with torch.export as ``Pipeline(model,
            split_points="auto")`` captures it), or a list of layers (an ``nn.Sequential`` or
            ``nn.ModuleList`` too) run one after another.
        example_inputs: one whole step's batch, as ``Pipeline.step`` takes it: a tensor, a
            tuple of positional or a dict of keyword arguments of ``forward`` (for a layer
            list: the first layer's input).
        loss_fn: ``loss_fn(output, target) -> scalar``, applied per micro-batch.
        target: the step's targets (split into micro-batches like the inputs).
        ranks: pipeline ranks.
        memory_limit: bytes each rank may hold.
        schedules: the schedule names to consider (default: all the planner knows).
        recompute: the recomputation policies to consider, of ``"never"`` and ``"always"``.
        microbatches: the micro-batch counts to consider (default: up to 4 that split the
            batch evenly, from ``ranks / 2`` up; :func:`~pipetrain.plan.planner.
            microbatch_choices`).
        split_dim: the batch dimension.
        scale: measured/profiled ratios and costs outside the schedule (default: none).
        threads: intra-op threads while profiling on CPU (None: as they are).

    Returns:
        Every layout, fitting ones first, fastest first (a near tie goes to fewer actions).

    Raises:
        TypeError: for a model that is neither a module nor a list of modules, or a
            ``loss_fn`` that is not callable.
        ValueError: for bad counts, unknown schedules or policies, a batch that does not split
            into the micro-batches asked, or a model with fewer units than ``ranks`` stages.
        PartitionError: when torch.export cannot capture the model (the message says why).
    """
    _check(ranks, memory_limit, loss_fn)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    names, policies = _names(schedules, recompute)
    layers, batch, captured = _units(model, example_inputs)
    from pipetrain.runtime import microbatch

    rows = microbatch.batch_size(batch, split_dim)
    counts = list(microbatch_choices(rows, ranks) if microbatches is None else microbatches)
    bad = [m for m in counts if not isinstance(m, int) or isinstance(m, bool) or m < 1
           or rows % m]
    if bad or not counts:
        raise ValueError(f"microbatches {bad or counts} do not split the batch of {rows} "
                         f"rows evenly; choose among "
                         f"{[m for m in range(1, rows + 1) if rows % m == 0]}")
    counts = sorted(set(counts))
    on_cuda = any(p.is_cuda for layer in layers for p in layer.parameters())
    before = torch.get_num_threads()
    if threads is not None and not on_cuda:
        torch.set_num_threads(threads)
    try:
        profiles = profile_module(layers, batch, loss_fn, target,
                                  [rows // m for m in counts], split_dim)
    finally:
        torch.set_num_threads(before)
    scale = scale or Scale(foreach=on_cuda)  # AdamW's foreach kernels: CUDA's default
    found = search(profiles, ranks, rows, float(memory_limit), scale, schedules=names,
                   recompute=policies)
    if not found:
        raise ValueError(f"no layout is possible: the model has {len(layers)} units, fewer "
                         f"than {ranks} ranks' stages; use fewer ranks, or give a list of "
                         "smaller layers")
    by_rows = {prof.rows: prof for prof in profiles}
    return [ModulePlan(c, by_rows[rows // c.microbatches], captured) for c in found]


def profile_module(layers: Sequence[nn.Module], batch: Any, loss_fn: LossFn, target: Any,
                   sizes: Sequence[int], split_dim: int = 0) -> list[Profiled]:
    """``layers`` (run one after another, ``batch`` the first one's input) profiled on one
    micro-batch of each of ``sizes`` rows: the first rows of ``batch`` and ``target``."""
    from pipetrain.runtime import microbatch
    from pipetrain.runtime.transport.payload import flatten
    from pipetrain.split.profile import profile_layers, storages

    rows = microbatch.batch_size(batch, split_dim)
    out = []
    for size in sizes:
        x = microbatch.split(batch, rows // size, split_dim)[0]
        y = microbatch.split(target, rows // size, split_dim)[0]
        costs = profile_layers(layers, x, loss_fn=loss_fn, sample_target=y, repeats=3,
                               reuse=True)  # the median of 3 runs: one stall does not count
        inputs = []
        with torch.no_grad():
            for layer in layers:
                inputs.append(sum(storages(flatten(x)[0]).values()))
                x = layer(x)
        out.append(Profiled(size, tuple(costs), tuple(inputs)))
    return out


def _check(ranks: int, memory_limit: float, loss_fn: Any) -> None:
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ValueError(f"ranks must be a positive integer (pipeline ranks), got {ranks!r}")
    if isinstance(memory_limit, bool) or not isinstance(memory_limit, (int, float)) \
            or not memory_limit > 0:
        raise ValueError(f"memory_limit must be a number of bytes > 0, got {memory_limit!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got "
                        f"{type(loss_fn).__name__}")


def _names(schedules: Iterable[str], recompute: Iterable[str]
           ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    _load_builtin()
    names, policies = tuple(schedules), tuple(recompute)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or not names:
        raise ValueError(f"schedules: unknown {unknown}; choose among {list(SCHEDULES)}")
    if not policies or any(p not in RECOMPUTE for p in policies):
        raise ValueError(f"recompute {list(policies)}: choose among {list(RECOMPUTE)}")
    return names, policies


def _units(model: Any, example: Any) -> tuple[list[nn.Module], Any, Any]:
    """The units to profile, the first one's input for the whole batch, and what ``Pipeline``
    captures the model with (None for a layer list)."""
    if isinstance(model, (nn.Sequential, nn.ModuleList, list, tuple)):
        layers = list(model)
        if not layers or not all(isinstance(m, nn.Module) for m in layers):
            raise TypeError("a layer list must hold nn.Module layers (at least one)")
        return layers, example, None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a list of layers, got "
                        f"{type(model).__name__}")
    from pipetrain.split.layers import trace_stages

    given = example if isinstance(example, (tuple, dict)) else (example,)
    traced = trace_stages(model, "auto", given, None, 1)
    return list(traced.stages), traced.payload(example), given
