"""Real-compute benchmarks still run: each script once at its tiny size (no timing checks)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from test_benchmarks import torch_threads

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """``benchmarks/<script>.py --tiny``'s ``main`` in this process (its ranks start from the
    session's forkserver, which imports the script by name through ``sys.path``): its stdout
    and its JSON."""
    out = tmp_path / f"{script}.json"
    text = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, torch_threads(), contextlib.redirect_stdout(text):
        mp.syspath_prepend(str(ROOT / "benchmarks"))
        mp.chdir(ROOT)
        assert importlib.import_module(script).main(["--tiny", "--json", str(out)]) in (0, None)
    data = json.loads(out.read_text())
    assert {"torch", "cpus", "platform"} <= data["meta"]["machine"].keys()
    return text.getvalue(), data


def test_real_compute_tiny(tmp_path: Path) -> None:
    stdout, data = _run("real_compute", tmp_path)
    assert "tokens/s" in stdout and "live MiB/rank" in stdout
    rows = data["rows"]
    assert [(r["schedule"], r["run"]) for r in rows] == [
        ("1f1b", "pipetrain"), ("1f1b", "torch"), ("zbv", "pipetrain"), ("zbv", "torch"),
        ("-", "one process")]
    losses = {r["loss"] for r in rows}
    # identical work: the same batch gives the same loss in all three runs, to rounding
    assert max(losses) - min(losses) < 1e-4, losses
    for r in rows:
        assert r["step_s"] > 0
        assert abs(r["tokens_per_s"] * r["step_s"] - data["meta"]["tokens_per_step"]) < 1e-3
        ranks = 1 if r["run"] == "one process" else 2
        assert len(r["live_peak_bytes"]) == len(r["step_rise_bytes"]) == ranks
        for live, rise in zip(r["live_peak_bytes"], r["step_rise_bytes"]):
            assert 0 < rise <= live  # activations appear during the step, on top of the weights
        if r["run"] != "one process":
            assert r["grad_diff"] < 1e-4  # both libraries computed the same gradients
            b = r["breakdown"]  # a rank's actions happen inside the step, one at a time
            assert 0 < b["busy_s"] <= b["span_s"] <= b["step_s"]
            assert set(b["op_ms"]) == ({"F", "B"} if r["schedule"] == "1f1b" else {"F", "I", "W"})
    # one process holds the whole model and its gradients: more than a rank holding half
    whole = rows[-1]["live_peak_bytes"][0]
    assert all(v < whole for r in rows[:-1] for v in r["live_peak_bytes"])


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    return _run("memory", tmp_path_factory.mktemp("memory"))


@pytest.mark.long  # beside test_real_compute_tiny
def test_memory_tiny(memory_run: tuple[str, dict[str, Any]]) -> None:
    stdout, data = memory_run
    assert "meas/pred" in stdout
    rows = data["rows"]
    assert {(r["schedule"], r["recompute"]) for r in rows} == {
        (s, c) for s in ("1f1b", "zb-h1", "zbv") for c in ("never", "always")}
    for r in rows:
        assert all(v > 0 for v in r["measured_bytes"] + r["predicted_bytes"])
        # the detailed model only adds to the simulator's rule
        assert all(d >= p for d, p in zip(r["detailed_bytes"], r["predicted_bytes"]))
        assert r["ratio"] == [m / p for m, p in zip(r["measured_bytes"], r["predicted_bytes"])]
    by = {(r["schedule"], r["recompute"]): r for r in rows}
    # 1F1B keeps p - rank micro-batches in flight: rank 0 holds more than rank 1
    assert by["1f1b", "never"]["sim_units"] == [2, 1]
    assert by["1f1b", "never"]["measured_bytes"][0] > by["1f1b", "never"]["measured_bytes"][1]
    # the gradients I keeps until W: only split-backward schedules, and most on a stage whose
    # I computes an input gradient (stage 1, not stage 0)
    assert by["1f1b", "never"]["sim_i_units"] == [2, 1]
    zb = by["zb-h1", "never"]
    assert zb["i_held"][1] > zb["i_held"][0] >= 0 and zb["sim_i_units"][1] > zb["sim_units"][1]


@pytest.mark.long  # beside test_real_compute_tiny
def test_memory_recompute_keeps_less(memory_run: tuple[str, dict[str, Any]]) -> None:
    by = {(r["schedule"], r["recompute"]): r for r in memory_run[1]["rows"]}
    # recomputation keeps less on the first rank, where micro-batches wait longest
    assert by["1f1b", "always"]["measured_bytes"][0] < by["1f1b", "never"]["measured_bytes"][0]
    # also under ZB-H1, where stage 0's W runs its whole backward: the replayed tensors go as
    # autograd uses them (before, they all stayed until the W ended: 1.6x the detailed rule)
    zb = by["zb-h1", "always"]
    assert zb["measured_bytes"][0] < by["zb-h1", "never"]["measured_bytes"][0]
    assert zb["measured_bytes"][0] < 1.3 * zb["detailed_bytes"][0]


def test_simulator_accuracy_tiny(tmp_path: Path) -> None:
    stdout, data = _run("simulator_accuracy", tmp_path)
    assert "calibrated" in stdout and "within 5% of measured: profiled" in stdout
    rows = data["rows"]
    assert [r["schedule"] for r in rows] == ["1f1b", "zb-h1", "zbv"]
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and r["replay_s"] > 0
        assert r["ratio"] == r["predicted_s"] / r["measured_s"]
        assert 0 < r["span_s"] <= r["measured_s"]  # actions run inside the step
        assert r["comm_s"] > 0
        split = r["schedule"] != "1f1b"
        assert set(r["op_ratio"]) == ({"F", "I", "W"} if split else {"F", "B"})
        for stage in r["costs"].values():
            assert all(stage[op] > 0 for op in ("F", "B", "W"))
        assert r["calibrated_s"] > 0
        assert r["calibrated_ratio"] == r["calibrated_s"] / r["measured_s"]
    # every schedule is predicted from the one calibration run, a separate one (DualPipeV,
    # stages of 2, 1, 1, 2 layers): a 2-stage split of 3 + 3 layers sums whole stages, and a
    # V-shaped split of the same layers takes the calibrated costs as they are
    calib = data["meta"]["calibration"]
    assert calib["schedule"] == "dualpipev" and calib["balance"] == [2, 1, 1, 2]
    assert calib["hops"] > 0 and calib["comm_s"] >= 0
    by = {r["schedule"]: r for r in rows}
    for op in "FBIW":
        c = calib["costs"][op]
        assert by["1f1b"]["calibrated_costs"][op] == pytest.approx([c[0] + c[1], c[2] + c[3]])
        assert by["zbv"]["calibrated_costs"][op] == pytest.approx(c)
