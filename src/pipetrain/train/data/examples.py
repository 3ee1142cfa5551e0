"""Examples: a data set's rows tokenized once into the cache, and padded batches of them.

:func:`example_corpus` turns each row of a data set (:mod:`pipetrain.train.data.records`) into one
example and writes, under ``<cache>/<key>``, the ids of every example one after another
(``.tokens``, int32), a flag per id saying whether the loss trains on it (``.trained``, uint8)
and each example's length (``.lengths``, int64). The key hashes what :func:`pipetrain.train.
tokens.cache_key` hashes (the tokenizer's files, the data files' names, sizes and times) and
the settings: the text column or ``--chat``, and the chat template. One process tokenizes
while the others wait (:func:`pipetrain.train.data.tokens.fill_once`); later runs map the files.

Without ``--pack`` (:mod:`pipetrain.train.data.packing`) a row of a batch is one example, its first
``seq_len + 1`` tokens (``seq_len`` inputs, the targets shifted by one), padded on the right,
with ``attention_mask`` 0 on the padding and the label -100 on the padding and on every token
not trained. Batch ``k`` is a pure function of ``(seed, k)``: it takes positions
``k*B .. k*B + B - 1`` of an endless sequence of epochs, each a permutation of the training
examples seeded by ``(seed, epoch)``, so a resumed run sees exactly the examples an
uninterrupted one would. The last ``eval_fraction`` of the rows (at least one) is held out.

The loss (:func:`masked_lm_loss`) is the sum of the trained tokens' cross-entropy times each
row's weight, ``replicas / N`` with N the trained tokens of the whole global batch; summed over
the micro-batches (``loss_reduction="sum"``) and averaged over the data-parallel replicas, it
is the mean over all trained tokens of the batch, what ``model(input_ids,
attention_mask=..., labels=...)`` gives on one process, however unevenly the micro-batches hold
trained tokens.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)

from pipetrain.train.data.records import Encoder, is_dataset, read_rows
from pipetrain.train.data.text import Positioned
from pipetrain.train.data.tokens import _Bar, cache_key, fill_once

__all__ = ["ExampleBatches", "ExampleCorpus", "cached_examples", "data_problems", "data_root",
           "describe", "example_batches", "example_corpus", "masked_lm_loss"]

IGNORE = -100
"""The label of a token the loss does not train on (transformers' ``ignore_index``)."""
_FORMAT = 1
_ROWS_AT_ONCE = 256

Batch = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True, eq=False)
class ExampleCorpus:
    """Every example's token ids and trained flags, memory-mapped, and the held-out rows."""

    ids: torch.Tensor
    """Every example's ids, one after another (int32, 1-D)."""
    trained: torch.Tensor
    """1 where the loss trains on predicting that id (uint8, 1-D)."""
    offsets: torch.Tensor
    """Example i is ``ids[offsets[i]:offsets[i + 1]]`` (int64, n + 1)."""
    n_train: int
    """Examples ``[0, n_train)`` are for training, the rest held out."""
    source: str
    files: tuple[str, ...]
    kind: str
    """What was read: ``chat`` or ``text column 'NAME'``."""
    pad_id: int
    """The id on padding (attention-masked and never a label)."""

    def __len__(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def batches(self) -> type[ExampleBatches]:
        """The class of this corpus's padded batches."""
        return ExampleBatches

    def usable(self, first: int, end: int, seq_len: int) -> tuple[torch.Tensor, dict[str, int]]:
        """The examples in ``[first, end)`` that train on at least one token of their first
        ``seq_len + 1``, and counts: examples, dropped (none trained), truncated, targets
        (positions with a real next token) and trained targets."""
        every = torch.arange(first, end)
        counts = self.trained_counts(every, seq_len)
        keep = counts > 0
        return every[keep], {"dropped": int((~keep).sum()),
                             **self.counts(every[keep], seq_len)}

    def trained_counts(self, examples: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Per example, its trained targets among its first ``seq_len + 1`` tokens."""
        starts = self.offsets[examples]
        kept = (self.offsets[examples + 1] - starts).clamp(max=seq_len + 1)
        return _trained_counts(self.trained, starts, kept)

    def counts(self, examples: torch.Tensor, seq_len: int) -> dict[str, int]:
        """Of ``examples``: how many, truncated, their targets and trained targets."""
        lengths = self.offsets[examples + 1] - self.offsets[examples]
        kept = lengths.clamp(max=seq_len + 1)
        return {"examples": int(examples.numel()),
                "truncated": int((lengths > seq_len + 1).sum()),
                "targets": int((kept - 1).sum()),
                "trained": int(self.trained_counts(examples, seq_len).sum())}


def _trained_counts(trained: torch.Tensor, starts: torch.Tensor, kept: torch.Tensor
                    ) -> torch.Tensor:
    """Per example, the trained flags of its tokens ``[1, kept)`` summed (chunk by chunk)."""
    out = torch.zeros(starts.numel(), dtype=torch.int64)
    for lo in range(0, starts.numel(), 4096):
        s, k = starts[lo:lo + 4096], kept[lo:lo + 4096]
        a, b = int(s[0]), int((s + k).max())
        csum = torch.cat([torch.zeros(1, dtype=torch.int64),
                          trained[a:b].to(torch.int64).cumsum(0)])
        out[lo:lo + 4096] = (csum[s + k - a] - csum[torch.minimum(s + 1, s + k) - a])
    return out


def example_corpus(tokenizer: Any, tokenizer_dir: str | Path, data: str, cache: str | Path, *,
                   text_field: str = "text", chat: bool = False, chat_field: str = "messages",
                   eval_fraction: float = 0.05,
                   progress: bool = False) -> ExampleCorpus:
    """The examples of the data set ``data`` under ``tokenizer`` (from ``tokenizer_dir``),
    cached in ``cache``.

    Raises:
        FileNotFoundError: when ``data`` does not exist.
        ImportError: without Hugging Face ``datasets`` (the message says how to install it).
        ValueError: for a missing column, a tokenizer without a chat template under ``chat``,
            rows that are not text or messages, or a data set without rows.
    """
    root = data_root(data)
    encoder = Encoder(tokenizer, chat_field if chat else text_field, chat, f"--data {root}")
    settings = f"examples:{_FORMAT}:{encoder.column}:{chat}:{tokenizer.eos_token_id}\n"
    template = str(getattr(tokenizer, "chat_template", None) or "") if chat else ""
    base, described = cached_examples(encoder, tokenizer_dir, root, cache, settings + template,
                                      progress)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id or 0)
    return _mapped(base, described, eval_fraction, int(pad))


def data_root(data: str) -> Path:
    """``--data`` as a path.

    Raises:
        FileNotFoundError: when it does not exist.
    """
    root = Path(data)
    if not root.exists():
        raise FileNotFoundError(f"--data: no such file or directory: {str(root)!r}")
    return root


def cached_examples(encoder: Any, tokenizer_dir: str | Path, root: Path, cache: str | Path,
                    settings: str, progress: bool) -> tuple[Path, dict[str, Any]]:
    """The cache's files of ``root`` under ``encoder`` (tokenized by one process, the first
    time): their base path and what they hold. The key hashes the tokenizer's and the data's
    files (:func:`pipetrain.train.data.tokens.cache_key`) and ``settings``."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    key = hashlib.blake2b((cache_key(tokenizer_dir, root, files, None) + settings).encode(),
                          digest_size=12).hexdigest()
    directory = Path(cache).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    base, info = directory / key, directory / f"{key}.json"
    lock = directory / f"{key}.lock"
    fill_once(lock, info, lambda: _tokenize(encoder, root, files, base, info, lock,
                                            directory / "datasets", progress),
              what=f"--data {root}")
    return base, json.loads(info.read_text())


def _tokenize(encoder: Any, root: Path, files: list[Path], base: Path, info: Path,
              lock: Path, converted: Path, progress: bool) -> None:
    rows = read_rows(root, converted)
    encoder.check(rows.column_names)
    suffix = f".partial{os.getpid()}"
    names = ("tokens", "trained", "lengths", *(("media.jsonl",) if encoder.media else ()))
    parts = {name: Path(f"{base}.{name}{suffix}") for name in names}
    n_tokens = n_trained = 0
    with (open(parts["tokens"], "wb") as ids_out, open(parts["trained"], "wb") as flags_out,
          open(parts["lengths"], "wb") as lengths_out,
          open(parts.get("media.jsonl", os.devnull), "w", encoding="utf-8") as media_out,
          _Rows(progress, len(rows)) as advance):
        for first in range(0, len(rows), _ROWS_AT_ONCE):
            encoded = encoder.encode_rows(rows[first:first + _ROWS_AT_ONCE], first)
            for ids, trained, *media in encoded:
                array.array("i", ids).tofile(ids_out)
                array.array("B", trained).tofile(flags_out)
                n_tokens, n_trained = n_tokens + len(ids), n_trained + sum(trained)
                media_out.writelines(json.dumps(m) + "\n" for m in media)
            array.array("q", [len(e[0]) for e in encoded]).tofile(lengths_out)
            advance(len(encoded))
            lock.touch()
        for out in (ids_out, flags_out, lengths_out, media_out):
            out.flush()
            if out is not media_out or encoder.media:
                os.fsync(out.fileno())
    for name, path in parts.items():
        os.replace(path, f"{base}.{name}")
    described = {"format": _FORMAT, "examples": len(rows), "tokens": n_tokens,
                 "trained": n_trained, "source": str(root), "kind": _kind(encoder),
                 "files": [f.name if f == root else f.relative_to(root).as_posix()
                           for f in files]}
    info.with_suffix(".json.partial").write_text(json.dumps(described))
    os.replace(info.with_suffix(".json.partial"), info)


def _kind(encoder: Any) -> str:
    return "chat" if encoder.chat else f"text column {encoder.column!r}"


class _Rows(_Bar):
    """The progress bar over rows (the text corpus's counts bytes)."""

    def __init__(self, shown: bool, n_rows: int) -> None:
        super().__init__(shown, [], None)
        self.total = n_rows


def _mapped(base: Path, info: dict[str, Any], eval_fraction: float, pad: int,
            kind: type[ExampleCorpus] | None = None, **extra: Any) -> ExampleCorpus:
    n, n_tokens = int(info["examples"]), int(info["tokens"])
    if n_tokens < 2:
        raise ValueError(f"{info['source']}: tokenized to {n_tokens} tokens, too few to train on")
    lengths = torch.from_file(f"{base}.lengths", shared=False, size=n, dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 and n > 1 else 0
    return (kind or ExampleCorpus)(
        torch.from_file(f"{base}.tokens", shared=False, size=n_tokens, dtype=torch.int32),
        torch.from_file(f"{base}.trained", shared=False, size=n_tokens, dtype=torch.uint8),
        offsets, n - n_eval, info["source"], tuple(info["files"]), info["kind"], pad, **extra)


class ExampleBatches(Positioned[Batch]):
    """Batches of whole examples, right-padded: batch ``k`` from ``(seed, k)``.

    Args:
        corpus: the examples.
        indices: the ones to draw from (:meth:`ExampleCorpus.usable`).
        batch_size: rows per (global) batch.
        seq_len: input tokens per row.
        seed: the order; the same seed gives the same batches on every machine.
        replicas: the data-parallel replicas that split each batch (each row's loss weight is
            ``replicas / N``, N the trained tokens of the batch).

    Raises:
        ValueError: for no examples to draw from.
    """

    def __init__(self, corpus: ExampleCorpus, indices: torch.Tensor, batch_size: int,
                 seq_len: int, *, seed: int = 0, replicas: int = 1) -> None:
        if indices.numel() == 0:
            raise ValueError(f"{corpus.source}: no example trains on any of its first "
                             f"{seq_len + 1} tokens; use a longer --seq-len, or check the "
                             "data (--chat trains on assistant turns only)")
        self.corpus, self.indices = corpus, indices
        self.batch_size, self.seq_len, self.replicas = batch_size, seq_len, replicas
        self.seed, self.step = seed, 0
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) > 1:
                self._orders.pop(min(self._orders))
            g = torch.Generator().manual_seed(_mix(self.seed, epoch))
            self._orders[epoch] = torch.randperm(self.indices.numel(), generator=g)
        return self._orders[epoch]

    def examples(self, step: int) -> list[int]:
        """The examples (their row numbers in the data set) of batch ``step``, in order."""
        n = self.indices.numel()
        rows = []
        for position in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, i = divmod(position, n)
            rows.append(int(self.indices[self._order(epoch)[i]]))
        return rows

    def batch(self, step: int) -> Batch:
        """Batch number ``step``: ({input_ids, attention_mask}, {labels, weight})."""
        c, width = self.corpus, self.seq_len + 1
        window = torch.full((self.batch_size, width), c.pad_id, dtype=torch.long)
        real = torch.zeros(self.batch_size, width, dtype=torch.bool)
        trained = torch.zeros(self.batch_size, width, dtype=torch.bool)
        for r, e in enumerate(self.examples(step)):
            a = int(c.offsets[e])
            k = min(int(c.offsets[e + 1]) - a, width)
            window[r, :k] = c.ids[a:a + k]
            real[r, :k] = True
            trained[r, :k] = c.trained[a:a + k].bool()
        labels = torch.where(trained[:, 1:], window[:, 1:], IGNORE)
        n = int((labels != IGNORE).sum())
        weight = torch.full((self.batch_size,), self.replicas / n, dtype=torch.float32)
        return ({"input_ids": window[:, :-1].contiguous(),
                 "attention_mask": real[:, :-1].long()},
                {"labels": labels, "weight": weight})

    def eval_batches(self, n_batches: int) -> list[Batch]:
        """The first ``n_batches`` batches, the same on every call (for a held-out loss)."""
        return [self.batch(k) for k in range(n_batches)]


def _mix(seed: int, epoch: int) -> int:
    digest = hashlib.blake2b(f"examples:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def masked_lm_loss(out: Any, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trained tokens' next-token cross-entropy of a ``CausalLMOutput``, summed per row
    and weighted by ``targets["weight"]`` (labels are the next tokens, -100 where untrained)."""
    labels = targets["labels"]
    ce = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                         reduction="none")
    return (ce.view(labels.shape).sum(1) * targets["weight"]).sum()


def example_batches(corpus: ExampleCorpus, batch_size: int, seq_len: int, seed: int,
                    replicas: int, eval_batches: int,
                    kind: type[ExampleBatches] | None = None
                    ) -> tuple[ExampleBatches, list[Batch], dict[str, Any]]:
    """The training batches, the held-out batches and what the run trains on (the ``data``
    record: :func:`describe` prints it); ``kind``: the batches' class (default
    :class:`ExampleBatches`; :class:`~pipetrain.train.data.packing.PackedBatches` packs them).

    Raises:
        ValueError: when no training example, or no held-out one, trains on a token.
    """
    train, counts = corpus.usable(0, corpus.n_train, seq_len)
    held, eval_counts = corpus.usable(corpus.n_train, len(corpus), seq_len)
    if held.numel() == 0:
        cut = (f", {eval_counts['image_cut']} with images beyond --seq-len {seq_len}"
               if eval_counts.get("image_cut") else "")
        raise ValueError(f"{corpus.source}: no held-out example to evaluate on ({len(corpus)} "
                         f"rows, the last {len(corpus) - corpus.n_train} held out and none of "
                         f"them trained on{cut}); use more rows")
    kind = kind or corpus.batches
    batches = kind(corpus, train, batch_size, seq_len, seed=seed, replicas=replicas)
    evals = kind(corpus, held, batch_size, seq_len, seed=seed, replicas=replicas)
    record = {"source": corpus.source, "reads": corpus.kind, "layout": "padded",
              "seq_len": seq_len, **counts, "held_out": eval_counts["examples"],
              "trained_fraction": counts["trained"] / max(counts["targets"], 1),
              "padding_fraction": 1 - counts["targets"] / max(counts["examples"] * seq_len, 1)}
    return batches, evals.eval_batches(eval_batches), record


def describe(record: dict[str, Any]) -> str:
    """The ``data`` record as the line printed after ``start``."""
    what = ("chat template, loss on the assistant's tokens only"
            if record["reads"] == "chat" else f"{record['reads']}, loss on every token")
    dropped = (f", {record['dropped']:,} dropped (nothing to train on)"
               if record["dropped"] else "")
    return (f"data: {record['source']}, {record['examples']:,} examples "
            f"({record['held_out']:,} held out{dropped}), {what}: "
            f"{100 * record['trained_fraction']:.1f}% of {record['targets']:,} tokens trained on; "
            + (f"packed into {record['rows']:,} rows of {record['seq_len']} tokens an epoch "
               f"({100 * record['padding_fraction']:.0f}% padding; one example a row: "
               f"{100 * record['padding_unpacked']:.0f}%), {record['truncated']:,} truncated"
               if record["layout"] == "packed" else
               f"one example per row, not packed, right-padded to {record['seq_len']} "
               f"({100 * record['padding_fraction']:.0f}% padding, {record['truncated']:,} "
               "truncated)"))


def data_problems(data: str | None, text_field: str, chat: bool) -> list[str]:
    """What is wrong with the data settings (checked before any process starts)."""
    import importlib.util

    dataset = is_dataset(data)
    problems = []
    if not dataset and (chat or text_field != "text"):
        flag = "--chat" if chat else f"--text-field {text_field}"
        problems.append(f"{flag} needs --data to be a .jsonl, .json, .parquet or .csv file "
                        f"or a save_to_disk directory, got {data or 'the default corpus'}")
    if dataset and importlib.util.find_spec("datasets") is None:
        from pipetrain.train.data.records import INSTALL

        problems.append(f"--data {data} is a data set, read with Hugging Face datasets, which "
                        f"is not installed; install it with {INSTALL}")
    return problems

