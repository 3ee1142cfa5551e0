"""Image-text source: a local image-text-to-text checkpoint (``--hf DIR`` of LLaVA, Gemma 3,
Qwen2-VL, ...) trained on chats with images.

It is an :class:`~pipetrain.train.sources.hf_source.HFSource` whose model is built through
``AutoModelForImageTextToText`` (:mod:`pipetrain.hf.image_text`) and whose text and images go
through the checkpoint's own processor: the data set's conversations are tokenized with their
images (:mod:`pipetrain.train.data.image_chats`), and each batch's rows are fed the
processor's tensors for them. The pipeline captures the model from its language model on, its
vision tower and projector run eagerly in stage 0 (:mod:`pipetrain.split.prefix`), so images of
any size and count go through one capture. ``--freeze-vision`` and ``--freeze-projector`` keep
those parts' weights as loaded (:func:`freeze`); ``--lora-r`` adapts the language model's
projections only (:func:`pipetrain.hf.lora.language_targets`). ``<out>/hf`` is written with the
processor, so ``AutoModelForImageTextToText`` and ``AutoProcessor`` load it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from pipetrain.hf.image_text import image_token_ids, load_processor, varying_inputs
from pipetrain.pipeline import Pipeline
from pipetrain.schedules.schedule import Schedule
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.examples import ExampleCorpus
from pipetrain.train.data.image_chats import image_chat_corpus
from pipetrain.train.data.image_feed import ImageFeed
from pipetrain.train.data.prompt_answer import rendered, takes_answers
from pipetrain.train.data.records import is_dataset
from pipetrain.train.data.text import Corpus
from pipetrain.train.sources.hf_source import HFSource, hf_pipeline
from pipetrain.train.sources.source import LossWrap

__all__ = ["ImageTextSource", "freeze", "image_data_problems", "image_text_problems",
           "random_chats"]

VISION = ("vision_tower", "visual", "vision_model", "vision_encoder")
"""What image-text models call their vision tower."""
PROJECTOR = ("multi_modal_projector", "mm_projector", "connector", "merger", "embed_vision",
             "projector")
"""What they call the layers between it and the language model (Qwen2-VL's ``merger`` sits
inside its ``visual``)."""


def _outermost(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    found: list[str] = []
    for name, _ in model.named_modules():
        if name.rpartition(".")[2] in names and not any(
                name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def freeze(model: nn.Module, *, vision: bool, projector: bool) -> int:
    """Stop gradients to the vision tower's weights (``vision``; its projector apart) and the
    projector's (``projector``); the count of weights frozen.

    Raises:
        ValueError: when a part asked for is not found by its usual names.
    """
    towers, projectors = _outermost(model, VISION), _outermost(model, PROJECTOR)
    for asked, found, flag, names in ((vision, towers, "--freeze-vision", VISION),
                                      (projector, projectors, "--freeze-projector", PROJECTOR)):
        if asked and not found:
            raise ValueError(f"{flag}: {type(model).__name__} has no module named one of "
                             f"{', '.join(names)}; freeze its parts from Python "
                             "(p.requires_grad_(False)) and use pt.Pipeline")
    frozen = 0
    for name, p in model.named_parameters():
        in_projector = any(name.startswith(q + ".") for q in projectors)
        in_tower = not in_projector and any(name.startswith(v + ".") for v in towers)
        if (vision and in_tower) or (projector and in_projector):
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def image_text_problems(cfg: TrainConfig, image_text: bool) -> list[str]:
    """What keeps ``cfg`` from training its model, an image-text one or not."""
    if not image_text:
        return [f"{flag} belongs to an image-text model (--hf DIR of LLaVA, Gemma 3, "
                "Qwen2-VL, ...); drop it" for flag, on in (
                    ("--freeze-vision", cfg.freeze_vision),
                    ("--freeze-projector", cfg.freeze_projector)) if on]
    problems = []
    for flag, on in (("--pack", cfg.pack), ("--tp", cfg.tp > 1), ("--ep", cfg.ep > 1),
                     ("--compile", cfg.compile), ("--cp", cfg.cp > 1)):
        if on:
            problems.append(f"{flag} is not supported for image-text models yet: drop it "
                            "(--fsdp and --dp compose)")
    return problems


def image_data_problems(cfg: TrainConfig) -> list[str]:
    """What keeps an image-text model from training on ``cfg``'s data."""
    if cfg.chat and is_dataset(cfg.data):
        return []
    return [f"--hf {cfg.hf} is an image-text model: train it on chats with images, --chat "
            "--data FILE.jsonl (or .parquet, or a save_to_disk directory; docs/multimodal.md)"]


class ImageTextSource(HFSource):
    """The model, processor and weights of an image-text ``cfg.hf``.

    Raises:
        FileNotFoundError: for a directory without a processor.
        ValueError: for a part to freeze that the model does not have.
    """

    images = True
    kv_samples = False  # <out>/hf is an image-text model: the sample goes through the pipeline

    def __init__(self, cfg: TrainConfig) -> None:
        self.processor = load_processor(cfg.hf)
        super().__init__(cfg)
        self.preprocessor = self.processor
        self.image_ids = image_token_ids(self.hf.config, self.processor)
        self.frozen = freeze(self.hf.model, vision=cfg.freeze_vision,
                             projector=cfg.freeze_projector)
        self.image_feed = ImageFeed(self.processor, ())
        self._corpus: ExampleCorpus | None = None
        self.fed: tuple[str, ...] = ()
        """The keys of the captured input (a sample's text-only rows take the same)."""

    def load_tokenizer(self) -> Any:
        return self.processor.tokenizer

    def describe(self) -> dict[str, Any]:
        described = super().describe()
        if self.cfg.freeze_vision or self.cfg.freeze_projector:
            described["frozen"] = {"vision": self.cfg.freeze_vision,
                                   "projector": self.cfg.freeze_projector}
        return described

    def example(self, rows: int, seq_len: int) -> dict[str, Any]:
        """What the pipeline captures with: ``rows`` copies of a short chat showing one
        image, as the processor gives it.

        Raises:
            ValueError: when one image's placeholders do not fit in ``seq_len`` tokens.
        """
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "b"}]}]
        text, answer = rendered(self.processor, chat, 1)
        answers = None if answer is None else [answer] * rows
        pixels = np.random.default_rng(self.cfg.seed).integers(0, 256, (16, 16, 3),
                                                              dtype=np.uint8)
        from PIL import Image

        image = Image.fromarray(pixels)
        whole = self.image_feed.tensors([text], [[image]], 1 << 20, answers and answers[:1])
        length = int(whole["attention_mask"].sum())
        if length > seq_len:
            raise ValueError(f"--seq-len {seq_len} is shorter than a one-image chat of "
                             f"{type(self.hf.model).__name__} ({length} tokens, most of them "
                             f"the image's placeholders); use --seq-len {length * 2} or more")
        out = self.image_feed.tensors([text] * rows, [[image]] * rows, seq_len, answers)
        self.fed = tuple(out)
        return out

    def pipeline(self, cfg: TrainConfig, schedule: Schedule, rows: int, pp_rank: int,
                 wrap: LossWrap, **where: Any) -> Pipeline:
        """Captured from the language model on, with a one-image chat per row (as many image
        slots a row as the data's examples need, for a model that gives them an axis)."""
        self.corpus(cfg)
        return hf_pipeline(self.hf.model, cfg, schedule, rows, wrap, examples=True,
                           example=self.example(rows, cfg.seq_len),
                           dynamic=varying_inputs(self.hf.model), **where)

    def corpus(self, cfg: TrainConfig, *, progress: bool = False) -> Corpus | ExampleCorpus:
        if not cfg.data:
            raise ValueError(f"--hf {cfg.hf} is an image-text model: give --chat --data")
        if self._corpus is None:
            self._corpus, self.image_feed = image_chat_corpus(
                self.processor, self.image_ids, self.root, cfg.data, cfg.token_cache,
                chat_field=cfg.chat_field, images_field=cfg.images_field, progress=progress)
        return self._corpus

    def feed(self, ids: Any) -> Any:
        """A batch's rows with their images, as the processor gives them; token ids alone (a
        sample's prompt) with the captured input's other per-token tensors as zeros."""
        if isinstance(ids, dict):
            return self.image_feed(ids)
        out: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        for key in self.fed:
            if key not in out and not key.startswith(("pixel_", "image_")):
                out[key] = torch.zeros_like(ids)
        return out


def random_chats(processor: Any, image_ids: set[int], rows: int, seq_len: int, seed: int
                 ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A batch of ``rows`` short chats showing 1, 0 or 2 random images of two sizes (row by
    row; one each where the processor takes a prompt and its answer: PaliGemma), as the
    processor gives them, and its targets for
    :func:`~pipetrain.train.data.examples.masked_lm_loss`: every next token but an image's,
    weighted to a mean (``pipetrain verify`` on an image-text model).

    Raises:
        ValueError: when the longest chat does not fit ``seq_len`` tokens.
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    texts, images, answers = [], [], []
    for r in range(rows):
        shown = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                 for h, w in _sizes(r, takes_answers(processor))]
        chat = [{"role": "user", "content": [{"type": "image"} for _ in shown]
                 + [{"type": "text", "text": "a b"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]
        text, answer = rendered(processor, chat, len(shown))
        texts.append(text)
        answers.append(answer)
        images.append(shown)
    feed = ImageFeed(processor, ())
    feed.slots = 2  # a row shows up to two (where a row's images have an axis)
    suffixes = None if answers[0] is None else [str(a) for a in answers]
    longest = int(feed.tensors(texts, images, 1 << 20, suffixes)["attention_mask"].sum(1).max())
    if longest + 1 > seq_len:
        raise ValueError(f"--seq-len {seq_len} is shorter than the check's chats of up to two "
                         f"images ({longest} tokens, most of them the images' placeholders); "
                         f"use --seq-len {longest + 1} or more")
    inputs = feed.tensors(texts, images, seq_len + 1, suffixes)
    ids = inputs["input_ids"]
    keep = inputs["attention_mask"][:, 1:].bool() & ~torch.isin(
        ids[:, 1:], torch.tensor(sorted(image_ids), dtype=ids.dtype))
    labels = torch.where(keep, ids[:, 1:], -100)
    cut = {k: v[:, :seq_len] if torch.is_tensor(v) and v.shape[:2] == ids.shape[:2] else v
           for k, v in inputs.items()}
    weight = torch.full((rows,), 1.0 / int(keep.sum()), dtype=torch.float64)
    return cut, {"labels": labels, "weight": weight}


def _sizes(row: int, answers: bool) -> list[tuple[int, int]]:
    """The (height, width) of the images of :func:`random_chats`' row ``row``: 1, 0 or 2 of
    them (one each for a prompt-answer processor, which takes an image with every prompt)."""
    if answers:
        return [(16, 16) if row % 2 == 0 else (12, 20)]
    return [(16, 16) if k % 2 == 0 else (12, 20) for k in range((1, 0, 2)[row % 3])]
