"""The README's snippet and first command run as written, and print what it shows; the package
type-checks and lints."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

slow = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests); all but one test here

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@slow
def test_readme_snippet_runs(tmp_path: Path) -> None:
    """Its ``train`` launched on 2 processes as its main block does, in this process (the
    ranks start from the session's forkserver; tests/test_docs.py does the same for docs)."""
    from test_docs import _launch  # the docs tests' helper

    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code is not None
    losses = _launch(code.group(1), tmp_path, "readme_snippet")
    assert len(losses) == 2 and losses[0] == losses[1]


def _console_line(containing: str) -> str:
    """The README's first ``$ ...`` console line that contains ``containing``, without ``$ ``."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("$ ") and containing in line:
            return line[2:]
    raise AssertionError(f"no README console line contains {containing!r}")


@slow
def test_readme_train_command_runs_at_a_tiny_size(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.cli import main

    for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
        monkeypatch.delenv(key)
    command = _console_line("pipetrain train").split(" && ")[-1].split()
    assert command[:4] == ["python3", "-m", "pipetrain", "train"], command
    tiny = ["--steps", "3", "--seq-len", "32", "--batch-size", "8", "--microbatches", "4",
            "--eval-every", "0", "--sample-tokens", "8", "--out", str(tmp_path / "run")]
    assert main([*command[3:], *tiny]) == 0  # the command's main, in this process
    steps = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if r["kind"] == "step"] == [0, 1, 2], steps
    for name in ("loss.png", "timeline.png", "summary.json", "checkpoints/step_000003"):
        assert (tmp_path / "run" / name).exists(), name


@slow
def test_ci_runs_the_readme_test_command() -> None:
    command = _console_line("pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f"{command!r} is not a line of .ci/run"


@slow
def test_quickstart_matches_one_device(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.examples import quickstart

    monkeypatch.setattr(sys, "argv", ["quickstart", "--steps", "3"])
    quickstart.main()  # in this process; its ranks start from the session's forkserver
    out = capsys.readouterr().out
    assert out.count("gradients identical to one device") == 2, out


@slow
@pytest.mark.skipif(shutil.which("ruff") is None and not (ROOT / ".ci").exists(),
                    reason="ruff not installed")
def test_ruff_clean() -> None:
    _run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], ROOT)


@slow
def test_mypy_strict_clean() -> None:
    pytest.importorskip("mypy")
    _run([sys.executable, "-m", "mypy"], ROOT, timeout=600)


# -- the first run's output ---------------------------------------------------------------------


def _first_run_block() -> list[str]:
    """The lines README shows under its first ``$ ... pipetrain train`` command."""
    text = (ROOT / "README.md").read_text()
    block = text.split("$ " + _console_line("pipetrain train") + "\n", 1)[1]
    return block.split("```", 1)[0].splitlines()


def _deterministic(lines: list[str], out: str = "runs/pipetrain") -> list[str]:
    """What is the same on every run with the same Python: the ``start:``, ``eval`` and
    ``checkpoint`` lines (the run's ``out`` written OUT), each ``step`` line up to its loss
    (tokens/s and the bubble are wall-clock), and the sample's first line."""
    kept = []
    for i, line in enumerate(lines):
        if line.startswith(("start: ", "eval ")):
            kept.append(line)
        elif line.startswith("checkpoint "):
            kept.append(line.replace(out, "OUT"))
        elif line.startswith("step "):
            kept.append(" ".join(line.split()[:4]))  # step N/STEPS loss X
        elif line == "sample:" and i + 1 < len(lines):
            kept.append("sample: " + lines[i + 1])
    return kept


def test_readme_first_run_block_is_what_the_reporter_prints() -> None:
    """Fast: each line of README's first-run block is what ``pipetrain train`` prints for the
    README's command, given the figures shown: the config's first line; the ``start:`` line
    (``report.describe_layout`` of the command's layout: its world, schedule, micro-batches,
    stages, every layer of the preset placed, its parameters); the step, eval, checkpoint and
    sample lines through the reporter itself, which prints only some steps' lines."""
    from rich.console import Console

    from pipetrain.cli import build_parser
    from pipetrain.models.gpt import PRESETS
    from pipetrain.schedules import make_schedule
    from pipetrain.train.commands.train_command import resolved
    from pipetrain.train.config import format_config
    from pipetrain.train.logs.report import ProgressReporter, describe_layout

    lines = _first_run_block()
    command = _console_line("pipetrain train").split(" && ")[-1].split()
    cfg = resolved(build_parser().parse_args(command[3:]), {})[0]
    assert lines[:2] == format_config(cfg, world=cfg.nproc).splitlines()[:2], lines[:2]

    start = next(line for line in lines if line.startswith("start: "))
    found = re.fullmatch(r"start: (.*), ([\d,]+) parameters", start)
    assert found is not None, start
    pp = cfg.nproc // cfg.dp
    schedule = make_schedule(cfg.schedule, pp, cfg.microbatches)
    model = dataclasses.replace(PRESETS[cfg.preset], seq_len=cfg.seq_len)
    balance = [int(n) for n in found.group(1).split("layers per stage ")[1].split(", fp")[0]
               .split(", ")]
    assert sum(balance) == model.n_layers + 2, balance  # embedding, blocks, head
    layout = {"world": cfg.nproc, "dp": cfg.dp, "pp": pp, "schedule": cfg.schedule,
              "microbatches": cfg.microbatches, "stages": schedule.n_stages,
              "stages_per_rank": schedule.n_stages // pp, "balance": balance,
              "precision": cfg.precision}
    assert found.groups() == (describe_layout(layout), f"{model.n_params:,}"), start

    shown = io.StringIO()
    reporter = ProgressReporter(dataclasses.replace(cfg, out="", progress=False),
                                console=Console(file=shown, width=1000, color_system=None))
    reporter.record("start", {"layout": layout, "params": model.n_params})
    expected = [start]
    for i, line in enumerate(lines):
        fields: dict[str, Any] | None = None
        if m := re.fullmatch(r"step +(\d+)/\d+  loss (\S+)  ([\d,]+) tok/s  bubble (\S+)", line):
            fields = {"step": int(m[1]), "loss": float(m[2]),
                      "tokens_per_s": float(m[3].replace(",", "")), "bubble": float(m[4])}
            kind = "step"
        elif m := re.fullmatch(r"eval  step (\d+)  loss (\S+)", line):
            fields, kind = {"step": int(m[1]), "eval_loss": float(m[2])}, "eval"
        elif m := re.fullmatch(r"checkpoint  step (\d+)  (\S+)", line):
            assert m[2] == f"{cfg.out}/checkpoints/step_{cfg.steps:06d}", line
            fields, kind = {"step": int(m[1]), "path": m[2]}, "checkpoint"
        elif line == "sample:":
            fields, kind = {"text": lines[i + 1]}, "sample"
            expected.append(line)
        if fields is not None:
            reporter.record(kind, fields)
            expected.append(lines[i + 1] if kind == "sample" else line)
        elif line.startswith(("step ", "eval ", "checkpoint ")):
            pytest.fail(f"README's line {line!r} is not of the reporter's form")
    reporter.close()
    assert shown.getvalue().splitlines() == expected


@pytest.mark.slow
@pytest.mark.long  # the command at full size; test_readme_train_command_runs_at_a_tiny_size runs
@pytest.mark.timeout(1800)  # it in CI, and the test above checks the block's form there
def test_readme_first_run_prints_what_readme_shows(tmp_path: Path) -> None:
    """README's first command, all 1500 steps, prints the deterministic lines README shows,
    field by field (README leaves some lines out: those it shows come in the printed order).
    They are of the Python README names, whose standard library the run trains on."""
    python = re.search(r"these are CPython\s+(\d+\.\d+\.\d+)'s", (ROOT / "README.md").read_text())
    assert python is not None, "README no longer names the Python of its first run"
    if platform.python_version() != python[1]:
        pytest.skip(f"README's first run is CPython {python[1]}'s standard library; this is "
                    f"{platform.python_version()}")
    command = _console_line("pipetrain train").split(" && ")[-1].split()
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    done = subprocess.run([sys.executable, *command[1:], "--no-progress", "--out", str(out)],
                          cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=1750)
    assert done.returncode == 0, done.stdout
    printed = _deterministic(done.stdout.splitlines(), out=str(out))
    shown = _deterministic(_first_run_block())
    assert {line.split()[0] for line in shown} >= {"start:", "step", "eval", "checkpoint",
                                                   "sample:"}, shown
    rest = iter(printed)
    missing = [line for line in shown if not any(line == got for got in rest)]
    assert not missing, f"README shows {missing}; the command printed:\n" + "\n".join(printed)
