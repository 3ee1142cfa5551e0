"""Checkpoints: save and load a pipelined run by original parameter names, at any layout.

What a checkpoint holds is a flat dict of tensors named by the caller, plus JSON metadata::

    state = {**checkpoint.model_state(pipe.named_parameters()),          # "model/3.weight"
             **checkpoint.optimizer_state(opt, pipe.named_parameters()),  # "optim/3.weight/exp_avg"
             **checkpoint.rng_state()}                                    # "rng/rank2/cpu"
    checkpoint.save(root, step, state, {"layout": ..., "lr_schedule": sched.state_dict()})
    ...
    path = checkpoint.latest(root)
    meta = checkpoint.load(path, state)        # fills the same tensors in place
    checkpoint.load_optimizer_state(opt, pipe.named_parameters(), state)
    checkpoint.set_rng_state(state)

Tensors are stored with ``torch.distributed.checkpoint`` (DCP) under those keys: each rank
writes only the keys it holds, a key held by several ranks (tied weights, data-parallel
replicas) is written once, and each rank loads only the keys it asks for, so a run saved at
pp=4 resumes at pp=2, or with another dp. DTensors (FSDP2 shards, tensor-parallel slices) are
saved by their global shape, so they load into any other split or into whole tensors. Plain
values that are the same on every rank (LR schedule, loss scale, model config, layout) go into
``meta`` as JSON. The data position is the
``step`` (optimizer steps done); :mod:`pipetrain.train.data.text` batches depend only on
(seed, step).

RNG state is per rank (``rng/rank<r>/...``): at the same layout each rank gets its own stream
back and training continues bitwise as if uninterrupted. At another layout rank r does not do
what rank r did before, so no mapping is right: leave the rng keys out of ``state`` (the
``rng/`` keys in the checkpoint are then ignored) and re-seed, e.g. from (seed, step, rank).

Commit and integrity: see :mod:`pipetrain.checkpoint.store`. Trust model: the sha256 manifest
detects truncated and corrupted files (``load`` hashes every file before DCP reads it); it is
not a signature, since whoever can write the directory can rewrite the manifest. What bounds
such a writer is that nothing is loaded with unrestricted pickle: tensors are read with
``torch.load(weights_only=True)``, DCP's ``.metadata`` index with an allow-list unpickler
(only after its hash matched), everything else is JSON. Non-tensor DCP entries, which DCP
would unpickle freely, are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from pipetrain.checkpoint import store as store
from pipetrain.checkpoint.state import (
    load_optimizer_state,
    model_state,
    optimizer_state,
    rng_state,
    set_rng_state,
)
from pipetrain.checkpoint.store import clean, latest
from pipetrain.errors import CheckpointError
from pipetrain.runtime.dtensors import copy_whole_, is_strided

__all__ = ["save", "load", "latest", "clean", "read_meta", "model_state", "optimizer_state",
           "load_optimizer_state", "rng_state", "set_rng_state", "RESERVED"]

RESERVED = ("step", "world_size", "pipetrain_version", "torch_version")
"""Metadata fields ``save`` fills in itself; the caller's ``meta`` may not use them."""
Group = dist.ProcessGroup | None
_T = TypeVar("_T")


# -- collective helpers -----------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without torch.distributed, DCP warns that it runs in one process: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _me(group: Group) -> tuple[int, int]:
    """(index in ``group``, size of ``group``); (0, 1) without torch.distributed."""
    if not _distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: Group, index: int) -> int:
    return index if group is None else dist.get_global_rank(group, index)


def _try(fn: Callable[[], _T]) -> tuple[_T | None, str]:
    """Run ``fn``; return (value, "") or (None, the error as text) for expected failures."""
    try:
        return fn(), ""
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as e:
        return None, f"{type(e).__name__}: {e}"


def _agree(problem: str, group: Group, what: str) -> None:
    """Collective: raise the same CheckpointError on every rank if any rank has a problem."""
    texts = _gather_text(problem, group)
    bad = [(_global(group, i), t) for i, t in enumerate(texts) if t]
    if bad:
        lines = "\n".join(f"  [rank {r}] {t}" for r, t in bad)
        raise CheckpointError(f"{what} failed on {len(bad)} of {len(texts)} ranks:\n{lines}")


def _gather_text(text: str, group: Group) -> list[str]:
    """Every rank's ``text`` (utf-8 over tensors, no pickle); one collective when all empty."""
    if not _distributed():
        return [text]
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(group) == "nccl" else torch.device("cpu")
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    n = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device), group=group)
    longest = max(int(s) for s in sizes)
    if longest == 0:
        return [""] * n
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    bufs = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(bufs, padded, group=group)
    return [bytes(b[:int(s)].tolist()).decode() for b, s in zip(bufs, sizes)]


# -- save -------------------------------------------------------------------------------------
def save(root: str | os.PathLike[str], step: int, state: dict[str, torch.Tensor],
         meta: dict[str, Any], *, group: Group = None, keep: int | None = None) -> Path:
    """Write ``state`` and ``meta`` as the checkpoint of ``step``; collective over ``group``.

    Every rank of the job calls it (all pp and dp ranks; ``group`` None is the world) with its
    own tensors; ``meta`` (JSON-serialisable) is taken from the group's first rank. The
    directory appears under ``root`` only when complete (see :mod:`pipetrain.checkpoint.store`).

    Args:
        root: the directory holding all checkpoints of a run, on a filesystem all ranks share.
        step: optimizer steps done; names the directory ``step_<step>``.
        state: this rank's tensors by key; a key on several ranks must hold equal values there.
        meta: model config, layout, LR schedule, loss scale...: anything JSON can hold.
        keep: after committing, delete all but the newest ``keep`` checkpoints (None: keep all).

    Returns:
        The committed directory.

    Raises:
        TypeError, ValueError: for bad arguments on the rank that passed them (the other
            ranks raise CheckpointError naming it).
        CheckpointError: on every rank, when any rank failed to write; the previous
            checkpoints are untouched.

    Example:
        >>> save("runs/a/ckpt", 200, model_state(pipe.named_parameters()),
        ...      {"preset": "tiny"}, keep=3)  # doctest: +SKIP
        PosixPath('runs/a/ckpt/step_000200')
    """
    _checked_everywhere(lambda: _check_save(step, state, meta, keep), group, step)
    root = Path(root)
    index, size = _me(group)
    tmp, final = store.partial_dir(root, step), store.step_dir(root, step)
    # [1] the first rank cleans up and creates the partial directory; the others wait for it
    problem = _try(lambda: store.prepare(root, step))[1] if index == 0 else ""
    _agree(problem, group, f"checkpoint step {step}: preparing {root}")
    # [2] every rank writes its tensors; DCP's index is written last, by the first rank
    _write_data(tmp, state, group)
    # [3] the first rank seals (meta, manifest, marker) and renames; nobody returns before it
    full = {**meta, "step": step, "world_size": size, "pipetrain_version": _version(),
            "torch_version": torch.__version__}
    problem = _try(lambda: _finish(root, step, tmp, full, keep))[1] if index == 0 else ""
    _agree(problem, group, f"checkpoint step {step}: committing {final}")
    return final


def _checked_everywhere(check: Callable[[], None], group: Group, step: int) -> None:
    """Run ``check`` on every rank: the failing rank raises its own error, the others a
    CheckpointError naming it, so no rank is left waiting in the save."""
    error: TypeError | ValueError | None = None
    try:
        check()
    except (TypeError, ValueError) as e:
        error = e
    try:
        _agree("" if error is None else f"{type(error).__name__}: {error}", group,
               f"checkpoint step {step}: checking the arguments")
    except CheckpointError as agreed:
        if error is not None:
            raise error from agreed
        raise


def _check_save(step: int, state: dict[str, torch.Tensor], meta: dict[str, Any],
                keep: int | None) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be None or an int >= 1, got {keep!r}")
    odd = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if odd:
        raise TypeError(f"state must map str keys to tensors; bad entries: {odd[:5]}; put "
                        "plain values into meta")
    clash = sorted(set(RESERVED) & set(meta))
    if clash:
        raise ValueError(f"meta keys {clash} are filled in by save itself; rename them")
    try:
        json.dumps(meta, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"meta must be JSON-serialisable (dicts, lists, str, numbers): {e}") from e


def _write_data(tmp: Path, state: dict[str, torch.Tensor], group: Group) -> None:
    """Every rank writes its tensors into ``tmp``; DCP writes its index from the first rank."""
    writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True)
    plain = {k: (cast(Any, v).full_tensor() if is_strided(v) else v).detach()
             for k, v in state.items()}
    try:
        with _quiet():
            dcp_save(plain, storage_writer=writer, process_group=group,
                     no_dist=not _distributed())
    except Exception as e:  # DCP raises the same error on every rank
        raise CheckpointError(f"writing checkpoint data into {tmp} failed: {e}; the previous "
                              "checkpoints are untouched") from e


def _finish(root: Path, step: int, tmp: Path, meta: dict[str, Any], keep: int | None) -> None:
    """The first rank seals and commits, then retires old checkpoints."""
    store.seal(tmp, meta)
    store.commit(tmp, store.step_dir(root, step))
    if keep is not None:
        store.retire(root, keep)


def _version() -> str:
    from pipetrain._version import __version__

    return __version__


# -- load -------------------------------------------------------------------------------------
def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of a committed checkpoint (after checking its hash), without loading it.

    Use it to decide what to load, e.g. RNG state only when ``meta["layout"]`` is this run's.
    """
    return store.open_checkpoint(Path(path)).meta


def load(path: str | os.PathLike[str], state: dict[str, torch.Tensor], *, group: Group = None,
         strict: bool = True, verify: bool = True) -> dict[str, Any]:
    """Fill ``state``'s tensors in place from the checkpoint at ``path``; collective.

    Every rank passes the tensors it needs (same keys as when saving; any layout). Before DCP
    reads anything, the ranks check the commit marker, the format, every file's sha256 (each
    rank hashes a share) and the keys; any problem raises the same error on every rank.

    Args:
        path: a committed checkpoint directory, e.g. ``latest(root)``.
        state: key -> destination tensor (e.g. from :func:`model_state`), overwritten in place.
        strict: require every key of ``state`` in the checkpoint, with its dtype, and every
            checkpoint key under a prefix (``model/``, ``optim/``, ``rng/`` ...) that some rank
            asked for to be loaded by some rank. Without it, absent keys stay as they are.
        verify: hash the data files first; False only for a checkpoint this process has
            just verified (a conversion loading it part by part).

    Returns:
        The metadata: the caller's ``meta`` plus step, world_size and versions.

    Raises:
        CheckpointError: on every rank, naming the file (missing, truncated, altered), the
            keys (missing, unexpected, wrong shape or dtype) or the incompatible format.
    """
    path = Path(path)
    index, size = _me(group)
    opened, problem = _try(lambda: store.open_checkpoint(path))
    _agree(problem, group, f"opening checkpoint {path}")
    assert opened is not None
    data = sorted(n for n in opened.files if n not in (store.META, store.DCP_METADATA))
    _agree("\n    ".join(store.verify_files(opened, data[index::size]) if verify else []),
           group, f"verifying checkpoint {path}")
    wanted, problem = _match_keys(opened.metadata, state, strict, group)
    _agree(problem, group, f"matching keys with checkpoint {path}")
    reader = _IndexedReader(path, opened.metadata)
    whole = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in wanted.items() if is_strided(v)}
    try:
        with _quiet():
            dcp_load({**wanted, **whole}, storage_reader=reader, process_group=group,
                     no_dist=not _distributed())
    except Exception as e:  # DCP raises the same error on every rank
        raise CheckpointError(f"reading checkpoint {path} failed: {e}") from e
    for key, value in whole.items():
        copy_whole_(wanted[key], value)
    return opened.meta





def _match_keys(metadata: Metadata, state: dict[str, torch.Tensor], strict: bool,
                group: Group) -> tuple[dict[str, torch.Tensor], str]:
    """The entries to load, and this rank's complaint about the keys (collective)."""
    saved = {k: v for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}  # parse_dcp_metadata admits only these
    problems = []
    missing = sorted(k for k in state if k not in saved)
    if missing and strict:
        problems.append(f"keys not in the checkpoint: {_few(missing)}")
    shape = [f"{k} {tuple(v.shape)} (checkpoint {tuple(saved[k].size)})"
             for k, v in state.items() if k in saved and tuple(v.shape) != tuple(saved[k].size)]
    if shape:
        problems.append(f"shape differs: {_few(shape)}")
    dtype = [f"{k} {v.dtype} (checkpoint {saved[k].properties.dtype})"
             for k, v in state.items() if k in saved and v.dtype != saved[k].properties.dtype]
    if dtype and strict:
        problems.append(f"dtype differs: {_few(dtype)}")
    unused = _unused(sorted(saved), state, group)
    if unused and strict and _me(group)[0] == 0:  # the same on every rank: said once
        problems.append(f"checkpoint keys no rank asked for: {_few(unused)}")
    if problems:
        problems.append("is this checkpoint from another model? (load(..., strict=False) skips "
                        "absent and unused keys)")
    return {k: v.detach() for k, v in state.items() if k in saved}, "; ".join(problems)


def _unused(keys: list[str], state: dict[str, torch.Tensor], group: Group) -> list[str]:
    """Checkpoint keys no rank asked for, within the prefixes (before '/') some rank used."""
    asked = torch.tensor([k in state for k in keys], dtype=torch.int32)
    if _distributed():
        if dist.get_backend(group) == "nccl":
            asked = asked.cuda()
        dist.all_reduce(asked, group=group)
    used = {k.split("/", 1)[0] for k, a in zip(keys, asked.tolist()) if a}
    return [k for k, a in zip(keys, asked.tolist()) if not a and k.split("/", 1)[0] in used]


def _few(items: list[str], n: int = 8) -> str:
    more = f" ... and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


class _IndexedReader(FileSystemReader):
    """DCP's file reader, handed the index we parsed from hash-checked bytes (no pickle.load)."""

    def __init__(self, path: Path, metadata: Metadata) -> None:
        super().__init__(path)
        self._index = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("pipetrain checkpoints have one global index, no per-rank one")
        if self._index.storage_meta is not None:
            self._index.storage_meta.load_id = self.load_id
        return self._index
