"""Fault injection: parsing, once-per-job markers, NaN and shape instructions, raise; kill/hang
in a child; the wrong-shape hook on a local pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.train.launch import faults

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


def test_parse_and_reject() -> None:
    assert faults.parse("kill@rank1:step7, nan@rank0:step3,shape@rank2:step4") == [
        faults.Fault("kill", 1, 7), faults.Fault("nan", 0, 3), faults.Fault("shape", 2, 4)]
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


def test_shape_fires_once_per_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.ENV, "shape@rank0:step2,nan@rank0:step3")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    assert [faults.at_step(s, 0) for s in range(5)] == [None, None, "shape", "nan", None]
    assert faults.at_step(2, 0) is None


def test_raise_names_rank_and_step(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(faults.ENV, "raise@rank0:step2")
    monkeypatch.setenv(faults.DIR_ENV, str(tmp_path))
    with pytest.raises(faults.InjectedFault, match=r"\[rank 0\] injected exception at step 2"):
        faults.at_step(2, 0)
    assert faults.at_step(2, 0) is None


@pytest.mark.parametrize("kind", ["kill", pytest.param("hang", marks=pytest.mark.long)])
def test_kill_and_hang_in_a_child(tmp_path: Path, kind: str) -> None:
    code = "from pipetrain.train.launch import faults; faults.at_step(1, 0); print('survived')"
    env = {faults.ENV: f"{kind}@rank0:step1", faults.DIR_ENV: str(tmp_path)}
    marker = tmp_path / f"{kind}@rank0:step1"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**_base_env(), **env},
                            stdout=subprocess.PIPE, text=True)
    try:  # wait for the fault to fire (the child's imports take seconds on a busy machine)
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        if kind == "kill":
            out, _ = proc.communicate(timeout=60)
            assert (proc.returncode, out) == (-9, "")
        else:
            time.sleep(0.5)  # at_step has not returned: no "survived", still running
            assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert marker.exists()
    rerun = subprocess.run([sys.executable, "-c", code], env={**_base_env(), **env},
                           capture_output=True, text=True, timeout=120, check=True)
    assert rerun.stdout.strip() == "survived"  # the marker keeps it from firing twice


def test_random_plan_is_seeded_and_draws_every_kind() -> None:
    plan = faults.random_plan(3, 50, 4, 12)
    assert plan == faults.random_plan(3, 50, 4, 12) != faults.random_plan(4, 50, 4, 12)
    parsed = faults.parse(plan)
    assert len({f.step for f in parsed}) == 12
    assert all(0 <= f.rank < 4 and 1 <= f.step < 50 for f in parsed)
    counts = {k: [f.kind for f in parsed].count(k) for k in faults.KINDS}
    assert sorted(counts.values()) == [2, 2, 2, 3, 3], counts
    only = faults.parse(faults.random_plan(0, 9, 2, 4, kinds=("kill", "nan")))
    assert sorted(f.kind for f in only) == ["kill", "kill", "nan", "nan"]
    with pytest.raises(ValueError, match="distinct steps"):
        faults.random_plan(0, 3, 2, 3)
    with pytest.raises(ValueError, match="fault kinds must be some of"):
        faults.random_plan(0, 9, 2, 3, kinds=("boom",))


def _mlp_pipe(ranks: int) -> pt.Pipeline:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    return pt.Pipeline(model, "1f1b", microbatches=2, loss_fn=nn.MSELoss(), local_ranks=ranks)


@pytest.mark.parametrize(("ranks", "stage", "error"), [
    (2, 0, r"\[rank 1 \| stage 1 \| mb 0 \| 1F0\] step 1 failed: .*cannot be multiplied"),
    (1, 0, r"\[rank 0 \| stage 0 \| mb 0 \| 0F0\] step 1 failed: .*3 rows along dim 0 .* 4"),
], ids=["next-stage-fails", "last-stage-rows"])
def test_wrong_shape_fails_where_it_is_read(ranks: int, stage: int, error: str) -> None:
    pipe = _mlp_pipe(ranks)
    assert faults.shape_target(pipe) == stage
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with faults.wrong_shape(pipe, False):  # disabled: an ordinary step
        assert pipe.step(x, y).loss is not None
    with pytest.raises(pt.PipelineError, match=error), faults.wrong_shape(pipe):
        pipe.step(x, y)
    assert all(not layer._forward_hooks for st in pipe.stages.values() for layer in st.module)


def test_shape_target_prefers_a_stage_sending_to_another_rank() -> None:
    torch.manual_seed(0)
    pipe = pt.Pipeline(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), "zbv",
                       microbatches=2, loss_fn=nn.MSELoss(), local_ranks=2)
    assert pipe.schedule.placement == (0, 1, 1, 0)
    assert faults.shape_target(pipe) == 0  # held: 0..3; stage 0 sends to rank 1


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
