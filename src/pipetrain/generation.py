"""Generator: text from a causal LM split into stages, a KV cache per stage, the pipeline kept full.

    gen = Generator(model, rows=4, length=256)           # the same call on every rank
    out = gen.generate([[1, 5, 9], [1, 7]], max_new_tokens=32)   # new tokens per prompt

The model is captured once with a static KV cache (:class:`pipetrain.hf.cache.CachedLM`) and cut
at its decoder layers into one stage per rank, each holding its own layers' caches. A batch of
prompts is split into groups of ``rows`` sequences, padded on the left to the longest prompt
as ``transformers``' ``generate`` pads them. Every group has a cache of its own on every stage
(swapped in before the stage runs one of its micro-batches), so the groups take turns through
the stages like the micro-batches of training; the schedule
(:func:`~pipetrain.schedules.generators.decode.decode_schedule`) says who runs what, and the
last stage's picked token goes back to stage 0 as the schedule's feedback::

    prompt ──► prefill slices (``prefill`` positions each) ──► token 1
           ──► decode steps: one position per step, cost flat in the context ──► token 2, 3 ...

Tokens are decided in windows of ``window`` decode steps; after each, every rank holds the
window's tokens (the streaming callback runs), and generation stops early when every
sequence has met an end token. Greedy decoding picks the argmax of float32 logits, as
``generate(do_sample=False)``; sampling (temperature, top-k, top-p) draws from a generator
seeded by (seed, sequence, token index), so the text is the same under every layout.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.hf.cache import (
    CachedImageTextLM,
    CachedLM,
    pad_left,
    positions,
    rope_index,
    visual_inputs,
)
from pipetrain.pipeline import Pipeline, StepResult
from pipetrain.pipeline_config import PipelineConfig
from pipetrain.runtime.torch_private import EXPORT_NON_STRICT_LOGGER
from pipetrain.schedules.generators.decode import decode_schedule
from pipetrain.split.partition import even_balance

__all__ = ["Generator", "Sampling"]

OnTokens = Callable[[list[list[int]]], None]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen from the logits of the last position.

    ``temperature`` 0 is greedy (argmax); otherwise the logits are divided by it, cut to the
    ``top_k`` most likely (0: all) and to the smallest set whose probability reaches
    ``top_p`` (1.0: all), and one token is drawn.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, "
                             f"got {self.temperature}, {self.top_k}, {self.top_p}")

    def pick(self, logits: torch.Tensor, row: int, index: int) -> int:
        """The token for sequence ``row``'s ``index``-th new token from its (vocab,) logits."""
        scores = logits.float()
        if self.temperature == 0:
            return int(scores.argmax())
        scores = scores / self.temperature
        if self.top_k:
            kth = scores.topk(min(self.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = scores.sort(descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) >= self.top_p  # keep the first above p
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        generator = torch.Generator().manual_seed(hash((self.seed, row, index)) & (2**62 - 1))
        return int(torch.multinomial(scores.softmax(-1).cpu(), 1, generator=generator))


class Generator:
    """Generate with ``model`` (a decoder-only Hugging Face causal LM) cut into one stage per
    rank, each with a KV cache of its layers.

    Args:
        model: the model, real or on ``meta`` (then load its weights into :attr:`pipe`'s
            ``state_dict()`` before generating, as :meth:`from_pretrained` does). It is put in
            eval mode: generation never drops out.
        rows: sequences per group (each group has its own cache; a batch is padded with
            copies of its first prompt to whole groups).
        length: the most positions a sequence may reach (longest prompt + new tokens - 1).
        prefill: prompt positions per prefill step (a longer prompt takes several).
        window: decode steps between two synchronisations (streaming, early stop).
        group, local_ranks, device, timeout, balance: as for :class:`Pipeline`; the cuts
            are at the decoder layers, ``balance`` (default: even) groups them.
        images: for an image-text model, one prompt's ids with its images as its processor
            gives them (``input_ids``, ``pixel_values``, ...), to capture with: the vision
            tower runs eagerly in the first stage (:class:`~pipetrain.hf.cache.
            CachedImageTextLM`), and :meth:`generate` takes each prompt's images.

    Raises:
        ValueError: for an encoder-decoder or counts below 1.
    """

    def __init__(self, model: nn.Module, *, rows: int = 1, length: int = 256,
                 prefill: int = 256, window: int = 16, group: dist.ProcessGroup | None = None,
                 local_ranks: int | None = None, device: torch.device | str | None = None,
                 timeout: float = 60.0, balance: Sequence[int] | str | None = None,
                 init_seed: int = 0, images: dict[str, torch.Tensor] | None = None) -> None:
        from pipetrain.hf.model import check_generation_stages, split_points

        if min(rows, length, prefill, window) < 1:
            raise ValueError(f"rows, length, prefill and window must be >= 1, got {rows}, "
                             f"{length}, {prefill}, {window}")
        self.rows, self.length, self.prefill, self.window = rows, length, prefill, window
        self.model = model
        self.group = group
        n_ranks = local_ranks or (dist.get_world_size(group) if dist.is_initialized() else 1)
        check_generation_stages(model, n_ranks, "{} ranks")
        model.eval()
        wrapped = CachedLM(model, rows, length) if images is None else \
            CachedImageTextLM(model, rows, length, images)
        example = {"input_ids": torch.zeros(rows, 2, dtype=torch.long),
                   "attention_mask": torch.ones(rows, length, dtype=torch.long),
                   "position_ids": torch.zeros(rows, 2, dtype=torch.long)}
        if isinstance(wrapped, CachedImageTextLM) and images is not None:
            example = wrapped.example(images, rows, length)
        points = ["model." + p for p in split_points(model, n_ranks, example)]
        if balance is None:
            balance = even_balance(len(points) + 1, n_ranks)
        kinds = {id(t): i % 3 for i, t in enumerate(wrapped.cache_tensors())}
        names = {id(b): n for n, b in wrapped.named_buffers()}
        cache_names = {names[i] for i in kinds if i in names}
        export_log = logging.getLogger(EXPORT_NON_STRICT_LOGGER)
        level = export_log.level  # rows = 1 fixes the batch size, as the cache does anyway
        export_log.setLevel(logging.ERROR)
        with torch.no_grad(), _grouped_query_attention(_on_cpu(device, group)):
            self.pipe = Pipeline.from_config(wrapped, PipelineConfig(
                decode_schedule(n_ranks, 1, 1), split_points=points, example_inputs=example,
                balance=balance, group=group, local_ranks=local_ranks, device=device,
                timeout=timeout, init_seed=init_seed, rng=False))
        export_log.setLevel(level)
        self.caches = {s: [b for n, b in self.pipe.named_buffers(s) if n in cache_names]
                       for s in self.pipe.stages}
        """Per hosted stage, the cache tensors its graph reads and writes."""
        self.rewritten = {s: [b for n, b in self.pipe.named_buffers(s) if n in wrapped.rewritten]
                          for s in self.pipe.stages}
        """Per hosted stage, the counters of its cross-attention layers' caches, which every
        step writes whole (:attr:`pipetrain.hf.cache.CachedLM.rewritten`)."""
        if isinstance(wrapped, CachedImageTextLM):  # its eager prefix reads the stages' cache
            wrapped.share_cache({n: b for st in self.pipe.stages
                                 for n, b in self.pipe.named_buffers(st) if n in cache_names})
        self._groups: list[dict[int, list[torch.Tensor]]] = []
        self._run: _Run | None = None
        self.windows: list[StepResult] = []
        """The last ``generate`` call's windows, each a :class:`StepResult` whose timeline
        has every rank's forwards (``bubble_fraction``: the share of idle time)."""

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> Generator:
        """A ``save_pretrained`` directory: each rank builds and reads only its own stage's
        tensors (:mod:`pipetrain.hf.model`); ``kwargs`` as for the constructor.

        Raises:
            FileNotFoundError, ValueError: as :func:`pipetrain.hf.model.open_model` and
                :func:`~pipetrain.hf.model.load_weights` do.
        """
        from pathlib import Path

        from pipetrain.hf.model import load_weights, open_model

        hf = open_model(Path(path), images=kwargs.get("images") is not None)
        limit, length = hf.max_positions, kwargs.get("length", 256)
        if limit is not None and length > limit:
            raise ValueError(f"{path}: {length} positions asked for (length=, the longest prompt "
                             f"plus the new tokens) but {type(hf.model).__name__} has "
                             f"{limit} (max_position_embeddings)")
        gen = cls(hf.model, **kwargs)
        state = {name.removeprefix("model."): t for name, t in gen.pipe.state_dict().items()}
        load_weights(hf, state)
        return gen

    # -- caches ------------------------------------------------------------------------------
    def _caches(self, groups: int) -> None:
        """A zeroed cache per group on every hosted stage (kept between calls when enough)."""
        while len(self._groups) < groups:
            self._groups.append({s: [torch.zeros_like(t) for t in ts]
                                 for s, ts in self.caches.items()})
        for group in self._groups[:groups]:
            for tensors in group.values():
                for t in tensors:
                    t.zero_()

    def enter(self, stage: int, mb: int) -> None:
        """Point ``stage``'s cache tensors at the cache of ``mb``'s group (no copy), its
        cross-attention layers' counters at 0."""
        if self._run is None:
            raise RuntimeError("enter() runs inside generate()")
        own = self._groups[mb % self._run.groups][stage]
        for t, store in zip(self.caches[stage], own):
            t.set_(store.untyped_storage(), store.storage_offset(), store.size(), store.stride())
        for t in self.rewritten[stage]:
            t.zero_()

    def close(self) -> None:
        """End what the generator's pipeline started (:meth:`Pipeline.close`); also at the end
        of ``with Generator(...) as gen:`` and when its last reference goes."""
        self.pipe.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 sampling: Sampling | None = None, eos_token_id: int | Sequence[int] | None = None,
                 pad_token_id: int = 0, on_tokens: OnTokens | None = None,
                 images: Sequence[dict[str, torch.Tensor]] | None = None) -> list[list[int]]:
        """Up to ``max_new_tokens`` new tokens after each prompt (the same on every rank).

        A sequence ends after an end token (included); ``on_tokens`` gets each window's new
        tokens per prompt, on every rank, as soon as they are decided. ``images``: per prompt,
        its visual tensors as the processor gives them (an image-text model's; each prompt
        is then prefilled in one step, its images with it).

        Raises:
            ValueError: for an empty prompt, or a prompt plus its new tokens longer than
                ``length``.
        """
        if max_new_tokens < 1 or not prompts:
            return [[] for _ in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens - 1 > self.length:
            raise ValueError(f"a prompt of {longest} tokens plus {max_new_tokens} new ones needs "
                             f"{longest + max_new_tokens - 1} cached positions; the generator "
                             f"holds {self.length} (length=)")
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"{len(images)} sets of images for {len(prompts)} prompts: give "
                             "one per prompt (an empty dict for none)")
        run = _Run(self, prompts, max_new_tokens, sampling or Sampling(), eos_token_id,
                   pad_token_id, images)
        self._caches(run.groups)
        self._run, self.windows = run, []
        try:
            return run.go(on_tokens)
        finally:
            self._run = None


def _on_cpu(device: torch.device | str | None, group: dist.ProcessGroup | None) -> bool:
    """Whether the stages will live on the CPU (as :class:`Pipeline` places them)."""
    if device is not None:
        return torch.device(device).type == "cpu"
    return not (dist.is_initialized() and dist.get_backend(group) == "nccl")


@contextmanager
def _grouped_query_attention(cpu: bool) -> Iterator[None]:
    """On the CPU, capture attention that reads each key-value head for its group of query
    heads in place (``scaled_dot_product_attention(enable_gqa=True)``, which the CPU kernel
    runs with a mask) instead of copying the whole cache to every query head at every step,
    as transformers does where a mask would send the GPU kernels to the slow path. Halves a
    decode step at 1024 positions here; the tokens are the same (tests/test_generation.py)."""
    flag = "TRANSFORMERS_SDPA_FORCE_GQA"
    before = os.environ.get(flag)
    if cpu:
        os.environ[flag] = "1"
    try:
        yield
    finally:
        if cpu and before is None:
            os.environ.pop(flag)
        elif cpu and before is not None:
            os.environ[flag] = before


class _Run:
    """One ``generate`` call: the padded prompts, the windows, the tokens so far."""

    def __init__(self, gen: Generator, prompts: Sequence[Sequence[int]], new: int,
                 sampling: Sampling, eos: int | Sequence[int] | None, pad: int,
                 images: Sequence[dict[str, torch.Tensor]] | None = None) -> None:
        self.gen, self.new, self.sampling, self.pad = gen, new, sampling, pad
        self.eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        self.n = len(prompts)
        rows = gen.rows
        self.groups = -(-self.n // rows)
        padded = list(prompts) + [prompts[0]] * (self.groups * rows - self.n)
        self.width = max(len(p) for p in padded)
        device = gen.pipe.device
        ids = torch.full((len(padded), self.width), pad, dtype=torch.long)
        mask = torch.zeros(len(padded), gen.length, dtype=torch.long)
        for i, p in enumerate(padded):
            ids[i, self.width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, self.width - len(p):] = 1
        places = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        self.ids, self.mask, self.positions = ids.to(device), mask.to(device), places.to(device)
        self.prefill = gen.prefill if images is None else self.width  # images whole
        self.prefill_steps = -(-self.width // self.prefill)
        self.images = [] if images is None else [
            pad_left(i, len(p), self.width) for i, p in zip(
                list(images) + [images[0]] * (len(padded) - self.n), padded, strict=True)]
        self.tokens: list[list[int]] = [[] for _ in padded]
        self.done = [False] * len(padded)
        self.start = 0  # the first step (of a group's steps) of the current window
        self.picked: dict[int, torch.Tensor] = {}
        self.rope = None if images is None else rope_index(
            gen.model, self.ids, self.mask[:, :self.width], self.images)
        """M-RoPE's positions of the prompts on three axes and each row's delta (Qwen-VL)."""
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        """Per group, what its decode steps give beside the token (Mllama's image states)."""

    def _rows(self, g: int) -> slice:
        return slice(g * self.gen.rows, (g + 1) * self.gen.rows)

    def _payload(self, g: int, ids: torch.Tensor, lo: int, hi: int, shown: bool = False
                 ) -> Any:
        """Stage 0's input for group ``g``: ``ids`` at cache positions ``lo .. hi-1``
        (``shown``: with the group's images, at its prefill)."""
        rows = self._rows(g)
        traced = self.gen.pipe.traced
        assert traced is not None  # built with split_points
        rope = None if self.rope is None else (self.rope[0][:, rows], self.rope[1][rows])
        given = {"input_ids": ids, "attention_mask": self.mask[rows],
                 "position_ids": positions(self.positions[rows, lo:hi], rope, slice(lo, hi))}
        if shown and self.images:
            given.update(visual_inputs(self.images[rows], self.gen.pipe.device,
                                       self.rope is not None))
            self._keep_states(g, given)
        elif g in self.states:
            given.update(self.states[g])
        if self.images and "token_type_ids" in self.images[0] and "token_type_ids" not in given:
            given["token_type_ids"] = torch.zeros_like(ids)  # text: types as the capture's
        return traced.payload(given)

    def _keep_states(self, g: int, given: dict[str, Any]) -> None:
        """Mllama: replace group ``g``'s images in ``given`` by the image states the model
        makes of them, kept with the last row of its ``cross_attention_mask`` for the decode
        steps (on the rank of stage 0, the only one that reads them)."""
        traced = self.gen.pipe.traced
        if "cross_attention_mask" not in given or traced is None or traced.prefix is None \
                or 0 not in self.gen.pipe.stages:
            return
        with torch.no_grad():
            states = traced.prefix.reach(traced.payload(given))["cross_attention_states"]
        for name in [k for k in given if k.startswith(("pixel_values", "aspect_ratio_"))]:
            del given[name]
        given["cross_attention_states"] = states
        self.states[g] = {"cross_attention_states": states,
                          "cross_attention_mask": given["cross_attention_mask"][:, -1:]}

    def _slot(self, step: int) -> int:
        """The cache position of a decode step's input token."""
        return self.width + step - self.prefill_steps

    def feed(self, mb: int, tokens: torch.Tensor) -> Any:
        step, g = self.start + mb // self.groups, mb % self.groups
        slot = self._slot(step)
        return self._payload(g, tokens.reshape(-1, 1).to(self.gen.pipe.device), slot, slot + 1)

    def enter(self, stage: int, mb: int) -> None:
        self.gen.enter(stage, mb)

    def pick(self, mb: int, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``mb``'s group (an end token makes the rest pad)."""
        step, g = self.start + mb // self.groups, mb % self.groups
        index = step - self.prefill_steps + 1  # this step's token number
        if index < 0:
            return torch.zeros(0, dtype=torch.long, device=logits.device)  # mid-prompt
        out = []
        for i, row in enumerate(range(*self._rows(g).indices(len(self.tokens)))):
            token = self.pad if self.done[row] else self.sampling.pick(logits[i, -1], row, index)
            self.done[row] = self.done[row] or token in self.eos
            out.append(token)
        picked = torch.tensor(out, dtype=torch.long, device=logits.device)
        self.picked[mb] = picked
        return picked

    def _window(self, first: bool) -> tuple[int, list[Any]]:
        """The steps of the next window and stage 0's inputs of its non-fed micro-batches."""
        gen, rows = self.gen, self.gen.rows
        if first:
            steps = self.prefill_steps + min(gen.window, self.new - 1)
            inputs = []
            for k in range(self.prefill_steps):
                lo, hi = k * self.prefill, min((k + 1) * self.prefill, self.width)
                inputs += [self._payload(g, self.ids[self._rows(g), lo:hi], lo, hi, k == 0)
                           for g in range(self.groups)]
            return steps, inputs
        left = self.new - len(self.tokens[0])
        slot = self._slot(self.start)
        last = torch.tensor([t[-1] for t in self.tokens], dtype=torch.long,
                            device=gen.pipe.device)
        inputs = [self._payload(g, last[g * rows:(g + 1) * rows, None], slot, slot + 1)
                  for g in range(self.groups)]
        return min(gen.window, left), inputs

    def go(self, on_tokens: OnTokens | None) -> list[list[int]]:
        first = True
        while first or (len(self.tokens[0]) < self.new and not all(self.done[:self.n])):
            steps, inputs = self._window(first)
            fed_from = self.prefill_steps if first else 1
            schedule = decode_schedule(self.gen.pipe.schedule.n_ranks, self.groups, steps,
                                       fed_from=min(fed_from, steps))
            self.picked = {}
            self.gen.windows.append(self.gen.pipe.decode(schedule, inputs, self))
            new = self._share(steps, first)
            if on_tokens is not None:
                on_tokens(new[:self.n])
            self.start += steps
            first = False
        return [self._cut(t) for t in self.tokens[:self.n]]

    def _share(self, steps: int, first: bool) -> list[list[int]]:
        """This window's new tokens per row, from the last stage's rank to every rank."""
        made = steps - (self.prefill_steps - 1 if first else 0)  # tokens per row
        table = torch.zeros(len(self.tokens), made, dtype=torch.long)
        pipe = self.gen.pipe
        last = pipe.schedule.n_stages - 1
        if last in pipe.stages:
            for mb, picked in self.picked.items():
                step, g = mb // self.groups, mb % self.groups
                column = step - (self.prefill_steps - 1 if first else 0)
                if picked.numel() and 0 <= column < made:
                    table[self._rows(g), column] = picked.cpu()
        if not pipe.local:
            holder = pipe.schedule.rank_of(last)
            shared = table.to(pipe.device)
            src = holder if self.gen.group is None else dist.get_global_rank(self.gen.group,
                                                                               holder)
            dist.broadcast(shared, src=src, group=self.gen.group)
            table = shared.cpu()
        new = table.tolist()
        for row, tokens in enumerate(new):
            self.tokens[row] += tokens
            self.done[row] = self.done[row] or any(t in self.eos for t in tokens)
        return new

    def _cut(self, tokens: list[int]) -> list[int]:
        """``tokens`` up to and including the first end token."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                return tokens[:i + 1]
        return tokens
