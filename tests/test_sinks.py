"""``--log tensorboard`` and ``--log wandb`` (:mod:`pipetrain.train.logs.sinks`): the
reporter's step and eval scalars read back with TensorBoard's own reader, and from W&B's
offline run; a two-process run writes them; bad ``--log`` values are refused before anything
starts."""

from __future__ import annotations

import io
import math
import time
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.train.commands.train_command import check
from pipetrain.train.config import TrainConfig
from pipetrain.train.logs import report
from pipetrain.train.logs.sinks import parse, scalars


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def _run(cfg: TrainConfig) -> None:
    rep = report.ProgressReporter(cfg, console=report.Console(file=io.StringIO()))
    rep.record("start", {"world": 2, "params": 10, "start_step": 0})
    for step, loss in enumerate([3.0, math.nan, 2.0]):
        rep.record("step", {"step": step, "loss": loss, "tokens_per_s": 10.0 * (step + 1),
                            "skipped": math.isnan(loss)})
    rep.record("eval", {"step": 2, "eval_loss": 2.5})
    rep.record("end", {"final_loss": 2.0, "steps": 3})
    rep.close()


def test_step_and_eval_scalars_are_sent_as_named() -> None:
    assert parse("tensorboard, wandb") == ["tensorboard", "wandb"] and parse("") == []
    assert scalars("step", {"step": 4, "time": 1.0, "loss": 2.0, "skipped": False,
                            "lr": 1e-3, "bubble": math.nan, "layout": {}}) == {
        "train/loss": 2.0, "train/lr": 1e-3}
    assert scalars("eval", {"step": 4, "eval_loss": 1.5}) == {"eval/eval_loss": 1.5}
    assert scalars("checkpoint", {"step": 4, "bytes": 10}) == {}


def test_tensorboard_event_files_hold_every_step_and_eval(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _run(TrainConfig(out=str(tmp_path), steps=3, log="tensorboard"))
    got = _scalars(tmp_path / "tensorboard")
    assert got["train/loss"] == [(0, 3.0), (2, 2.0)]  # the skipped step's NaN is left out
    assert got["train/tokens_per_s"] == [(0, 10.0), (1, 20.0), (2, 30.0)]
    assert got["eval/eval_loss"] == [(2, 2.5)]
    assert (tmp_path / "log.jsonl").exists()  # still the source


def test_wandb_offline_run_holds_the_scalars(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "pipetrain-test")
    _run(TrainConfig(out=str(tmp_path / "run"), steps=3, log="wandb"))
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    names = (b"train/loss", b"train/tokens_per_s", b"eval/eval_loss", b"pipetrain-test")
    deadline = time.monotonic() + 60  # W&B's service process may still be writing after
    data = run.read_bytes()           # finish() returns (seen once, on a loaded machine)
    while not all(n in data for n in names) and time.monotonic() < deadline:
        time.sleep(0.5)
        data = run.read_bytes()  # W&B's own log of the run, uploaded by `wandb sync`
    for name in names:
        assert name in data, name


def test_bad_log_values_are_refused_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown sink 'mlflow'; choose among tensorboard, "
                                         "wandb"):
        check(TrainConfig(log="tensorboard,mlflow"))
    with pytest.raises(ValueError, match="the sinks write under --out"):
        check(TrainConfig(log="tensorboard", out=""))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match="--log wandb needs wandb: pip install wandb"):
        check(TrainConfig(log="wandb"))


@pytest.mark.long  # beside test_tensorboard_event_files_hold_every_step_and_eval
def test_a_two_process_run_writes_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--nproc", "2", "--steps", "4", "--batch-size",
                 "8", "--microbatches", "2", "--seq-len", "16", "--eval-every", "2",
                 "--no-progress", "--out", str(out), "--log", "tensorboard"]) == 0
    got = _scalars(out / "tensorboard")
    assert [s for s, _ in got["train/loss"]] == [0, 1, 2, 3]
    assert [s for s, _ in got["eval/eval_loss"]] == [1, 3]
