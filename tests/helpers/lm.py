"""A small GPT-style language model written the usual way (not for pipelining), for the tests.

Token and learned position embeddings, a ``ModuleList`` of pre-norm blocks called in a loop
with a padding mask built from the ``attention_mask`` keyword argument, a final LayerNorm and an
LM head tied to the token embedding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

from pipetrain.split.capture import Captured


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape  # noqa: N806  (batch, time, channels: the usual letters)
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           is_causal=attn_mask is None)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask=attn_mask)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, n_heads: int = 2, n_layers: int = 4,
                 max_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, n_heads) for _ in range(n_layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def embed_and_mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token plus position embeddings, and the causal mask combined with a (B, T) padding
        mask (1 = token, 0 = padding) when one is given."""
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.embed(input_ids) + self.pos(positions)
        if attention_mask is None:
            return x, None
        causal = positions[None, :] <= positions[:, None]
        return x, causal & attention_mask[:, None, None, :].bool()

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x, mask = self.embed_and_mask(input_ids, attention_mask)
        for block in self.blocks:
            x = block(x, attn_mask=mask)
        return self.head(self.norm(x))


def tiny_lm(seed: int = 0, n_layers: int = 4) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(n_layers=n_layers)


@functools.cache
def captured_lm(masked: bool) -> tuple[TinyLM, Captured]:
    """One ``tiny_lm()`` and its capture on ``lm_batch()``, shared by tests that only read the
    model (capture takes seconds; zero the gradients before use)."""
    from pipetrain.split.capture import capture

    model = tiny_lm()
    ids, mask, _ = lm_batch()
    inputs = {"input_ids": ids, "attention_mask": mask} if masked else {"input_ids": ids}
    return model, capture(model, inputs)


def lm_batch(n: int = 4, length: int = 8, vocab: int = 32, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a right-padded attention mask (row i has ``length - i`` tokens), targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, (n, length), generator=g)
    mask = (torch.arange(length)[None, :] < (length - torch.arange(n))[:, None]).long()
    targets = torch.randint(vocab, (n, length), generator=g)
    return ids, mask, targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class SkipLM(TinyLM):
    """TinyLM with long skips: every block also reads the embedding output (a value residual),
    the second half of the blocks adds the first half's outputs in mirror order (U-Net style)
    and the head reads the embedding output once more."""

    def forward(self, input_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x0, mask = self.embed_and_mask(input_ids, attention_mask)
        x, saved, half = x0, [], len(self.blocks) // 2
        for i, block in enumerate(self.blocks):
            if i >= len(self.blocks) - half:
                x = x + saved.pop()
            x = block(x, attn_mask=mask) + 0.5 * x0
            if i < half:
                saved.append(x)
        return self.head(self.norm(x + x0))


def skip_lm(seed: int = 0, n_layers: int = 8) -> SkipLM:
    torch.manual_seed(seed)
    return SkipLM(n_layers=n_layers)
