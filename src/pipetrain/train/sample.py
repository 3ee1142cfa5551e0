"""Sample: a run's held-out loss and the text it prints at the end, from its pipeline.

The held-out loss is :func:`pipetrain.train.infer.eval_loss` over the run's eval batches. The
text sample is generated with a KV cache per stage from the ``<out>/hf`` an ``--hf`` run has just
written (:class:`pipetrain.generation.Generator`) where it can be, else through the training
pipeline itself, the whole window again per token (:func:`pipetrain.train.infer.generate`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pipetrain.train.infer import eval_loss, generate
from pipetrain.train.precision import autocast
from pipetrain.train.setup import Trainer

__all__ = ["cache_length", "evaluate", "last_step", "prompt_ids", "sample"]

NEWLINE = 10
"""The prompt of an empty ``--prompt``: a newline's byte."""


def evaluate(trainer: Trainer) -> float:
    """The held-out loss (mean over the eval batches and the replicas)."""
    with autocast(trainer.cfg.precision, trainer.mesh.device):
        scaled = eval_loss(trainer.pipe, trainer.mesh, trainer.eval_set, step=last_step(trainer),
                           feed=trainer.feed)
    loss = trainer.scale.unscale_loss(scaled)  # the loss function multiplies by the fp16 scale
    return loss if trainer.replicas is None else trainer.replicas.mean(loss)  # --ft


def _split_sequence(trainer: Trainer) -> bool:
    """The run's tensor parallelism splits activations along the sequence (windows padded)."""
    return bool(getattr(trainer.tensor_parallel, "sequence_parallel", False))


def sample(trainer: Trainer) -> str | None:
    """``cfg.sample_tokens`` tokens after ``cfg.prompt``, as text; None when none are asked."""
    cfg = trainer.cfg
    if cfg.sample_tokens <= 0:
        return None
    source, prompt = trainer.source, prompt_ids(trainer)
    ids = _cached_sample(trainer, prompt)
    if ids is not None:
        return source.decode(prompt + ids)
    with autocast(cfg.precision, trainer.mesh.device):
        ids = generate(trainer.pipe, trainer.mesh, prompt, cfg.sample_tokens,
                       context=cfg.seq_len, top_k=cfg.sample_top_k, seed=cfg.seed,
                       step=last_step(trainer), feed=trainer.feed,
                       logits=source.logits,
                       multiple=trainer.mesh.tp if _split_sequence(trainer) else 1,
                       slices=trainer.mesh.cp, whole=_joined(trainer))
    return source.decode(prompt + ids)


def _joined(trainer: Trainer) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """With ``--cp``: the logits of every slice of the window, in order (an all-gather over
    the last pipeline rank's context-parallel ranks, which all call it)."""
    mesh = trainer.mesh
    if mesh.cp_group is None:
        return None
    group = mesh.cp_group

    def join(logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(mesh.cp)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=group)
        return torch.cat(parts, dim=1)
    return join


def _cached_sample(trainer: Trainer, prompt: list[int]) -> list[int] | None:
    """The sample of an ``--hf`` run with an ``out``, generated with a KV cache per stage from
    the ``<out>/hf`` just written (:class:`pipetrain.generation.Generator`, each pipeline rank
    reading its own stage); None where there is none, or the model's positions are too few
    (then the whole window is run again per token, :func:`pipetrain.train.infer.generate`)."""
    cfg, mesh = trainer.cfg, trainer.mesh
    length = cache_length(trainer, prompt)
    if length is None:
        return None
    from pipetrain.generation import Generator, Sampling

    torch.distributed.barrier()  # every shard of <out>/hf written
    gen = Generator.from_pretrained(str(Path(cfg.out) / "hf"), rows=1, length=length,
                                    group=mesh.pp_group, timeout=cfg.timeout,
                                    device=mesh.device)
    sampling = Sampling(1.0 if cfg.sample_top_k > 0 else 0.0, max(cfg.sample_top_k, 0),
                        seed=cfg.seed)
    return gen.generate([prompt], cfg.sample_tokens, sampling=sampling)[0]


def cache_length(trainer: Trainer, prompt: list[int]) -> int | None:
    """The positions a cached sample of ``prompt`` needs, or None when it cannot have one."""
    cfg, source = trainer.cfg, trainer.source
    length = len(prompt) + cfg.sample_tokens - 1
    limit = source.max_positions
    exported = cfg.out and source.exports and source.kv_samples
    if not exported or (limit is not None and length > limit):
        return None
    return length


def prompt_ids(trainer: Trainer) -> list[int]:
    source, text = trainer.source, trainer.cfg.prompt
    return source.encode(text) or [NEWLINE]


def last_step(trainer: Trainer) -> int:
    """The number of the last training step done, which eval steps and sampling follow."""
    return max(trainer.step - 1, 0)
