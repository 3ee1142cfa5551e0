"""Text: byte-level text, a held-out split, and batches that a resumed run repeats exactly.

Tokens are bytes (ids 0..255), so any text needs no tokenizer and no download. The default
corpus is the Python standard library's own source and documentation found on this machine.

The last ``eval_fraction`` of the bytes is held out for evaluation; training windows never
reach into it. Batch ``k`` is a pure function of ``(seed, k)``: it draws its window starts from
a generator seeded with both, so the position of a run is just its step counter and a resumed
run sees exactly the batches an uninterrupted one would::

    corpus = default_corpus()
    batches = Batches(corpus.train, batch_size=16, seq_len=64, seed=0)
    inputs, targets = next(batches)            # (16, 64) int64 each, targets shifted by one
    state = batches.state_dict()               # {"seed": 0, "step": 1}: save with the model
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

__all__ = ["Batches", "Positioned", "ByteCorpus", "Corpus", "decode", "default_corpus", "encode",
           "text_files"]

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
DEFAULT_MAX_BYTES = 8 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True, eq=False)
class Corpus:
    """All token ids of a text corpus (1-D) and where its held-out tail begins.

    A :class:`ByteCorpus` holds bytes (uint8); a tokenized corpus
    (:func:`pipetrain.train.data.tokens.token_corpus`) holds a tokenizer's ids, memory-mapped.
    """

    data: torch.Tensor
    """Every token id, training part first (1-D)."""
    n_train: int
    """Tokens ``[0, n_train)`` are for training, ``[n_train, len)`` are held out."""
    source: str
    """Where the text came from (a path, or a description)."""
    files: tuple[str, ...] = ()
    """The files read, in order (relative to ``source`` for a directory)."""

    @property
    def train(self) -> torch.Tensor:
        """The training tokens."""
        return self.data[: self.n_train]

    @property
    def eval(self) -> torch.Tensor:
        """The held-out tokens, after (never overlapping) the training tokens."""
        return self.data[self.n_train:]

    def __len__(self) -> int:
        return int(self.data.numel())

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.source!r}, {len(self):,} tokens, "
                f"{len(self.files)} files, {self.n_train:,} train / "
                f"{len(self) - self.n_train:,} eval)")


@dataclass(frozen=True, eq=False, repr=False)
class ByteCorpus(Corpus):
    """A corpus whose tokens are its bytes (uint8, ids 0..255).

    Build one with :meth:`from_path`, :meth:`from_bytes` or :func:`default_corpus`.
    """

    @classmethod
    def from_bytes(cls, raw: bytes, *, eval_fraction: float = 0.05, source: str = "<bytes>",
                   files: Sequence[str] = ()) -> ByteCorpus:
        """A corpus of ``raw``, its last ``eval_fraction`` held out.

        Raises:
            ValueError: for no bytes, or an ``eval_fraction`` outside [0, 1).
        """
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        if not raw:
            raise ValueError(f"{source}: no text to train on (0 bytes)")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        n_train = len(raw) - round(len(raw) * eval_fraction)
        return cls(data, n_train, source, tuple(files))

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], *, eval_fraction: float = 0.05,
                  max_bytes: int | None = None,
                  suffixes: Sequence[str] = TEXT_SUFFIXES) -> ByteCorpus:
        """A file, or every file under a directory with one of ``suffixes`` in sorted order.

        Example::

            corpus = ByteCorpus.from_path("docs/", max_bytes=1 << 20)

        Raises:
            FileNotFoundError: when ``path`` does not exist.
            ValueError: when it holds no text (empty file, or no matching files).
        """
        root = Path(path)
        if not root.exists():
            raise FileNotFoundError(f"no such file or directory: {str(root)!r}")
        files = [root] if root.is_file() else text_files(root, suffixes)
        if not files:
            raise ValueError(f"{str(root)!r} holds no text files (looked for "
                             f"{', '.join(suffixes)} recursively)")
        raw, n_read = _read(files, max_bytes)
        names = [p.name if p == root else p.relative_to(root).as_posix() for p in files[:n_read]]
        return cls.from_bytes(raw, eval_fraction=eval_fraction, source=str(root), files=names)

def default_corpus(*, max_bytes: int = DEFAULT_MAX_BYTES,
                   eval_fraction: float = 0.05) -> ByteCorpus:
    """The Python standard library's ``.py``/``.txt``/``.md``/``.rst`` files on this machine.

    Installed packages (``site-packages``) are left out; at most ``max_bytes`` are read.
    """
    return ByteCorpus.from_path(sysconfig.get_paths()["stdlib"], eval_fraction=eval_fraction,
                                max_bytes=max_bytes)


def text_files(root: Path, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """Every file under ``root`` ending in one of ``suffixes``, in an order every machine shares
    (installed packages and caches left out)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath, f) for f in filenames if f.endswith(tuple(suffixes))]
    # sorted by the path inside root, so the order is the same on every machine
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read(files: Sequence[Path], max_bytes: int | None) -> tuple[bytes, int]:
    """The files' bytes joined, cut at ``max_bytes``, and how many files were (partly) read."""
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 (or None), got {max_bytes}")
    parts, total = [], 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        chunk = f.read_bytes()
        parts.append(chunk if max_bytes is None else chunk[: max_bytes - total])
        total += len(parts[-1])
    return b"".join(parts), len(parts)


B = TypeVar("B")


class Positioned(Generic[B]):
    """Batches that depend only on ``(seed, step)``: iterate them, and save and restore where
    the iteration is (a resumed run takes the batch an uninterrupted one takes next)."""

    seed: int
    step: int

    def batch(self, step: int) -> B:
        """Batch number ``step``, without moving the position."""
        raise NotImplementedError

    def __iter__(self) -> Positioned[B]:
        return self

    def __next__(self) -> B:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        """The position: the seed and the number of batches already taken."""
        return {"seed": self.seed, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next batch is the one an uninterrupted run takes next."""
        self.seed, self.step = int(state["seed"]), int(state["step"])


class Batches(Positioned[tuple[torch.Tensor, torch.Tensor]]):
    """Random windows of ``seq_len + 1`` bytes as (inputs, targets), batch ``k`` from (seed, k).

    Args:
        data: the bytes to draw from (``corpus.train`` or ``corpus.eval``), uint8 1-D.
        batch_size: windows per batch.
        seq_len: tokens per window; targets are the inputs shifted by one.
        seed: the data order; the same seed gives the same batches on every machine.

    Raises:
        ValueError: for non-positive sizes, or data shorter than one window.

    Example::

        batches = Batches(corpus.train, 16, 64, seed=0)
        inputs, targets = next(batches)
        resumed = Batches(corpus.train, 16, 64)
        resumed.load_state_dict(batches.state_dict())   # continues with batch 1
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, *,
                 seed: int = 0) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if data.dim() != 1 or data.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} bytes of 1-D data to "
                             f"draw a window, got shape {tuple(data.shape)}; use a larger "
                             "corpus or eval_fraction, or a shorter seq_len")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.seed, self.step = seed, 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``step`` (without moving the position): (inputs, targets), int64."""
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        starts = torch.randint(self.data.numel() - self.seq_len, (self.batch_size,), generator=g)
        windows = self.data[starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def eval_batches(self, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first ``n_batches`` batches, the same on every call (for a held-out loss)."""
        return [self.batch(k) for k in range(n_batches)]


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from (seed, step), distinct for distinct pairs in practice."""
    digest = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as token ids (int64, 1-D)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor | Sequence[int]) -> str:
    """Text of byte token ids; invalid UTF-8 (a cut multi-byte char) becomes U+FFFD."""
    values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")
