"""Tokens: a text corpus through a model's own tokenizer, tokenized once, then memory-mapped.

:func:`token_corpus` reads ``--data`` (a file, or every text file under a directory in sorted
order; default: the Python standard library's sources, as for bytes), encodes each file with
the tokenizer of the ``--hf`` directory (local files only), puts the end-of-text token between
files, and writes the ids as int32 to ``<cache>/<key>.tokens``. The key hashes the tokenizer's
files, the data files' names, sizes and modification times, and the byte limit, so a changed
corpus or tokenizer is tokenized again and an unchanged one never is. Later runs, and every
rank of a job, map that file (``torch.from_file``) instead of reading it.

One process tokenizes while the others wait (:func:`fill_once`): the first to create
``<key>.lock`` writes its host and pid into it, writes the ids (touching the lock as it goes,
with a progress bar when asked), then renames the finished file into place; a lock left by a
process that stopped touching it for :data:`STALE_S`, or whose process on this host exited, is
taken over. A waiter says which host and pid hold the lock and how to clear it: at once when
that is another host sharing the cache directory. The last ``eval_fraction`` of the tokens is
held out, as for bytes. Data sets of examples (JSONL, Parquet, chat) are cached the same way
by :mod:`pipetrain.train.data.examples`.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import socket
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from pipetrain.train.data.text import DEFAULT_MAX_BYTES, Corpus, text_files

__all__ = ["token_corpus", "cache_key", "fill_once", "STALE_S"]

STALE_S = 120.0
"""A lock file not touched for this long belongs to a tokenizer that stopped."""
TELL_S = 10.0
"""A wait for a process on this host is explained after this many seconds."""
PIECE = 1 << 20
"""Text is encoded in pieces of about this many characters, cut at line ends."""
_TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "added_tokens")
_FORMAT = 1


def token_corpus(tokenizer: Any, tokenizer_dir: str | Path, data: str | None,
                 cache: str | Path, *, eval_fraction: float = 0.05,
                 progress: bool = False) -> Corpus:
    """The token ids of ``data`` under ``tokenizer`` (from ``tokenizer_dir``), cached.

    Args:
        tokenizer: the model's tokenizer (:func:`pipetrain.hf.model.load_tokenizer`).
        tokenizer_dir: where its files are (part of the cache key).
        data: a text file or a directory; None: the standard library's sources (8 MiB).
        cache: the directory of token files (created when missing).
        eval_fraction: the held-out tail, a fraction of the tokens.
        progress: show a progress bar while tokenizing (the process that tokenizes).

    Raises:
        FileNotFoundError: when ``data`` does not exist.
        ValueError: when it holds no text, or too little for a held-out split.
    """
    root = Path(data) if data else Path(sysconfig.get_paths()["stdlib"])
    if not root.exists():
        raise FileNotFoundError(f"--data: no such file or directory: {str(root)!r}")
    files = [root] if root.is_file() else text_files(root)
    if not files:
        raise ValueError(f"--data {str(root)!r} holds no text files")
    limit = None if data else DEFAULT_MAX_BYTES
    key = cache_key(tokenizer_dir, root, files, limit)
    directory = Path(cache).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    tokens, info = directory / f"{key}.tokens", directory / f"{key}.json"
    lock = directory / f"{key}.lock"
    fill_once(lock, info, lambda: _tokenize(tokenizer, root, files, limit, tokens, info, lock,
                                            progress), what=f"--data {root}")
    return _mapped(tokens, json.loads(info.read_text()), eval_fraction)


def cache_key(tokenizer_dir: str | Path, root: Path, files: Sequence[Path],
              limit: int | None) -> str:
    """A hash of the tokenizer's files and of the data files' names, sizes and times."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"pipetrain-tokens:{_FORMAT}:{limit}\n".encode())
    for f in sorted(Path(tokenizer_dir).iterdir()):
        if f.is_file() and (f.name.startswith(_TOKENIZER_FILES) or f.suffix == ".model"):
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def fill_once(lock: Path, done: Path, fill: Callable[[], None], *, what: str,
              say: Callable[[str], None] | None = None) -> None:
    """Run ``fill`` (which writes ``done``) in one process; the others wait until ``done`` is.

    The process that creates ``lock`` writes its host and pid into it and fills; the lock is
    deleted after. A waiter takes over a lock not touched for :data:`STALE_S`, or one whose
    process on this host has exited. It says what it waits for (on stderr, or ``say``) when
    the holder is on another host (a shared filesystem) at once, and after :data:`TELL_S`
    otherwise: which host and pid hold the lock, and how to clear it.
    """
    told, began = False, time.monotonic()
    while not done.is_file():
        if _take_lock(lock):
            try:
                fill()
            finally:
                lock.unlink(missing_ok=True)
            continue
        holder = _holder(lock)
        elsewhere = holder.get("host") not in (None, socket.gethostname())
        if not told and lock.exists() and (elsewhere or time.monotonic() - began > TELL_S):
            (say or _say)(_waiting(lock, holder, what))
            told = True
        time.sleep(0.2)


def _take_lock(lock: Path) -> bool:
    """Create ``lock`` (this process fills), or clear one that went stale or lost its process."""
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            holder = _holder(lock)
            if time.time() - lock.stat().st_mtime > STALE_S or _gone(holder):
                lock.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}, f)
    return True


def _holder(lock: Path) -> dict[str, Any]:
    """Who wrote ``lock``: host, pid and since when ({} while unwritten or unreadable)."""
    try:
        found = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _gone(holder: dict[str, Any]) -> bool:
    """The lock's process was on this host and has exited."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def _waiting(lock: Path, holder: dict[str, Any], what: str) -> str:
    try:
        age = f"{time.time() - lock.stat().st_mtime:.0f} s ago"
    except FileNotFoundError:
        age = "just now"
    who = (f"pid {holder['pid']} on host {holder['host']}" if holder.get("host")
           else "a process that did not write its host (an older pipetrain)")
    return (f"pipetrain: waiting for {who} to tokenize {what}: it holds {lock} (last touched "
            f"{age}; taken over after {STALE_S:.0f} s untouched). If that process is gone, "
            f"delete {lock} and this run goes on")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _tokenize(tokenizer: Any, root: Path, files: Sequence[Path], limit: int | None,
              tokens: Path, info: Path, lock: Path, progress: bool) -> None:
    eos = tokenizer.eos_token_id
    partial = tokens.with_suffix(f".partial{os.getpid()}")
    n = 0
    with open(partial, "wb") as out, _Bar(progress, files, limit) as advance:
        for i, (piece, size) in enumerate(_pieces(files, limit)):
            if piece is None:  # the end of a file
                ids = [eos] if eos is not None else []
            else:
                ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
                advance(size)
            array.array("i", ids).tofile(out)
            n += len(ids)
            if i % 16 == 0:
                lock.touch()
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, tokens)
    described = {"tokens": n, "source": str(root), "eos": eos,
                 "files": [f.name if f == root else f.relative_to(root).as_posix()
                           for f in files]}
    info.with_suffix(".json.partial").write_text(json.dumps(described))
    os.replace(info.with_suffix(".json.partial"), info)


def _pieces(files: Sequence[Path], limit: int | None) -> Iterator[tuple[str | None, int]]:
    """(text, its bytes) pieces of each file, cut at line ends; (None, 0) after each file."""
    left = limit
    for f in files:
        if left is not None and left <= 0:
            return
        raw = f.read_bytes()
        raw = raw if left is None else raw[:left]
        left = None if left is None else left - len(raw)
        text = raw.decode("utf-8", errors="replace")
        start = 0
        while start < len(text):
            end = text.find("\n", start + PIECE)
            end = len(text) if end < 0 else end + 1
            yield text[start:end], len(text[start:end].encode("utf-8", errors="replace"))
            start = end
        yield None, 0


class _Bar:
    """A rich progress bar over the bytes to tokenize (no-op when not shown)."""

    def __init__(self, shown: bool, files: Sequence[Path], limit: int | None) -> None:
        total = sum(f.stat().st_size for f in files)
        self.total = total if limit is None else min(total, limit)
        self.progress: Any = None
        if shown:
            from rich.console import Console
            from rich.progress import Progress

            self.progress = Progress(console=Console(stderr=True), transient=True)

    def __enter__(self) -> Any:
        if self.progress is None:
            return lambda n: None
        self.progress.start()
        task = self.progress.add_task("tokenizing", total=self.total)
        return lambda n: self.progress.advance(task, n)

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()


def _mapped(tokens: Path, info: dict[str, Any], eval_fraction: float) -> Corpus:
    n = int(info["tokens"])
    if n < 2:
        raise ValueError(f"{info['source']}: tokenized to {n} tokens, too few to train on")
    data = torch.from_file(str(tokens), shared=False, size=n, dtype=torch.int32)
    n_train = n - round(n * eval_fraction)
    return Corpus(data, n_train, info["source"], tuple(info["files"]))
