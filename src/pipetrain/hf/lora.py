"""LoRA: peft's low-rank adapters added to a Hugging Face model before it is cut, written back
in peft's own format.

``pipetrain train --hf DIR --lora-r R`` wraps the model on ``meta`` with
``peft.get_peft_model`` (:func:`add_adapters`): every targeted ``nn.Linear`` becomes peft's
``lora.Linear``, its stored weight under ``<name>.base_layer.weight`` and frozen, the adapter
``<name>.lora_A.default.weight`` and ``lora_B`` beside it. The pipeline then cuts that model
like any other; only the adapters get gradients, optimizer states and data-parallel
reductions. Each rank reads its base weights from the safetensors files under their stored
names (:func:`stored_name`); ``lora_B`` starts at zero, so the adapted model starts as the
base (``lora_A`` is initialised by the model's own initialiser, from ``--seed``).

:func:`save_adapter` writes ``OUT/adapter`` as ``PeftModel.save_pretrained`` does
(``adapter_config.json``, ``adapter_model.safetensors``, its names made by peft's
``get_peft_model_state_dict``), so ``PeftModel.from_pretrained(base, OUT/adapter)`` loads it;
:func:`merge` writes the base with the adapter merged in by peft's ``merge_and_unload``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["add_adapters", "is_adapter", "language_targets", "lora_config", "merge",
           "save_adapter", "stored_name"]

ADAPTER = "default"
"""peft's name of the one adapter."""


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ImportError("--lora-r needs peft: pip install peft (or pipetrain's [lora] "
                          "extra)") from None
    return peft


def lora_config(r: int, alpha: float, dropout: float, targets: str,
                text_of: Any = None) -> Any:
    """peft's ``LoraConfig``: rank ``r``, ``alpha`` (0: 2 r), ``dropout``, the modules
    ``targets`` names (commas; empty: peft's default for the architecture).

    ``text_of``: the config of an image-text model, whose adapters go on its language model
    only: the projections ``targets`` names (empty: peft's default for its text model, or
    ``q_proj,v_proj``) under its ``language_model`` or ``text_model``, not the vision
    tower's of the same names.
    """
    peft = require_peft()
    names: Any = [t.strip() for t in targets.split(",") if t.strip()] or None
    if text_of is not None:
        names = language_targets(text_of, names)
    return peft.LoraConfig(r=r, lora_alpha=alpha or 2 * r, lora_dropout=dropout,
                           target_modules=names, task_type="CAUSAL_LM")


def language_targets(config: Any, names: list[str] | None) -> str:
    """A peft ``target_modules`` pattern: the modules ``names`` names under the language
    model of the image-text model of ``config`` (None: peft's default for its text model)."""
    if names is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

        text = str(getattr(config.get_text_config(), "model_type", ""))
        names = list(TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(
            text, ["q_proj", "v_proj"]))
    alternatives = "|".join(sorted(re.escape(n) for n in names))
    return rf"^(.*\.)?(language_model|text_model)\..*\.({alternatives})$"


def add_adapters(model: nn.Module, config: Any) -> nn.Module:
    """``model`` with peft's adapters in place and every other parameter frozen.

    Raises:
        ValueError: when no module of ``model`` matches the targets.
    """
    peft = require_peft()
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        raise ValueError(f"--lora-targets: {e}") from None
    base: nn.Module = wrapped.get_base_model()  # ``model`` itself, changed in place
    return base


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def stored_name(name: str) -> str:
    """The name a base weight is stored under (peft inserts ``base_layer``)."""
    return name.replace(".base_layer.", ".")


def start_as_base(state: Mapping[str, torch.Tensor]) -> None:
    """Zero every ``lora_B``: the adapted model starts as the base, as peft's does."""
    with torch.no_grad():
        for name, tensor in state.items():
            if ".lora_B." in name:
                tensor.zero_()


def save_adapter(out: Path, adapters: Mapping[str, torch.Tensor], config: Any,
                 model_config: Any, base: str) -> Path:
    """Write ``adapters`` (the model's names, whole tensors) as peft's ``OUT/adapter``."""
    peft = require_peft()
    from safetensors.torch import save_file

    from pipetrain.hf.model import meta_model

    wrapped = peft.get_peft_model(meta_model(model_config, images=True), config)
    prefixed = {f"base_model.model.{n}": t.detach().cpu().contiguous()
                for n, t in adapters.items()}
    state = peft.get_peft_model_state_dict(wrapped, state_dict=prefixed,
                                           adapter_name=ADAPTER)
    partial = out.with_name(out.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base
    wrapped.peft_config[ADAPTER].save_pretrained(str(partial))
    save_file(dict(state), str(partial / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(partial, out)
    return out


def merge(out: Path, base: Path, adapter: Path, tokenizer: Any) -> Path:
    """Write ``out``: the base model of ``base`` with ``adapter`` merged in (peft's
    ``merge_and_unload``), as ``save_pretrained``; the whole model is built in this process."""
    peft = require_peft()
    from pipetrain.hf.model import transformers

    tf = transformers()
    bars = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # the run's console is pipetrain's
    try:
        from pipetrain.hf.image_text import is_image_text

        config = tf.AutoConfig.from_pretrained(base, local_files_only=True)
        auto = (tf.AutoModelForImageTextToText if is_image_text(config)
                else tf.AutoModelForCausalLM)
        model = auto.from_pretrained(base, dtype=torch.float32)
        merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    finally:
        if bars:
            tf.utils.logging.enable_progress_bar()
    return out
