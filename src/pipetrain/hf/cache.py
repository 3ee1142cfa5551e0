"""Cache: a Hugging Face causal LM with a static KV cache that torch.export records in place.

transformers' ``StaticCache`` preallocates every layer's keys and values (``rows`` sequences
of ``length`` positions) and writes a step's keys into them with ``index_copy_`` at the
positions its ``cumulative_length`` counter gives: in-place writes that the capture keeps
(:mod:`pipetrain.split.capture`). Each layer's cache is read and written only inside that
layer, so cut at the decoder layers every stage holds the caches of its own layers and a
decode step sends one token's hidden state from stage to stage, not the context. The model
keeps its own attention code; this module only hands it the cache, as transformers' own
``TorchExportableModuleWithStaticCache`` (its ExecuTorch recipe) does, with two differences:
the attention mask and positions are inputs (prompts of different lengths, padded on the
left, as ``generate`` pads them), and the counters are not reset inside ``forward``
(:class:`~pipetrain.generation.Generator` swaps whole caches in and out per group instead).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

__all__ = ["CachedImageTextLM", "CachedLM", "pad_left", "positions", "rope_index",
           "visual_inputs"]

_TEXT = ("input_ids", "attention_mask")
"""A processor's outputs that are not visual."""
_PER_TOKEN = ("token_type_ids", "mm_token_type_ids", "cross_attention_mask")
"""A processor's outputs with a value per token (their second dimension), besides the ids."""


class CachedLM(nn.Module):
    """``model`` called with a static KV cache of ``rows`` sequences and ``length`` positions.

    ``forward(input_ids, attention_mask, position_ids)`` returns the logits; the cache is
    written in place. ``attention_mask`` covers all ``length`` positions (0 where a prompt is
    padded); ``position_ids`` are each token's position in its own sequence.

    A cross-attention layer (Mllama's, attending to the images) caches ``cross`` positions,
    its keys and values of the images, as transformers' own static cache for Mllama does;
    they are written whole at every step, from the image states each step gives again
    (:attr:`rewritten`: the counters to zero before each step).

    Raises:
        ValueError: for a model whose cache transformers cannot make static (a sliding window
            that the model also relies on, an encoder-decoder).
    """

    def __init__(self, model: nn.Module, rows: int, length: int, cross: int = 0) -> None:
        super().__init__()
        from transformers.cache_utils import StaticCache, StaticLayer
        from transformers.configuration_utils import get_head_shapes

        config = cast(Any, model).config.get_text_config()
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder; generation through "
                             "the pipeline takes decoder-only causal LMs")
        self.model = model
        self.config = cast(Any, model).config  # with _init_weights: a meta model is built by name
        self.cache = StaticCache(max_cache_len=length, config=config)
        for i, layer in enumerate(self._layers()):
            if type(layer) is not StaticLayer:  # a sliding window decides on the counter:
                window = getattr(config, "sliding_window", None)  # only exact below the window
                if window is not None and window < length:
                    raise ValueError(f"{type(model).__name__} attends over a sliding window of "
                                     f"{window} positions, shorter than {length}: generate at "
                                     "most that many positions")
                self.cache.layers[i] = StaticLayer(length)
        crossing = set(getattr(config, "cross_attention_layers", None) or ()) if cross else set()
        for i in crossing:
            self.cache.layers[i] = StaticLayer(cross)
        self.rewritten = {f"cumulative_length_{i}" for i in crossing}
        """The buffers of the cross-attention layers' counters (zeroed before each step)."""
        heads, head_dim = get_head_shapes(config)
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.cache.early_initialization(rows, heads, head_dim, dtype, device)
        for layer in self._layers():  # a meta model's counters real: an image-text model's
            if layer.cumulative_length.is_meta:  # prefix runs eagerly at its capture, on
                layer.cumulative_length = torch.zeros((), dtype=torch.long)  # real embeddings
        for i, layer in enumerate(self._layers()):  # buffers, so that a meta model's are
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)  # its own
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)
            self.register_buffer(f"cumulative_length_{i}", layer.cumulative_length,
                                 persistent=False)

    def _init_weights(self, module: nn.Module) -> None:
        """The model's own initialisation (:class:`pipetrain.split.lazy.NamedInit` runs it)."""
        self.model._init_weights(module)  # type: ignore[operator]

    def get_input_embeddings(self) -> nn.Module:
        """The model's token embedding (made real for an image-text model's prefix on
        ``meta``, :mod:`pipetrain.split.prefix_meta`)."""
        embed: nn.Module = self.model.get_input_embeddings()  # type: ignore[operator]
        return embed

    def cache_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the cache: per layer its keys, values and position counter."""
        return [t for layer in self._layers()
                for t in (layer.keys, layer.values, layer.cumulative_length)]

    def _layers(self) -> list[Any]:
        return list(self.cache.layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> Any:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids, cache=self.cache, use_cache=True)
        return out.logits


_FIRST_POSITION = {"paligemma": 1}
"""The models whose forward numbers positions from 1, not 0 (PaliGemma's, and its
``generate`` adds 1 to the positions it is given): the positions a prompt's tokens get."""


class CachedImageTextLM(CachedLM):
    """An image-text-to-text model called with a static KV cache: as :class:`CachedLM`, and
    with the images of a prompt (``pixel_values`` and what the processor gives beside them:
    ``image_sizes``, Gemma 3's ``token_type_ids``, Mllama's tiles and ``cross_attention_mask``)
    at its prefill. Captured from its language model on, the vision tower running eagerly in
    the first stage (:mod:`pipetrain.split.prefix`); a decode step gives no images (token types
    of 0), and the model embeds its token alone. Mllama's decode steps give the image states
    its prefill made (``cross_attention_states``) and the last row of its
    ``cross_attention_mask``, as its ``generate`` does (``images``: the capture's prompt, which
    sizes the cross-attention cache). A model with multimodal rotary positions (Qwen-VL) is
    given them on every axis (:func:`positions`); Qwen3-VL's graph takes its vision tower's
    outputs (``mm_encoder_outputs``, :mod:`pipetrain.split.prefix`), empty at a decode step."""

    def __init__(self, model: nn.Module, rows: int, length: int,
                 images: dict[str, torch.Tensor]) -> None:
        super().__init__(model, rows, length, cross=_image_states(model, images))

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                pixel_values: torch.Tensor | None = None,
                image_sizes: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                aspect_ratio_ids: torch.Tensor | None = None,
                aspect_ratio_mask: torch.Tensor | None = None,
                cross_attention_mask: torch.Tensor | None = None,
                cross_attention_states: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None,
                pixel_attention_mask: torch.Tensor | None = None,
                batch_num_images: torch.Tensor | None = None,
                mm_encoder_outputs: dict[str, Any] | None = None) -> Any:
        given = {"pixel_values": pixel_values, "image_sizes": image_sizes,
                 "image_grid_thw": image_grid_thw, "mm_encoder_outputs": mm_encoder_outputs,
                 "pixel_attention_mask": pixel_attention_mask,
                 "batch_num_images": batch_num_images,
                 "token_type_ids": token_type_ids, "aspect_ratio_ids": aspect_ratio_ids,
                 "aspect_ratio_mask": aspect_ratio_mask,
                 "cross_attention_mask": cross_attention_mask,
                 "cross_attention_states": cross_attention_states}
        visual = {k: v for k, v in given.items() if v is not None}
        first = _FIRST_POSITION.get(self.config.model_type, 0)
        if position_ids is not None and first:
            position_ids = position_ids + first
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds,
                         attention_mask=attention_mask, position_ids=position_ids,
                         cache=self.cache, use_cache=True, **visual)
        return out.logits

    def example(self, images: dict[str, torch.Tensor], rows: int, length: int
                ) -> dict[str, Any]:
        """The capture's input: ``rows`` copies of one prompt and its images (``images``:
        ``input_ids`` of shape (1, n) and the visual tensors, as the processor gives them),
        with the positions :func:`positions` gives."""
        ids = images["input_ids"].repeat(rows, 1)
        n = ids.shape[1]
        mask = torch.zeros(rows, length, dtype=torch.long)
        mask[:, :n] = 1
        prompts = [images] * rows
        rope = rope_index(self.model, ids, mask[:, :n], prompts)
        return {"input_ids": ids, "attention_mask": mask,
                "position_ids": positions(torch.arange(n).repeat(rows, 1), rope),
                **visual_inputs(prompts, ids.device, rope is not None)}

    def share_cache(self, buffers: dict[str, torch.Tensor]) -> None:
        """Point this wrapper's own cache at the stages' tensors of it (``key_cache_3``:
        layer 3's keys), those this rank holds: the model's forward, run eagerly up to its
        language model (a Gemma 3 builds its masks there), reads the positions they hold."""
        fields = {"key_cache": "keys", "value_cache": "values",
                  "cumulative_length": "cumulative_length"}
        layers = self._layers()
        for name, tensor in buffers.items():
            kind, _, index = name.rpartition("_")
            setattr(layers[int(index)], fields[kind], tensor)
        held = next((layer.cumulative_length for layer in layers if not layer.keys.is_meta),
                    None)
        for layer in layers:  # another rank's layers: every layer counts the same positions
            if held is not None and layer.keys.is_meta:
                layer.cumulative_length = held


def _image_states(model: nn.Module, images: dict[str, torch.Tensor]) -> int:
    """How many image states a cross-attention layer attends to for ``images`` (Mllama's: per
    image, its tiles' patches and class token), as transformers sizes its static cache; 0 for
    a model without cross-attention layers."""
    config = cast(Any, model).config
    if not getattr(config.get_text_config(), "cross_attention_layers", None):
        return 0
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2 + 1
    return int(images["pixel_values"].shape[1]) * int(vision.max_num_tiles) * int(patches)


def rope_index(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor,
               prompts: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a model with multimodal rotary positions (M-RoPE: the Qwen-VL family, GLM-4V, ...:
    its inner model's ``get_rope_index``), the prompts' positions on the three axes (time,
    height, width; shape (3, rows, n)) as its ``generate`` computes them from the image grids,
    and each row's delta (rows, 1) that its new tokens' positions add on every axis; None for
    another model. ``ids`` and ``mask`` (rows, n): the prompts padded on the left, ``prompts``:
    each row's processor output (its ``mm_token_type_ids`` and grids), padded as the ids
    (:func:`pad_left`)."""
    index = getattr(getattr(model, "model", None), "get_rope_index", None)
    if index is None or not prompts or "mm_token_type_ids" not in prompts[0]:
        return None
    types = torch.cat([p["mm_token_type_ids"] for p in prompts]).to(ids.device)  # padded as ids
    grids = {k: torch.cat([p[k] for p in prompts]).to(ids.device)
             for k in ("image_grid_thw", "video_grid_thw") if k in prompts[0]}
    axes, deltas = index(ids, types, attention_mask=mask, **grids)
    return axes, deltas


def positions(text: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
              at: slice | None = None) -> torch.Tensor:
    """The ``position_ids`` of tokens whose places in their own sequences are ``text`` (rows,
    k): those, or for an M-RoPE model (``rope``, :func:`rope_index`) the four rows its
    ``generate`` passes, ``text`` and the three axes: the prompt's at its columns ``at`` (all
    when None), after the prompt ``text`` plus each row's delta."""
    if rope is None:
        return text
    axes, deltas = rope
    if at is not None and at.start >= axes.shape[2]:
        three = (text + deltas.to(text.device)).expand(3, -1, -1)
    else:
        three = axes[:, :, at if at is not None else slice(None)].to(text.device)
    return torch.cat([text[None], three])


def pad_left(prompt: dict[str, torch.Tensor], n: int, width: int) -> dict[str, torch.Tensor]:
    """A prompt's processor output (of ``n`` tokens) with its tensors of a value per token
    (token types, Mllama's ``cross_attention_mask``) padded with zeros on the left to
    ``width``, as its ids are in a group of prompts (a padded token has no type and sees no
    image)."""
    out = dict(prompt)
    for k in _PER_TOKEN:
        v = prompt.get(k)
        if v is not None and v.dim() > 1 and v.shape[1] == n < width:
            pad = v.new_zeros(v.shape[0], width - n, *v.shape[2:])
            out[k] = torch.cat([pad, v], dim=1)
    return out


def visual_inputs(prompts: list[dict[str, torch.Tensor]], device: torch.device,
                  rope: bool = False) -> dict[str, torch.Tensor]:
    """The visual tensors of several prompts' processor outputs, one after another (``rope``:
    without the token types, which only :func:`rope_index` reads)."""
    text = (*_TEXT, "mm_token_type_ids") if rope else _TEXT
    keys = [k for k in prompts[0] if k not in text]
    return {k: torch.cat([p[k] for p in prompts if k in p]).to(device) for k in keys}
