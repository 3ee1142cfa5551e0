"""A user's own model for ``pipetrain plan --module pipetrain.examples.own_model:build``.

    $ pipetrain plan --module pipetrain.examples.own_model:build --pp 2 --memory-limit 3MiB

An embedding, a ``ModuleList`` of residual MLP blocks and a head, with a ``forward`` that
loops: no layer list, nothing shaped for pipetrain. :func:`build` returns what
``--module`` needs (:mod:`pipetrain.plan.module_command`): the model, one step's batch, the loss
and the targets.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

VOCAB, WIDTH, DEPTH, ROWS, SEQ = 256, 64, 6, 8, 32


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm(x))))
        return out


class TokenModel(nn.Module):
    """Token ids -> logits: embed, the blocks in a loop, a final norm and the head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1))


def build() -> dict[str, Any]:
    """The ``--module`` contract: the model, one whole step's inputs, the loss, the targets."""
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ))
    return {"model": TokenModel(), "example_inputs": ids, "loss_fn": next_token_loss,
            "target": ids}
