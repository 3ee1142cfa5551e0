"""Verify HF: an ``--hf`` model's architecture from its config, optionally shrunk, split as
``pipetrain train`` splits it, one step checked against one process.

:func:`verify_hf` is what ``pipetrain verify`` runs
(:mod:`pipetrain.train.commands.verify_command`), and
:func:`before_training` what ``pipetrain train --verify`` before it starts any worker.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pipetrain.train.config import TrainConfig
from pipetrain.verify import Verification, verify_with

__all__ = ["verify_hf", "shrink", "before_training", "WIDTH", "ROWS"]

WIDTH = 64
"""The hidden size ``pipetrain train --verify`` checks the model at."""
ROWS = 2
"""Sequences per micro-batch (export specialises a dimension of size 1)."""

def verify_hf(cfg: TrainConfig, pp: int, *, layers: int | None = None,
              width: int | None = None, tolerance: float | None = None,
              dtype: torch.dtype = torch.float64,
              announce: Callable[[str], None] | None = None) -> Verification:
    """One step of ``cfg.hf``'s model (shrunk by ``layers``, ``width``) pipelined over ``pp``
    local ranks as ``pipetrain train`` would with ``cfg``, against one process;
    ``announce`` is given one line naming the model checked, before the check.

    With all its layers and ``balance = params`` the stages hold the layers a full-size run
    gives them (planned on the full model on ``meta``), whatever ``width``.

    Raises:
        ValueError, FileNotFoundError: for a directory without a config, sizes that do not
            fit the model, or a layout the schedule does not allow.
    """
    from pipetrain.hf.model import open_model, transformers
    from pipetrain.train.checks import run_schedule

    opened = open_model(Path(cfg.hf), images=True)
    if opened.image_text:
        return _verify_image_text(opened, cfg, pp, layers, width, tolerance, dtype, announce)
    config = shrink(opened.config, layers, width)
    _check_positions(config, cfg.seq_len)
    with torch.device("meta"):
        model = transformers().AutoModelForCausalLM.from_config(config, dtype=dtype)
    _float64_experts(model, dtype)
    if announce is not None:
        announce(_describe(cfg, config, opened.config, model))
    schedule = run_schedule(cfg, pp)
    if cfg.balance == "params" and width is not None and layers is None:
        cfg = dataclasses.replace(cfg, balance=_full_size_balance(opened.model, cfg, schedule))
    vocab = int(config.vocab_size)
    g = torch.Generator().manual_seed(cfg.seed)
    window = torch.randint(0, vocab, (ROWS * cfg.microbatches, cfg.seq_len + 1), generator=g)

    from pipetrain.train.sources.hf_source import hf_pipeline

    return verify_with(lambda m: hf_pipeline(m, cfg, schedule, ROWS, lambda f: f,
                                             local_ranks=pp),
                       model, {"input_ids": window[:, :-1]}, window[:, 1:],
                       tolerance=tolerance, dtype=dtype, seed=cfg.seed)


def _verify_image_text(opened: Any, cfg: TrainConfig, pp: int, layers: int | None,
                       width: int | None, tolerance: float | None, dtype: torch.dtype,
                       announce: Callable[[str], None] | None) -> Verification:
    """:func:`verify_hf` of an image-text model: its language model shrunk (its vocabulary
    kept: the processor writes every id), its vision tower as saved, on chats with random
    images of two sizes made by its own processor
    (:func:`~pipetrain.train.sources.image_text_source.random_chats`)."""
    from pipetrain.hf.image_text import (
        image_token_ids,
        load_processor,
        meta_image_text,
        varying_inputs,
    )
    from pipetrain.train.checks import run_schedule
    from pipetrain.train.data.prompt_answer import takes_answers
    from pipetrain.train.sources.hf_source import hf_pipeline
    from pipetrain.train.sources.image_text_source import random_chats

    config = copy.deepcopy(opened.config)
    text = config.get_text_config()
    shrunk = shrink(text, layers, width)
    shrunk.vocab_size = text.vocab_size
    for key, value in vars(shrunk).items():
        setattr(text, key, value)
    _check_positions(text, cfg.seq_len)
    model = meta_image_text(config).to(dtype)
    processor = load_processor(cfg.hf)
    inputs, targets = random_chats(processor, image_token_ids(config, processor),
                                   ROWS * cfg.microbatches, cfg.seq_len, cfg.seed)
    if announce is not None:
        announce(_describe(cfg, text, opened.config.get_text_config(), model,
                           f"{ROWS * cfg.microbatches} chats of up to {cfg.seq_len} tokens "
                           + ("with a random image each, of two sizes"
                              if takes_answers(processor) else
                              "with 0 to 2 random images of two sizes")))
    schedule = run_schedule(cfg, pp)
    example = random_chats(processor, image_token_ids(config, processor), ROWS, cfg.seq_len,
                           cfg.seed)[0]  # what the capture is taken with (a row shows one)
    return verify_with(lambda m: hf_pipeline(m, cfg, schedule, ROWS, lambda f: f,
                                             examples=True, example=example,
                                             dynamic=varying_inputs(m), local_ranks=pp),
                       model, inputs, targets, tolerance=tolerance, dtype=dtype, seed=cfg.seed)


def _float64_experts(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A mixture of experts checked in float64 runs its experts as transformers'
    ``batched_mm`` (the default ``grouped_mm`` kernel has no float64; ``eager`` loops over the
    experts that got tokens, which a capture cannot follow); the training run keeps its own."""
    can = getattr(model, "_can_set_experts_implementation", None)
    if dtype == torch.float64 and callable(can) and can():
        model.set_experts_implementation("batched_mm")  # type: ignore[operator]


def _describe(cfg: TrainConfig, config: Any, saved: Any, model: torch.nn.Module,
              fed: str | None = None) -> str:
    """One line: the model, its sizes (and the saved ones where shrunk), what it is fed."""
    sizes = []
    for key, label in (("num_hidden_layers", "{} layers"), ("hidden_size", "hidden {}"),
                       ("num_attention_heads", "{} heads"), ("vocab_size", "vocabulary {}")):
        now, was = getattr(config, key), getattr(saved, key)
        sizes.append(label.format(now) + ("" if now == was else f" (saved: {was})"))
    n = sum(p.numel() for p in model.parameters())
    fed = fed or f"{ROWS * cfg.microbatches} random sequences of {cfg.seq_len} tokens"
    return (f"pipetrain verify: {type(model).__name__} of {cfg.hf}: {', '.join(sizes)}; "
            f"{n:,} parameters; {fed}\n")


def _full_size_balance(model: torch.nn.Module, cfg: TrainConfig, schedule: Any) -> str:
    """The layers per stage ``balance = params`` gives the full-size model (on ``meta``)."""
    from pipetrain.hf.model import split_points
    from pipetrain.split.balance import plan_balance
    from pipetrain.split.layers import trace_stages

    example = {"input_ids": torch.zeros(ROWS, cfg.seq_len, dtype=torch.long)}
    traced = trace_stages(model, split_points(model, schedule.n_stages, example), example, "params",
                          schedule.n_stages)
    sizes = plan_balance(list(traced.stages), schedule, "params").balance
    return ",".join(map(str, sizes))


# ------------------------------------------------------------------------------ shrinking


_MLP = ("intermediate_size", "ffn_dim", "n_inner", "moe_intermediate_size",
        "shared_expert_intermediate_size", "ffn_hidden_size")
_EMBEDDING = ("word_embed_proj_dim", "embedding_size")


def shrink(config: Any, layers: int | None, width: int | None) -> Any:
    """A copy of a transformers config with ``layers`` decoder layers (per-layer lists cut to
    match) and hidden size ``width`` (heads, MLP and vocabulary made small to match).

    Raises:
        ValueError: for fewer than 1 layer, or a width the heads cannot share.
    """
    config = copy.deepcopy(config)
    if layers is not None:
        _shrink_layers(config, layers)
    if width is not None:
        _shrink_width(config, width)
    return config


def _shrink_layers(config: Any, layers: int) -> None:
    had = int(config.num_hidden_layers)
    if not 1 <= layers:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    for key, value in vars(config).items():  # layer_types and the like: one entry per layer
        if isinstance(value, list) and len(value) == had:
            setattr(config, key, value[:layers])
    config.num_hidden_layers = min(layers, had)


def _shrink_width(config: Any, width: int) -> None:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    group = heads // kv if heads % kv == 0 else 1
    new_kv = min(kv, 2)
    new_heads = new_kv * group
    if width < 2 or width % new_heads or (width // new_heads) % 2:
        raise ValueError(f"--width {width}: {new_heads} heads ({new_kv} key-value heads, "
                         f"grouped {group} to 1 as the model groups them) need a width that "
                         f"is a multiple of {2 * new_heads}")
    config.hidden_size, config.num_attention_heads = width, new_heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = new_kv
    if vars(config).get("head_dim"):  # stored, not a property of the others
        config.head_dim = width // new_heads
    for key in _MLP:
        if type(getattr(config, key, None)) is int:
            setattr(config, key, 2 * width)
    for key in _EMBEDDING:
        if getattr(config, key, None) == hidden:
            setattr(config, key, width)
    config.vocab_size = min(int(config.vocab_size), max(256, _largest_token_id(config) + 1))


def _largest_token_id(config: Any) -> int:
    ids = [-1]
    for key, value in vars(config).items():
        if key.endswith("_token_id"):
            values = value if isinstance(value, list) else [value]
            ids += [v for v in values if type(v) is int]
    return max(ids)


def _check_positions(config: Any, seq_len: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} is longer than the model's {limit} positions")


# ----------------------------------------------------------------------- train --verify


def before_training(cfg: TrainConfig, announce: Callable[[str], None] | None = None
                    ) -> Verification:
    """``pipetrain train --verify``: :func:`verify_hf` of the run's model at hidden size
    :data:`WIDTH` with all its layers, under the run's pipeline layout (ranks, schedule,
    stages per rank, micro-batches, balance, recomputation, seed, sequence length; whole
    sequences under ``--cp``); ``announce`` as in :func:`verify_hf`.

    Raises:
        ValueError: without ``--hf``, or for a layout the run cannot have.
    """
    from pipetrain.train.mesh import layout

    if not cfg.hf:
        raise ValueError("--verify checks a --hf model; the built-in GPT's pipeline is "
                         "checked by the test suite (tests/test_runtime_dist.py)")
    world = int(os.environ.get("WORLD_SIZE", cfg.nproc))
    _, pp = layout(world, cfg.dp, cfg.pp, cfg.fsdp, cfg.tp, cfg.cp)
    # whole sequences: with --cp the sliced attention has its own check, which the command
    # runs first (pipetrain.hf.sequence_attention.check_model)
    return verify_hf(dataclasses.replace(cfg, cp=1), pp, width=WIDTH, announce=announce)
