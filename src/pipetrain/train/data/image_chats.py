"""Image chats: conversations with images, tokenized once by the checkpoint's processor, and the
images of a batch's rows read when the batch is fed.

A row holds a ``messages`` column (``--chat-field``) of ``{role, content}`` turns whose
content is text or a list of parts. Two conventions name the images, and both are read:

* TRL's: ``{"type": "image"}`` placeholders in the content, the images in order in an
  ``images`` column (``--images-field``): paths, or a ``datasets`` Image feature;
* transformers' content parts: ``{"type": "image", "path": ...}`` (or ``"url"`` to a local
  file, ``file://`` or a path, or ``"image"``) where the image goes.

A relative path is read against the data file's directory, then the working directory. Each
row is rendered by the processor's chat template and tokenized by the processor with its
images (:class:`ImageChatEncoder`), which writes each image's placeholder tokens as its size
asks. The trained tokens are the assistant's turns, found as :mod:`.records` finds them: the
conversation rendered up to each turn, tokenized with the images shown so far; every token
standing for an image (:func:`pipetrain.hf.image_text.image_token_ids`) is never trained.
The ids and flags go to the example cache (:mod:`.examples`), and beside them, per example,
its rendered text and where its images are (``<key>.media.jsonl``).

A batch (:class:`ImageChatBatches`) carries each row's example number; the feed
(:class:`~pipetrain.train.data.image_feed.ImageFeed`) reads those rows' images and runs the
processor on their texts and images once more, so the model gets the processor's own tensors
(``pixel_values``, grids, token types, ...), cut or padded to ``--seq-len`` like the ids. An
example whose images do not end within ``--seq-len`` tokens is dropped (a cut image would not
match its placeholders).
A processor without a chat template that takes answers (PaliGemma) reads each row as a prompt
and its answer instead (:mod:`.prompt_answer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipetrain.train.data.examples import Batch, ExampleBatches, ExampleCorpus
from pipetrain.train.data.image_feed import ImageFeed, Ref, line_of, open_image
from pipetrain.train.data.prompt_answer import answer_ids, prompt_answer, takes_answers

__all__ = ["ImageChatBatches", "ImageChatCorpus", "ImageChatEncoder", "image_chat_corpus"]

class ImageChatEncoder:
    """Rows of a data set of image chats to (ids, trained flags, media) by ``processor``.

    Args:
        processor: the checkpoint's processor (:func:`pipetrain.hf.image_text.load_processor`).
        image_ids: the token ids that stand for images (never trained).
        column: the messages column; ``images``: the images column (TRL's).
        where: the data set, for errors; ``base``: the directory relative paths start from.
    """

    media = True  # the cache keeps each example's text and images beside its ids

    def __init__(self, processor: Any, image_ids: set[int], column: str, images: str,
                 where: str, base: Path) -> None:
        self.processor, self.image_ids = processor, image_ids
        self.column, self.images, self.where, self.base = column, images, where, base
        self.chat = True
        self.answers = takes_answers(processor)
        """Rows are a prompt and its answer (:mod:`.prompt_answer`: PaliGemma), not rendered
        by a chat template."""
        if not self.answers and not getattr(processor, "chat_template", None):
            raise ValueError(f"--chat: the processor ({type(processor).__name__}) has no chat "
                             "template, so conversations with images cannot be rendered; save "
                             "the checkpoint's chat_template.jinja with its processor")

    def check(self, columns: list[str]) -> None:
        """Raise ValueError, naming the columns there are, when the messages are missing."""
        if self.column not in columns:
            raise ValueError(f"--chat: {self.where} has no {self.column!r} column (its columns: "
                             f"{', '.join(columns)}); name the column of messages with "
                             "--chat-field")

    def encode_rows(self, rows: dict[str, list[Any]], first: int
               ) -> list[tuple[list[int], list[int], dict[str, Any]]]:
        """Rows ``first``, ``first + 1``, ... (a slice of the data set's columns) as (ids,
        trained, media)."""
        given = rows.get(self.images) or [None] * len(rows[self.column])
        return [self._row(m, pool, first + i)
                for i, (m, pool) in enumerate(zip(rows[self.column], given, strict=True))]

    def sources(self, messages: Any, pool: Any, row: int) -> tuple[list[Any], list[Any]]:
        """The messages as the template takes them (each image a bare ``{"type": "image"}``
        part) and the images' sources in order."""
        label = line_of(self.where, row)
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError(f"{label}: {self.column!r} must be a non-empty list of {{role, "
                             f"content}} objects, got {str(messages)[:80]!r}")
        pool = list(pool or [])
        found: list[Any] = []
        out: list[dict[str, Any]] = []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, list):
                out.append({"role": m["role"], "content": content or ""})
                continue
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image":
                    source = next((part[k] for k in ("path", "url", "image")
                                   if part.get(k) is not None), None)
                    if source is None and not pool:
                        raise ValueError(
                            f"{label}: more {{\"type\": \"image\"}} placeholders than images "
                            f"(the {self.images!r} column holds {len(found) - len(pool)}); "
                            "give one image per placeholder")
                    found.append(pool.pop(0) if source is None else source)
                    parts.append({"type": "image"})
                elif kind == "text":
                    parts.append({"type": "text", "text": part.get("text") or ""})
                else:
                    raise ValueError(f"{label}: a content part of type {kind!r}; pipetrain "
                                     "reads 'text' and 'image' parts")
            out.append({"role": m["role"], "content": parts})
        if pool:
            raise ValueError(f"{label}: {len(pool)} image(s) in {self.images!r} beyond the "
                             f"{len(found)} {{\"type\": \"image\"}} placeholders of its "
                             "messages; give one placeholder per image")
        return out, found

    def ref(self, source: Any, row: int, k: int) -> Ref:
        """Where image ``k`` of row ``row`` is, checked to exist."""
        if not isinstance(source, str):
            return ["row", row, k]
        if source.startswith(("http://", "https://")):
            raise ValueError(f"{line_of(self.where, row)}: image {source!r} is on the web; "
                             "pipetrain reads local files only: download it and give its path")
        path = Path(source.removeprefix("file://")).expanduser()
        if not path.is_absolute():
            path = self.base / path if (self.base / path).exists() else path.resolve()
        if not path.is_file():
            raise ValueError(f"{line_of(self.where, row)}: image {source!r} does not exist "
                             f"(looked for {str(path)!r}); give paths that exist, relative "
                             "ones to the data file's directory")
        return str(path)

    def _row(self, messages: Any, pool: Any, row: int
             ) -> tuple[list[int], list[int], dict[str, Any]]:
        template, found = self.sources(messages, pool, row)
        label = line_of(self.where, row)
        refs = [self.ref(s, row, k) for k, s in enumerate(found)]
        images = [open_image(s if isinstance(r, list) else r, label)
                  for s, r in zip(found, refs, strict=True)]
        if self.answers:
            return self._answer_row(template, images, refs, label)
        whole = self._render(template, False, label)
        ids = self.ids(whole, images, label)
        trained = [0] * len(ids)
        shown = 0
        for i, m in enumerate(template):
            if m["role"] != "assistant":
                shown += _count(m)
                continue
            before = self._render(template[:i], True, label) if i else ""
            upto = self._render(template[:i + 1], False, label)
            if not (upto.startswith(before) and whole.startswith(upto)):
                raise ValueError(f"{label}: the chat template renders the conversation up to "
                                 f"message {i} differently from the start of the whole; use a "
                                 "template that renders each turn the same whatever follows")
            a = _common(ids, self.ids(before, images[:shown], label)) if before else 0
            shown += _count(m)
            b = _common(ids, self.ids(upto, images[:shown], label))
            trained[a:b] = [int(t not in self.image_ids) for t in ids[a:b]]
        return ids, trained, {"text": whole, "images": refs, "last_image": self._last_image(ids)}

    def _answer_row(self, template: list[Any], images: list[Any], refs: list[Ref], label: str
                    ) -> tuple[list[int], list[int], dict[str, Any]]:
        prompt, answer = prompt_answer(self.processor, template, len(images), label)
        ids, trained = answer_ids(self.processor, prompt, answer, images, label)
        trained = [int(f and t not in self.image_ids) for t, f in zip(ids, trained, strict=True)]
        return ids, trained, {"text": prompt, "answer": answer, "images": refs,
                              "last_image": self._last_image(ids)}

    def _last_image(self, ids: list[int]) -> int:
        """The position of the last token standing for an image (-1: none)."""
        return max((p for p, t in enumerate(ids) if t in self.image_ids), default=-1)

    def _render(self, messages: list[Any], prompt: bool, label: str) -> str:
        try:
            return str(self.processor.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=prompt))
        except Exception as e:  # noqa: BLE001  (a Jinja error, or any the template raises)
            raise ValueError(f"{label}: the chat template failed on {len(messages)} messages "
                             f"({type(e).__name__}: {e})") from None

    def ids(self, text: str, images: list[Any], label: str) -> list[int]:
        """The processor's ids of ``text`` with ``images`` (no added special tokens: the
        template wrote them)."""
        try:
            out = self.processor(text=[text], images=[images] if images else None,
                                 add_special_tokens=False)
        except Exception as e:  # noqa: BLE001  (the processor's own errors share no base)
            raise ValueError(f"{label}: the processor refused the conversation and its "
                             f"{len(images)} image(s) ({type(e).__name__}: {e})") from None
        return [int(t) for t in out["input_ids"][0]]


def _count(message: dict[str, Any]) -> int:
    content = message.get("content")
    return sum(1 for p in content if p.get("type") == "image") if isinstance(content, list) \
        else 0


def _common(a: list[int], b: list[int]) -> int:
    """The length of the common start of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def read_media(base: Path) -> list[dict[str, Any]]:
    """Each example's text, images and last image position (``<base>.media.jsonl``)."""
    with open(f"{base}.media.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@dataclass(frozen=True, eq=False)
class ImageChatCorpus(ExampleCorpus):
    """Examples of image chats: their tokens (:class:`ExampleCorpus`) and their media."""

    media: tuple[dict[str, Any], ...] = ()
    """Per example: its rendered ``text``, its ``images`` (:data:`Ref`) and ``last_image``,
    the position of its last image token (-1: none)."""

    @property
    def batches(self) -> type[ExampleBatches]:
        return ImageChatBatches

    def usable(self, first: int, end: int, seq_len: int) -> tuple[torch.Tensor, dict[str, int]]:
        """As :meth:`ExampleCorpus.usable`, less the examples whose images do not end within
        ``seq_len`` tokens (``image_cut``)."""
        kept, counts = super().usable(first, end, seq_len)
        fits = torch.tensor([self.media[int(e)]["last_image"] < seq_len for e in kept],
                            dtype=torch.bool)
        return kept[fits], {**counts, **self.counts(kept[fits], seq_len),
                            "image_cut": int((~fits).sum())}


class ImageChatBatches(ExampleBatches):
    """Padded batches of image chats: :class:`ExampleBatches`' with each row's example number
    (``example``), whose images :class:`ImageFeed` reads."""

    def batch(self, step: int) -> Batch:
        inputs, targets = super().batch(step)
        inputs["example"] = torch.tensor(self.examples(step), dtype=torch.long)
        return inputs, targets


def image_chat_corpus(processor: Any, image_ids: set[int], model_dir: str | Path, data: str,
                      cache: str | Path, *, chat_field: str = "messages",
                      images_field: str = "images", eval_fraction: float = 0.05,
                      progress: bool = False) -> tuple[ImageChatCorpus, ImageFeed]:
    """The image chats of the data set ``data`` under ``processor`` (saved in ``model_dir``),
    cached in ``cache``, and the feed that reads their images.

    Raises:
        FileNotFoundError: when ``data`` does not exist.
        ValueError: for a missing column, a processor without a chat template, or a row whose
            images are missing, do not decode, or do not match its placeholders (naming it).
    """
    from pipetrain.train.data.examples import _mapped, cached_examples, data_root
    from pipetrain.train.data.records import read_rows

    root = data_root(data)
    where = f"--data {root}"
    encoder = ImageChatEncoder(processor, image_ids, chat_field, images_field, where,
                               root.parent if root.is_file() else root)
    files = "".join(p.read_text(errors="replace") for p in sorted(Path(model_dir).iterdir())
                    if p.name in _PROCESSOR_FILES)
    settings = (f"image-chats:{_FORMAT}:{chat_field}:{images_field}:{sorted(image_ids)}\n"
                f"{processor.chat_template}\n{files}")
    base, described = cached_examples(encoder, model_dir, root, cache, settings, progress)
    media = tuple(read_media(base))
    corpus = _mapped(base, described, eval_fraction, int(processor.tokenizer.pad_token_id),
                     ImageChatCorpus, media=media)
    converted = Path(cache).expanduser() / "datasets"
    feed = ImageFeed(processor, media, encoder, lambda: read_rows(root, converted))
    return corpus, feed  # type: ignore[return-value]


_FORMAT = 1
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "chat_template.jinja",
                    "chat_template.json", "video_preprocessor_config.json")
"""The processor's own files (beside the tokenizer's), part of the cache key."""
