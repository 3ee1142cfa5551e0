"""Fault injection: parsing, once-per-job markers, NaN instruction, raise; kill/hang in a child."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.train import faults


def test_parse_and_reject() -> None:
    assert faults.parse("kill@rank1:step7, nan@rank0:step3,") == [
        faults.Fault("kill", 1, 7), faults.Fault("nan", 0, 3)]
    with pytest.raises(ValueError, match="KIND@rankR:stepS"):
        faults.parse("explode@rank0:step1")
    with pytest.raises(ValueError, match="'kill@1:7'"):
        faults.parse("kill@1:7")


def test_no_env_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.ENV, raising=False)
    assert all(faults.at_step(s, r) is None for s in range(5) for r in range(3))


def test_nan_fires_once_per_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.ENV, "nan@rank1:step3")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path / "markers"))
    assert faults.at_step(3, 0) is None and faults.at_step(2, 1) is None
    assert faults.at_step(3, 1) == "nan"
    assert faults.at_step(3, 1) is None  # a restarted job replays step 3 without the fault
    assert (tmp_path / "markers" / "nan@rank1:step3").exists()


def test_raise_names_rank_and_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.ENV, "raise@rank0:step2")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    with pytest.raises(faults.InjectedFault, match=r"\[rank 0\] injected exception at step 2"):
        faults.at_step(2, 0)
    assert faults.at_step(2, 0) is None


@pytest.mark.parametrize(("kind", "returncode"), [("kill", -9), ("hang", None)])
def test_kill_and_hang_in_a_child(tmp_path: Path, kind: str, returncode: int | None) -> None:
    code = "from pipetrain.train import faults; faults.at_step(1, 0); print('survived')"
    env = {faults.ENV: f"{kind}@rank0:step1", faults.DIR_ENV: str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env={**_base_env(), **env},
                            stdout=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=3)
        assert (proc.returncode, out) == (returncode, "")
    except subprocess.TimeoutExpired:
        assert returncode is None  # hang: still running after the timeout
        proc.kill()
        proc.communicate()
    rerun = subprocess.run([sys.executable, "-c", code], env={**_base_env(), **env},
                           capture_output=True, text=True, timeout=30, check=True)
    assert rerun.stdout.strip() == "survived"  # the marker keeps it from firing twice


def test_random_plan_is_seeded() -> None:
    plan = faults.random_plan(3, 50, 4, 5)
    assert plan == faults.random_plan(3, 50, 4, 5)
    parsed = faults.parse(plan)
    assert len({f.step for f in parsed}) == 5
    assert all(0 <= f.rank < 4 and 1 <= f.step < 50 for f in parsed)
    with pytest.raises(ValueError, match="distinct steps"):
        faults.random_plan(0, 3, 2, 3)


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
