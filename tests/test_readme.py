"""The README's snippet and first command run as written; the package type-checks and lints."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], cwd: Path, timeout: float = 240) -> str:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_readme_snippet_runs(tmp_path: Path) -> None:
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code is not None
    script = tmp_path / "snippet.py"
    script.write_text(code.group(1))
    losses = eval(_run([sys.executable, str(script)], tmp_path).strip())  # a list of floats
    assert len(losses) == 2 and losses[0] == losses[1]


def test_quickstart_matches_one_device() -> None:
    out = _run([sys.executable, "-m", "pipetrain.examples.quickstart", "--steps", "3"], ROOT)
    assert out.count("gradients identical to one device") == 2, out


@pytest.mark.skipif(shutil.which("ruff") is None and not (ROOT / ".ci").exists(),
                    reason="ruff not installed")
def test_ruff_clean() -> None:
    _run([sys.executable, "-m", "ruff", "check", "src", "tests", "benchmarks"], ROOT)


def test_mypy_strict_clean() -> None:
    pytest.importorskip("mypy")
    _run([sys.executable, "-m", "mypy"], ROOT, timeout=600)
