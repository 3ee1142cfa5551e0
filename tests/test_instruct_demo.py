"""The instruction-tuning demo (benchmarks/instruct_demo.py) runs end to end at its tiny size."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long tier (CONTRIBUTING.md: tests): chat
# examples trained and answered in CI: test_examples_train_dist.py, test_generate_cli.py

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "instruct_demo.py"


@functools.cache
def _script() -> ModuleType:
    """The script as a module (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("instruct_demo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_run_answers_before_and_after_training(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The script's main in this process (its ranks start from the session's forkserver,
    which finds the script's module through sys.path)."""
    work = tmp_path / "demo"
    demo = _script()
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.chdir(ROOT)
    assert demo.main(["--tiny", "--out", str(work)]) == 0
    out = capsys.readouterr().out
    steps, n_test = demo.TINY.steps, demo.TINY.test_prompts
    # the training run went through pipetrain train and wrote OUT/hf, which was answered from
    assert re.search(r"^running: pipetrain train --hf .* --chat --nproc 2 --schedule zbv ", out,
                     re.MULTILINE)
    records = [json.loads(line) for line in (work / "run" / "log.jsonl").read_text().splitlines()]
    assert {"kind": "hf", "step": steps} in [{k: r.get(k) for k in ("kind", "step")}
                                            for r in records if r["kind"] == "hf"]
    assert (work / "run" / "hf" / "config.json").is_file()
    rows = [json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()]
    assert len(rows) == demo.TINY.train_examples
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant"]
    # the table: both accuracies over the held-out prompts, then one line per prompt shown
    for label in ("before training", f"after {steps} steps"):
        match = re.search(rf"^{label}\s+(\d+)/{n_test}\s+(\d+\.\d)%$", out, re.MULTILINE)
        assert match, f"no {label!r} line in:\n{out[-2000:]}"
        right, percent = int(match[1]), float(match[2])
        assert 0 <= right <= n_test and percent == pytest.approx(100 * right / n_test, abs=0.05)
    samples = re.findall(r'^(\d\d)\+(\d\d)=\s+(\d+)\s+".*"\s+"(.*)"\s+(right|wrong)$', out,
                         re.MULTILINE)
    assert len(samples) == min(8, n_test)
    for a, b, want, said, mark in samples:
        assert int(want) == int(a) + int(b)
        assert (mark == "right") == (said == want)
    assert re.search(r"^wall time: \d+ s$", out, re.MULTILINE)


def test_held_out_sums_are_not_trained_in_either_order() -> None:
    train, test = _script().make_task(0, 4000, 200)
    assert len(train) == 4000 and len(set(test)) == 200
    assert not set(train) & (set(test) | {(b, a) for a, b in test})
    assert all(10 <= x <= 99 for pair in train + test for x in pair)


def test_an_earlier_run_in_out_is_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(SystemExit) as stop:
        _script().main(["--out", str(tmp_path)])
    assert stop.value.code == 2
    assert "holds an earlier run" in capsys.readouterr().err
