"""Tiny image-text checkpoints saved with their processors (nothing is downloaded), and chats
with images written as users have them: TRL's ``images`` column beside ``{"type": "image"}``
placeholders, and transformers' content parts naming a path."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import chat

PARTS = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
         "{% for p in m['content'] %}{% if p['type'] == 'image' %}{IMAGE}"
         "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML with content parts, an image written as the model's placeholder text."""
TEXT = dict(vocab_size=None, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _tokenizer(extra: list[str], template: str, named: dict[str, str] | None = None,
               bos: str | None = None) -> Any:
    """:func:`helpers.chat.tokenizer` with ``extra`` special tokens, ``named`` ones among
    them as attributes (Gemma 3's ``boi_token``)."""
    import transformers as tf

    tok = chat.tokenizer(template)
    tok.add_special_tokens({"additional_special_tokens": chat.SPECIAL[1:] + extra})
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer,
                                     eos_token=chat.SPECIAL[0], pad_token=chat.SPECIAL[0],
                                     bos_token=bos, extra_special_tokens=named or {})
    tok.chat_template = template
    return tok


def _save(root: Path, model: Any, processor: Any) -> Path:
    model.save_pretrained(root)
    processor.save_pretrained(root)
    return root


def save_llava(root: Path) -> Path:
    """LLaVA (CLIP tower, 8x8 images of 16 placeholders, a 4-layer Llama) with its
    processor."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<image>")
    tok = _tokenizer(["<image>"], template)
    images = tf.CLIPImageProcessor(size={"shortest_edge": 8},
                                   crop_size={"height": 8, "width": 8})
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=2,
                                  chat_template=template, num_additional_image_tokens=1,
                                  vision_feature_select_strategy="default")
    config = tf.LlavaConfig(
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id),
        vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=2,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, projection_dim=16),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    return _save(root, tf.LlavaForConditionalGeneration(config), processor)


def save_gemma3(root: Path) -> Path:
    """Gemma 3 (SigLIP tower, 8x8 images pooled to 4 soft tokens between a begin and an end
    marker, token types) with its processor."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<start_of_image>")
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
             "image_token": "<image_soft_token>"}
    tok = _tokenizer(list(named.values()), template, named)
    images = tf.Gemma3ImageProcessor(size={"height": 8, "width": 8})
    processor = tf.Gemma3Processor(image_processor=images, tokenizer=tok,
                                   chat_template=template, image_seq_length=4)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<start_of_image>", "<end_of_image>",
                                                     "<image_soft_token>")}
    config = tf.Gemma3Config(
        text_config=dict(TEXT, model_type="gemma3_text", vocab_size=len(tok), head_dim=8,
                         sliding_window=128, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id),
        vision_config=dict(model_type="siglip_vision_model", image_size=8, patch_size=2,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2),
        mm_tokens_per_image=4, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(0)
    return _save(root, tf.Gemma3ForConditionalGeneration(config), processor)




def write_images(directory: Path, n: int, seed: int = 0) -> list[Path]:
    """``n`` PNG files of random pixels and several sizes (the processor resizes them)."""
    import numpy as np
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = (12, 20) if i % 2 else (16, 16)
        path = directory / f"image{i}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def conversations(n: int, images: list[Path], seed: int = 0, *, parts: bool = False
                  ) -> list[dict[str, Any]]:
    """``n`` rows of 0, 1 or 2 images each (text-only rows among them), one or two exchanges:
    in TRL's convention (an ``images`` column of paths relative to the data file), or with
    ``parts`` in transformers' (each image part naming its ``path``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = (1, 0, 2)[i % 3]
        shown = [images[(i + j) % len(images)].name for j in range(k)]
        ask = " ".join(rng.choices(chat.WORDS, k=rng.randint(2, 6)))
        user = [{"type": "image", "path": name} if parts else {"type": "image"}
                for name in shown] + [{"type": "text", "text": ask}]
        turns = [{"role": "user", "content": user},
                 {"role": "assistant", "content": [{"type": "text", "text": " ".join(
                     rng.choices(chat.WORDS, k=rng.randint(1, 4)))}]}]
        if i % 4 == 3:
            turns += [{"role": "user", "content": [{"type": "text", "text": "again"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "nine"}]}]
        rows.append({"messages": turns} if parts else {"messages": turns, "images": shown})
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_mllama(root: Path) -> Path:
    """Mllama (a tiled vision tower, cross-attention layers between self-attention layers,
    one <|image|> token an image) with its processor."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<|image|>")
    tok = _tokenizer(["<|image|>", "<|begin_of_text|>"], template, bos="<|begin_of_text|>")
    images = tf.MllamaImageProcessor(size={"height": 8, "width": 8}, max_image_tiles=2)
    processor = tf.MllamaProcessor(image_processor=images, tokenizer=tok,
                                   chat_template=template)
    config = tf.MllamaConfig(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_global_layers=1, attention_heads=2, image_size=8, patch_size=4,
                           max_num_tiles=2, vision_output_dim=32, intermediate_layers_indices=[0],
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]]),
        text_config=dict(TEXT, vocab_size=len(tok) + 8, cross_attention_layers=[1],
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id),
        image_token_index=tok.convert_tokens_to_ids("<|image|>"))
    torch.manual_seed(0)
    return _save(root, tf.MllamaForConditionalGeneration(config), processor)


def save_paligemma(root: Path) -> Path:
    """PaliGemma (SigLIP tower, 16 placeholders an image, a Gemma) with its processor, which
    has no chat template: it takes a prompt and its answer (``suffix``)."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    tok = _tokenizer(["<image>", "<bos>"], "", {"image_token": "<image>"}, bos="<bos>")
    tok.chat_template = None
    images = tf.SiglipImageProcessor(size={"height": 8, "width": 8})
    images.image_seq_length = 16
    processor = tf.PaliGemmaProcessor(image_processor=images, tokenizer=tok)
    config = tf.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma", head_dim=8, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, initializer_range=0.5),
        vision_config=dict(model_type="siglip_vision_model", image_size=8, patch_size=2,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2),
        image_token_index=tok.convert_tokens_to_ids("<image>"), projection_dim=32)
    torch.manual_seed(0)
    return _save(root, tf.PaliGemmaForConditionalGeneration(config), processor)


IDEFICS_TOKENS = {"image_token": "<image>", "fake_image_token": "<fake_token_around_image>",
                  "global_image_token": "<global-img>",
                  "end_of_utterance_token": "<end_of_utterance>"}
"""Idefics3's and SmolVLM's named special tokens."""


def _idefics_like(config_cls: Any, model_cls: Any, tok: Any) -> Any:
    """A tiny Idefics3 or SmolVLM (a SigLIP tower, pixel shuffle by 2, a Llama), seeded."""
    import torch

    config = config_cls(
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id),
        vision_config=dict(image_size=8, patch_size=2, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2),
        scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    return model_cls(config)


def save_idefics3(root: Path) -> Path:
    """Idefics3 (SigLIP tower, pixel shuffle to 4 placeholders an image between markers, a
    row's images padded on an axis of their own, no image splitting) with its processor."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<image>")
    tok = _tokenizer(list(IDEFICS_TOKENS.values()), template, IDEFICS_TOKENS)
    images = tf.Idefics3ImageProcessorPil(size={"longest_edge": 8},
                                          max_image_size={"longest_edge": 8},
                                          do_image_splitting=False)
    processor = tf.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                     chat_template=template)
    return _save(root, _idefics_like(tf.Idefics3Config, tf.Idefics3ForConditionalGeneration,
                                     tok), processor)


def save_llava_next(root: Path) -> Path:
    """LLaVA-NeXT (CLIP tower, any-resolution crops of 8x8 tiles chosen by each image's size,
    an ``image_newline`` between rows, ``image_sizes``) with its processor."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<image>")
    tok = _tokenizer(["<image>"], template)
    grid = [[8, 8], [8, 16], [16, 8], [16, 16]]
    images = tf.LlavaNextImageProcessorPil(size={"shortest_edge": 8},
                                           crop_size={"height": 8, "width": 8},
                                           image_grid_pinpoints=grid)
    processor = tf.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                                      chat_template=template, num_additional_image_tokens=1,
                                      vision_feature_select_strategy="default")
    config = tf.LlavaNextConfig(
        text_config=dict(TEXT, model_type="llama", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id),
        vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=4,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, projection_dim=16),
        image_grid_pinpoints=grid, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(0)
    return _save(root, tf.LlavaNextForConditionalGeneration(config), processor)


def save_mistral3(root: Path) -> Path:
    """Mistral 3 (a Pixtral tower on images kept at their own size, patches of 2 merged 2x2,
    a break token after each row of them, ``image_sizes``) with its processor."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "[IMG]")
    tok = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"], template)
    images = tf.PixtralImageProcessorPil(size={"longest_edge": 16}, patch_size=2)
    processor = tf.PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=2,
                                    spatial_merge_size=2, chat_template=template,
                                    image_token="[IMG]", image_break_token="[IMG_BREAK]",
                                    image_end_token="[IMG_END]")
    config = tf.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", head_dim=8, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                         initializer_range=0.5),  # drawn wide: its greedy answer varies
        vision_config=dict(model_type="pixtral", image_size=16, patch_size=2, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=8),
        spatial_merge_size=2, image_token_index=tok.convert_tokens_to_ids("[IMG]"))
    torch.manual_seed(0)
    return _save(root, tf.Mistral3ForConditionalGeneration(config), processor)


def save_smolvlm(root: Path) -> Path:
    """SmolVLM (Idefics3's layout: pixel shuffle to 4 placeholders an image between markers, a
    row's images on an axis of their own) with its processor, whose video processor needs
    torchvision."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<image>")
    tok = _tokenizer(list(IDEFICS_TOKENS.values()), template, IDEFICS_TOKENS)
    size = {"longest_edge": 8}
    processor = tf.SmolVLMProcessor(
        image_processor=tf.SmolVLMImageProcessor(size=size, max_image_size=size,
                                                 do_image_splitting=False),
        tokenizer=tok, video_processor=tf.SmolVLMVideoProcessor(size=size, max_image_size=size),
        image_seq_len=4, chat_template=template)
    return _save(root, _idefics_like(tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration,
                                     tok), processor)


def save_internvl(root: Path) -> Path:
    """InternVL (pixel shuffle to 4 placeholders an image between ``<img>`` markers, a Qwen2)
    with its processor, whose video processor needs torchvision."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<IMG_CONTEXT>")  # the processor writes the markers
    named = {"start_image_token": "<img>", "end_image_token": "</img>",
             "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tok = _tokenizer(list(named.values()), template, named)
    size = {"height": 8, "width": 8}
    processor = tf.InternVLProcessor(
        image_processor=tf.GotOcr2ImageProcessor(size=size, crop_to_patches=False),
        tokenizer=tok, video_processor=tf.InternVLVideoProcessor(size=size),
        image_seq_length=4, chat_template=template)
    config = tf.InternVLConfig(
        text_config=dict(TEXT, model_type="qwen2", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                         initializer_range=0.5),  # drawn wide: its greedy answer varies
        vision_config=dict(image_size=8, patch_size=2, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4)
    torch.manual_seed(0)
    return _save(root, tf.InternVLForConditionalGeneration(config), processor)


def save_llava_onevision(root: Path) -> Path:
    """LLaVA-OneVision (SigLIP tower, any-resolution crops of 8x8 tiles, ``image_newline``, a
    Qwen2) with its processor, whose video processor needs torchvision."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<image>")
    tok = _tokenizer(["<image>", "<video>"], template)
    grid = [[8, 8], [8, 16], [16, 8], [16, 16]]
    size = {"height": 8, "width": 8}
    processor = tf.LlavaOnevisionProcessor(
        image_processor=tf.LlavaOnevisionImageProcessor(size=size, image_grid_pinpoints=grid),
        tokenizer=tok, video_processor=tf.LlavaOnevisionVideoProcessor(size=size),
        num_image_tokens=4, vision_feature_select_strategy="full", chat_template=template)
    config = tf.LlavaOnevisionConfig(
        text_config=dict(TEXT, model_type="qwen2", vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id),
        vision_config=dict(model_type="siglip_vision_model", image_size=8, patch_size=4,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2),
        image_grid_pinpoints=grid, image_token_index=tok.convert_tokens_to_ids("<image>"),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full", vision_feature_layer=-1)
    torch.manual_seed(0)
    return _save(root, tf.LlavaOnevisionForConditionalGeneration(config), processor)


QWEN_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
QWEN_VISION = dict(depth=1, num_heads=2, patch_size=2, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3)
QWEN_CONFIGS: dict[str, Callable[[dict[str, Any], dict[str, int]], Any]] = {
    "qwen2_vl": lambda text, ids: __import__("transformers").Qwen2VLConfig(
        text_config=dict(text, model_type="qwen2_vl_text",
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1])),
        vision_config=dict(QWEN_VISION, embed_dim=16, hidden_size=32), **ids),
    "qwen2_5_vl": lambda text, ids: __import__("transformers").Qwen2_5_VLConfig(
        text_config=dict(text, model_type="qwen2_5_vl_text",
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1])),
        vision_config=dict(QWEN_VISION, hidden_size=16, intermediate_size=32,
                           out_hidden_size=32, window_size=8, fullatt_block_indexes=[0]),
        **ids),
    "qwen3_vl": lambda text, ids: __import__("transformers").Qwen3VLConfig(
        text_config=dict(text, model_type="qwen3_vl_text", head_dim=8,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=[2, 1, 1], mrope_interleaved=True)),
        vision_config=dict(depth=2, num_heads=2, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, hidden_size=16,
                           intermediate_size=32, out_hidden_size=32, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]), **ids),
}
"""Tiny configs of the Qwen-VL family, from a text config and the placeholder token ids."""


def save_qwen_vl(root: Path, family: str = "qwen2_vl") -> Path:
    """A Qwen-VL model (``family``: qwen2_vl, qwen2_5_vl or qwen3_vl; patches of 2 pixels, 2x2
    merged, so a 16x16 image is 16 placeholders) with its processor, whose video processor needs
    torchvision."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    template = PARTS.replace("{IMAGE}", "<|vision_start|><|image_pad|><|vision_end|>")
    tok = _tokenizer(QWEN_TOKENS, template)
    sizes = dict(patch_size=2, merge_size=2, temporal_patch_size=2,
                 size={"shortest_edge": 64, "longest_edge": 1024})
    cls = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[family]
    images = tf.Qwen2VLImageProcessor(**sizes)  # Qwen3-VL's too
    videos = getattr(tf, "Qwen3VLVideoProcessor" if family == "qwen3_vl" else
                     "Qwen2VLVideoProcessor")(**sizes)
    processor = getattr(tf, f"{cls}Processor")(image_processor=images, tokenizer=tok,
                                              video_processor=videos, chat_template=template)
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id",
                    "video_token_id"), tok.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    text = dict(TEXT, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(QWEN_CONFIGS[family](text, ids))
    return _save(root, model, processor)


def exchanges(n: int, images: list[Path], seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows of one image and one exchange (TRL's convention), as PaliGemma trains."""
    import random

    rng = random.Random(seed)
    return [{"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " ".join(
            rng.choices(chat.WORDS, k=rng.randint(2, 6)))}]},
        {"role": "assistant", "content": [{"type": "text", "text": " ".join(
            rng.choices(chat.WORDS, k=rng.randint(1, 4)))}]}],
        "images": [images[i % len(images)].name]} for i in range(n)]


SAVERS: dict[str, Callable[[Path], Path]] = {"llava": save_llava, "gemma3": save_gemma3,
                                             "mllama": save_mllama, "paligemma": save_paligemma,
                                             "idefics3": save_idefics3,
                                             "llava_next": save_llava_next}
"""The savers whose processors load without torchvision (Mistral 3's and the Qwen-VL
family's need it: :func:`save_mistral3`, :func:`save_qwen_vl`)."""
