"""Sinks: a run's step and eval scalars sent to TensorBoard and Weights & Biases as well.

``--log tensorboard``, ``--log wandb`` or ``--log tensorboard,wandb`` (``cfg.log``) add sinks
beside ``log.jsonl``, which stays the source: every ``step`` record's numbers go under
``train/`` and every ``eval`` record's under ``eval/``, at the record's step. TensorBoard's
event files are written with torch's own ``SummaryWriter`` into ``OUT/tensorboard`` (``pip
install tensorboard``); W&B's run through ``wandb`` (``pip install wandb``) into ``OUT/wandb``,
its project ``WANDB_PROJECT`` or ``pipetrain``, its mode as W&B's environment says
(``WANDB_MODE=offline`` keeps it on disk for ``wandb sync``), the run's settings as its config.
Only global rank 0 writes, as it writes ``log.jsonl``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any, Protocol

from pipetrain.train.config import TrainConfig

__all__ = ["SINKS", "Sink", "open_sinks", "parse", "scalars"]

SINKS = ("tensorboard", "wandb")
_INSTALL = {"tensorboard": "pip install tensorboard (or pipetrain's [tensorboard] extra)",
            "wandb": "pip install wandb (or pipetrain's [wandb] extra)"}
_SCOPE = {"step": "train", "eval": "eval"}


class Sink(Protocol):
    def write(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def parse(log: str) -> list[str]:
    """The sinks ``--log`` names, checked (commas between them; empty: none).

    >>> parse("tensorboard,wandb"), parse("")
    (['tensorboard', 'wandb'], [])

    Raises:
        ValueError: for a name not in :data:`SINKS`.
    """
    names = [n.strip() for n in log.split(",") if n.strip()]
    for name in names:
        if name not in SINKS:
            raise ValueError(f"--log {log!r}: unknown sink {name!r}; choose among "
                             f"{', '.join(SINKS)} (commas between several)")
    return names


def missing(log: str) -> list[str]:
    """What ``--log`` needs installed and is not, each with how to install it."""
    import importlib.util

    return [f"--log {name} needs {name}: {_INSTALL[name]}" for name in parse(log)
            if importlib.util.find_spec(name) is None]


def scalars(kind: str, fields: dict[str, Any]) -> dict[str, float]:
    """A ``step`` or ``eval`` record's finite numbers, named ``train/...`` or ``eval/...``
    (its ``step`` and ``time`` left out); other records give none."""
    scope = _SCOPE.get(kind)
    if scope is None:
        return {}
    return {f"{scope}/{key}": float(value) for key, value in fields.items()
            if key not in ("step", "time") and isinstance(value, (int, float))
            and not isinstance(value, bool) and math.isfinite(value)}


def open_sinks(cfg: TrainConfig, out: Path) -> list[Sink]:
    """The sinks of ``cfg.log``, writing under ``out``."""
    made: list[Sink] = []
    for name in parse(cfg.log):
        made.append(_TensorBoard(out) if name == "tensorboard" else _Wandb(cfg, out))
    return made


class _TensorBoard:
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))

    def write(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, cfg: TrainConfig, out: Path) -> None:
        import wandb

        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pipetrain"),
                              name=out.name, dir=str(out), config=dataclasses.asdict(cfg),
                              reinit="create_new")

    def write(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
