"""Setup: from a TrainConfig to this rank's mesh, pipelined GPT, optimizer, loss scale and data.

Every rank builds the GPT's layers in order from ``cfg.seed``, so their values do not depend on
the layout, but keeps real only the blocks of its own stages (the others are moved to ``meta``
as soon as they are built: a rank never holds more than its share plus one block); the
profiling balances, which measure every layer on rank 0, build them all. It hosts its stages in
a :class:`~pipetrain.Pipeline` over its replica's pipeline group, and draws the same global
batch per step, of which its replica takes rows ``[dp_rank * B/dp, (dp_rank + 1) * B/dp)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipetrain.balance import plan_balance
from pipetrain.data import Batches, ByteCorpus, default_corpus
from pipetrain.generators import make_schedule
from pipetrain.gpt import PRESETS, GPTConfig, gpt_layers, lm_loss
from pipetrain.partition import check_balance, even_balance, stage_bounds
from pipetrain.pipeline import Pipeline
from pipetrain.schedule import Schedule
from pipetrain.train.config import TrainConfig
from pipetrain.train.mesh import GradReducer, Mesh, build_mesh, layout
from pipetrain.train.nonfinite import NaNInjector
from pipetrain.train.optim import build_optimizer, counted_parameters, no_decay_names
from pipetrain.train.precision import PRECISIONS, LossScale

__all__ = ["Trainer", "build", "check_config", "hosted_layers"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Trainer:
    """Everything one rank of a training run holds, and where the run stands."""

    cfg: TrainConfig
    mesh: Mesh
    model: GPTConfig
    pipe: Pipeline
    optimizer: torch.optim.AdamW
    scale: LossScale
    reducer: GradReducer
    batches: Batches
    """The global training batches (every replica draws all of them, then takes its rows)."""
    eval_set: list[Batch]
    """This replica's rows of the held-out batches."""
    injector: NaNInjector
    params: list[nn.Parameter] = field(default_factory=list)
    """This rank's trainable parameters."""
    counted: list[nn.Parameter] = field(default_factory=list)
    """The ones this rank counts towards the global gradient norm."""
    step: int = 0
    """The next step to run (= steps done, skipped ones included)."""
    skipped: int = 0
    """Steps skipped for a non-finite loss, gradients or an fp16 overflow."""

    def layout(self) -> dict[str, Any]:
        """How the run is laid out: a resumed run with the same layout restores RNG streams."""
        s = self.pipe.schedule
        return {**self.mesh.describe(), "schedule": s.name, "microbatches": s.n_microbatches,
                "stages": s.n_stages, "stages_per_rank": s.n_stages // s.n_ranks,
                "placement": list(s.placement), "balance": list(self.pipe.balance),
                "precision": self.cfg.precision}

    def batch(self, step: int) -> Batch:
        """This replica's rows of global batch ``step``."""
        return self.rows(self.batches.batch(step))

    def rows(self, batch: Batch) -> Batch:
        n = batch[0].size(0) // self.mesh.dp
        lo = self.mesh.dp_rank * n
        return batch[0][lo:lo + n], batch[1][lo:lo + n]


def check_config(cfg: TrainConfig, world: int) -> None:
    """Every problem with ``cfg`` for a world of ``world`` ranks, raised at once.

    Raises:
        ValueError: listing each problem and how to fix it.
    """
    problems = []
    try:
        dp, pp = layout(world, cfg.dp, cfg.pp)
        make_schedule(cfg.schedule, pp, cfg.microbatches, cfg.stages_per_rank)
    except ValueError as e:
        problems.append(str(e))
        dp = max(cfg.dp, 1)
    if cfg.preset not in PRESETS:
        problems.append(f"unknown preset {cfg.preset!r}; choose one of {list(PRESETS)}")
    if cfg.precision not in PRECISIONS:
        problems.append(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.nonfinite not in ("skip", "abort"):
        problems.append(f"nonfinite must be 'skip' or 'abort', got {cfg.nonfinite!r}")
    if cfg.batch_size % dp or cfg.batch_size // dp < cfg.microbatches:
        problems.append(f"batch_size={cfg.batch_size} must split into dp={dp} equal replica "
                        f"batches of at least microbatches={cfg.microbatches} sequences; use a "
                        f"multiple of {dp} that is >= {dp * cfg.microbatches}")
    if cfg.steps < 1 or cfg.seq_len < 1 or cfg.warmup < 0 or cfg.eval_batches < 1:
        problems.append("steps, seq_len and eval_batches must be >= 1 and warmup >= 0 (got "
                        f"{cfg.steps}, {cfg.seq_len}, {cfg.eval_batches}, {cfg.warmup})")
    if problems:
        raise ValueError("invalid training configuration:\n" + "\n".join(
            f"  - {p}" for p in problems))


def build(cfg: TrainConfig) -> Trainer:
    """This rank's part of the run described by ``cfg`` (call on every rank at once)."""
    import torch.distributed as dist

    check_config(cfg, dist.get_world_size() if dist.is_initialized() else 1)
    mesh = build_mesh(cfg.dp, cfg.pp, cfg.device)
    model = dataclasses.replace(PRESETS[cfg.preset], seq_len=cfg.seq_len)
    schedule = make_schedule(cfg.schedule, mesh.pp, cfg.microbatches, cfg.stages_per_rank)
    hosted = hosted_layers(model, schedule, _balance(cfg.balance), mesh.pp_rank)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        layers = gpt_layers(model, keep=None if hosted is None else hosted.__contains__)
    no_decay = no_decay_names(nn.Sequential(*layers))
    scale = LossScale(enabled=cfg.precision == "fp16")
    pipe = Pipeline(layers, schedule, cfg.microbatches, scale.wrap(lm_loss),
                    balance=_balance(cfg.balance),
                    group=mesh.pp_group, device=mesh.device, timeout=cfg.timeout,
                    recompute=cfg.recompute, init_seed=cfg.seed,
                    example_inputs=torch.zeros(cfg.batch_size // mesh.dp // cfg.microbatches,
                                               cfg.seq_len, dtype=torch.long))
    corpus = ByteCorpus.from_path(cfg.data) if cfg.data else default_corpus()
    batches = Batches(corpus.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    params = [p for p in pipe.parameters() if p.requires_grad]
    trainer = Trainer(
        cfg, mesh, model, pipe,
        build_optimizer(pipe.named_parameters(), no_decay, lr=cfg.lr,
                        weight_decay=cfg.weight_decay),
        scale, GradReducer({s: st.parameters() for s, st in pipe.stages.items()}, mesh.dp_group,
                           mesh.dp), batches, [],
        NaNInjector.for_pipeline(pipe),
        params, counted_parameters(pipe))
    trainer.eval_set = [trainer.rows(b) for b in _eval_batches(corpus, cfg)]
    return trainer


def hosted_layers(model: GPTConfig, schedule: Schedule, balance: str | Sequence[int] | None,
                  pp_rank: int) -> set[int] | None:
    """Indices of the layers of ``pp_rank``'s stages; None when every rank must build them all.

    The split is the one ``Pipeline`` makes of the same layers: ``"params"`` is planned on the
    model built on ``meta`` (parameter bytes need no values). The profiling balances run every
    layer on rank 0, so under them every rank builds every layer (None).
    """
    with torch.device("meta"):
        described = gpt_layers(model)
    n = len(described)
    if balance == "params":
        sizes: Sequence[int] = plan_balance(described, schedule, "params").balance
    elif balance is None:
        sizes = even_balance(n, schedule.n_stages)
    elif isinstance(balance, str):
        return None
    else:
        sizes = check_balance(balance, n, schedule.n_stages)
    bounds = stage_bounds(sizes)
    return {i for s in schedule.stages_of(pp_rank) for i in range(*bounds[s])}


def _balance(text: str) -> str | Sequence[int] | None:
    """``--balance``: a mode, ``even`` (None), or layers per stage ``3,4,4,3``."""
    if text == "even":
        return None
    if text and text.replace(",", "").replace(" ", "").isdigit():
        return [int(n) for n in text.split(",")]
    return text


def _eval_batches(corpus: ByteCorpus, cfg: TrainConfig) -> list[Batch]:
    try:
        held_out = Batches(corpus.eval, cfg.batch_size, cfg.seq_len, seed=cfg.seed)
    except ValueError as e:
        raise ValueError(f"the held-out part of {corpus.source} is too short for an eval "
                         f"batch ({e})") from None
    return held_out.eval_batches(cfg.eval_batches)
