"""Source choice: the one place a run's config decides what it trains.

``--hf DIR`` (or a Hub id) trains that checkpoint (:class:`.hf_source.HFSource`); without it,
the built-in GPT of ``--preset`` (:class:`.source.GPTSource`). What differs between the two
before any rank starts (the checks, the launcher's one tokenization, what the workers import,
what a checkpoint records) is a :class:`Kind`, light to import, since the launcher asks it;
what differs on each rank is the :class:`~.source.Source` it builds. A new source is a
``Source`` class, a ``Kind`` and a line in :func:`kind_of`.
"""

from __future__ import annotations

import json
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.models.gpt import PRESETS
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.records import is_dataset

if TYPE_CHECKING:
    from torch import nn

    from pipetrain.train.sources.source import Source

__all__ = ["Kind", "kind_of", "source_for"]


class Kind(ABC):
    """A kind of model source, as the command and the launcher see it before any rank starts."""

    @abstractmethod
    def problems(self, cfg: TrainConfig) -> list[str]:
        """What keeps this source from ``cfg``'s run, each saying how to fix it."""

    def data_problems(self, cfg: TrainConfig) -> list[str]:
        """What keeps this source from training on ``cfg``'s data (none by default)."""
        return []

    @abstractmethod
    def source(self, cfg: TrainConfig) -> Source:
        """The source itself, built on a rank of the run."""

    def prepare(self, cfg: TrainConfig) -> None:
        """The launcher's work for this source before any rank starts, once a run."""
        return

    def rank_modules(self, cfg: TrainConfig) -> tuple[str, ...]:
        """Modules this source's ranks import, for the launcher's forkserver to import once."""
        return ()

    def provenance(self, cfg: TrainConfig) -> dict[str, str]:
        """Where the model came from, kept in each checkpoint's metadata."""
        return {}

    def slicing_problems(self, cfg: TrainConfig, shrink: Any) -> list[str]:
        """What keeps this model's attention from ``--cp``'s slices, found by running a small
        copy (``shrink(config, layers, width)`` makes its config); none by default."""
        return []

    def meta_model(self, cfg: TrainConfig) -> nn.Module | None:
        """The whole model on ``meta``, for the planner to size (None: it needs none)."""
        return None

    @abstractmethod
    def label(self, cfg: TrainConfig) -> str:
        """The model's name in a title."""


class GPTKind(Kind):
    """The built-in GPT of ``--preset``, on the bytes of text files."""

    def problems(self, cfg: TrainConfig) -> list[str]:
        if cfg.preset not in PRESETS:
            return [f"unknown preset {cfg.preset!r}; choose one of {list(PRESETS)}"]
        c, problems = PRESETS[cfg.preset], []
        if cfg.tp > 1 and (c.n_heads % cfg.tp or c.mlp_ratio * c.d_model % cfg.tp):
            problems.append(f"tp={cfg.tp} must divide the preset's {c.n_heads} heads and "
                            f"{c.mlp_ratio * c.d_model} MLP units; use a divisor of both")
        if cfg.tp > 1 and cfg.sequence_parallel and cfg.seq_len % cfg.tp:
            problems.append(f"seq_len={cfg.seq_len} must divide by tp={cfg.tp} under sequence "
                            "parallelism; change --seq-len, or pass --no-sequence-parallel")
        if cfg.cp > 1 and (c.n_heads // max(cfg.tp, 1)) % cfg.cp:
            problems.append(f"--cp {cfg.cp}: the {cfg.preset} preset's {c.n_heads} heads"
                            f"{f' over --tp {cfg.tp}' if cfg.tp > 1 else ''} do not divide "
                            "among the cp ranks (attention splits its heads among them); use "
                            "a --cp that divides them")
        if cfg.ep > 1:
            problems.append(f"--ep {cfg.ep} spreads a mixture of experts' experts over ranks; "
                            "the built-in GPT has none: give --hf an MoE model, or leave --ep "
                            "out")
        if cfg.lora_r:
            problems.append("--lora-r adapts a Hugging Face model: give --hf DIR or ORG/NAME")
        if is_dataset(cfg.data):
            problems.append(f"--data {cfg.data} is a data set: it needs --hf DIR, whose "
                            "tokenizer reads it (the built-in GPT trains on the bytes of text "
                            "files)")
        return problems + _image_problems(cfg, False)

    def source(self, cfg: TrainConfig) -> Source:
        from pipetrain.train.sources.source import GPTSource

        return GPTSource(cfg)

    def label(self, cfg: TrainConfig) -> str:
        return cfg.preset


def _cp_problems(cfg: TrainConfig) -> list[str]:
    """What keeps ``--hf``'s model from ``--cp`` by its config: heads that do not spread,
    ALiBi, chunked attention (:func:`pipetrain.hf.sequence_attention.problems`)."""
    from pipetrain.hf.model import transformers
    from pipetrain.hf.sequence_attention import problems

    config = transformers().AutoConfig.from_pretrained(cfg.hf, local_files_only=True)
    return problems(config, cfg.cp, cfg.tp)


class HFKind(Kind):
    """A Hugging Face checkpoint (``--hf``), through its own tokenizer."""

    def problems(self, cfg: TrainConfig) -> list[str]:
        """A directory without a config; under ``--tp``, a model without a tensor-parallel
        plan whose heads split, or without stored weights (read on ``meta``)."""
        if not Path(cfg.hf, "config.json").is_file():
            return [f"--hf {cfg.hf!r}: no config.json there; give a local directory written by "
                    "save_pretrained (config, safetensors, tokenizer) or a Hub id, "
                    "ORG/NAME[@REVISION]"]
        if cfg.tp > 1:
            from pipetrain.hf.model import open_model
            from pipetrain.hf.tp_plan import require_weights, shrink

            opened = open_model(Path(cfg.hf))
            try:
                shrink(opened.model, cfg.tp)
                require_weights(bool(opened.weights), cfg.hf)
            except ValueError as e:
                return [str(e)]
        if cfg.cp > 1:  # the heads' split, from the config (the slices are run: slicing_problems)
            found = _cp_problems(cfg)
            if found:
                return found
        return _image_problems(cfg, False)

    def slicing_problems(self, cfg: TrainConfig, shrink: Any) -> list[str]:
        return _hf_slicing(cfg, shrink) if cfg.cp > 1 else []

    def source(self, cfg: TrainConfig) -> Source:
        from pipetrain.train.sources.hf_source import HFSource

        return HFSource(cfg)

    def prepare(self, cfg: TrainConfig) -> None:
        """Tokenize the corpus once (cached), here, with a bar on the launcher's terminal."""
        self.source(cfg).corpus(cfg, progress=cfg.progress)

    def rank_modules(self, cfg: TrainConfig) -> tuple[str, ...]:
        """transformers, and the modeling modules this process opened (:meth:`prepare`)."""
        return ("transformers", *sorted(m for m in sys.modules if m.startswith(
            "transformers.models.") and ".modeling_" in m))

    def provenance(self, cfg: TrainConfig) -> dict[str, str]:
        return {"hf_source": str(Path(cfg.hf).resolve())}

    def meta_model(self, cfg: TrainConfig) -> nn.Module | None:
        from pipetrain.hf.model import open_model

        return open_model(Path(cfg.hf)).model

    def label(self, cfg: TrainConfig) -> str:
        return cfg.hf


def _hf_slicing(cfg: TrainConfig, shrink: Any) -> list[str]:
    """A 2-layer copy of width 32 through the sliced path against transformers' own
    (:func:`pipetrain.hf.sequence_attention.check_model`)."""
    from pipetrain.hf.model import transformers
    from pipetrain.hf.sequence_attention import check_model

    config = transformers().AutoConfig.from_pretrained(cfg.hf, local_files_only=True)
    try:
        check_model(shrink(config, 2, 32), cfg.hf)
    except ValueError as e:
        return [str(e)]
    return []


class ImageTextKind(HFKind):
    """An image-text-to-text checkpoint (``--hf`` of LLaVA, Gemma 3, Qwen2-VL, ...), through
    its own processor (:mod:`.image_text_source`)."""

    def problems(self, cfg: TrainConfig) -> list[str]:
        """The image-text model's (:func:`.image_text_source.image_text_problems`), and a
        directory whose processor does not load."""
        from pipetrain.hf.image_text import load_processor

        try:
            load_processor(cfg.hf)
        except (FileNotFoundError, ImportError) as e:
            return [str(e)]
        return _image_problems(cfg, True)

    def data_problems(self, cfg: TrainConfig) -> list[str]:
        from pipetrain.train.sources.image_text_source import image_data_problems

        return image_data_problems(cfg)

    def source(self, cfg: TrainConfig) -> Source:
        from pipetrain.train.sources.image_text_source import ImageTextSource

        return ImageTextSource(cfg)

    def meta_model(self, cfg: TrainConfig) -> nn.Module | None:
        from pipetrain.hf.model import open_model

        return open_model(Path(cfg.hf), images=True).model


def _image_problems(cfg: TrainConfig, image_text: bool) -> list[str]:
    from pipetrain.train.sources.image_text_source import image_text_problems

    return image_text_problems(cfg, image_text)


def _image_text(directory: str) -> bool:
    """Whether ``directory``'s config is of an image-text-to-text model."""
    path = Path(directory, "config.json")
    if not path.is_file() or "vision_config" not in json.loads(path.read_text()):
        return False
    from pipetrain.hf.image_text import is_image_text
    from pipetrain.hf.model import transformers

    config = transformers().AutoConfig.from_pretrained(directory, local_files_only=True)
    return is_image_text(config)


def kind_of(cfg: TrainConfig) -> Kind:
    """The kind of the run's model source: ``--hf``'s when given (an image-text one's when
    its config is), else the GPT preset's."""
    if not cfg.hf:
        return GPTKind()
    return ImageTextKind() if _image_text(cfg.hf) else HFKind()


def source_for(cfg: TrainConfig) -> Source:
    """The run's model source, built (on every rank of the run)."""
    return kind_of(cfg).source(cfg)
