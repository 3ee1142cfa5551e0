"""Benchmarks still run: each script once at its tiny size (timings are not checked)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long tier (CONTRIBUTING.md: tests): the
# scripts print figures; the library they time is tested in CI on its own

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, timeout: int = 240) -> str:
    """Run ``benchmarks/<script>.py`` with ``args``; its stdout (fails with its stderr)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _here(script: str, *args: str, monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``benchmarks/<script>.py``'s ``main(args)`` in this process (its ranks start from
    the session's forkserver, which imports the script by name through ``sys.path``); its
    stdout."""
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.chdir(ROOT)
    with torch_threads():
        assert importlib.import_module(script).main(list(args)) in (0, None)
    return capsys.readouterr().out


def test_asynchronous_tiny_prints_a_table_and_writes_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "asynchronous.json"
    stdout = _here("asynchronous", "--tiny", "--json", str(out), monkeypatch=monkeypatch,
                   capsys=capsys)
    assert "of bound" in stdout and "pipedream-2bw" in stdout
    rows = {row["schedule"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1f1b", "zbv", "pipedream-2bw", "pipedream"}
    for row in rows.values():
        assert 0 < row["bound_s"] and 0 < row["measured_s"]
    # the simulator's bounds: 2BW's steady period below ZB-V's and 1F1B's makespans
    assert rows["pipedream-2bw"]["bound_s"] < rows["zbv"]["bound_s"] < rows["1f1b"]["bound_s"]


def test_calibrated_tiny_prints_a_table_and_writes_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "calibrated.json"
    stdout = _here("calibrated", "--tiny", "--json", str(out), monkeypatch=monkeypatch,
                   capsys=capsys)
    assert "schedule" in stdout and "pt eff" in stdout
    data = json.loads(out.read_text())
    assert {"meta", "rows"} <= data.keys()
    assert {"torch", "cpus", "platform"} <= data["meta"]["machine"].keys()
    names = {row["schedule"] for row in data["rows"]}
    assert {"gpipe", "1f1b", "zbv", "dualpipev", "zb-h1", "zb-h2"} <= names
    for row in data["rows"]:
        assert {"p", "m", "F_ms", "I_ms", "W_ms", "ideal_s", "pipetrain", "torch"} <= row.keys()
        ours = row["pipetrain"]
        assert {"measured_s", "predicted_s", "efficiency", "misplaced_sleeps",
                "busiest_op_extra_s"} <= ours.keys()
        assert 0 < ours["busiest_op_extra_s"] < ours["measured_s"]
        assert ours["measured_s"] > 0 and ours["predicted_s"] >= row["ideal_s"] * 0.999
        # every sleep ran inside the op it belongs to: the split backward really splits
        assert ours["misplaced_sleeps"] == 0
        if row["schedule"] in ("zb-h1", "zb-h2"):
            assert row["torch"] is None
        else:
            assert row["torch"]["misplaced_sleeps"] == 0


def test_split_backward_tiny_prints_the_ratio_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "split.json"
    stdout = _run("split_backward", "--d-model", "32", "--heads", "4", "--seq", "16", "--batch",
                  "2", "--warmup", "1", "--repeats", "3", "--json", str(out), timeout=120)
    assert "(I+W)/B = " in stdout and "I - I0 = " in stdout
    data = json.loads(out.read_text())
    assert set(data["median_s"]) == {"F", "B", "I", "W", "I0"}
    assert all(v > 0 for v in data["median_s"].values()) and data["ratio_iw_over_b"] > 0


def test_breakdown_tiny_times_every_piece_and_writes_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "breakdown.json"
    stdout = _here("breakdown", "--tiny", "--json", str(out), monkeypatch=monkeypatch,
                   capsys=capsys)
    assert "P2P.send" in stdout and "main thread cpu" in stdout
    data = json.loads(out.read_text())
    for name, wanted in (("1f1b", {"Stage.backward"}), ("zbv", {"Stage.weight", "_Graph"})):
        ranks = data["schedules"][name]
        assert len(ranks) == 2
        for res in ranks:
            pieces = res["pieces"]
            assert {"Executor.run", "Stage.forward", "P2P.send", "encode", "post",
                    "P2P.recv"} | wanted <= pieces.keys()
            # one post per message here: every tiny payload fits behind its header
            assert pieces["post"]["calls_per_step"] == pieces["P2P.send"]["calls_per_step"] > 0
            assert pieces["Stage.forward"]["wall_ms_per_step"] < pieces["Executor.run"][
                "wall_ms_per_step"]


def test_cold_tiny_times_every_piece_in_every_condition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cold.json"
    stdout = _here("cold", "--tiny", "--json", str(out), monkeypatch=monkeypatch, capsys=capsys)
    assert "sleep/warm" in stdout
    pieces = json.loads(out.read_text())["pieces"]
    assert {"encode 64 B", "encode 512 KiB", "new_frame", "read_header+decode",
            "torch detach"} == set(pieces)
    for by in pieces.values():
        assert set(by) == {"warm", "busy", "sleep", "evict"} and all(v > 0 for v in by.values())


def test_capture_tiny_times_capture_and_compares_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch.export")
    out = tmp_path / "capture.json"
    stdout = _here("capture", "--tiny", "--json", str(out), monkeypatch=monkeypatch,
                   capsys=capsys)
    assert "capture s" in stdout and "captured/list" in stdout
    data = json.loads(out.read_text())
    sizes = data["capture"]["sizes"]
    assert [s["preset"] for s in sizes] == ["tiny", "small"]
    assert all(s["capture_s"] > 0 and s["nodes"] > 0 for s in sizes)
    for shared in (data["shared"], data["shared_fixed"]):  # symbolic, and at fixed shapes:
        # rank 0's program travels without weights, and loads the same graph
        assert shared["same_graph"] and shared["payload_kib"] < shared["weights_kib"]
        assert shared["export_s"] > 0 and shared["load_s"] > 0
    step = data["step"]
    assert step["losses_equal"] and step["grad_rel_diff_step0"] == 0.0  # same model, same math
    assert step["median_list_s"] > 0 and step["median_captured_s"] > 0


def test_watchdog_cost_tiny_times_both_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "watchdog.json"
    stdout = _here("watchdog_cost", "--tiny", "--json", str(out), monkeypatch=monkeypatch,
                   capsys=capsys)
    assert "on/off" in stdout
    data = json.loads(out.read_text())
    for layout in ("pp4", "dp2xpp2"):
        row = data["layouts"][layout]
        assert row["on_ms"] > 0 and row["off_ms"] > 0
        assert len(row["rounds_on_ms"]) == len(row["rounds_off_ms"]) == 1


@contextlib.contextmanager
def torch_threads() -> Iterator[None]:
    """Give back torch's thread count as it was (a benchmark may set its own)."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _module(script: str) -> Any:
    """``benchmarks/<script>.py`` as a module (its runs then launch from this session)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{script}",
                                                  ROOT / "benchmarks" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parallel_memory_tiny_prints_each_layout_against_dp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "parallel.json"
    bench = _module("parallel_memory")
    bench.IN_PROCESS = True
    bench.main(["--tiny", "--steps", "2", "--json", str(out)])
    assert "vs dp2" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == ["dp2", "tp2 sp"]
    assert rows[0]["vs_dp2"] == [1.0, 1.0]
    for row in rows:  # the figures, not their relation: on tiny the activations dominate
        assert len(row["peak_mib"]) == 2 and row["step_s"] > 0 and row["ranks"] == 4, row
        assert row["vs_dp2"] == [p / b for p, b in zip(row["peak_mib"], rows[0]["peak_mib"])]


def test_long_context_tiny_prints_cp_against_cp_1(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "long.json"
    _module("long_context").main(["--tiny", "--steps", "2", "--json", str(out)])
    assert "longest sequence under" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [(r["cp"], r["seq_len"]) for r in rows] == [(1, 128), (2, 128), (1, 256), (2, 256)]
    assert all(r["peak_mib"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_peers_tiny_puts_each_installed_peer_beside_pipetrain() -> None:
    for peer in ("deepspeed", "torchgpipe"):  # the bench extra; CI runs without it
        pytest.importorskip(peer, reason=f"{peer} is not installed (pip install -e '.[bench]')")
    out = _run("peers", "--tiny", "--steps", "2")
    rows = [line.split() for line in out.splitlines() if line.startswith("p2 m8")]
    libraries = {" ".join(r[2:-3]) for r in rows}
    assert libraries == {"pipetrain 1f1b", "DeepSpeed 1F1B", "pipetrain gpipe",
                         "pipetrain gpipe local", "torchgpipe (never)",
                         "torchgpipe (except_last)"}, out
    assert all(float(r[-3]) >= float(r[-2]) * 0.95 for r in rows), out  # not under the bound
    gpt = _run("peers", "--gpt", "--tiny", "--steps", "2")  # real compute, tiny GPT
    rows = [(line[8:33].strip(), line[33:].split()) for line in gpt.splitlines()
            if line.startswith("p2 m8")]
    assert [name for name, _ in rows] == [
        "pipetrain 1f1b", "DeepSpeed 1F1B", "pipetrain gpipe local", "pipetrain local recompute",
        "torchgpipe (never)", "torchgpipe (except_last)", "pipetrain gpipe"], gpt
    assert all(float(r[1].replace(",", "")) > 0 and float(r[3]) > 0 for _, r in rows), gpt
    peaks = {name: r[3:] for name, r in rows}  # one per process: "a / b" on two
    assert len(peaks["pipetrain gpipe"]) == 3 and len(peaks["torchgpipe (never)"]) == 1, gpt


def test_overhead_reads_each_threads_cpu_time() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from overhead import _by_thread
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    before = _by_thread()
    sum(i * i for i in range(200_000))  # some CPU on this (the main) thread
    after = _by_thread()
    assert after["main"][0] > before["main"][0] and after["main"][1] >= before["main"][1]


def test_overhead_tiny_prints_each_librarys_cost_per_action(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    out = _here("overhead", "--tiny", monkeypatch=monkeypatch, capsys=capsys)
    rows = {line.split()[2]: line.split() for line in out.splitlines()
            if line.startswith(" 2   8")}
    assert {"pipetrain", "torch"} <= set(rows), out  # DeepSpeed too, when installed
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows.values()), out
    assert rows["pipetrain"][5] == "1.00x"


def test_overhead_runs_reports_each_run_the_median_ratio_and_how_often_pipetrain_was_lower(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import overhead
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    figures = iter([(100e-6, 120e-6), (300e-6, 250e-6), (110e-6, 100e-6), (280e-6, 300e-6),
                    (90e-6, 100e-6), (270e-6, 300e-6)])  # (pipetrain, torch): p 2, p 4, ...

    def launch(_body: object, p: int, *_args: object, **_kw: object) -> list[object]:
        ours, theirs = next(figures)  # the larger rank holds these; the other less
        return [[{"pipetrain": (ours, 0.0), "torch": (theirs, 0.0)}],
                [{"pipetrain": (ours / 2, 0.0), "torch": (theirs / 2, 0.0)}]]

    monkeypatch.setattr(overhead.pt, "launch", launch)
    lines = overhead.repeated((2, 4), 16, 3, runs=3)
    p2, p4 = lines[1].split(), lines[2].split()
    assert p2[:8] == ["2", "16", "100", "110", "90", "120", "100", "100"]
    assert p2[8:] == ["0.90x", "2/3"]  # ratios 0.83, 1.10, 0.90
    assert p4[2:5] == ["300", "280", "270"] and p4[8:] == ["0.93x", "2/3"]  # 1.2, .93, .9


def test_gpu_kernels_quick_on_cpu_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "kernels.json"
    _run("gpu_kernels", "--device", "cpu", "--quick", "--out", str(out), timeout=120)
    data = json.loads(out.read_text())
    assert {"schema", "header", "gemm", "gemm_fp8", "attention", "memory", "notes"} <= set(data)
    assert {r["layout"] for r in data["gemm"]} == {"nt", "nn", "tn"}
    assert data["attention"] and data["memory"] and all(r["gbps"] > 0 for r in data["memory"])


def test_vlm_tiny_prints_each_layout_and_writes_json(tmp_path: Path) -> None:
    out = _run("vlm", "--procs", "2", "--steps", "2", "--rows", "4", "--microbatches", "2",
               "--seq-len", "32", "--hidden", "32", "--layers", "2", "--json",
               str(tmp_path / "vlm.json"))
    assert "units per stage" in out and "tokens/s" in out
    results = json.loads((tmp_path / "vlm.json").read_text())["results"]
    assert [(r["procs"], r["balance_mode"]) for r in results] == [(2, "params"), (2, "time")]
    assert all(len(r["balance"]) == 2 and r["tokens_per_s"] > 0 for r in results)
