"""Model source: what a ``pipetrain train`` run trains, and how text becomes its input.

A run trains the built-in GPT on bytes (:class:`GPTSource`, ``--preset``) or a local Hugging
Face checkpoint through its own tokenizer (:class:`~pipetrain.train.sources.hf_source.HFSource`,
``--hf DIR``). The rest of the run (mesh, schedule, optimizer, checkpoints, eval, samples)
asks its source for the same few things, listed by :class:`Source`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.models.gpt import PRESETS, GPTConfig, gpt_layers, lm_loss
from pipetrain.parallel.context_parallel import slice_attention
from pipetrain.pipeline import Pipeline
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.balance import plan_balance
from pipetrain.split.partition import check_balance, even_balance, stage_bounds
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.examples import ExampleCorpus
from pipetrain.train.data.text import ByteCorpus, Corpus, decode, default_corpus, encode

__all__ = ["GPTSource", "Source", "parse_balance"]


LossWrap = Callable[[Callable[[Any, Any], torch.Tensor]], Callable[[Any, Any], torch.Tensor]]
"""Wraps the loss function (the fp16 loss scale multiplies it)."""


class Source(ABC):
    """The model of a run: built into this rank's pipeline, fed token ids, read as text."""

    model: Any
    """What the run trains: a :class:`~pipetrain.models.gpt.GPTConfig` or a Hugging Face model."""
    n_params: int
    """Parameters of the whole model (a tied weight once)."""
    no_decay: set[str]
    """Parameter names without weight decay (biases, norms, embeddings)."""
    exports = False
    """Whether :meth:`save` writes the model as ``save_pretrained`` does (``<out>/hf``, which
    the run's samples then generate from with a KV cache); else a run keeps it in pipetrain's
    checkpoints only."""
    max_positions: int | None = None
    """The most positions the model attends over (None: no limit known)."""
    kv_samples = True
    """Whether the end-of-run sample may be generated with a KV cache from the ``<out>/hf``
    just written (else through the training pipeline)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """The model's identity as JSON values: a checkpoint of another model is refused."""

    @abstractmethod
    def pipeline(self, cfg: TrainConfig, schedule: Schedule, rows: int, pp_rank: int,
                 wrap: LossWrap, **where: Any) -> Pipeline:
        """This rank's stages of the model, ``rows`` sequences per micro-batch; ``where``
        holds the pipeline's ``group``, ``device``, ``timeout`` and ``parallelize``."""

    @abstractmethod
    def corpus(self, cfg: TrainConfig, *, progress: bool = False) -> Corpus | ExampleCorpus:
        """The token ids of ``cfg.data`` (its last part held out), or its examples when it is
        a data set (:mod:`pipetrain.train.data.examples`)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (a prompt)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids."""

    def feed(self, ids: torch.Tensor) -> Any:
        """The pipeline's input for token ids (B, T)."""
        return ids

    def logits(self, outputs: Any) -> torch.Tensor:
        """The (B, T, vocab) logits in the pipeline's merged outputs."""
        return outputs  # type: ignore[no-any-return]

    def loaded(self, pipe: Pipeline) -> dict[str, Any]:
        """Give the built stages their stored values, if the source has any; what was read."""
        return {}

    def tensor_parallel(self, cfg: TrainConfig, mesh: Any) -> Any:
        """The ``parallelize`` hook that splits this model's layers over ``mesh`` (call
        before :meth:`pipeline`): the GPT plan of :mod:`pipetrain.parallel.tensor_parallel`."""
        from pipetrain.parallel.tensor_parallel import TensorParallel

        return TensorParallel(mesh, sequence_parallel=cfg.sequence_parallel)

    def expert_load(self) -> Any:
        """The counter of tokens per expert (:class:`pipetrain.hf.expert_load.ExpertLoad`);
        None for a model without experts."""
        return None

    def expert_parallel(self, cfg: TrainConfig, mesh: Any, load: Any = None) -> Any:
        """The ``parallelize`` hook that spreads this model's experts over ``mesh.ep_mesh``.

        Raises:
            ValueError: the built-in GPT has no experts.
        """
        raise ValueError("--ep spreads a mixture of experts' experts over ranks; the built-in "
                         "GPT has none: train an --hf MoE model, or leave --ep out")

    def save(self, out: Path, state: dict[str, torch.Tensor], group: Any) -> Path | None:
        """Write the model back in its own format at ``out`` from this rank's whole ``state``
        (collective over one pipeline); None when it has none (the built-in GPT lives in
        pipetrain's checkpoints only)."""
        return None


class GPTSource(Source):
    """The built-in GPT (``--preset``) on bytes."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.model: GPTConfig = dataclasses.replace(PRESETS[cfg.preset], seq_len=cfg.seq_len)
        self.n_params = self.model.n_params

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self.model)

    def pipeline(self, cfg: TrainConfig, schedule: Schedule, rows: int, pp_rank: int,
                 wrap: LossWrap, **where: Any) -> Pipeline:
        """Every rank builds the layers in order from ``cfg.seed``, keeping only its own."""
        hosted = hosted_layers(self.model, schedule, parse_balance(cfg.balance), pp_rank)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            layers = gpt_layers(self.model, keep=None if hosted is None else hosted.__contains__)
        self.no_decay = _no_decay(nn.Sequential(*layers))
        if cfg.cp > 1:  # each rank a slice of every sequence (train/setup.py binds the group)
            slice_attention(nn.Sequential(*layers))
        return Pipeline(layers, schedule, cfg.microbatches, wrap(lm_loss),
                        balance=parse_balance(cfg.balance), recompute=cfg.recompute,
                        init_seed=cfg.seed,
                        example_inputs=torch.zeros(rows, cfg.seq_len, dtype=torch.long),
                        **where)

    def corpus(self, cfg: TrainConfig, *, progress: bool = False) -> Corpus:
        return ByteCorpus.from_path(cfg.data) if cfg.data else default_corpus()

    def encode(self, text: str) -> list[int]:
        return encode(text).tolist()

    def decode(self, ids: Sequence[int]) -> str:
        return decode(ids)


def _no_decay(model: nn.Module) -> set[str]:
    from pipetrain.train.optim import no_decay_names

    return no_decay_names(model)


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


def parse_balance(text: str) -> str | Sequence[int] | None:
    """``--balance``: a mode, ``even`` (None), or layers per stage ``3,4,4,3``."""
    if text == "even":
        return None
    if text and text.replace(",", "").replace(" ", "").isdigit():
        return [int(n) for n in text.split(",")]
    return text
