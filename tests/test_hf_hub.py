"""``--hf ORG/NAME[@REVISION]`` (:mod:`pipetrain.hf.hub`): read from a Hugging Face cache laid out
as huggingface_hub writes it, with ``HF_HUB_OFFLINE=1`` (nothing touches the network), by the
commands users run; a local directory wins; each failure says what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.chat import save_model
from pipetrain.cli import main
from pipetrain.hf import hub

SHA = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo: str, files: Path, revision: str = "main") -> Path:
    """``files`` as the snapshot of ``repo`` at ``revision`` in the cache at ``cache``:
    ``models--ORG--NAME/refs/REVISION`` names the commit, ``snapshots/COMMIT/`` holds the
    files (huggingface_hub's own layout; its blobs are left out, the snapshot's files being
    what it reads)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / SHA
    shutil.copytree(files, snapshot, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / revision).write_text(SHA)
    return snapshot


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("saved") / "m")


@pytest.fixture
def offline(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache holding ``acme/tiny-llama`` at main, read offline; returns its snapshot."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return cache_repo(cache, "acme/tiny-llama", model)


def test_a_hub_id_resolves_to_its_cached_snapshot(offline: Path) -> None:
    assert hub.local("acme/tiny-llama") == str(offline)
    assert hub.local("acme/tiny-llama@main") == str(offline)
    assert hub.local(f"acme/tiny-llama@{SHA}") == str(offline)  # a commit
    assert (offline.parents[2] / ".locks" / "pipetrain--acme--tiny-llama.lock").exists()


def test_a_local_directory_wins_over_the_same_spelling(offline: Path, tmp_path: Path) -> None:
    mine = tmp_path / "acme" / "tiny-llama"
    mine.mkdir(parents=True)
    (mine / "config.json").write_text("{}")
    assert hub.local("acme/tiny-llama") == "acme/tiny-llama"
    assert hub.local(str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")  # a path


def test_offline_and_not_cached_says_how_to_get_it(offline: Path) -> None:
    with pytest.raises(ValueError, match=r"not in the Hugging Face cache .* HF_HUB_OFFLINE is "
                                         r"set: run once with the network \(or `hf download "
                                         r"acme/other --revision v2`\)"):
        hub.local("acme/other@v2")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        hub.local("acme/tiny-llama@v9")  # cached, but not at that revision


def _http(error: type[Exception], status: int) -> Exception:
    """The Hub's error without its HTTP response (whose library varies between versions)."""
    refused = error.__new__(error)
    Exception.__init__(refused, f"{status} refused")
    return refused


@pytest.mark.parametrize("kind, status, says", [
    ("GatedRepoError", 403, r"gated: accept its terms on https://huggingface.co/acme/closed "
                            r"and give a token \(HF_TOKEN"),
    ("RepositoryNotFoundError", 404, "no such repository on the Hub, or it is private"),
    ("RevisionNotFoundError", 404, "has no revision 'v3'"),
])
def test_the_hubs_refusals_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         kind: str, status: int, says: str) -> None:
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    calls: list[dict[str, Any]] = []

    def refuse(repo: str, **kw: Any) -> str:
        calls.append(kw)
        if kw.get("local_files_only"):
            raise errors.LocalEntryNotFoundError("not cached")
        raise _http(getattr(errors, kind), status)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ValueError, match=says):
        hub.local("acme/closed@v3")
    # the cache was asked first; the download took only the files pipetrain reads
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["allow_patterns"] == hub.WEIGHTS and calls[1]["revision"] == "v3"
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in hub.WEIGHTS)


def test_pickle_only_weights_are_refused_with_what_to_do(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: str(snapshot))
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo, revision=None: ["config.json", "pytorch_model.bin"])
    with pytest.raises(ValueError, match=r"only pickle files \(pytorch_model.bin\), which "
                                         r"pipetrain never reads"):
        hub.local("acme/old")
    assert hub.local("acme/old", hub.CONFIG) == str(snapshot)  # a plan needs no weights


@pytest.mark.long  # beside test_a_hub_id_resolves_to_its_cached_snapshot
def test_commands_take_a_hub_id(offline: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """verify (the config), plan --cluster (the config only) and generate (weights and
    tokenizer, two processes) on ``acme/tiny-llama`` from the cache."""
    assert main(["verify", "--hf", "acme/tiny-llama", "--schedule", "1f1b", "--pp", "2",
                 "--microbatches", "2"]) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    assert main(["plan", "--cluster", "H100", "--gpus", "8", "--hf", "acme/tiny-llama",
                 "--seq-len", "64", "--global-batch", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["fits"] is True
    assert main(["generate", "--hf", "acme/tiny-llama@main", "--nproc", "2", "--device",
                 "cpu", "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    assert main(["verify", "--hf", "acme/absent"]) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err
