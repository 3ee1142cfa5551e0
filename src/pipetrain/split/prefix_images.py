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
           "spatial_shapes")
"""Arguments the prefix consumes (the images and what describes them), by name or prefix."""


def tokens_per_image(model: nn.Module, payload: dict[str, Any], pixels: str, grid: str,
                     total: int) -> list[int]:
    """Each image's count of placeholder tokens, in order."""
    if grid in payload:
        vision = getattr(model.config, "vision_config", None)
        merge = getattr(vision, "spatial_merge_size", 1) or 1
        return [int(g.prod()) // merge ** 2 for g in payload[grid]]
    n = int(payload[pixels].shape[0])
    if n == 0 or total % n:
        raise ValueError(f"{total} image placeholders do not share evenly among the {n} "
                         f"images of {pixels}: without a grid, images of different sizes "
                         "(image_sizes) cannot be told apart; give each image the same size, "
                         "or every row one image")
    return [total // n] * n


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
    for k in group:
        value = payload[k]
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
