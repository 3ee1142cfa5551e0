"""Setup: from a TrainConfig to this rank's mesh, pipelined model, optimizer, loss scale and data.

The model comes from its source (:mod:`pipetrain.train.sources.source`): the built-in GPT, whose
layers every rank builds in order from ``cfg.seed`` keeping real only those of its own stages,
or a Hugging Face checkpoint (``--hf``), built on ``meta``, cut at its decoder layers, each
rank materialising and loading only its own stages. A rank hosts its stages in a
:class:`~pipetrain.Pipeline` over its replica's pipeline group, and draws the same global
batch per step, of which its replica takes rows ``[dp_rank * B/dp, (dp_rank + 1) * B/dp)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.parallel.context_parallel import ContextParallel
from pipetrain.parallel.parallelize import Composed
from pipetrain.parallel.sharded import ShardedStages
from pipetrain.pipeline import Pipeline
from pipetrain.runtime.torch_private import pytree
from pipetrain.split.shared_capture import across
from pipetrain.train.checks import check_config, run_schedule
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.examples import ExampleBatches, ExampleCorpus, example_batches
from pipetrain.train.data.packing import packed_batches
from pipetrain.train.data.text import Batches, Corpus
from pipetrain.train.mesh import GradReducer, Mesh, build_mesh
from pipetrain.train.nonfinite import NaNInjector
from pipetrain.train.optim import build_optimizer, counted_parameters
from pipetrain.train.placement import gather_rank_map
from pipetrain.train.precision import LossScale
from pipetrain.train.sources.choice import source_for
from pipetrain.train.sources.source import Source

if TYPE_CHECKING:
    from pipetrain.train.launch.replicas import Replicas

__all__ = ["Trainer", "build"]

Batch = tuple[Any, Any]
"""(inputs, targets): token ids, or padded examples' dicts
(:mod:`pipetrain.train.data.examples`)."""


@dataclass
class Trainer:
    """Everything one rank of a training run holds, and where the run stands."""

    cfg: TrainConfig
    mesh: Mesh
    model: Any
    """What the run trains (the source's model: a GPTConfig, or a Hugging Face model)."""
    pipe: Pipeline
    optimizer: torch.optim.AdamW
    scale: LossScale
    reducer: GradReducer
    batches: Batches | ExampleBatches
    """The global training batches (every replica draws all of them, then takes its rows)."""
    eval_set: list[Batch]
    """This replica's rows of the held-out batches."""
    injector: NaNInjector
    source: Source
    """The model's source (built-in GPT or ``--hf``): input, logits and text."""
    params: list[nn.Parameter] = field(default_factory=list)
    """This rank's trainable parameters."""
    counted: list[nn.Parameter] = field(default_factory=list)
    """The ones this rank counts towards the global gradient norm, whole (or FSDP2 shards)."""
    split: list[nn.Parameter] = field(default_factory=list)
    """Counted ones split across the tensor-parallel ranks (summed over them)."""
    step: int = 0
    """The next step to run (= steps done, skipped ones included)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss, gradients or an fp16 overflow."""
    loaded: dict[str, Any] = field(default_factory=dict)
    """What this rank read of stored weights (``--hf``), and its peak memory after."""
    last_scale: float = 1.0
    """PipeDream-2BW: the loss scale the last step's forwards used, which its gradients,
    applied a step later, are made with."""
    sharded: ShardedStages | None = None
    """With ``--fsdp``: FSDP2 on the stages, which averages the gradients over the
    data-parallel ranks instead of :attr:`reducer`."""
    tensor_parallel: Any = None
    """With ``--tp``: the split of the layers (the GPT plan, or a Hugging Face model's own),
    whose ``finish()`` settles partial gradient sums."""
    experts: list[nn.Parameter] = field(default_factory=list)
    """With ``--ep``: this rank's slices of the experts (other ranks of its expert-parallel
    group hold the others), counted apart from :attr:`counted` (summed over that group)."""
    expert_load: Any = None
    """For a mixture of experts: the tokens each expert got in a step's forwards
    (:class:`pipetrain.hf.expert_load.ExpertLoad`); None without experts."""
    expert_reducer: GradReducer | None = None
    """With ``--ep``: the experts' gradients summed over the ranks holding the same experts
    and divided by every data-parallel rank (their sums already hold the group's tokens)."""
    data: dict[str, Any] = field(default_factory=dict)
    """With a data set as ``--data``: what the run trains on (the ``data`` record:
    :func:`pipetrain.train.data.examples.example_batches`); empty for text."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Where every rank landed (node, host, local rank, coordinates), by global rank:
    :func:`pipetrain.train.placement.gather_rank_map`."""
    replicas: Replicas | None = None
    """With ``--ft``: this rank's :class:`pipetrain.train.launch.replicas.Replicas` (this replica is
    one of ``dp``, each a torch.distributed world of its own); None without."""
    parts: int = 1
    """Into how many parts each global batch is cut (data-parallel ranks of all replicas)."""
    part: int = 0
    """Which part this rank trains on."""
    sequence: ContextParallel | None = None
    """With ``--cp``: this rank's slice of every sequence (the pipeline's input and targets
    are cut to it), and the group its attention exchanges with."""

    @property
    def job_rank(self) -> int:
        """This rank's number in the whole job (with ``--ft``: replica x its world + rank)."""
        if self.replicas is None:
            return self.mesh.rank
        return self.replicas.replica * self.mesh.world + self.mesh.rank

    @property
    def on_grads_ready(self) -> Any:
        """The pipeline's hook when a stage's gradients are final: start their reduction."""
        hook = self.reducer.hook if self.sharded is None else self.sharded.reduce
        experts = None if self.expert_reducer is None else self.expert_reducer.hook
        if experts is None or hook is None:
            return hook or experts

        def both(stage: int) -> None:
            hook(stage)
            experts(stage)
        return both

    def finish_grads(self) -> None:
        """Finish the reduction: every rank holds the mean gradient (its shard of it)."""
        if self.sharded is None:
            self.reducer.finish()
        else:
            self.sharded.finish()
        if self.expert_reducer is not None:
            self.expert_reducer.finish()
        if self.tensor_parallel is not None:
            self.tensor_parallel.finish()

    def layout(self) -> dict[str, Any]:
        """How the run is laid out: a resumed run with the same layout restores RNG streams."""
        s = self.pipe.schedule
        replicas = {} if self.replicas is None else {"replicas": self.cfg.dp}
        tokens = {"tokens_per_rank": self.cfg.seq_len // self.mesh.cp} if self.mesh.cp > 1 \
            else {}
        return {**self.mesh.describe(), **tokens, **replicas, "schedule": s.name,
                "microbatches": s.n_microbatches,
                "stages": s.n_stages, "stages_per_rank": s.n_stages // s.n_ranks,
                "placement": list(s.placement), "balance": list(self.pipe.balance),
                "precision": self.cfg.precision}

    def batch(self, step: int) -> Batch:
        """This replica's rows of global batch ``step`` (with ``--cp``, the targets of this
        rank's slice of each sequence)."""
        return self.rows(self.batches.batch(step))

    def feed(self, ids: torch.Tensor) -> Any:
        """The pipeline's input for token ids (a dict of keyword arguments for ``--hf``);
        with ``--cp``, of this rank's slice of each sequence."""
        fed = self.source.feed(ids)
        if self.sequence is None:
            return fed
        return self.sequence.take(fed, pytree.tree_leaves(ids)[0].shape[-1])

    def rows(self, batch: Batch) -> Batch:
        n = pytree.tree_leaves(batch)[0].size(0) // self.parts
        lo = self.part * n
        inputs, targets = pytree.tree_map(lambda t: t[lo:lo + n], batch)
        if self.sequence is not None:
            targets = self.sequence.take(targets, self.cfg.seq_len)
        return inputs, targets


def build(cfg: TrainConfig, *, progress: bool = False) -> Trainer:
    """This rank's part of the run described by ``cfg`` (call on every rank at once).

    ``progress`` shows a bar if this rank tokenizes the corpus (``--hf``, first use).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    replicas = cfg.dp if cfg.ft else 1  # --ft: this world is one replica of cfg.dp
    check_config(cfg, world * replicas)
    mesh = build_mesh(cfg.dp // replicas, cfg.pp, cfg.device, cfg.fsdp, cfg.tp,
                      cfg.mesh_order, cfg.ep, cfg.cp)
    sequence = (None if mesh.cp == 1  # bound before the model is captured
                else ContextParallel(mesh.cp_group, documents=cfg.pack))
    try:
        return _build(cfg, mesh, sequence, progress=progress)
    except BaseException:
        if sequence is not None:
            sequence.close()
        raise


def _build(cfg: TrainConfig, mesh: Mesh, sequence: ContextParallel | None, *,
           progress: bool) -> Trainer:
    """:func:`build` on the rank's mesh (and its slices of the sequences, with ``--cp``)."""
    replicas = cfg.dp if cfg.ft else 1
    replica = _replicas(cfg, mesh)
    ranks = gather_rank_map(mesh.placement)
    source = source_for(cfg)
    schedule = run_schedule(cfg, mesh.pp)
    scale = LossScale(enabled=cfg.precision == "fp16")
    parts = mesh.dp * replicas
    part = (0 if replica is None else replica.replica) * mesh.dp + mesh.dp_rank
    rows = cfg.batch_size // parts // cfg.microbatches
    sharded = (None if mesh.shard_mesh is None
               else ShardedStages(mesh.shard_mesh, cfg.fsdp_reshard))
    split = None if mesh.tp_mesh is None else source.tensor_parallel(cfg, mesh.tp_mesh)
    load = source.expert_load()
    spread = None if mesh.ep_mesh is None else source.expert_parallel(cfg, mesh, load)
    if spread is not None and sharded is not None:
        sharded.ignored = spread.params  # filled by the time FSDP2 shards a stage
    hooks = [h for h in (spread, split, sharded) if h is not None]  # experts, tp, FSDP2
    with across(dist.group.WORLD):  # every replica builds it now: one export for the job
        pipe = source.pipeline(cfg, schedule, rows, mesh.pp_rank, scale.wrap,
                               group=mesh.pp_group, device=mesh.device, timeout=cfg.timeout,
                               compile=cfg.compile, parallelize=Composed(*hooks)
                               if len(hooks) > 1 else (hooks[0] if hooks else None))
    loaded = source.loaded(pipe)
    if load is not None:
        _count_forwards(load, pipe, tapped=spread is not None)
    corpus = source.corpus(cfg, progress=progress and mesh.rank == 0)
    data: dict[str, Any] = {}
    batches: Batches | ExampleBatches
    if isinstance(corpus, ExampleCorpus):  # a data set: padded examples, held-out ones too
        make = packed_batches if cfg.pack else example_batches
        batches, held_out, data = make(corpus, cfg.batch_size, cfg.seq_len, cfg.seed,
                                       parts * mesh.cp, cfg.eval_batches)  # averaged ranks
    else:
        batches = Batches(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
        held_out = _eval_batches(corpus, cfg)
    params = [p for p in pipe.parameters() if p.requires_grad]
    experts = [] if spread is None else [p for p in spread.params if p.requires_grad]
    apart = {id(p) for p in experts}
    reducer, expert_reducer = _reducers(pipe, mesh, sharded is not None, apart)
    trainer = Trainer(
        cfg, mesh, source.model, pipe,
        build_optimizer(pipe.named_parameters(), source.no_decay, lr=cfg.lr,
                        weight_decay=cfg.weight_decay),
        scale, reducer, batches, [], NaNInjector.for_pipeline(pipe), source,
        params, *_tp_split([p for p in counted_parameters(pipe) if id(p) not in apart],
                           split is not None),
        loaded=loaded, sharded=sharded, tensor_parallel=split, ranks=ranks, experts=experts,
        expert_load=load, expert_reducer=expert_reducer, replicas=replica, parts=parts,
        part=part, sequence=sequence)
    trainer.eval_set = [trainer.rows(b) for b in held_out]
    trainer.data = data
    return trainer


def _replicas(cfg: TrainConfig, mesh: Mesh) -> Replicas | None:
    """With ``--ft``: this rank's torchft Manager (its server starts beating now, before the
    model is built); None without."""
    if not cfg.ft:
        return None
    from pipetrain.train.launch.replicas import Replicas

    return Replicas(cfg, mesh, cfg.ft_replica_id or 0)


def _reducers(pipe: Pipeline, mesh: Mesh, sharded: bool, experts: set[int]
              ) -> tuple[GradReducer, GradReducer | None]:
    """The data-parallel mean of the weights that are not ``experts`` (ids; FSDP2 averages
    its own when ``sharded``), and with expert parallelism the experts' reducer."""
    def params(spread: bool) -> dict[int, list[nn.Parameter]]:
        return {s: [p for p in st.parameters() if (id(p) in experts) == spread]
                for s, st in pipe.stages.items()}

    reducer = GradReducer(params(False), mesh.mean_group, 1 if sharded else mesh.averaged)
    if mesh.expert_group is None:
        return reducer, None
    return reducer, GradReducer(params(True), mesh.expert_group, mesh.averaged // mesh.ep,
                                divisor=mesh.averaged)


def _count_forwards(load: Any, pipe: Pipeline, *, tapped: bool) -> None:
    """Count ``load`` in the pipeline's F actions only (not a recomputed layer's replay
    before its backward); tap the experts' graphs unless expert parallelism counts already."""
    from pipetrain.schedules.action import Op

    def forward() -> bool:
        running = pipe.running()
        return running is not None and running.op is Op.F

    load.when = forward
    if not tapped:
        load.tap(stage.module for stage in pipe.stages.values())


def _eval_batches(corpus: Corpus, cfg: TrainConfig) -> list[Batch]:
    try:
        held_out = Batches(corpus.eval, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    except ValueError as e:
        raise ValueError(f"the held-out part of {corpus.source} is too short for an eval "
                         f"batch ({e})") from None
    return held_out.eval_batches(cfg.eval_batches)


def _tp_split(counted: list[nn.Parameter], tp: bool) -> tuple[list[nn.Parameter],
                                                              list[nn.Parameter]]:
    """(whole, split): the tensor-parallel slices apart (each rank holds one slice), the
    weights every tensor-parallel rank holds alike (perhaps FSDP2-sharded) on their own."""
    if not tp:
        return counted, []
    from torch.distributed.tensor import DTensor

    def is_split(p: nn.Parameter) -> bool:
        if not isinstance(p, DTensor) or "tp" not in (p.device_mesh.mesh_dim_names or ()):
            return False
        names = list(p.device_mesh.mesh_dim_names or ())
        return not p.placements[names.index("tp")].is_replicate()
    return [p for p in counted if not is_split(p)], [p for p in counted if is_split(p)]
