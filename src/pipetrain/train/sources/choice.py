"""Source choice: the one place a run's config decides what it trains."""

from __future__ import annotations

from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.hf_source import HFSource
from pipetrain.train.sources.source import GPTSource, Source

__all__ = ["source_for"]


def source_for(cfg: TrainConfig) -> Source:
    """The run's model: ``--hf DIR`` when given, else the GPT preset."""
    if cfg.hf:
        return HFSource(cfg)
    return GPTSource(cfg)
