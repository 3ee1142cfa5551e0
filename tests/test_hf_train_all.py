"""`pipetrain train --hf` with every feature at once: dp 2 x pp 2, bf16, recomputation, a skipped
NaN step, a killed rank and its restart, checkpoints and ``OUT/hf`` every 2 steps, a resume under
torchrun at another layout, and ``pipetrain export-hf`` of the last checkpoint, equal to
``OUT/hf``. A file of its own (about 40 s), so that it runs beside tests/test_hf_train_dist.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pipetrain.cli import main
from test_hf_train_dist import _hf_model, _records, _train, place

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")
__all__ = ["place"]  # the fixture, shared with tests/test_hf_train_dist.py


# in CI: each feature alone: test_examples_train_dist.py, test_train_torchrun.py
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_every_feature_at_once_then_a_torchrun_resume_at_another_layout(place: Path) -> None:
    first = _train(place, "llama", "all", "--nproc", "4", "--dp", "2", "--schedule", "zbv",
                   "--batch-size", "16", "--steps", "4", "--precision", "bf16",
                   "--recompute", "always", "--checkpoint-every", "2", "--save-hf-every", "2",
                   "--eval-every", "2", "--max-restarts", "1", "--grad-clip", "1.0",
                   faults="nan@rank0:step1,kill@rank1:step3")
    out = place / "all"
    assert first["steps"] == 4 and first["skipped"] == 1, first
    assert first["layout"]["dp"] == 2 and first["layout"]["precision"] == "bf16"
    starts = _records(out, "start")
    assert [s["start_step"] for s in starts] == [0, 2], starts  # killed at 3, resumed at 2
    assert [r["step"] for r in _records(out, "hf")][-2:] == [2, 4]
    assert all(f in first["files"] for f in ("loss.png", "timeline.png"))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--standalone", "-m", "pipetrain"]
    second = _train(place, "llama", "all", "--pp", "2", "--schedule", "1f1b",
                    "--batch-size", "16", "--steps", "6", "--precision", "bf16",
                    "--sample-tokens", "6", launcher=torchrun)
    assert second["steps"] == 6 and second["layout"]["pp"] == 2
    assert _records(out, "start")[-1]["start_step"] == 4
    assert second["sample"] is not None and second["sample"].startswith("def ")
    exported = place / "exported"
    assert main(["export-hf", str(out / "checkpoints"), str(exported),
                 "--shard-size", "40KB"]) == 0
    assert len(list(exported.glob("model-*.safetensors"))) > 1
    a, b = _hf_model(exported).state_dict(), _hf_model(out / "hf").state_dict()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
