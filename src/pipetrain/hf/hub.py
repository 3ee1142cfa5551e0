"""Hub: ``--hf ORG/NAME[@REVISION]`` resolved to a local snapshot through huggingface_hub.

Every command that takes ``--hf`` takes a Hub id too. :func:`local` returns a directory:

* a local directory with a ``config.json`` is used as it is, and wins over a Hub id of the same
  spelling;
* otherwise ``ORG/NAME`` (optionally ``@REVISION``: a branch, tag or commit) is fetched with
  ``huggingface_hub.snapshot_download`` into its cache (``HF_HUB_CACHE``, or ``HF_HOME/hub``),
  only the files pipetrain reads: ``config.json``, ``generation_config.json``, the tokenizer's
  files and the safetensors weights with their index (:data:`WEIGHTS`); for a plan, only the
  config (:data:`CONFIG`). The token comes from the environment (``HF_TOKEN``) or
  ``hf auth login``, as huggingface_hub finds it; ``HF_HUB_OFFLINE=1`` reads the cache only.

Processes of one node share the cache: each takes a file lock beside it before fetching, so the
first downloads and the others wait, then find every file cached and download nothing. A
failure says what to do: offline and not cached, a gated repository, a missing one or a missing
revision, a repository whose weights are only pickle files (``pytorch_model.bin``, which is
never read).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from filelock import FileLock

__all__ = ["CONFIG", "WEIGHTS", "is_hub_id", "local"]

CONFIG = ["config.json"]
WEIGHTS = [*CONFIG, "generation_config.json", "*.safetensors", "*.safetensors.index.json",
           "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model",
           "chat_template.*"]
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(spec: str) -> bool:
    """True when ``spec`` is spelled as ``ORG/NAME[@REVISION]`` and is not a local directory.

    >>> is_hub_id("meta-llama/Llama-3.2-1B"), is_hub_id("Qwen/Qwen3-0.6B@main")
    (True, True)
    >>> is_hub_id("./ckpt"), is_hub_id("/abs/path"), is_hub_id("a/b/c")
    (False, False, False)
    """
    return bool(_ID.match(spec)) and not Path(spec).exists()


def local(spec: str, files: list[str] | None = None) -> str:
    """A local directory for ``--hf spec``: ``spec`` itself when it is a directory (or not a Hub
    id, for the caller's own "no config.json" error), else the Hub snapshot with ``files``
    (default :data:`WEIGHTS`).

    Raises:
        ValueError: the repository cannot be had as asked, saying why and what to do.
    """
    if not is_hub_id(spec):
        return spec
    repo, _, revision = spec.partition("@")
    wanted = WEIGHTS if files is None else files
    with _node_lock(repo):
        path = _snapshot(spec, repo, revision or None, wanted)
    if wanted is WEIGHTS:
        _require_safetensors(spec, repo, revision or None, Path(path))
    return path


def _cache() -> Path:
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub:
        return Path(hub)
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface")
    return Path(home, "hub")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _node_lock(repo: str) -> FileLock:
    from filelock import FileLock

    where = _cache() / ".locks"
    where.mkdir(parents=True, exist_ok=True)
    return FileLock(str(where / f"pipetrain--{repo.replace('/', '--')}.lock"))


def _snapshot(spec: str, repo: str, revision: str | None, files: list[str]) -> str:
    """The snapshot directory: from the cache alone when it holds it, else downloaded."""
    from huggingface_hub import errors, snapshot_download

    cache = str(_cache())
    try:  # a process after the first on this node, or a second run: nothing to fetch
        return str(snapshot_download(repo, revision=revision, cache_dir=cache,
                                     allow_patterns=files, local_files_only=True))
    except (errors.LocalEntryNotFoundError, FileNotFoundError):
        if _offline():
            raise ValueError(
                f"--hf {spec}: not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                "set: run once with the network (or `hf download "
                f"{repo}{' --revision ' + revision if revision else ''}`), or point "
                "HF_HUB_CACHE at a cache that holds it, or give a local directory") from None
    try:
        return str(snapshot_download(repo, revision=revision, cache_dir=cache,
                                     allow_patterns=files))
    except errors.GatedRepoError:
        raise ValueError(f"--hf {spec}: the repository is gated: accept its terms on "
                         f"https://huggingface.co/{repo} and give a token (HF_TOKEN, or "
                         "`hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"--hf {spec}: no such repository on the Hub, or it is private: "
                         "check the spelling (ORG/NAME), or give a token that can read it "
                         "(HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"--hf {spec}: the repository has no revision {revision!r} (a "
                         "branch, tag or commit)") from None
    except errors.HfHubHTTPError as e:
        raise ValueError(f"--hf {spec}: the Hub answered {e}; retry, or set "
                         "HF_HUB_OFFLINE=1 to use the cache only") from None
    except OSError as e:  # no network at all
        raise ValueError(f"--hf {spec}: cannot reach the Hub ({e}); with the files cached, "
                         "set HF_HUB_OFFLINE=1") from None


def _require_safetensors(spec: str, repo: str, revision: str | None, path: Path) -> None:
    """Refuse a snapshot without safetensors weights where the Hub has pickle ones (a
    repository with no weights at all is a config, trained from scratch like such a local
    directory; offline, the Hub cannot be asked)."""
    if any(path.glob("*.safetensors")) or _offline():
        return
    from huggingface_hub import HfApi

    try:
        names = HfApi().list_repo_files(repo, revision=revision)
    except Exception:  # noqa: BLE001 - unknown: train from the config, as for a local one
        return
    pickled = any(n.endswith((".bin", ".pt", ".pth", ".ckpt")) for n in names)
    if pickled:
        raise ValueError(f"--hf {spec}: the repository's weights are only pickle files "
                         "(pytorch_model.bin), which pipetrain never reads (loading one runs "
                         "code): pick a revision with safetensors (the Hub's conversion bot "
                         "opens one as a pull request, refs/pr/N), or convert them yourself "
                         "with transformers' save_pretrained(safe_serialization=True)")
