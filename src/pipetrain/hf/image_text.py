"""Image-text checkpoints: which configs are image-text-to-text models, their processor, and
the tokens that stand for images (and ``transformers`` itself, imported quietly).

A directory whose ``config.json`` has a ``vision_config`` and a class transformers' auto
mapping ``AutoModelForImageTextToText`` knows (LLaVA, Qwen2-VL, Gemma 3, PaliGemma, ...) is
built through that class, on ``meta`` as a text model is (:func:`meta_image_text`). Its
text and images go through the checkpoint's own ``AutoProcessor`` (:func:`load_processor`):
its chat template, its tokenizer, and its image processor, which also decides how many
placeholder tokens each image fills. :func:`image_token_ids` names every token id that stands
for an image (the placeholders and the markers around them), which the loss never trains on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["image_token_ids", "is_image_text", "load_processor", "meta_image_text",
           "transformers"]

_TOKEN_ATTRS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                "vision_start_token_id", "vision_end_token_id", "boi_token_id",
                "eoi_token_id", "boi_token_index", "eoi_token_index", "image_start_token_id",
                "image_end_token_id")
"""Config attributes that hold the id of a token standing for (or around) an image."""
_PROCESSOR_TOKENS = ("image_token", "video_token", "boi_token", "eoi_token",
                     "vision_start_token", "vision_end_token", "fake_image_token",
                     "global_image_token", "start_image_token", "end_image_token")
"""Processor attributes that hold such a token as text."""


def transformers() -> Any:
    """The ``transformers`` module, quiet, or an ImportError that says how to install it."""
    try:
        import transformers as tf
    except ImportError as e:  # pragma: no cover - the hf extra is a test dependency
        raise ImportError("--hf needs transformers and safetensors: pip install "
                          "'pipetrain[hf]' (with torch pinned)") from e
    tf.logging.set_verbosity_error()
    return tf


def is_image_text(config: Any) -> bool:
    """Whether ``config`` is of an image-text-to-text model transformers builds through
    ``AutoModelForImageTextToText`` (it has a ``vision_config`` and the auto mapping knows its
    ``model_type``)."""
    if getattr(config, "vision_config", None) is None:
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def meta_image_text(config: Any) -> nn.Module:
    """``AutoModelForImageTextToText.from_config(config)`` on ``meta``, float32, in train
    mode."""
    tf = transformers()
    with torch.device("meta"):
        model: nn.Module = tf.AutoModelForImageTextToText.from_config(config,
                                                                      dtype=torch.float32)
    return model.train()


def load_processor(root: str | Path) -> Any:
    """The processor saved in ``root`` (``AutoProcessor``, local files only), padding on the
    right with its end-of-text token where its tokenizer has no padding token.

    Raises:
        FileNotFoundError: when ``root`` has no processor with an image processor, saying how
            to add one.
        ImportError: when the processor needs a library not installed (torchvision).
    """
    tf = transformers()
    fix = ("save the checkpoint's processor there: AutoProcessor.from_pretrained(<its Hub id "
           "or directory>).save_pretrained(DIR), which writes the tokenizer, the chat template "
           "and the image processor's preprocessor_config.json")
    try:
        processor = tf.AutoProcessor.from_pretrained(Path(root), local_files_only=True)
    except ImportError as e:  # Qwen2-VL's video processor needs torchvision
        said = " ".join(str(e).split(". ")[0].split())
        raise ImportError(f"--hf {str(root)!r}: its processor needs a library that is not "
                          f"installed ({said}); install it, matching your torch (torchvision: "
                          "the release made for your torch)") from None
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise FileNotFoundError(f"--hf {str(root)!r}: no processor could be loaded from it "
                                f"({str(e).strip().splitlines()[0]}); {fix}") from None
    if getattr(processor, "image_processor", None) is None:
        raise FileNotFoundError(f"--hf {str(root)!r}: its processor "
                                f"({type(processor).__name__}) has no image processor; {fix}")
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor


def image_token_ids(config: Any, processor: Any) -> set[int]:
    """Every token id that stands for an image or marks one (never trained on): the
    config's placeholder and marker ids, and the processor's image tokens."""
    ids = set()
    for where in (config, getattr(config, "text_config", None)):
        for name in _TOKEN_ATTRS:
            value = getattr(where, name, None)
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    tokenizer = processor.tokenizer
    for name in _PROCESSOR_TOKENS:
        token = getattr(processor, name, None)
        if isinstance(token, str) and token:
            found = tokenizer.convert_tokens_to_ids(token)
            if isinstance(found, int) and found != tokenizer.unk_token_id:
                ids.add(found)
    return ids


def varying_inputs(model: Any) -> bool:
    """Whether the capture of image-text ``model`` takes inputs whose sizes change from
    micro-batch to micro-batch, so that it is captured with symbolic shapes: Qwen3-VL's graph
    takes its vision tower's outputs (``mm_encoder_outputs``, a row per image token of the
    micro-batch) to make its deepstack features (:mod:`pipetrain.split.prefix`)."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    return bool(getattr(vision, "deepstack_visual_indexes", None))
