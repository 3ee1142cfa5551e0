"""GPT: a decoder-only language model written as a layer list, so a pipeline can cut it anywhere.

``gpt_layers(config)`` returns ``[Embedding, Block x n_layers, Head]``; each layer takes one
tensor and returns one, so ``nn.Sequential(*gpt_layers(cfg))(ids)`` is the whole model and
``Pipeline(gpt_layers(cfg), ...)`` splits it between any two layers. The head's output matrix
*is* the embedding's token table (one ``nn.Parameter`` in two layers), which the pipeline
recognises and keeps tied across ranks.

Every layer initialises itself in ``reset_parameters()`` (normal(0, 0.02), zero biases, the
projections that write into the residual stream scaled by 1/sqrt(2 n_layers) as in GPT-2), so
the values follow from ``torch.manual_seed`` and a layer built on the ``meta`` device can be
materialised by :func:`pipetrain.split.lazy.materialize`.

Presets (byte vocabulary, 256 tokens; parameters counted once for the tied table, checked by
``tests/test_gpt.py``)::

    preset  d_model  layers  heads  seq_len      parameters
    tiny         64       4      4       64         220,544
    small       256       6      8      256       4,870,144
    medium      768      12     12     1024      86,039,040
    large      1024      24     16     1024     303,622,144
    1b         2048      24     16     2048   1,213,321,216

Two ways to build a model:

- ``gpt_layers(cfg)``: real modules, head tied to the embedding. The recommended path.
- ``gpt_specs(cfg)``: :class:`~pipetrain.split.lazy.LayerSpec` s, so each rank builds only its own
  stages (models too big to build whole on every rank). Each spec builds a separate layer, so
  the head gets its **own, untied** output matrix (``config.n_params + vocab x d_model``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

from pipetrain.runtime import sequence
from pipetrain.split.lazy import LayerSpec

__all__ = ["GPTConfig", "PRESETS", "Embedding", "Block", "Head", "gpt_layers", "gpt_specs",
           "lm_loss", "preset_table"]

INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT model."""

    vocab_size: int = 256
    """Token ids are 0..vocab_size-1 (256: bytes)."""
    seq_len: int = 64
    """Longest sequence the learned position table covers."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per block; must divide d_model."""
    n_layers: int = 4
    """Transformer blocks."""
    mlp_ratio: int = 4
    """Hidden width of the MLP over d_model."""
    dropout: float = 0.0
    """Dropout on the embedding, attention weights and each residual branch."""

    def __post_init__(self) -> None:
        sizes = {k: getattr(self, k) for k in
                 ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio")}
        problems = [f"{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
        if self.d_model % max(self.n_heads, 1):
            problems.append(f"n_heads={self.n_heads} must divide d_model={self.d_model}")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise ValueError("invalid GPTConfig: " + "; ".join(problems))

    @property
    def n_params(self) -> int:
        """Parameters of the tied model, from the shapes alone (nothing is built)."""
        d, h = self.d_model, self.mlp_ratio * self.d_model
        embedding = (self.vocab_size + self.seq_len) * d
        norms = 2 * 2 * d
        attention = d * 3 * d + 3 * d + d * d + d
        mlp = d * h + h + h * d + d
        return embedding + self.n_layers * (norms + attention + mlp) + 2 * d


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=64, d_model=64, n_heads=4, n_layers=4),
    "small": GPTConfig(seq_len=256, d_model=256, n_heads=8, n_layers=6),
    "medium": GPTConfig(seq_len=1024, d_model=768, n_heads=12, n_layers=12),
    "large": GPTConfig(seq_len=1024, d_model=1024, n_heads=16, n_layers=24),
    "1b": GPTConfig(seq_len=2048, d_model=2048, n_heads=16, n_layers=24),
}


def preset_table() -> str:
    """The preset table of this module's docstring, computed from :data:`PRESETS`."""
    rows = ["preset  d_model  layers  heads  seq_len      parameters"]
    for name, c in PRESETS.items():
        rows.append(f"{name:<6}  {c.d_model:>7}  {c.n_layers:>6}  {c.n_heads:>5}  "
                    f"{c.seq_len:>7}  {c.n_params:>14,}")
    return "\n".join(rows)


class Linear(nn.Linear):
    """``nn.Linear`` initialised normal(0, std) with a zero bias."""

    def __init__(self, d_in: int, d_out: int, *, std: float = INIT_STD) -> None:
        self.std = std  # before super().__init__(), which calls reset_parameters()
        super().__init__(d_in, d_out)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Module):
    """Token ids (B, T) -> token + learned position embeddings (B, T, d_model)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.seq_len = config.seq_len
        self.tokens = nn.Parameter(torch.empty(config.vocab_size, config.d_model))
        self.positions = nn.Parameter(torch.empty(config.seq_len, config.d_model))
        self.dropout = config.dropout
        self.sequence: str | None = None
        """Under context parallelism: the tag of the ranks holding the other slices of each
        sequence (:mod:`pipetrain.runtime.sequence`); ids are then this rank's slice."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.tokens, 0.0, INIT_STD)
        nn.init.normal_(self.positions, 0.0, INIT_STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.size(1)
        first = 0 if self.sequence is None else sequence.bound(self.sequence).offset(length)
        if first + length > self.seq_len:
            raise ValueError(f"sequence of {first + length} tokens is longer than the model's "
                             f"seq_len {self.seq_len}; crop it or build the model with a "
                             "larger seq_len")
        x = F.embedding(ids, self.tokens) + self.positions[first:first + length]
        return F.dropout(x, self.dropout, self.training)


class Attention(nn.Module):
    """Causal multi-head self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads, self.dropout = config.n_heads, config.dropout
        self.qkv = Linear(d, 3 * d)
        self.proj = Linear(d, d, std=_residual_std(config))
        self.sequence: str | None = None
        """Under context parallelism: the tag of the ranks holding the other slices of each
        sequence; attention then exchanges heads for tokens with them (Ulysses)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # noqa: N806  (batch, time, channels: the shape's usual letters)
        head = C // self.n_heads
        # chunk, not split(C): under tensor parallelism qkv yields this rank's heads only
        q, k, v = (t.reshape(B, T, -1, head).transpose(1, 2) for t in self.qkv(x).chunk(3, 2))
        if self.sequence is not None:  # every token of this rank's heads
            q, k, v = (sequence.seq_to_heads(t.contiguous(), self.sequence) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        if self.sequence is not None:
            y = sequence.heads_to_seq(y.contiguous(), self.sequence)
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)); (B, T, d) -> same."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, hidden = config.d_model, config.mlp_ratio * config.d_model
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(Linear(d, hidden), nn.GELU(),
                                 Linear(hidden, d, std=_residual_std(config)))
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)


class Head(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits: (B, T, d) -> (B, T, vocab).

    Args:
        config: the model shape.
        tied: the embedding's token table to use as the output matrix; None creates (and
            initialises) an own one.
    """

    def __init__(self, config: GPTConfig, tied: nn.Parameter | None = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.is_tied = tied is not None
        self.weight = tied if tied is not None else nn.Parameter(
            torch.empty(config.vocab_size, config.d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.is_tied:  # a tied table belongs to (and is initialised by) the Embedding
            nn.init.normal_(self.weight, 0.0, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.weight)


def _residual_std(config: GPTConfig) -> float:
    """GPT-2: each block adds two branches to the residual stream; keep its variance bounded."""
    return INIT_STD / math.sqrt(2 * config.n_layers)


def gpt_layers(config: GPTConfig, keep: Callable[[int], bool] | None = None) -> list[nn.Module]:
    """The model as a layer list, the head tied to the embedding; values from the global RNG.

    ``keep(i)`` false moves block ``i`` (its index in the list) to ``meta`` right after it is
    built: it still draws its random numbers, so every kept layer has the values of the whole
    model built at once, but only one unkept block exists at a time. The embedding and the head
    share the token table and are always kept.

    Example::

        torch.manual_seed(0)
        model = nn.Sequential(*gpt_layers(PRESETS["tiny"]))
        logits = model(ids)                       # (B, T, 256)
    """
    embedding = Embedding(config)
    blocks: list[nn.Module] = []
    for i in range(1, config.n_layers + 1):
        block = Block(config)
        blocks.append(block if keep is None or keep(i) else block.to("meta"))
    return [embedding, *blocks, Head(config, tied=embedding.tokens)]


def gpt_specs(config: GPTConfig) -> list[LayerSpec]:
    """The model as :class:`LayerSpec` s for lazy, per-rank construction; the head is UNTIED.

    Example::

        pipe = pt.Pipeline(gpt_specs(PRESETS["1b"]), "zbv", 16, lm_loss, init_seed=0)
    """
    return [LayerSpec(Embedding, config), *[LayerSpec(Block, config)] * config.n_layers,
            LayerSpec(Head, config)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over all B x T positions: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
