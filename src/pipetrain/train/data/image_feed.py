"""Image feed: a batch's rows of image chats as the model's keyword arguments, the processor's
own tensors for their texts and images, read when the batch is fed.

The example cache (:mod:`.image_chats`) holds each example's ids, and beside them its rendered
text and where its images are. :class:`ImageFeed` reads a batch's images and runs the
processor on its texts and images once more, so the model gets the processor's own tensors
(``pixel_values``, grids, token types, ...), cut or padded to ``--seq-len`` like the ids, and
every batch of a model that gives a row's images an axis (Mllama) the same number of slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ImageFeed", "Ref", "Rows", "line_of", "open_image"]

Ref = str | list[Any]
"""Where an image is: an absolute path, or ``["row", r, k]``, the ``k``-th image of row
``r`` of the data set (an image stored in it)."""


def line_of(where: str, row: int) -> str:
    """How an error names a row: its line in a JSONL file, else its number."""
    return f"{where} line {row + 1}" if where.endswith(".jsonl") else f"{where} row {row}"


def open_image(source: Any, label: str) -> Any:
    """``source`` (a path, a PIL image, or a ``datasets`` Image value) as an RGB PIL image.

    Raises:
        ValueError: naming ``label`` when the file does not exist or does not decode.
    """
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    if isinstance(source, dict) and source.get("bytes") is not None:
        source = io.BytesIO(source["bytes"])
    elif isinstance(source, dict):
        source = source.get("path")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"{label}: image {str(source)!r} does not exist; give paths that "
                         "exist (relative ones are read against the data file's directory)"
                         ) from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{label}: image {str(source)!r} does not decode as an image "
                         f"({e}); give a PNG, JPEG or another format PIL reads") from None


class Rows(Protocol):
    """What re-reads the images stored in a data set's rows (an image chat encoder)."""

    column: str
    images: str
    where: str

    def sources(self, messages: Any, pool: Any, row: int) -> tuple[list[Any], list[Any]]:
        """A row's messages as its template takes them and its images' sources in order."""
        ...


class ImageFeed:
    """A batch's rows as the model's keyword arguments: the processor's tensors for their texts
    and images, fit to ``seq_len`` tokens.

    Args:
        processor: the checkpoint's processor.
        media: each example's text and images (:attr:`.image_chats.ImageChatCorpus.media`).
        encoder: re-reads an image stored in the data set (:data:`Ref` ``["row", r, k]``).
        rows: opens the data set's rows (for such images), when first asked.
    """

    def __init__(self, processor: Any, media: tuple[dict[str, Any], ...],
                 encoder: Rows | None = None, rows: Callable[[], Any] | None = None) -> None:
        self.processor, self.media, self.encoder, self._rows = processor, media, encoder, rows
        self._opened: Any = None
        self.slots = max((len(m["images"]) for m in media), default=1) or 1
        """Image slots per row, where a processor gives each row an axis of images (Mllama):
        the most any example shows, so that every batch has the same shapes."""
        self.blank: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        """Per visual tensor of a model that cross-attends to its images (Mllama), its shape
        past the rows and its dtype: a batch without an image gets these as zeros (every
        slot empty), so that every micro-batch gives the graph the same inputs."""

    def __call__(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        examples = [int(e) for e in inputs["example"]]
        texts = [self.media[e]["text"] for e in examples]
        images = [[self._image(r, e) for r in self.media[e]["images"]] for e in examples]
        answers = [self.media[e]["answer"] for e in examples] \
            if examples and "answer" in self.media[examples[0]] else None
        out = self.tensors(texts, images, inputs["input_ids"].shape[1], answers)
        ids, mask = out["input_ids"], inputs["attention_mask"].bool()
        if not torch.equal(ids[mask], inputs["input_ids"][mask].to(ids.dtype)):
            raise ValueError("the processor's tokens for examples "
                             f"{examples} differ from the token cache's; the processor or its "
                             "files changed after tokenizing: delete the cache "
                             "(--token-cache) and run again")
        return out

    def tensors(self, texts: list[str], images: list[list[Any]], seq_len: int,
                answers: list[str] | None = None) -> dict[str, Any]:
        """The processor's outputs for ``texts`` and their ``images`` (and ``answers``, the
        suffixes of prompt-answer rows): every tensor of one entry per token cut or
        right-padded to ``seq_len``, the others as given; the processor's own labels left out
        (the targets are the cache's)."""
        shown = images if any(images) else None
        given = {} if answers is None else {"suffix": answers}
        out = self.processor(text=texts, images=shown, add_special_tokens=False,  # right:
                             padding=True, padding_side="right",  # some pad left (InternVL)
                             return_tensors="pt", **given)
        out.pop("labels", None)
        ids = out["input_ids"]
        pad = int(self.processor.tokenizer.pad_token_id)
        fitted: dict[str, Any] = {}
        for key, value in out.items():
            if torch.is_tensor(value) and value.shape[:2] == ids.shape[:2]:
                value = _fit(value, seq_len, pad if key == "input_ids" else 0)
            fitted[key] = value
        pixels = fitted.get("pixel_values")
        if torch.is_tensor(pixels) and pixels.dim() >= 5 and "image_sizes" not in fitted:
            # a row's images on an axis (not LLaVA-NeXT's crops of each image)
            _rows_of_images(fitted, [bool(shown) for shown in images])
            _pad_slots(fitted, int(pixels.shape[1]), self.slots)
            if "cross_attention_mask" in fitted:
                self.blank = {k: (tuple(v.shape[1:]), v.dtype) for k, v in fitted.items()
                              if k in _SLOTTED}
        elif self.blank:
            rows = ids.shape[0]
            fitted.update({k: torch.zeros(rows, *shape, dtype=dtype)
                           for k, (shape, dtype) in self.blank.items()})
        return fitted

    def _image(self, ref: Ref, example: int) -> Any:
        if isinstance(ref, str):
            return open_image(ref, f"example {example}")
        if self.encoder is None or self._rows is None:
            raise ValueError(f"example {example}: its image is stored in the data set, which "
                             "this feed cannot open")
        if self._opened is None:
            self._opened = self._rows()
        _, row, k = ref
        encoder = self.encoder
        record = self._opened[int(row)]
        _, found = encoder.sources(record[encoder.column], record.get(encoder.images), int(row))
        return open_image(found[int(k)], line_of(encoder.where, int(row)))


_SLOTTED = {"pixel_values": 1, "aspect_ratio_ids": 1, "aspect_ratio_mask": 1,
            "pixel_attention_mask": 1, "cross_attention_mask": 2}
"""The tensors with an axis of a row's images, and which axis (Mllama, Idefics3)."""


def _rows_of_images(fitted: dict[str, Any], showing: list[bool]) -> None:
    """Give each tensor with an axis of a row's images a row per row of the batch, where the
    batch's pixels have that axis (Mllama's, Idefics3's; never a batch of images one after
    another, as LLaVA's): a processor may leave out the rows without an image (Mllama's
    torchvision backend does for its aspect ratios, its PIL one does not), which get empty
    slots (zeros) back in their places."""
    rows = len(showing)
    for key in _SLOTTED:
        value = fitted.get(key)
        if not torch.is_tensor(value) or value.dim() == 0 or value.shape[0] == rows \
                or value.shape[0] != sum(showing):
            continue
        full = value.new_zeros(rows, *value.shape[1:])
        full[torch.tensor(showing)] = value
        fitted[key] = full


def _pad_slots(fitted: dict[str, Any], shown: int, slots: int) -> None:
    """Pad each tensor's axis of images from ``shown`` to ``slots`` with zeros (empty slots,
    as the processor pads a row with fewer images)."""
    for key, axis in _SLOTTED.items():
        value = fitted.get(key)
        if not torch.is_tensor(value) or value.dim() <= axis or value.shape[axis] != shown \
                or shown >= slots:
            continue
        shape = list(value.shape)
        shape[axis] = slots - shown
        fitted[key] = torch.cat([value, value.new_zeros(shape)], dim=axis)


def _fit(value: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """``value`` cut or right-padded with ``pad`` to ``length`` along dim 1."""
    if value.shape[1] >= length:
        return value[:, :length].contiguous()
    shape = (value.shape[0], length - value.shape[1], *value.shape[2:])
    return torch.cat([value, value.new_full(shape, pad)], dim=1)
