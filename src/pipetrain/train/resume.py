"""Resume: a training run's checkpoint (model, optimizer, loss scale, RNG, data position), saved
and restored through :mod:`pipetrain.checkpoint.run`.

Tensors are keyed by the original parameter names, so a run saved at one layout (pp, dp,
schedule) resumes at another. The rest is plain metadata: the step (which is also the data
position and the learning-rate schedule's whole state), the skipped-step count, the fp16 loss
scale, the model shape and the layout. Every rank's RNG stream comes back only at the same
layout, where rank r does again what rank r did; at another layout each rank re-seeds from
(seed, step, rank). At the same layout on CPU the resumed loss curve is bitwise the
uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

from pipetrain.checkpoint import run as checkpoint
from pipetrain.errors import CheckpointError
from pipetrain.runtime.dtensors import local_shard
from pipetrain.train.setup import Trainer
from pipetrain.train.sources.choice import kind_of

__all__ = ["checkpoint_root", "save", "restore", "peer_state", "load_peer_state"]


def checkpoint_root(out: str) -> Path | None:
    """Where a run writing into ``out`` keeps its checkpoints; None for an empty ``out``."""
    return Path(out) / "checkpoints" if out else None


def _state(trainer: Trainer, *, rng: bool) -> dict[str, torch.Tensor]:
    """What a checkpoint holds: the trained parameters (a frozen one, such as LoRA's base,
    is the source's, read again from it), persistent buffers, the optimizer's state."""
    every = list(trainer.pipe.named_parameters())
    params = {n for n, _ in every}
    named = [(n, p) for n, p in every if p.requires_grad]
    buffers = [(n, b) for n, b in trainer.pipe.state_dict().items() if n not in params]
    state = {**checkpoint.model_state([*named, *buffers]),  # persistent buffers too
             **checkpoint.optimizer_state(trainer.optimizer, named)}
    if rng:
        state.update(checkpoint.rng_state(trainer.mesh.rank))
    return state


def _model(trainer: Trainer) -> dict[str, object]:
    """The model's identity (a GPT config, or a Hugging Face architecture and config)."""
    described: dict[str, object] = json.loads(json.dumps(trainer.source.describe()))
    return described


def _meta(trainer: Trainer) -> dict[str, object]:
    source = kind_of(trainer.cfg).provenance(trainer.cfg)
    return {"model": _model(trainer), "layout": trainer.layout(), **source,
            "seed": trainer.cfg.seed, "skipped": trainer.skipped,
            "loss_scale": trainer.scale.state_dict(), "data": {"seed": trainer.cfg.seed,
                                                                "step": trainer.step}}


def save(trainer: Trainer) -> Path | None:
    """Save the run after ``trainer.step`` steps (every rank at once); None without ``out``."""
    root = checkpoint_root(trainer.cfg.out)
    if root is None:
        return None
    keep = trainer.cfg.keep_checkpoints or None
    return checkpoint.save(root, trainer.step, _state(trainer, rng=True), _meta(trainer),
                           keep=keep)


def restore(trainer: Trainer) -> Path | None:
    """Continue from the newest committed checkpoint, if ``cfg.resume`` and there is one.

    Raises:
        CheckpointError: when the checkpoint holds another model, the ranks see different
            checkpoints, or loading fails (on every rank); with ``--no-resume``, when ``out``
            already holds checkpoints (before any step, rather than at this run's first save).
    """
    root = checkpoint_root(trainer.cfg.out)
    if root is None:
        return None
    if not trainer.cfg.resume:
        _refuse_earlier_checkpoints(root, trainer.mesh.rank)
        return None
    path = _agreed_latest(root, trainer)
    if path is None:
        return None
    meta = checkpoint.read_meta(path)
    want = _model(trainer)
    if meta.get("model") != want:
        raise CheckpointError(
            f"[rank {trainer.mesh.rank}] the checkpoint {path} holds another model "
            f"({meta.get('model')}) than this run ({want}); pass another --out, or delete "
            f"{root} to start afresh there")
    same = meta.get("layout") == trainer.layout()
    state = _state(trainer, rng=same)
    checkpoint.load(path, state)
    checkpoint.load_optimizer_state(trainer.optimizer, trainer.pipe.named_parameters(), state)
    step = int(meta["step"])
    if same:
        checkpoint.set_rng_state(state, trainer.mesh.rank)
    else:
        torch.manual_seed(_reseed(trainer.cfg.seed, step, trainer.mesh.rank))
    trainer.step, trainer.skipped = step, int(meta.get("skipped", 0))
    trainer.scale.load_state_dict(meta["loss_scale"])
    return path


def peer_state(trainer: Trainer) -> dict[str, object]:
    """What this rank sends a recovering replica's rank of the same place (``--ft``): a
    checkpoint's tensors (local shards, copied) and what its metadata says of the run."""
    tensors = {k: local_shard(v).detach().clone() for k, v in
               _state(trainer, rng=True).items()}
    return {"tensors": tensors, "step": trainer.step, "skipped": trainer.skipped,
            "loss_scale": trainer.scale.state_dict()}


def load_peer_state(trainer: Trainer, state: dict[str, object]) -> None:
    """Take a healthy replica's state (:func:`peer_state`) as this rank's own.

    Raises:
        CheckpointError: the state lacks a tensor this rank holds, or has another shape.
    """
    sent = cast(dict[str, torch.Tensor], state["tensors"])
    mine = _state(trainer, rng=True)
    for key, value in mine.items():
        got = sent.get(key)
        held = local_shard(value)
        if got is None or got.shape != held.shape:
            raise CheckpointError(
                f"[rank {trainer.mesh.rank}] a peer replica's state has "
                f"{'no' if got is None else 'another shape of'} {key}: every replica must run "
                "the same model at the same layout (same flags but --ft-replica-id)")
        if key.startswith("rng/"):
            mine[key] = got
        else:
            held.copy_(got)
    checkpoint.load_optimizer_state(trainer.optimizer, trainer.pipe.named_parameters(), mine)
    checkpoint.set_rng_state(mine, trainer.mesh.rank)
    trainer.step, trainer.skipped = cast(int, state["step"]), cast(int, state["skipped"])
    trainer.scale.load_state_dict(cast(dict[str, float], state["loss_scale"]))


def _refuse_earlier_checkpoints(root: Path, rank: int) -> None:
    """A run that starts afresh must not save among an earlier run's checkpoints (a later
    resume would pick whichever step is newest, of either run)."""
    path = checkpoint.latest(root)
    if path is not None:
        raise CheckpointError(
            f"[rank {rank}] --no-resume, but {root} holds an earlier run's checkpoints "
            f"(newest: {path.name}); pass another --out, or delete {root} to start afresh "
            "there")


def _agreed_latest(root: Path, trainer: Trainer) -> Path | None:
    """The newest checkpoint, checked to be the same one on every rank."""
    path = checkpoint.latest(root)
    found = -1 if path is None else int(checkpoint.read_meta(path)["step"])
    low = -trainer.mesh.world_max(-float(found))
    high = trainer.mesh.world_max(float(found))
    if dist.is_initialized() and low != high:
        raise CheckpointError(
            f"[rank {trainer.mesh.rank}] ranks see different newest checkpoints under {root} "
            f"(steps {int(low)} .. {int(high)}; this rank: {found}); --out must be on a "
            "filesystem every rank shares")
    return path


def _reseed(seed: int, step: int, rank: int) -> int:
    digest = hashlib.blake2b(f"rng:{seed}:{step}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
