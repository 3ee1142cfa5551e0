"""benchmarks/soak.py: the tiny run survives every fault bitwise; its checks catch failures."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pipetrain.train.launch import faults

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long tier (CONTRIBUTING.md: tests): a kill
# and a NaN restarted bitwise in CI: test_train_launch.py; a wrong shape: test_failures_dist.py

ROOT = Path(__file__).resolve().parents[1]


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_soak_survives_every_fault_and_ends_bitwise_equal(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--tiny",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["problems"] == [], r["problems"]
    assert r["injected"] == r["survived"] == 3
    assert {k: n["survived"] for k, n in r["by_kind"].items() if n["planned"]} == {
        "kill": 1, "nan": 1, "shape": 1}
    assert r["restarts"] == 2
    assert r["bitwise"] == {"equal": True, "tensors": r["bitwise"]["tensors"], "steps": 12,
                            "different_tensors": [], "different_steps": []}
    assert r["bitwise"]["tensors"] > 0
    assert r["steps_lost"] == sum(f["steps_lost"] for f in r["faults_detail"])
    assert "soak: OK" in proc.stdout


def _records(*rows: tuple[float, str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"time": t, "kind": kind, **fields} for t, kind, fields in rows]


@pytest.mark.parametrize(("kind", "records", "lines", "problem"), [
    ("nan", _records((0, "start", {"start_step": 0}),
                     (11, "step", {"step": 5, "loss": 4.0, "skipped": False})),
     [], "not skipped"),
    ("nan", _records((0, "start", {"start_step": 0}), (12, "start", {"start_step": 4})),
     [], "did not finish in the same attempt"),
    ("kill", _records((0, "start", {"start_step": 0}), (5, "checkpoint", {"step": 4})),
     [], "no restart"),
    ("kill", _records((0, "start", {"start_step": 0}), (5, "checkpoint", {"step": 4}),
                      (15, "start", {"start_step": 0})),
     [(11, "pipetrain train: [rank 0] CommError: peer closed")], "newest checkpoint 4"),
    ("hang", _records((0, "start", {"start_step": 0}), (30, "start", {"start_step": 0})),
     [(25, "pipetrain train: [rank 0] CommError: timed out")], "bound 8.0 s"),
    ("raise", _records((0, "start", {"start_step": 0}), (15, "start", {"start_step": 0})),
     [(11, "pipetrain train: restart 1 of 3")], "no failure line"),
    ("shape", _records((0, "start", {"start_step": 0}), (15, "start", {"start_step": 0})),
     [(11, "pipetrain train: [rank 0] ValueError: bad")], "names rank, stage"),
], ids=["nan-not-skipped", "nan-restarted", "no-restart", "old-checkpoint", "slow-hang",
        "silent", "shape-unnamed"])
def test_checks_report_a_fault_not_survived(kind: str, records: list[dict[str, Any]],
                                            lines: list[tuple[float, str]],
                                            problem: str) -> None:
    soak = _soak()
    outcome = soak.Outcome(faults.Fault(kind, 0, 5), fired=10.0)
    soak.check_fault(outcome, soak.Job(Path("."), 0, 1.0, lines), records, 5.0)
    assert not outcome.survived
    assert any(problem in p for p in outcome.problems), outcome.problems


def test_checks_pass_a_clean_recovery() -> None:
    soak = _soak()
    records = _records((0, "start", {"start_step": 0}), (5, "checkpoint", {"step": 4}),
                       (15, "start", {"start_step": 4}))
    line = "pipetrain train: StageError: [rank 1 | stage 1 | mb 0 | 1F0] step 3 failed: shape"
    outcome = soak.Outcome(faults.Fault("shape", 0, 5), fired=10.0)
    soak.check_fault(outcome, soak.Job(Path("."), 0, 1.0, [(10.5, line)]), records, 5.0)
    assert outcome.problems == [] and outcome.survived
    assert (outcome.resumed_at, outcome.steps_lost, outcome.recovery_s) == (4, 1, 5.0)
    assert outcome.first_failure_s == 0.5
