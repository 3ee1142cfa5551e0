"""Prefix images: the share of a batch's visual tensors that each micro-batch of rows takes.

For the vision prefix (:mod:`pipetrain.split.prefix`), whose
:meth:`~pipetrain.split.prefix.VisionPrefix.split` says how images belong to rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.runtime import microbatch
from pipetrain.split.inputs import Packed

__all__ = ["is_visual", "kind_of", "split_images", "tokens_per_image"]

_VISUAL = ("pixel_values", "image_", "video_", "aspect_ratio_", "pixel_attention_mask",
           "spatial_shapes", "batch_num_images")
"""Arguments the prefix consumes (the images and what describes them), by name or prefix."""


def tokens_per_image(model: nn.Module, payload: dict[str, Any], pixels: str, grid: str,
                     total: int) -> list[int]:
    """Each image's count of placeholder tokens, in order."""
    if grid in payload:
        vision = getattr(model.config, "vision_config", None)
        merge = getattr(vision, "spatial_merge_size", 1) or 1
        return [int(g.prod()) // merge ** 2 for g in payload[grid]]
    sizes = payload.get("image_sizes") if pixels == "pixel_values" else None
    counted = _packed_lengths(model, sizes, payload.get("batch_num_images")) \
        if sizes is not None else None
    if counted is None and sizes is not None:
        counted = _merged_lengths(model, sizes)
    if counted is not None:
        return counted
    n = int(payload[pixels].shape[0])
    if n == 0 or total % n:
        raise ValueError(f"{total} image placeholders do not share evenly among the {n} "
                         f"images of {pixels}: without a grid, images of different sizes "
                         "(image_sizes) cannot be told apart; give each image the same size, "
                         "or every row one image")
    return [total // n] * n


def _packed_lengths(model: nn.Module, sizes: Any, counts: Any = None) -> list[int] | None:
    """For a model that cuts each image into crops by its size and packs their features with a
    newline after each row (LLaVA-NeXT, LLaVA-OneVision: ``pack_image_features``), each
    image's count of features for its ``image_sizes``: the model's own packing, run on
    ``meta`` features of the crops' shapes (no pixels are read); None for another model.
    ``counts``: LLaVA-OneVision's ``batch_num_images``, the images of each row that shows any,
    which its forward cuts into crops only when a row shows one."""
    import inspect
    import sys

    inner: Any = next((m for m in model.modules() if hasattr(m, "image_newline")
                       and callable(getattr(m, "pack_image_features", None))), None)
    config: Any = getattr(inner, "config", None)
    if inner is None or sizes is None or not getattr(config, "image_grid_pinpoints", None):
        return None
    crops_of = getattr(sys.modules[type(inner).__module__], "image_size_to_num_patches", None)
    if crops_of is None:
        return None
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    newline = inner.image_newline
    crops = [crops_of(image_size=size, grid_pinpoints=config.image_grid_pinpoints,
                      patch_size=vision.image_size) for size in sizes]
    if counts is not None:  # LLaVA-OneVision: an image among several of its row is not cut
        crops = [c if n == 1 else 1 for c, n in zip(crops, (int(n) for n in counts
                                                            for _ in range(int(n))))]
    features = [torch.empty(c, side * side, newline.shape[-1], device="meta") for c in crops]
    pack = inner.pack_image_features
    kwargs: dict[str, Any] = {"image_newline": newline.to("meta")}
    params = inspect.signature(pack).parameters
    if "vision_feature_select_strategy" in params:
        kwargs["vision_feature_select_strategy"] = config.vision_feature_select_strategy
    if "vision_aspect_ratio" in params:
        kwargs["vision_aspect_ratio"] = config.vision_aspect_ratio
    packed, _ = pack(features, sizes, **kwargs)
    return [int(f.shape[0]) for f in packed]


def _merged_lengths(model: nn.Module, sizes: torch.Tensor) -> list[int] | None:
    """For a model that keeps each image at its own size and merges its patches
    ``spatial_merge_size`` by ``spatial_merge_size`` (Mistral 3's Pixtral tower), each image's
    count of placeholders from its ``image_sizes``, as its ``get_image_features`` splits them;
    None for another model."""
    config: Any = getattr(model, "config", None)
    merge = getattr(config, "spatial_merge_size", None)
    patch = getattr(getattr(config, "vision_config", None), "patch_size", None)
    if not isinstance(merge, int) or not isinstance(patch, int):
        return None
    return [int(n) for n in (torch.as_tensor(sizes) // (patch * merge)).prod(dim=-1)]


def split_images(payload: dict[str, Any], pixels: str, grid: str,
                 per_row: list[int] | None, rows: list[int],
                 parts: list[dict[str, Any]], shown: list[bool]) -> None:
    """Put each micro-batch's share of the visual tensors of one kind into ``parts``; one
    whose rows show none of its placeholders (``shown``) gets none (Idefics3's forward drops
    a row's padding images and fails on none left)."""
    group = [k for k in payload if is_visual(k) and kind_of(k) == kind_of(pixels)]
    if per_row is None:
        split = microbatch.split(Packed({k: payload[k] for k in group}), len(rows))
        for part, share, any_shown in zip(parts, split, shown):
            if any_shown:
                part.update(share)
        return
    bounds, at = [], 0
    for n in rows:
        bounds.append((sum(per_row[:at]), sum(per_row[:at + n])))
        at += n
    patches = ([int(g.prod()) for g in payload[grid]] if grid in payload else None)
    showing = [n > 0 for n in per_row]  # batch_num_images: an entry per row that shows images
    starts = [sum(rows[:i]) for i in range(len(rows) + 1)]
    for k in group:
        value = payload[k]
        if k == "batch_num_images":
            for part, a, b in zip(parts, starts, starts[1:]):
                if any(showing[a:b]):
                    part[k] = value[sum(showing[:a]):sum(showing[:b])]
            continue
        for part, (lo, hi) in zip(parts, bounds):
            if lo == hi:
                continue  # rows without images of this kind: the model's forward without them
            if k == pixels and patches is not None:
                lo, hi = sum(patches[:lo]), sum(patches[:hi])
            part[k] = value[lo:hi] if torch.is_tensor(value) and value.dim() > 0 else value


def kind_of(name: str) -> str:
    return "video" if "video" in name else "image"


def is_visual(name: str) -> bool:
    return name.startswith(_VISUAL)
