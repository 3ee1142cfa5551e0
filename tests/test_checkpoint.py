"""Checkpoints in one process: round trips, the commit protocol under kills, integrity, keys."""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import run as ck
from pipetrain.checkpoint import store as store
from pipetrain.errors import CheckpointError


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {**ck.model_state(model.named_parameters()),
            **ck.optimizer_state(opt, model.named_parameters()), **ck.rng_state()}


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _saved(root: Path, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a trained model's state at ``step``; return a copy of what was saved."""
    model, opt = _model(seed)
    _train(model, opt, range(step + 1))
    state = _state(model, opt)
    ck.save(root, step, state, {"seed": seed})
    return _copy(state)


def test_round_trip_restores_parameters_optimizer_and_rng(tmp_path: Path) -> None:
    model, opt = _model(0)
    _train(model, opt, range(3))
    saved = _copy(_state(model, opt))
    path = ck.save(tmp_path, 3, _state(model, opt), {"preset": "x", "lr": [0.1, 1e-300]})
    assert path == tmp_path / "step_000003" and ck.latest(tmp_path) == path

    fresh, fresh_opt = _model(1)
    torch.manual_seed(123)
    state = _state(fresh, fresh_opt)
    meta = ck.load(path, state)
    ck.load_optimizer_state(fresh_opt, fresh.named_parameters(), state)
    ck.set_rng_state(state)
    assert _equal(_copy(_state(fresh, fresh_opt)), saved)
    assert torch.equal(torch.get_rng_state(), saved["rng/rank0/cpu"])
    assert meta["step"] == 3 and meta["preset"] == "x" and meta["lr"] == [0.1, 1e-300]
    assert meta["world_size"] == 1 and meta["pipetrain_version"] and ck.read_meta(path) == meta


def test_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path: Path) -> None:
    model, opt = _model(0)
    torch.manual_seed(7)
    _train(model, opt, range(6))  # dropout draws from the global RNG
    want = _copy(ck.model_state(model.named_parameters()))

    model, opt = _model(0)
    torch.manual_seed(7)
    _train(model, opt, range(3))
    path = ck.save(tmp_path, 3, _state(model, opt), {})
    model, opt = _model(5)  # a restarted process: other values, fresh optimizer, other RNG
    state = _state(model, opt)
    ck.load(path, state)
    ck.load_optimizer_state(opt, model.named_parameters(), state)
    ck.set_rng_state(state)
    _train(model, opt, range(3, 6))
    assert _equal(_copy(ck.model_state(model.named_parameters())), want)


def test_no_resume_refuses_an_out_with_checkpoints_before_any_step(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from pipetrain.train.config import TrainConfig
    from pipetrain.train.resume import restore

    def trainer(resume: bool) -> Any:
        return SimpleNamespace(cfg=TrainConfig(out=str(tmp_path), resume=resume),
                               mesh=SimpleNamespace(rank=1))

    assert restore(trainer(resume=False)) is None  # no checkpoints yet: a fresh start
    model, opt = _model(0)
    ck.save(tmp_path / "checkpoints", 3, _state(model, opt), {})
    with pytest.raises(CheckpointError, match=r"\[rank 1\] --no-resume, but .*checkpoints holds "
                       r"an earlier run's checkpoints \(newest: step_000003\); pass another "
                       r"--out, or delete"):
        restore(trainer(resume=False))


def test_optimizer_state_by_name_and_back() -> None:
    model, opt = _model(0)
    before = _copy(ck.model_state(model.named_parameters()))
    state = ck.optimizer_state(opt, model.named_parameters())  # materialises a fresh optimizer
    assert _equal(_copy(ck.model_state(model.named_parameters())), before)
    assert sorted(state) == sorted(f"optim/{n}/{f}" for n in ("0.weight", "0.bias", "2.weight",
                                   "2.bias") for f in ("exp_avg", "exp_avg_sq", "step"))
    assert all(float(state[k]) == 0.0 for k in state if k.endswith("/step"))

    trained, trained_opt = _model(0)
    _train(trained, trained_opt, range(2))
    values = _copy(ck.optimizer_state(trained_opt, trained.named_parameters()))
    ck.load_optimizer_state(opt, model.named_parameters(), values)  # copies (not live tensors)
    assert _equal(_copy(ck.optimizer_state(opt, model.named_parameters())), values)
    model.load_state_dict(trained.state_dict())
    for m, o in ((model, opt), (trained, trained_opt)):
        torch.manual_seed(9)  # the same dropout masks
        _train(m, o, range(2, 3))
    assert _equal(dict(model.state_dict()), dict(trained.state_dict()))

    with pytest.raises(ValueError, match="1 of the optimizer's 4 parameters have no name"):
        ck.optimizer_state(opt, list(model.named_parameters())[1:])


def test_latest_ignores_partial_uncommitted_and_tampered_directories(tmp_path: Path) -> None:
    assert ck.latest(tmp_path / "nothing") is None and ck.latest(tmp_path) is None
    _saved(tmp_path, 1)
    good = _saved(tmp_path, 2)
    (tmp_path / ".step_000009.partial").mkdir()
    shutil.copytree(tmp_path / "step_000002", tmp_path / "step_000007")
    (tmp_path / "step_000007" / store.COMMIT).unlink()  # no marker: never committed
    shutil.copytree(tmp_path / "step_000002", tmp_path / "step_000008")
    (tmp_path / "step_000008" / store.MANIFEST).write_text("{}")  # marker does not match
    assert ck.latest(tmp_path) == tmp_path / "step_000002"
    removed = ck.clean(tmp_path)
    assert [p.name for p in removed] == [".step_000009.partial", "step_000007"]
    state = _zeros_like(good)
    ck.load(ck.latest(tmp_path), state)  # type: ignore[arg-type]
    assert _equal(state, good)


def test_keep_deletes_all_but_the_newest(tmp_path: Path) -> None:
    model, opt = _model(0)
    for step in range(4):
        ck.save(tmp_path, step, _state(model, opt), {}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    with pytest.raises(CheckpointError, match="a checkpoint of step 3 already exists"):
        ck.save(tmp_path, 3, _state(model, opt), {})


def test_bad_arguments(tmp_path: Path) -> None:
    model, opt = _model(0)
    state = _state(model, opt)
    with pytest.raises(TypeError, match="JSON"):
        ck.save(tmp_path, 1, state, {"when": object()})
    with pytest.raises(ValueError, match=r"\['step'\] are filled in by save"):
        ck.save(tmp_path, 1, state, {"step": 1})
    with pytest.raises(TypeError, match="bad entries: \\['lr'\\]"):
        ck.save(tmp_path, 1, {**state, "lr": 0.1}, {})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ck.save(tmp_path, -1, state, {})
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        ck.load(tmp_path / "step_000001", state)
    assert not any(tmp_path.iterdir())


# -- integrity ---------------------------------------------------------------------------------
def _zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "flip", "flip-index", "flip-meta", "delete"])
def test_damaged_files_are_named(tmp_path: Path, damage: str) -> None:
    saved = _saved(tmp_path, 1)
    path = tmp_path / "step_000001"
    name = {"flip-index": ".metadata", "flip-meta": "meta.json"}.get(damage, "__0_0.distcp")
    target = path / name
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-100])
    elif damage == "delete":
        target.unlink()
    else:
        _flip(target, target.stat().st_size // 2)
    state = _zeros_like(saved)
    with pytest.raises(CheckpointError, match=str(target)):
        ck.load(path, state)
    assert all(not v.any() for v in state.values())  # nothing was loaded


def test_incompatible_format_names_both_versions(tmp_path: Path) -> None:
    saved = _saved(tmp_path, 1)
    path = tmp_path / "step_000001"
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["format"] = 99
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    (path / store.COMMIT).write_text(store.sha256_file(path / store.MANIFEST))
    with pytest.raises(CheckpointError, match="format 99, but this pipetrain reads format 1"):
        ck.load(path, _zeros_like(saved))


class _Payload:
    """Unpickling it would create a directory: proof that code ran."""

    def __init__(self, where: Path) -> None:
        self.where = where

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return (os.mkdir, (str(self.where),))


def test_index_pickle_admits_only_dcp_classes(tmp_path: Path) -> None:
    """Even with a consistent (rewritten) manifest, a hostile .metadata runs no code."""
    saved = _saved(tmp_path, 1)
    path, pwned = tmp_path / "step_000001", tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(pwned)))
    manifest = json.loads((path / store.MANIFEST).read_text())
    manifest["files"][".metadata"] = {"sha256": store.sha256_file(path / ".metadata"),
                                      "bytes": (path / ".metadata").stat().st_size}
    (path / store.MANIFEST).write_text(json.dumps(manifest))
    (path / store.COMMIT).write_text(store.sha256_file(path / store.MANIFEST))
    with pytest.raises(CheckpointError, match="refusing to unpickle posix.mkdir"):
        ck.load(path, _zeros_like(saved))
    assert not pwned.exists()
    with pytest.raises(CheckpointError, match="holds a dict, not DCP Metadata"):
        store.parse_dcp_metadata(pickle.dumps({"a": 1}), path)


# -- keys of another model ---------------------------------------------------------------------
def test_another_model_is_named_by_its_keys(tmp_path: Path) -> None:
    saved = _saved(tmp_path, 1)
    path = tmp_path / "step_000001"
    extra = {**_zeros_like(saved), "model/9.weight": torch.zeros(2)}
    with pytest.raises(CheckpointError, match=r"keys not in the checkpoint: model/9\.weight"):
        ck.load(path, extra)
    fewer = {k: v for k, v in _zeros_like(saved).items() if k != "model/2.bias"}
    with pytest.raises(CheckpointError, match=r"no rank asked for: model/2\.bias"):
        ck.load(path, fewer)
    wide = {**_zeros_like(saved), "model/0.weight": torch.zeros(9, 6)}
    with pytest.raises(CheckpointError, match=r"shape differs: model/0\.weight \(9, 6\) "
                                              r"\(checkpoint \(8, 6\)\)"):
        ck.load(path, wide, strict=False)

    loose = {k: v for k, v in _zeros_like(saved).items() if k.startswith("model/0.")}
    loose["model/9.weight"] = torch.zeros(2)
    ck.load(path, loose, strict=False)  # loads what matches, leaves the rest
    assert torch.equal(loose["model/0.weight"], saved["model/0.weight"])
    assert not loose["model/9.weight"].any()

    no_rng = {k: v for k, v in _zeros_like(saved).items() if not k.startswith("rng/")}
    ck.load(path, no_rng)  # another layout: rng/ keys nobody asks for are no error
    assert _equal(no_rng, {k: v for k, v in saved.items() if not k.startswith("rng/")})


# -- a save killed at each phase ---------------------------------------------------------------
PARTIAL = ".step_000003.partial"
DATA = "__0_0.distcp"
LEFT = {  # phase -> what the killed save leaves beside the committed step_ directories
    "before-data": {PARTIAL: []},
    "torn-data": {PARTIAL: [DATA]},
    "before-seal": {PARTIAL: [".metadata", DATA]},
    "before-rename": {PARTIAL: [".metadata", "COMMITTED", DATA, "manifest.json", "meta.json"]},
    "before-retire": {},
    "during-retire": {".trash-step_000001": None, ".trash-step_000002": None},
}
COMMITTED_BEFORE_KILL = {"before-retire", "during-retire"}


def _die(*args: object, **kwargs: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit, no flush


def _arm(phase: str) -> None:
    """In the forked child only: make the save die at ``phase``."""
    if phase == "before-data":
        ck._write_data = _die  # type: ignore[assignment]
    elif phase == "torn-data":
        real, calls = torch.save, [0]

        def torn(obj: object, f: io.BufferedIOBase, *args: object, **kwargs: object) -> None:
            calls[0] += 1
            if calls[0] < 3:
                return real(obj, f, *args, **kwargs)  # type: ignore[arg-type]
            buf = io.BytesIO()
            real(obj, buf)
            f.write(buf.getvalue()[:len(buf.getvalue()) // 2])  # a torn third tensor
            f.flush()
            _die()

        torch.save = torn
    elif phase == "during-retire":
        store.shutil.rmtree = _die  # type: ignore[assignment]
    else:
        name = {"before-seal": "seal", "before-rename": "commit", "before-retire": "retire"}
        setattr(store, name[phase], _die)


def _trained(steps: int) -> dict[str, torch.Tensor]:
    model, opt = _model(2)
    _train(model, opt, range(steps))
    return _state(model, opt)


def _killed_save(root: Path, phase: str) -> None:
    torch.set_num_threads(1)
    _arm(phase)
    ck.save(root, 3, _trained(4), {}, keep=1)
    os._exit(0)  # only if the kill did not happen


@pytest.mark.parametrize("phase", list(LEFT))
def test_save_killed_at_each_phase_leaves_a_loadable_checkpoint(tmp_path: Path,
                                                                phase: str) -> None:
    _saved(tmp_path, 1)
    before = _saved(tmp_path, 2)
    child = mp.get_context("fork").Process(target=_killed_save, args=(tmp_path, phase))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL, f"the save was not killed at {phase}"
    after = _copy(_trained(4))

    done = phase in COMMITTED_BEFORE_KILL
    path = ck.latest(tmp_path)
    assert path == tmp_path / ("step_000003" if done else "step_000002")
    state = _zeros_like(before)
    ck.load(path, state)  # type: ignore[arg-type]
    assert _equal(state, after if done else before)

    left = {p.name: sorted(q.name for q in p.iterdir()) for p in tmp_path.iterdir()
            if not p.name.startswith("step_")}
    if phase == "during-retire":
        left = dict.fromkeys(left)
    assert left == LEFT[phase]
    if phase == "torn-data":
        assert 0 < (tmp_path / PARTIAL / DATA).stat().st_size < (path / DATA).stat().st_size
    assert {p.name for p in ck.clean(tmp_path)} == set(left)
    assert all(p.name.startswith("step_") and store.committed(p) for p in tmp_path.iterdir())
    if done:
        with pytest.raises(CheckpointError, match="already exists"):
            ck.save(tmp_path, 3, _trained(4), {})
    else:
        assert ck.save(tmp_path, 3, _trained(4), {}, keep=1) == tmp_path / "step_000003"
        assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]
