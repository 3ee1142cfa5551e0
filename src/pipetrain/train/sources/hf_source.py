"""HF source: a local Hugging Face checkpoint (``--hf DIR``) as the model of a training run.

The model comes from ``DIR/config.json`` on ``meta`` (:mod:`pipetrain.hf.model`), is cut at its
decoder layers, which ``--balance`` groups into the schedule's stages, and each rank
materialises its own stages by name from ``--seed`` and then reads their stored values, if DIR
has weights, straight from the safetensors files. Text goes through DIR's tokenizer
(:mod:`pipetrain.train.data.tokens`); the pipeline's input is ``{"input_ids": ids}``, and the
loss is
the mean next-token cross-entropy of the output's ``logits`` (plus ``router_aux_loss_coef x
aux_loss`` for a mixture of experts whose config sets ``output_router_logits``), which is what
``model(input_ids, labels=...)`` computes on the same tokens. A data set as ``--data``
(:mod:`pipetrain.train.data.examples`) feeds padded examples, ``{"input_ids", "attention_mask"}``,
and the loss is the mean over the trained tokens, as ``model(..., labels=...)`` with -100 on
the others.
"""

from __future__ import annotations

import copy
import json
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.hf import lora
from pipetrain.hf.model import load_tokenizer, load_weights, open_model, share_bytes, split_points
from pipetrain.hf.save import save_pretrained
from pipetrain.models.gpt import lm_loss
from pipetrain.pipeline import Pipeline
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.lazy import NamedInit, is_meta
from pipetrain.split.partition import even_balance
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.examples import ExampleCorpus, example_corpus, masked_lm_loss
from pipetrain.train.data.records import is_dataset
from pipetrain.train.data.text import Corpus
from pipetrain.train.data.tokens import token_corpus
from pipetrain.train.optim import no_decay_names
from pipetrain.train.sources.source import LossWrap, Source, parse_balance

__all__ = ["HFSource", "causal_lm_loss", "causal_lm_loss_of", "hf_pipeline", "peak_rss_bytes"]


def causal_lm_loss(out: Any, targets: torch.Tensor, *, aux_coef: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy of a ``CausalLMOutput``'s logits against ``targets``, plus
    ``aux_coef`` times ``out.aux_loss``, the router's load-balancing loss that a mixture of
    experts returns with ``output_router_logits``. With ``aux_coef`` its config's
    ``router_aux_loss_coef`` (:func:`causal_lm_loss_of`), this is the loss of
    ``model(input_ids, labels=...)``.
    """
    loss = lm_loss(out.logits, targets)
    aux = getattr(out, "aux_loss", None)
    if not aux_coef or not isinstance(aux, torch.Tensor):
        return loss
    return loss + aux_coef * aux.to(loss.device)


def causal_lm_loss_of(model: nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """:func:`causal_lm_loss` with ``model``'s router loss weight: its config's
    ``router_aux_loss_coef`` when the config has ``output_router_logits`` on (a mixture of
    experts returning ``aux_loss``); else the cross-entropy alone.
    """
    config = getattr(model, "config", None)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or not coef:
        return causal_lm_loss

    def loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(out, targets, aux_coef=coef)

    return loss


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (``getrusage``; kilobytes on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def hf_pipeline(model: nn.Module, cfg: TrainConfig, schedule: Schedule, rows: int,
                wrap: LossWrap, *, examples: bool = False,
                example: dict[str, Any] | None = None, dynamic: bool = False,
                **where: Any) -> Pipeline:
    """``model`` (on ``meta`` or real) cut as ``pipetrain train --hf`` cuts it: at its decoder
    layers, which ``cfg.balance`` groups into the schedule's stages (``even``: equal counts),
    ``rows`` sequences of ``cfg.seq_len`` tokens per micro-batch, captured at those shapes
    (``dynamic=False``: every step gives them, and export does no symbolic shape reasoning,
    about a third of the CPU time to capture); ``where`` as in
    :meth:`Source.pipeline` (or ``local_ranks``). The profiling balances (``time``,
    ``memory``) run every layer, so under them a ``meta`` model is materialised whole first.

    ``examples``: the input is padded examples (:mod:`pipetrain.train.data.examples`): captured
    with an ``attention_mask``, the loss :func:`~pipetrain.train.data.examples.masked_lm_loss`
    summed over the micro-batches. ``example``: what to capture with instead of zeros (an
    image-text model's processor outputs); ``dynamic``: captured with symbolic shapes instead,
    for inputs whose sizes change (:func:`pipetrain.hf.image_text.varying_inputs`).
    """
    if example is None and cfg.cp > 1:  # a slice of each sequence, at its positions
        from pipetrain.hf.sequence_attention import shard_attention

        shard_attention(model)
        length = cfg.seq_len // cfg.cp
        example = {"input_ids": torch.zeros(rows, length, dtype=torch.long),
                   "position_ids": torch.arange(length).repeat(rows, 1)}
    if example is None:
        example = {"input_ids": torch.zeros(rows, cfg.seq_len, dtype=torch.long)}
        if examples and cfg.pack:  # packed rows: positions restart at each example, no mask
            example["position_ids"] = torch.arange(cfg.seq_len).repeat(rows, 1)
        elif examples:
            example["attention_mask"] = torch.ones(rows, cfg.seq_len, dtype=torch.long)
    points = split_points(model, schedule.n_stages, example)
    balance = parse_balance(cfg.balance)
    if balance is None:
        balance = even_balance(len(points) + 1, schedule.n_stages)
    if isinstance(balance, str) and balance != "params" and is_meta(model):
        model = NamedInit(model, cfg.seed).materialize(model)
    return Pipeline(model, schedule, cfg.microbatches,
                    wrap(masked_lm_loss if examples else causal_lm_loss_of(model)),
                    split_points=points, balance=balance, recompute=cfg.recompute,
                    init_seed=cfg.seed, example_inputs=example, dynamic=dynamic,
                    loss_reduction="sum" if examples else "mean", **where)


def _sequences(ids: Any) -> dict[str, torch.Tensor]:
    """The input of a context-parallel pipeline: ``{input_ids, position_ids}``, the positions
    given (packed rows) or counted from 0 along each row. A padded row's attention mask is
    left out: its padding is at the end, where causal attention keeps every trained token
    from seeing it, so the loss and its gradients are those of the masked row."""
    inputs = ids if isinstance(ids, dict) else {"input_ids": ids}
    tokens = inputs["input_ids"]
    positions = inputs.get("position_ids")
    if positions is None:
        positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    return {"input_ids": tokens, "position_ids": positions.contiguous()}


class HFSource(Source):
    """The model, tokenizer and weights of ``cfg.hf``.

    Raises:
        FileNotFoundError, ValueError: for a directory without a config or tokenizer, a
            tokenizer larger than the model's vocabulary, or ``--seq-len`` beyond the model's
            positions.
    """

    exports = True  # <out>/hf, with save_pretrained's files
    images = False
    """Whether an image-text config is built as such (:mod:`.image_text_source`)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.root = Path(cfg.hf)
        self.hf = open_model(self.root, images=self.images)
        self.cfg = cfg
        self.lora = (lora.lora_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                      cfg.lora_targets,
                                      self.hf.config if self.hf.image_text else None)
                     if cfg.lora_r else None)
        if self.lora is not None:  # before the cut: the stages hold the adapters
            lora.add_adapters(self.hf.model, self.lora)
        self.rss_before = peak_rss_bytes()
        self.model = self.hf
        self.n_params = self.hf.n_params
        self.tokenizer = self.load_tokenizer()
        self.preprocessor: Any = self.tokenizer
        """What ``<out>/hf`` is written with beside the weights (tokenizer or processor)."""
        self.examples = is_dataset(cfg.data)
        """``--data`` is a data set of examples (padded rows, masked loss), not text."""
        self.no_decay = no_decay_names(self.hf.model)
        vocab = int(self.hf.config.get_text_config().vocab_size)
        if len(self.tokenizer) > vocab:
            raise ValueError(f"--hf {cfg.hf}: the tokenizer has {len(self.tokenizer)} tokens but "
                             f"the model's vocab_size is {vocab}; save the matching tokenizer")
        self.max_positions = limit = self.hf.max_positions
        if limit is not None and cfg.seq_len > limit:
            raise ValueError(f"--seq-len {cfg.seq_len} is longer than {limit}, the positions "
                             f"of {type(self.hf.model).__name__} (max_position_embeddings); "
                             f"use --seq-len {limit} or less")

    def load_tokenizer(self) -> Any:
        """The directory's tokenizer."""
        return load_tokenizer(self.root)

    def describe(self) -> dict[str, Any]:
        described = self.hf.describe()
        if self.lora is not None:
            described["lora"] = {"r": self.lora.r, "alpha": self.lora.lora_alpha,
                                 "dropout": self.lora.lora_dropout,
                                 "targets": sorted(self.lora.target_modules)}
        return described

    def pipeline(self, cfg: TrainConfig, schedule: Schedule, rows: int, pp_rank: int,
                 wrap: LossWrap, **where: Any) -> Pipeline:
        """Cut at the decoder layers; the balance groups them (``even``: equal counts).

        The profiling balances (``time``, ``memory``) run every layer, so under them the
        whole model is materialised on every rank first.
        """
        return hf_pipeline(self.hf.model, cfg, schedule, rows, wrap, examples=self.examples,
                           **where)

    def loaded(self, pipe: Pipeline) -> dict[str, Any]:
        """Read this rank's tensors from the safetensors files; what it read, and this
        process's peak resident memory before building its stages and after loading them."""
        state = pipe.state_dict()
        if self.lora is not None:  # the base under its stored names; the adapters start at 0
            lora.start_as_base(state)
            state = {lora.stored_name(n): t for n, t in state.items() if not lora.is_adapter(n)}
        report = load_weights(self.hf, state)
        return {"weights": "stored" if self.hf.weights else "initialised from --seed",
                "tensors_read": report.tensors, "bytes_read": report.bytes,
                "share_bytes": share_bytes(state), "model_bytes": 4 * self.n_params,
                "rss_before_bytes": self.rss_before, "peak_rss_bytes": peak_rss_bytes()}

    def tensor_parallel(self, cfg: TrainConfig, mesh: Any) -> Any:
        """The model's own plan (:mod:`pipetrain.hf.tp_plan`): its meta model takes
        one tp rank's shapes here, before :meth:`pipeline` captures it.

        Raises:
            ValueError: when the model declares no plan, its heads do not split, or it has
                no stored weights (seeded values would repeat across the ranks' slices).
        """
        from pipetrain.hf.tp_plan import TracedTensorParallel, require_weights, shrink

        require_weights(bool(self.hf.weights), self.root)
        return TracedTensorParallel(mesh, shrink(self.hf.model, mesh.size(),
                                                 mesh.get_local_rank()))

    def expert_load(self) -> Any:
        """Counts of tokens per expert of each MoE layer the model's expert-parallel plan
        names (:mod:`pipetrain.hf.expert_load`); None for a model without one."""
        from pipetrain.hf.expert_load import ExpertLoad
        from pipetrain.hf.expert_parallel import experts_paths

        paths = experts_paths(self.hf.model)
        if not paths:
            return None
        experts: Any = self.hf.model.get_submodule(paths[0])
        return ExpertLoad(paths, int(experts.num_experts))

    def expert_parallel(self, cfg: TrainConfig, mesh: Any, load: Any = None) -> Any:
        """The model's own expert-parallel plan (:mod:`pipetrain.hf.expert_parallel`),
        applied to the captured stages; ``mesh.ep_mesh`` holds the experts, ``load`` counts
        their tokens.

        Raises:
            ValueError: when the model declares no plan, or ``--ep`` does not divide its
                experts.
        """
        from pipetrain.hf.expert_parallel import TracedExpertParallel

        return TracedExpertParallel(self.hf.model, mesh.ep_mesh, mesh.batch_mesh, load)

    def corpus(self, cfg: TrainConfig, *, progress: bool = False) -> Corpus | ExampleCorpus:
        if self.examples and cfg.data:
            return example_corpus(self.tokenizer, self.root, cfg.data, cfg.token_cache,
                                  text_field=cfg.text_field, chat=cfg.chat,
                                  chat_field=cfg.chat_field, progress=progress)
        return token_corpus(self.tokenizer, self.root, cfg.data, cfg.token_cache,
                            progress=progress)

    def feed(self, ids: Any) -> Any:
        """``{"input_ids": ids}``; padded examples come as such a dict already, and text for
        a pipeline captured with a mask (a sample) gets one of ones."""
        if self.cfg.cp > 1:  # every slice at its positions, no mask (see _sequences)
            return _sequences(ids)
        if isinstance(ids, dict):
            return ids
        if self.examples and self.cfg.pack:
            positions = torch.arange(ids.shape[-1], device=ids.device).expand_as(ids)
            return {"input_ids": ids, "position_ids": positions.contiguous()}
        if self.examples:
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"input_ids": ids}

    def logits(self, outputs: Any) -> torch.Tensor:
        return outputs.logits  # type: ignore[no-any-return]

    def context_problems(self, cfg: TrainConfig) -> list[str]:
        """What keeps this model from ``--cp`` (:mod:`pipetrain.hf.sequence_attention`)."""
        from pipetrain.hf.sequence_attention import problems

        return problems(self.hf.config, cfg.cp, cfg.tp)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids))
        return text

    def save(self, out: Path, state: dict[str, torch.Tensor], group: Any) -> Path | None:
        """Write ``out`` as a ``save_pretrained`` directory from this rank's whole ``state``
        (collective over one pipeline); with LoRA, ``out``'s sibling ``adapter`` in peft's
        format instead, and ``out`` with the adapter merged in under ``--merge``."""
        if self.lora is None:
            return save_pretrained(out, state, self.saved_config(), self.preprocessor,
                                   self.root, group=group)
        mine = {n: t.detach().cpu() for n, t in state.items() if lora.is_adapter(n)}
        held: list[Any] = [mine]
        if dist.is_initialized():
            held = [None] * dist.get_world_size(group)
            dist.all_gather_object(held, mine, group=group)
        if dist.is_initialized() and dist.get_rank(group) != 0:
            return None
        adapters = {n: t for part in held for n, t in part.items()}
        where = lora.save_adapter(out.with_name("adapter"), adapters, self.lora,
                                  self.saved_config(), str(self.root))
        if self.cfg.merge:
            lora.merge(out, self.root, where, self.preprocessor)
        return where

    def saved_config(self) -> Any:
        """The config to save: the source's, float32, with its own ``use_cache``."""
        config = copy.deepcopy(self.hf.config)
        raw = json.loads((self.root / "config.json").read_text())
        config.use_cache = raw.get("use_cache", True)
        return config
