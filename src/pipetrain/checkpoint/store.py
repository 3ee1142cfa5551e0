"""Checkpoint store: the on-disk layout of checkpoints, their atomic commit and their hashes.

A root directory holds one directory per saved step; only directories named ``step_<N>`` with
a valid commit marker count::

    <root>/step_000200/          a committed checkpoint
        __0_0.distcp ...         tensors, one file per writing rank (torch.distributed.checkpoint)
        .metadata                DCP's index of the data files (a pickle, see below)
        meta.json                step, versions and the caller's metadata
        manifest.json            format, and sha256 + size of every file above
        COMMITTED                sha256 of manifest.json: written last, inside the partial directory
    <root>/.step_000300.partial/ a save in progress, or one a crash interrupted
    <root>/.trash-step_000100/   an old checkpoint being deleted

A save writes everything into ``.step_<N>.partial``, fsyncs it, and commits with one
``rename`` to ``step_<N>``; old checkpoints are renamed into ``.trash-*`` before they are
deleted. A crash at any moment therefore leaves either the complete new directory or none, and
never a half-deleted one under a ``step_`` name: :func:`latest` returns the newest committed
checkpoint, and :func:`clean` removes what interrupted saves and deletions left behind. This
assumes a POSIX filesystem where ``rename`` is atomic and that every rank sees (NFS, Lustre and
local disks do; object stores do not).

DCP's ``.metadata`` is a pickle. It is never handed to ``pickle.load``: :func:`parse_dcp_metadata`
first checks its sha256 against the manifest and then unpickles it with an unpickler that only
admits DCP's metadata classes, ``torch.Size``, dtypes, layouts and paths.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from pipetrain.errors import CheckpointError
from pipetrain.runtime.torch_distributed import DCP_PICKLED

__all__ = ["FORMAT", "step_dir", "partial_dir", "latest", "committed", "clean", "retire",
           "seal", "commit", "prepare", "Opened", "open_checkpoint", "verify_files",
           "parse_dcp_metadata"]

FORMAT = 1
"""Version of the checkpoint layout; :func:`open_checkpoint` refuses any other."""
COMMIT, MANIFEST, META, DCP_METADATA = "COMMITTED", "manifest.json", "meta.json", ".metadata"
_STEP = re.compile(r"^step_(\d+)$")
_CHUNK = 1 << 20


def step_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives once committed."""
    return root / f"step_{step:06d}"


def partial_dir(root: Path, step: int) -> Path:
    """Where a save of ``step`` writes before it commits."""
    return root / f".step_{step:06d}.partial"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# -- finding checkpoints ----------------------------------------------------------------------
def committed(path: Path) -> bool:
    """True when ``path`` has a commit marker matching its manifest (files are not hashed)."""
    try:
        marker = (path / COMMIT).read_text(encoding="utf-8").strip()
        return marker == sha256_file(path / MANIFEST)
    except OSError:
        return False


def _steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := _STEP.match(p.name))]
    return sorted(found)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The committed checkpoint of the highest step under ``root``, or None.

    Partial, uncommitted and half-deleted directories are ignored (and left for :func:`clean`).
    """
    for _, path in reversed(_steps(Path(root))):
        if committed(path):
            return path
    return None


def clean(root: str | os.PathLike[str]) -> list[Path]:
    """Delete what interrupted saves and deletions left under ``root``; return those paths.

    Removes ``.step_*.partial`` and ``.trash-*`` directories and ``step_*`` directories without
    a commit marker. Call it only when no save into ``root`` is running.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    junk = [p for p in root.iterdir() if p.is_dir() and (
        (p.name.startswith(".step_") and p.name.endswith(".partial"))
        or p.name.startswith(".trash-")
        or (_STEP.match(p.name) is not None and not (p / COMMIT).exists()))]
    for p in sorted(junk):
        shutil.rmtree(p)
    return sorted(junk)


def retire(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints; return the deleted paths."""
    old = [p for _, p in _steps(root) if committed(p)][:-keep]
    for p in old:
        trash = root / f".trash-{p.name}"
        os.rename(p, trash)  # first out of the step_ namespace, so a crash cannot tear it
    _fsync_dir(root)
    for p in old:
        shutil.rmtree(root / f".trash-{p.name}")
    return old


# -- writing (the coordinating rank) ------------------------------------------------------------
def prepare(root: Path, step: int) -> Path:
    """Clean ``root``, refuse an existing checkpoint of ``step``, create the partial directory."""
    final = step_dir(root, step)
    if final.exists() and committed(final):
        raise CheckpointError(f"a checkpoint of step {step} already exists at {final}; save "
                              "under another step or delete that directory first")
    root.mkdir(parents=True, exist_ok=True)
    clean(root)
    tmp = partial_dir(root, step)
    tmp.mkdir()
    return tmp


def seal(tmp: Path, meta: dict[str, Any]) -> None:
    """Write meta.json, then the manifest of every file, then the commit marker (all fsynced)."""
    _write_durable(tmp / META, json.dumps(meta, indent=1, sort_keys=True))
    files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {"format": FORMAT, "files": files}
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    _write_durable(tmp / COMMIT, sha256_file(tmp / MANIFEST) + "\n")
    _fsync_dir(tmp)


def commit(tmp: Path, final: Path) -> None:
    """Publish the sealed directory: one atomic rename, made durable."""
    os.rename(tmp, final)
    _fsync_dir(final.parent)


# -- reading --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    """A checkpoint whose marker, manifest and small files were checked."""

    path: Path
    files: dict[str, dict[str, Any]]
    """File name -> {"sha256", "bytes"} from the manifest."""
    meta: dict[str, Any]
    metadata: Metadata
    """DCP's index, parsed from hash-checked bytes by the restricted unpickler."""


def open_checkpoint(path: Path) -> Opened:
    """Check the commit marker, the manifest's format and the small files; parse them.

    Raises:
        CheckpointError: naming the file that is missing, tampered with or incompatible.
    """
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint directory at {path}")
    if not committed(path):
        raise CheckpointError(f"{path} is not a committed checkpoint ({COMMIT} is missing or "
                              f"does not match {MANIFEST}); use latest(root) to find one")
    manifest = _json(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: checkpoint format {manifest.get('format')!r}, "
                              f"but this pipetrain reads format {FORMAT}; load it with the "
                              "pipetrain version that wrote it (see its meta.json)")
    files: dict[str, dict[str, Any]] = manifest["files"]
    for name in (META, DCP_METADATA):
        if name not in files:
            raise CheckpointError(f"{path}: the manifest lists no {name}")
    meta = json.loads(_verified_bytes(path, name=META, entry=files[META]))
    metadata = parse_dcp_metadata(_verified_bytes(path, DCP_METADATA, files[DCP_METADATA]),
                                  path / DCP_METADATA)
    return Opened(path, files, meta, metadata)


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def _verified_bytes(path: Path, name: str, entry: dict[str, Any]) -> bytes:
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path / name}: unreadable ({e})") from e
    problem = _mismatch(len(data), hashlib.sha256(data).hexdigest(), entry)
    if problem:
        raise CheckpointError(f"{path / name}: {problem}")
    return data


def _mismatch(size: int, digest: str, entry: dict[str, Any]) -> str | None:
    if size != entry["bytes"]:
        return (f"{size} bytes but the manifest says {entry['bytes']} (truncated or "
                "overwritten): restore it or load an older checkpoint")
    if digest != entry["sha256"]:
        return ("sha256 differs from the manifest (corrupted or modified): restore it or load "
                "an older checkpoint")
    return None


def verify_files(opened: Opened, names: list[str]) -> list[str]:
    """Hash the named files; one message per file that is missing, truncated or altered."""
    problems = []
    for name in names:
        path = opened.path / name
        try:
            problem = _mismatch(path.stat().st_size, sha256_file(path), opened.files[name])
        except OSError as e:
            problem = f"unreadable ({e})"
        if problem:
            problems.append(f"{path}: {problem}")
    return problems


# -- DCP's pickled index, read with an allow-list ---------------------------------------------
_DCP_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                "TensorStorageMetadata", "ChunkStorageMetadata")
_ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in _DCP_CLASSES} | {
    *DCP_PICKLED, ("torch", "Size"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Admits only the globals DCP's index of tensors needs; anything else is an error."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name}: a checkpoint index holds "
                              "only DCP metadata classes")


def parse_dcp_metadata(data: bytes, where: Path) -> Metadata:
    """DCP's ``Metadata`` from the bytes of ``.metadata`` (tensors only), via the allow-list."""
    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e
    except Exception as e:  # any malformed pickle
        raise CheckpointError(f"{where}: not a DCP index ({type(e).__name__}: {e})") from e
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP Metadata")
    odd = [k for k, v in metadata.state_dict_metadata.items()
           if not isinstance(v, TensorStorageMetadata)]
    if odd:
        raise CheckpointError(f"{where}: entries {odd[:5]} are not tensors; pipetrain "
                              "checkpoints hold tensors only")
    return metadata
