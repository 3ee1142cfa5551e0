"""`pipetrain plan`: the JSON report, the TOML that `train --config` reads, the picture, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.train.cli import load_toml

FEW = "1f1b,zb-h1,zbv"


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", FEW, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_profile_only_plan_writes_a_config_train_runs(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _plan(tmp_path, capsys, "--memory-limit", "64MiB", "--no-calibrate")
    best = report["best"]
    assert code == 0 and best["fits"] and max(best["predicted_peak_bytes"]) <= 64 * 2**20
    assert set(best) >= {"schedule", "stages_per_rank", "microbatches", "balance", "recompute",
                         "predicted_step_s", "predicted_peak_bytes"}
    assert len(best["predicted_peak_bytes"]) == 2 and best["schedule"] in FEW.split(",")
    assert report["candidates"][0] == best and len(report["candidates"]) > 10
    steps = [c["predicted_step_s"] for c in report["candidates"] if c["fits"]]
    assert steps == sorted(steps)
    toml = load_toml(Path(report["config"]))
    assert toml["schedule"] == best["schedule"] and toml["microbatches"] == best["microbatches"]
    assert toml["balance"] == ",".join(map(str, best["balance"]))
    assert toml["recompute"] == best["recompute"]
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"


def test_a_limit_nothing_fits_exits_3_and_says_how(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", "1f1b", "--memory-limit", "1MiB", "--no-calibrate"])
    captured = capsys.readouterr()
    assert code == 3 and "no layout fits" in captured.err and "NO" in captured.out


@pytest.mark.parametrize(("argv", "match"), [
    (["--memory-limit", "lots"], "--memory-limit 'lots': give a size"),
    (["--memory-limit", "1GiB", "--schedules", "1f1b,fast"], "unknown \\['fast'\\]"),
    (["--memory-limit", "1GiB", "--nproc", "3", "--dp", "2"], "dp=2 does not divide"),
])
def test_bad_flags_exit_2(argv: list[str], match: str, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--out", str(tmp_path), *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_calibrated_plan_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, report = _plan(tmp_path / "plan", capsys, "--memory-limit", "64MiB")
    assert list(cwd.iterdir()) == []  # the calibration runs write no files (out="")
    scale = report["scale"]
    assert code == 0 and all(scale[op] > 0 for op in "fiwb") and scale["overhead"] >= 0
    assert report["best"]["fits"]
