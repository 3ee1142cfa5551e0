"""Inference through the pipeline: the held-out loss, and text generated token by token.

Both run ``Pipeline.eval_step`` (forward only) on every rank of a replica. The logits of a
generation step exist only on the rank holding the last stage: that rank picks the next token
and broadcasts it over the pipeline group, so the rank holding stage 0 (and every other) can
feed it back in. Each eval step needs one row per micro-batch, so the context is repeated
``microbatches`` times and row 0's logits are used. A pipeline captured at fixed shapes
(``pipetrain train --hf``'s: ``Pipeline(..., dynamic=False)``) takes only those: the window is
padded at its end to the captured positions (a causal model's logits at the window's last
token do not see what follows it) and repeated to the captured rows of every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.pipeline import Pipeline
from pipetrain.train.mesh import Mesh

__all__ = ["eval_loss", "generate", "pick"]


def eval_loss(pipe: Pipeline, mesh: Mesh, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
              *, step: int | None = None, feed: Callable[[torch.Tensor], Any] | None = None
              ) -> float:
    """Mean loss over ``batches`` (this replica's rows), averaged over the replicas.

    ``step`` numbers the eval steps (the training step they follow; errors name it); ``feed``
    turns token ids into the pipeline's input (default: the ids themselves).
    """
    total = 0.0
    for inputs, targets in batches:
        loss = pipe.eval_step(inputs if feed is None else feed(inputs), targets,
                              step=step).loss
        if loss is None:
            raise RuntimeError(f"[rank {mesh.rank}] eval step returned no loss")
        total += float(loss)
    return mesh.dp_mean(total / max(len(batches), 1))


def pick(logits: torch.Tensor, top_k: int, generator: torch.Generator) -> int:
    """The next token from one position's logits: greedy (``top_k <= 0``) or seeded top-k."""
    if top_k <= 0:
        return int(logits.argmax())
    values, index = logits.float().cpu().topk(min(top_k, logits.numel()))
    choice = torch.multinomial(torch.softmax(values, dim=0), 1, generator=generator)
    return int(index[choice])


def generate(pipe: Pipeline, mesh: Mesh, prompt: Sequence[int], n_tokens: int, *,
             context: int, top_k: int = 0, seed: int = 0, step: int | None = None,
             feed: Callable[[torch.Tensor], Any] | None = None,
             logits: Callable[[Any], torch.Tensor] | None = None,
             multiple: int = 1, slices: int = 1,
             whole: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[int]:
    """``n_tokens`` new tokens after ``prompt``, the same list on every rank of the replica.

    Args:
        pipe: the trained pipeline (a model whose last stage outputs (B, T, vocab) logits).
        mesh: this rank's mesh (the broadcast goes over its pipeline group).
        prompt: token ids to start from (at least one).
        n_tokens: how many tokens to generate.
        context: the longest window fed to the model (its position table).
        top_k: 0 picks the most likely token; k > 0 samples among the k most likely.
        seed: the sampling generator's seed (the text is deterministic given it).
        step: the number of its eval steps (the training step they follow; errors name it).
        feed: token ids -> the pipeline's input (default: the ids themselves).
        logits: the pipeline's outputs -> (B, T, vocab) logits (default: the outputs).
        multiple: windows are padded at the end to a multiple of this many positions (a
            sequence-parallel model splits positions evenly); a causal model's next-token
            logits do not see the padding.
        slices: context parallelism's ranks: ``feed`` cuts each window into this many slices
            (so a captured pipeline's window is its positions times this), and ``whole``
            joins the last stage's logits of the slices again.

    Raises:
        ValueError: for an empty prompt.
    """
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    last = pipe.schedule.n_stages - 1
    holder = pipe.schedule.rank_of(last)
    src = mesh.global_rank(mesh.dp_rank, holder)
    generator = torch.Generator().manual_seed(seed)
    per_mb, positions = fixed_shape(pipe)
    rows = pipe.schedule.n_microbatches * per_mb
    ids = list(prompt)
    for _ in range(n_tokens):
        window = ids[-context:]
        last = len(window) - 1
        pad = (positions * slices - len(window) if positions
               else -len(window) % (multiple * slices))
        window = window + window[-1:] * pad  # after the last token: causal, unseen
        batch = torch.tensor(window, dtype=torch.long).repeat(rows, 1)
        outputs = pipe.eval_step(batch if feed is None else feed(batch), step=step).outputs
        token = torch.zeros(1, dtype=torch.long, device=mesh.comm_device)
        if pipe.rank == holder:
            scores = outputs if logits is None else logits(outputs)
            scores = scores if whole is None else whole(scores)
            token[0] = pick(scores[0, last], top_k, generator)
        dist.broadcast(token, src=src, group=mesh.pp_group)
        ids.append(int(token))
    return ids[len(prompt):]


def fixed_shape(pipe: Pipeline) -> tuple[int, int | None]:
    """The rows per micro-batch and the positions of the token ids a pipeline captured at
    fixed shapes takes; else ``(1, None)`` (any)."""
    traced = pipe.traced
    if traced is None or traced.captured.dynamic:
        return 1, None
    leaves = [leaf for leaf in traced.captured.inputs if leaf.tensor]
    ids = next((leaf for leaf in leaves if leaf.path == "input_ids"), None) or \
        next(iter(leaves), None)
    dims = dict(ids.static) if ids is not None else {}
    return dims.get(0, 1), dims.get(1)
