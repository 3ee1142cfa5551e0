"""Sequence attention: a transformers model's attention over sequences sliced across cp ranks.

transformers lets a model's attention be any function registered with its public
``AttentionInterface``. :func:`shard_attention` registers :func:`attend` as ``pipetrain_cp``
and sets a model to it (before it is captured); each attention layer then calls it with its
own q, k and v of this rank's slice of the sequence. It exchanges heads for tokens
(:mod:`pipetrain.runtime.sequence`), runs the model's own kernel (transformers' SDPA, or the
model's eager attention where it caps logits) over the whole sequence with the mask of the
whole sequence, and exchanges back::

    q, k, v (B, H, s, D) ──seq_to_heads──► (B, H/cp, S, D) ──kernel + mask──► ──heads_to_seq──►

The mask is built here from the positions of the whole sequence (gathered from the ranks):
causal, a layer's sliding window (``sliding_window``, as transformers passes it: Mistral,
Qwen2's sliding layers, Gemma), and packed documents (positions restarting) kept apart. The
model's own mask is not used: transformers builds none for an attention it does not know.

:func:`problems` says what keeps a config from this path, and :func:`check_model` runs a
small copy of the model through it on one rank against transformers' own attention (packed
documents, a short sliding window), so that a model whose layers do not call the interface,
or call it with another meaning, is refused before any process starts.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipetrain.runtime.sequence import (
    TAG,
    Shards,
    bound,
    document_mask,
    gather_seq,
    heads_to_seq,
    kv_repeats,
    seq_to_heads,
)

__all__ = ["NAME", "attend", "check_model", "problems", "shard_attention"]

NAME = "pipetrain_cp"
"""The attention implementation's name in transformers' ``AttentionInterface``."""

_REFUSED_TYPES = {"bloom": "ALiBi", "mpt": "ALiBi", "jais": "ALiBi", "baichuan": "ALiBi"}
"""Model types whose attention biases positions in ways a slice does not see."""


class _Heads:
    """A layer as its kernel sees it after key-value heads were repeated ``repeats`` times."""

    def __init__(self, module: nn.Module, repeats: int) -> None:
        self._module = module
        self.num_key_value_groups = module.num_key_value_groups // repeats  # type: ignore[operator]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _kernel(module: nn.Module) -> tuple[Callable[..., Any], bool]:
    """The attention function this layer runs over the whole sequence, and whether it takes
    an additive float mask (eager) rather than a boolean one (SDPA)."""
    config = getattr(module, "config", None)
    if getattr(config, "attn_logit_softcapping", None):  # SDPA has no cap: the model's eager
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager, True
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS["sdpa"], False


def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function for this rank's slice of the sequence (see the
    module): (B, H, s, D) q, k, v in, (B, s, H, D) out."""
    shards = bound(TAG)
    repeats = kv_repeats(query.shape[1], key.shape[1], shards.size)
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    q, k, v = (seq_to_heads(t.contiguous(), TAG) for t in (query, key, value))
    kernel, additive = _kernel(module)
    window = kwargs.pop("sliding_window", None)
    positions = kwargs.pop("position_ids", None)
    mask = None
    if shards.documents or window is not None or additive:
        if positions is None:
            raise ValueError(f"{type(module).__name__} gives its attention no position_ids, "
                             "which context parallelism needs for a mask of the whole "
                             "sequence; run it without --cp")
        whole = gather_seq(positions.expand(query.shape[0], -1).contiguous(), TAG)
        mask = document_mask(whole, window)
        if additive:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~mask, torch.finfo(q.dtype).min)
    layer = _Heads(module, repeats) if repeats > 1 else module
    out, _ = kernel(layer, q, k, v, mask, **kwargs)  # (B, S, H/cp, D)
    mine = heads_to_seq(out.transpose(1, 2).contiguous(), TAG)
    return mine.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attend)  # again: the same function under the name


def shard_attention(model: nn.Module) -> None:
    """Set ``model`` (and its sub-models) to :func:`attend`, registered first."""
    _register()
    set_implementation = getattr(model, "set_attn_implementation", None)
    if set_implementation is not None:
        set_implementation(NAME)
    else:  # pragma: no cover - transformers before set_attn_implementation
        model.config._attn_implementation = NAME  # type: ignore[union-attr]


def problems(config: Any, cp: int, tp: int = 1) -> list[str]:
    """What keeps a model of ``config`` from ``cp`` context-parallel ranks (with ``tp``
    tensor-parallel ranks splitting its heads first), each with its fix."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = str(getattr(text, "model_type", ""))
    found = []
    if kind in _REFUSED_TYPES or getattr(text, "alibi", False):
        found.append(f"--cp: {type(config).__name__} biases attention by distance "
                     f"({_REFUSED_TYPES.get(kind, 'ALiBi')}), which this path does not carry "
                     "across the slices; train it without --cp")
    if getattr(text, "attention_chunk_size", None):
        found.append(f"--cp: {type(config).__name__} attends in chunks, which the whole "
                     "sequence's mask here does not draw; train it without --cp")
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(heads, int):
        return found + [f"--cp: {type(config).__name__} names no num_attention_heads: "
                        "context parallelism needs attention layers; train it without --cp"]
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    if heads % tp or kv % tp and tp % kv:
        return found  # --tp's own check names it
    local, local_kv = heads // tp, max(kv // tp, 1)
    try:
        kv_repeats(local, local_kv, cp)
    except ValueError as e:
        per = f" per --tp {tp} rank" if tp > 1 else ""
        found.append(f"--cp {cp}: {e} ({heads} heads, {kv} key-value heads{per})")
    return found


def check_model(small: Any, where: str) -> None:
    """Refuse ``--cp`` for a model whose attention does not go through this path as it
    should: a copy of config ``small`` (the model's, a few layers narrow: ``pipetrain train``
    gives 2 of width 32 at most), in float32 (a mixture of experts' grouped multiplies take
    no float64), on one rank, its sliding window (if any) cut to 3, reads two packed
    documents through :func:`attend` and through transformers' SDPA; every layer must call
    :func:`attend` and the logits must agree within 1e-5 of their largest (a wrong mask moves
    them by tenths).

    Raises:
        ValueError: naming the architecture and what went wrong.
    """
    from pipetrain.hf.model import transformers

    tf = transformers()
    small = copy.deepcopy(small)
    if getattr(small, "sliding_window", None):
        small.sliding_window = 3
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
    name = type(model).__name__
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(small.vocab_size), (1, 12), generator=g)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return attend(*args, **kwargs)

    try:
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=positions, use_cache=False).logits
            from transformers import AttentionInterface

            AttentionInterface.register(NAME + "_check", counted)
            model.set_attn_implementation(NAME + "_check")
            with Shards(None, documents=True):
                got = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    except Exception as e:  # noqa: BLE001 - any failure means it cannot be sliced
        raise ValueError(f"--cp: {name} ({where}) fails with its attention over slices "
                         f"({type(e).__name__}: {e}); train it without --cp") from None
    layers = int(getattr(small.get_text_config(), "num_hidden_layers", 0))
    if calls[0] < layers:
        raise ValueError(f"--cp: {name} ({where}) runs {layers - calls[0]} of its {layers} "
                         "attention layers without transformers' attention interface, so "
                         "they would see only their rank's slice; train it without --cp")
    if float((got - want).abs().max()) > 1e-5 * max(float(want.abs().max()), 1.0):
        raise ValueError(f"--cp: {name} ({where}) attends differently through the sliced "
                         "path than through its own (its mask is not causal, windowed and "
                         "by document as this path draws it); train it without --cp")
