"""Pipeline config: every setting of a pipeline but the model, frozen, its rules checked once.

``Pipeline(model, schedule, microbatches, loss_fn, **settings)`` builds one of these from its
arguments, as :func:`pipetrain.verify`, :class:`pipetrain.Generator` and
:func:`pipetrain.plan.plan_module` do from theirs, so that a rule between two settings (a
schedule name needs ``microbatches``; ``compile=`` runs without ``recompute`` or
``parallelize=``; ``optimizer=`` is PipeDream's; an asynchronous schedule runs without
``compile=`` or ``parallelize=``; ``split_points=`` needs ``example_inputs=``) is checked here
and nowhere else, and its error names the setting. What needs the model or the ranks too (the
ranks a Schedule was made for, a model that draws random numbers under ``compile=``, a weight
tied across stages under PipeDream) is checked where the pipeline meets them.

    >>> PipelineConfig("zbv", 8, loss_reduction="sum").loss_reduction
    'sum'
    >>> PipelineConfig("zbv")
    Traceback (most recent call last):
    ...
    ValueError: microbatches is required with a schedule name ('zbv'); give microbatches=M
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime.recompute import Policy
from pipetrain.schedules.schedule import Schedule

__all__ = ["PipelineConfig"]


@dataclass(frozen=True)
class PipelineConfig:
    """How a model is pipelined: the arguments of :class:`~pipetrain.Pipeline` but the model.

    Attributes:
        schedule: a schedule name (``pipetrain schedules``) or a :class:`Schedule`.
        microbatches: micro-batches per step (taken from ``schedule`` if it is a Schedule).
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` applied per micro-batch.
        balance: layers per stage; None splits evenly; ``"params"``, ``"time"`` or
            ``"memory"`` (or ``fn(layer_costs, first, end) -> cost``) chooses the split that
            minimises the bottleneck exactly (:mod:`pipetrain.split.balance`; the profiling modes
            need ``example_inputs``, one micro-batch of the first layer's input, and real
            layers: ``meta`` ones take ``"params"``). The plan is kept as ``balance_plan``.
        stages_per_rank: None takes the schedule's own (2 for interleaved-1f1b, zbv, dualpipev).
        group: the pipeline process group (default: the world).
        local_ranks: run this many ranks in this one process instead of distributed.
        device: where the stages live (default: the current CUDA device under NCCL, else CPU).
        split_dim: the batch dimension that micro-batches split.
        loss_reduction: ``"mean"`` (micro-batch i weighted by its share of the batch) or
            ``"sum"`` (weight 1), matching how ``loss_fn`` reduces.
        timeout: seconds any wait for a peer may last before the step fails.
        recompute: activation recomputation (:mod:`pipetrain.runtime.recompute`): per stage,
            ``"never"``, ``"always"``, ``"except_last"`` (the last stage's backward follows
            its forward at once, so recomputing it saves little) or a collection of stage
            indices; or per layer, ``("every", k)``: the layers whose index in the layer list
            is a multiple of k (0, k, 2k, ...; a traced model's layers are its stages).
        split_points: cut an arbitrary ``model`` (not a layer list) into stages by tracing it
            (:func:`pipetrain.split.trace.split_model`): one stage starts at the first use of each
            named module (``["blocks.4", "blocks.8"]``); ``"auto"`` cuts at every unit
            (:mod:`pipetrain.split.autosplit`) and groups the units by ``balance`` (default
            ``"params"``); with ``balance=``, a list cuts units that the balance groups the
            same way. Needs ``example_inputs``; ``step`` takes the inputs as ``forward`` does:
            a tensor, a tuple of positional arguments, a dict of keyword arguments, or
            :meth:`pack`'s payload (to mix positional and keyword arguments).
        example_inputs: with ``split_points``, positional (tuple) or keyword (dict) arguments
            of ``model.forward``; with a profiling ``balance``, one micro-batch of input.
        dynamic: with ``split_points``, capture every input dimension symbolic where the code
            allows, so steps may change batch size and sequence length (default); False: at
            ``example_inputs``' shapes, which every step must give, in about a third of the
            CPU time (:mod:`pipetrain.split.capture`).
        init_seed: seed of the per-layer initialisation of :class:`LayerSpec` and ``meta``
            layers, and of the by-name initialisation of a traced ``meta`` model, whose
            parameters then equal ``NamedInit(model, init_seed).materialize(model)`` (see
            :mod:`pipetrain.split.lazy`); real modules are used as given.
        parallelize: ``fn(stage, layers)``, called once for each stage this rank holds, after
            the split and before the first step, to wrap the stage's layers in place: FSDP2's
            ``fully_shard`` (:class:`pipetrain.parallel.sharded.ShardedStages` does it), tensor
            parallelism, or the user's own. Parameters keep their names in the model.
        rng: whether each micro-batch's forward draws its random numbers (dropout) from a
            stream of its own that travels with it from stage to stage, so that every layer
            draws what it draws on one device when micro-batch i starts from
            ``rng.start(base, i)`` (:mod:`pipetrain.runtime.rng`; ``testing.reference_step(...,
            rng=True)``). None: when the model draws (a captured graph with a dropout of p > 0
            in training; a layer list with a dropout module of p > 0 in training mode; for
            dropout called as a function in a layer's own forward, pass True).
        compile: run each stage's layers as compiled F, I and W programs
            (:mod:`pipetrain.runtime.compiled`): True for ``torch.compile``'s inductor, or
            the name of another ``torch.compile`` backend. Every schedule, split backward
            included; not with ``recompute`` or ``parallelize``, nor with a model that
            draws (dropout) unless ``rng=False``.
        optimizer: PipeDream's weight stashing (``schedule="pipedream"``) only, where the
            pipeline steps each stage after every backward: a function that makes an optimizer
            from a stage's parameters (``lambda ps: torch.optim.SGD(ps, lr=0.1)``).

    Raises:
        ValueError: for a value out of range or two settings that do not go together, naming
            them and what to use instead.
        TypeError: for a value of the wrong type.
    """

    schedule: str | Schedule = "1f1b"
    microbatches: int | None = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    balance: Sequence[int] | str | Callable[..., float] | None = None
    stages_per_rank: int | None = None
    group: dist.ProcessGroup | None = None
    local_ranks: int | None = None
    device: torch.device | str | None = None
    split_dim: int = 0
    loss_reduction: str = "mean"
    timeout: float = 60.0
    max_message_bytes: int = 1 << 36
    recompute: Policy = "never"
    init_seed: int = 0
    split_points: Sequence[str] | str | None = None
    example_inputs: Any = None
    dynamic: bool = True
    parallelize: Callable[[int, list[nn.Module]], None] | None = None
    rng: bool | None = None
    compile: bool | str = False
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None

    def __post_init__(self) -> None:
        self._check_values()
        self._check_schedule()
        self._check_compile()

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)

    @property
    def update(self) -> str | None:
        """How the schedule updates weights inside a step: ``"stash"`` (PipeDream),
        ``"2bw"`` (PipeDream-2BW), None (synchronous: the caller's optimizer step)."""
        if isinstance(self.schedule, Schedule):
            return self.schedule.update
        from pipetrain.schedules.generators import REGISTRY, _load_builtin

        _load_builtin()
        kind = REGISTRY.get(self.schedule)
        return None if kind is None else kind.update

    def _check_values(self) -> None:
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got "
                             f"{self.loss_reduction!r}")
        if self.local_ranks is not None and self.local_ranks < 1:
            raise ValueError(f"local_ranks must be >= 1, got {self.local_ranks}")
        if self.split_points is not None and self.example_inputs is None:
            raise TypeError("split_points= needs example_inputs=: the positional (tuple) or "
                            "keyword (dict) arguments of the model's forward, to trace it")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got "
                             f"{self.timeout!r}")

    def _check_schedule(self) -> None:
        if not isinstance(self.schedule, Schedule) and self.microbatches is None:
            raise ValueError(f"microbatches is required with a schedule name "
                             f"({self.schedule!r}); give microbatches=M")
        if isinstance(self.schedule, Schedule) and self.microbatches not in (
                None, self.schedule.n_microbatches):
            raise ValueError(f"schedule {self.schedule.name!r} has "
                             f"{self.schedule.n_microbatches} micro-batches, but microbatches="
                             f"{self.microbatches} was passed; leave microbatches out")
        name, update = _name(self.schedule), self.update
        if update == "stash" and self.optimizer is None:
            raise ValueError(f"{name!r} steps each stage after every backward: pass "
                             "optimizer=, a function making an optimizer from a stage's "
                             "parameters, e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)")
        if update != "stash" and self.optimizer is not None:
            raise ValueError(f"optimizer= is for schedule 'pipedream' (an update after every "
                             f"backward); under {name!r} step your optimizer after each step")
        refused = [what for what, on in (("compile=", self.compile is not False),
                                         ("parallelize=", self.parallelize is not None)) if on]
        if update is not None and refused:
            raise ValueError(f"{name!r} (asynchronous: weight versions per step) does not "
                             f"run with {', '.join(refused)} yet; use a synchronous schedule "
                             "such as '1f1b' there")

    def _check_compile(self) -> None:
        if self.compile is False:
            return
        if not isinstance(self.compile, (bool, str)):
            raise TypeError(f"compile must be True, False or a torch.compile backend name, got "
                            f"{self.compile!r}")
        if self.recompute != "never":
            raise ValueError("compile=True with recompute: a compiled stage keeps what its own "
                             "graph saves; pass recompute='never' (or compile=False)")
        if self.parallelize is not None:
            raise ValueError("compile=True with parallelize= (FSDP2, tensor parallel) is not "
                             "supported; drop one of the two")


def _name(schedule: str | Schedule) -> str:
    return schedule.name if isinstance(schedule, Schedule) else schedule
