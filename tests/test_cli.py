"""Command line: `pipetrain schedules | simulate | validate`, run in-process through main()."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.schedules import make_schedule

GOOD = make_schedule("1f1b", 2, 3).to_text()
# rank 1 starts with micro-batch 1, which rank 0 sends only after its 0B0, which waits on rank 1
CROSSED = "# schedule: crossed\nrank 0,rank 1\n0F0,1F1\n0B0,1B1\n0F1,1F0\n0B1,1B0\n"


def test_schedules_lists_names_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedules"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by_name = {line.split()[0]: line.split()[1] for line in lines[1:] if line.strip()}
    assert by_name["gpipe"] == "1" and by_name["1f1b"] == "1"
    assert any("GPipe" in line for line in lines)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (3, 5)])
def test_simulate_json_1f1b_makespan(capsys: pytest.CaptureFixture[str], p: int, m: int) -> None:
    argv = ["simulate", "--schedule", "1f1b", "--ranks", str(p), "--microbatches", str(m),
            "--cost", "F=1,B=2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    required = {"schedule", "ranks", "stages", "microbatches", "makespan", "span",
                "bubble_fraction", "bubble_rate", "peak_activations", "actions"}
    assert required <= result.keys()
    assert (result["schedule"], result["ranks"], result["microbatches"]) == ("1f1b", p, m)
    assert result["makespan"] == (m + p - 1) * (1 + 2)


def test_simulate_text_summary_and_grid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "zb-h1", "-p", "4", "-m", "8", "--cost", "F=1,I=1,W=1",
                 "--comm", "0", "--grid"]) == 0
    out = capsys.readouterr().out
    assert "schedule        zb-h1" in out and "makespan        27" in out
    assert "peak activations" in out
    assert "rank 3 |... ... ... 3F0 3I0 " in out  # text timeline
    assert "step  rank 0  rank 1" in out  # grid


@pytest.mark.parametrize(("limit", "code", "fits"), [("4", 0, True), ("3", 3, False)])
def test_memory_limit_reports_the_fit(capsys: pytest.CaptureFixture[str], limit: str, code: int,
                                      fits: bool) -> None:
    # 1F1B at p = 4 holds 4 stage-activations on rank 0, 3 on rank 1, ...
    argv = ["simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--memory-limit", limit]
    assert main(argv) == code
    out = capsys.readouterr().out
    assert ("fits (peak 4, rank 0)" in out) == fits
    assert ("DOES NOT FIT on ranks [0] (peak 4, rank 0)" in out) == (not fits)
    assert main([*argv, "--json"]) == code
    result = json.loads(capsys.readouterr().out)
    assert (result["memory_limit"], result["fits"]) == (float(limit), fits)


def test_memory_limit_must_be_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--memory-limit", "-1"]) == 2
    assert "--memory-limit must be a finite number >= 0" in capsys.readouterr().err


def test_simulate_writes_png_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["simulate", "-s", "gpipe", "-p", "2", "-m", "2", "--json",
                 "--png", str(png), "--trace", str(trace)]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays one JSON object; file notes go to stderr
    assert "wrote" in captured.err
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(trace.read_text())["traceEvents"]) > 0


def test_validate_good_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "good.csv"
    path.write_text(GOOD)
    assert main(["validate", str(path), "--cost", "F=1,B=2"]) == 0
    out = capsys.readouterr().out
    assert "valid schedule '1f1b'" in out and "makespan        12" in out


def test_validate_broken_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "crossed.csv"
    path.write_text(CROSSED)
    assert main(["validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert "deadlocks" in captured.err and "ERROR HERE" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_validate_unparsable_file_exits_1(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("rank 0\n0X0\n")
    assert main(["validate", str(path)]) == 1
    assert "0X0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["simulate", "-s", "nosuch", "-p", "2", "-m", "2"],
    ["simulate", "-s", "gpipe", "-p", "2", "-m", "2", "-v", "2"],
    ["simulate", "-s", "1f1b", "-p", "2", "-m", "0"],
    ["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--cost", "X=1"],
    ["simulate", "-s", "1f1b", "-p", "2"],
    ["validate", "no/such/file.csv"],
    ["frobnicate"],
], ids=["unknown-schedule", "bad-v", "m-zero", "bad-cost", "missing-arg", "no-file",
        "no-command"])
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() and "Traceback" not in captured.err


def test_python_dash_m_pipetrain() -> None:
    done = subprocess.run([sys.executable, "-m", "pipetrain", "schedules"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "1f1b" in done.stdout and "gpipe" in done.stdout
