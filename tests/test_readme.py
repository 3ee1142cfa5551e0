"""The README's snippet and first command run as written; the package type-checks and lints."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


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


def test_ci_runs_the_readme_test_command() -> None:
    command = _console_line("pytest")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci, f"{command!r} is not a line of .ci/run"


def test_quickstart_matches_one_device(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.examples import quickstart

    monkeypatch.setattr(sys, "argv", ["quickstart", "--steps", "3"])
    quickstart.main()  # in this process; its ranks start from the session's forkserver
    out = capsys.readouterr().out
    assert out.count("gradients identical to one device") == 2, out


@pytest.mark.skipif(shutil.which("ruff") is None and not (ROOT / ".ci").exists(),
                    reason="ruff not installed")
def test_ruff_clean() -> None:
    _run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], ROOT)


def test_mypy_strict_clean() -> None:
    pytest.importorskip("mypy")
    _run([sys.executable, "-m", "mypy"], ROOT, timeout=600)
