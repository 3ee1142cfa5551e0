"""`pipetrain plan`: the JSON report, the TOML that `train --config` reads, the picture, errors,
and a plan of a local Hugging Face checkpoint (``--hf``) cut where ``train --hf`` cuts it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.plan.planner import MARGIN
from pipetrain.train.commands.train_command import load_toml

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

FEW = "1f1b,zb-h1,zbv"


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", FEW, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_profile_only_plan_writes_a_config_train_runs(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _plan(tmp_path, capsys, "--memory-limit", "64MiB", "--no-calibrate")
    best = report["best"]
    assert code == 0 and best["fits"] and max(best["predicted_peak_bytes"]) <= 64 * 2**20
    assert set(best) >= {"schedule", "stages_per_rank", "microbatches", "balance", "recompute",
                         "predicted_step_s", "predicted_peak_bytes"}
    assert len(best["predicted_peak_bytes"]) == 2 and best["schedule"] in FEW.split(",")
    assert report["candidates"][0] == best and len(report["candidates"]) > 10
    steps = [c["predicted_step_s"] for c in report["candidates"] if c["fits"]]
    # fastest first, except that a near tie (within MARGIN) may bring one with fewer actions
    # to the front: the rest stay in order
    assert steps[1:] == sorted(steps[1:]) and steps[0] <= min(steps) * (1 + MARGIN)
    toml = load_toml(Path(report["config"]))
    assert toml["schedule"] == best["schedule"] and toml["microbatches"] == best["microbatches"]
    assert toml["balance"] == ",".join(map(str, best["balance"]))
    assert toml["recompute"] == best["recompute"]
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"


def test_a_searched_schedule_is_written_out_and_trained_as_planned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.schedules.schedule import Schedule
    from pipetrain.train.checks import run_schedule
    from pipetrain.train.config import TrainConfig

    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", "zb-auto", "--memory-limit", "64MiB", "--no-calibrate",
                 "--json"])
    best = json.loads(capsys.readouterr().out)["best"]
    toml = load_toml(tmp_path / "plan.toml")
    assert code == 0 and toml["schedule"] == str(tmp_path / "plan.schedule.csv")
    planned = Schedule.from_text(best["schedule_text"])
    assert run_schedule(TrainConfig(**toml), 2).actions == planned.actions


def test_a_limit_nothing_fits_exits_3_and_says_how(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", "1f1b", "--memory-limit", "1MiB", "--no-calibrate"])
    captured = capsys.readouterr()
    assert code == 3 and "no layout fits" in captured.err and "NO" in captured.out


@pytest.mark.parametrize(("argv", "match"), [
    (["--memory-limit", "lots"], "--memory-limit 'lots': give a size"),
    (["--memory-limit", "1GiB", "--schedules", "1f1b,fast"], "unknown \\['fast'\\]"),
    (["--memory-limit", "1GiB", "--nproc", "3", "--dp", "2"], "dp=2 does not divide"),
])
def test_bad_flags_exit_2(argv: list[str], match: str, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--out", str(tmp_path), *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


def test_memory_limit_defaults_to_the_device(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from pipetrain.cli import build_parser
    from pipetrain.plan import limit

    assert build_parser().parse_args(["plan"]).memory_limit is None  # no longer required
    assert limit.memory_limit("16GiB", "auto", 4) == (16 * 2**30, None)  # given: as it is
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:         1048576 kB\n"
                       "MemAvailable:    8388608 kB\n")
    monkeypatch.setattr(limit, "MEMINFO", meminfo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cpu", "auto"):  # on CPU the ranks share the RAM available
        assert limit.memory_limit(None, device, 4) == (
            2 * 2**30, f"--memory-limit not given: 2.0 GiB, the available RAM (8.0 GiB, "
                       f"MemAvailable, {meminfo}) / 4 local ranks")
    meminfo.unlink()  # no /proc/meminfo: the free pages
    ram, source = limit.available_ram() or (0, "")
    assert ram > 0 and source == "free pages, sysconf"
    # a GPU each: the GPU's total memory (not a rank's share of the RAM)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 80 * 2**30, "name": "H100"}))
    assert limit.memory_limit(None, "auto", 4) == (
        80 * 2**30, "--memory-limit not given: 80.0 GiB, the total memory of GPU 0 (H100), "
                    "one GPU per rank")
    assert limit.memory_limit(None, "cpu", 4)[0] == ram // 4
    with pytest.raises(ValueError, match="found 4 GPUs on this node but 8 local ranks"):
        limit.memory_limit(None, "auto", 8)


@pytest.mark.long  # beside test_plan_module.py::test_a_hugging_face_llama_from_a_tiny_config_...
def test_plan_of_a_hugging_face_llama_cuts_its_decoder_layers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from helpers.hf import python_text, save_dir
    from pipetrain.hf.model import open_model, split_points

    text = python_text(2)
    (tmp_path / "data.py").write_text(text)
    llama = save_dir("llama", tmp_path / "llama", text, layers=6)
    code = main(["plan", "--hf", str(llama), "--seq-len", "32", "--batch-size", "8",
                 "--nproc", "2", "--out", str(tmp_path / "plan"), "--schedules", FEW,
                 "--memory-limit", "1GiB", "--no-calibrate", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["best"]["fits"]
    units = len(split_points(open_model(llama).model, 2)) + 1
    assert units == 6 and all(sum(c["balance"]) == units for c in report["candidates"])
    assert {c["stages_per_rank"] for c in report["candidates"]} == {1, 2}  # 6 layers: zbv too
    toml = load_toml(Path(report["config"]))
    assert toml["hf"] == str(llama) and toml["seq_len"] == 32
    # stored weights: train --config plan.toml chooses the fine-tuning optimiser settings
    assert not {"lr", "min_lr", "warmup", "weight_decay"} & set(toml)
    # the profile saw the layers' sizes: the last stage holds the head, the first the table
    assert all(b > 0 for c in report["candidates"] for b in c["predicted_peak_bytes"])
    # 4 processes at pp 2: Llama's own tensor-parallel plan is searched too
    code = main(["plan", "--hf", str(llama), "--seq-len", "32", "--batch-size", "8",
                 "--nproc", "4", "--pp", "2", "--out", str(tmp_path / "plan4"), "--schedules",
                 "1f1b", "--memory-limit", "1GiB", "--no-calibrate", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and {(c["dp"], c["fsdp"], c["tp"]) for c in report["candidates"]} == {
        (2, 1, 1), (1, 2, 1), (1, 1, 2)}


def test_plan_of_a_missing_checkpoint_exits_2(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hf", str(tmp_path), "--memory-limit", "1GiB", "--no-calibrate",
                 "--out", str(tmp_path / "plan")]) == 2
    assert "no config.json there" in capsys.readouterr().err


def _layouts(report: dict) -> set[tuple]:
    return {(c["pp"], c["dp"], c["fsdp"], c["tp"], c["fsdp_reshard"] if c["fsdp"] > 1 else "")
            for c in report["candidates"]}


def test_four_processes_search_pp_dp_fsdp_and_tp(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.train.checks import check_config
    from pipetrain.train.config import TrainConfig

    args = ("--nproc", "4", "--memory-limit", "64MiB", "--no-calibrate")
    code, report = _plan(tmp_path, capsys, *args)
    assert code == 0 and _layouts(report) == {
        (4, 1, 1, 1, ""), (2, 2, 1, 1, ""), (2, 1, 1, 2, ""),
        *((2, 1, 2, 1, when) for when in ("step", "layer", "part"))}
    # a V under FSDP too: the tiny GPT's embedding and tied head both on rank 0
    assert [c for c in report["candidates"] if c["fsdp"] > 1 and c["schedule"] == "zbv"]
    code, report = _plan(tmp_path / "fsdp", capsys, *args, "--fsdp", "2",
                         "--fsdp-reshard", "layer")
    assert code == 0 and _layouts(report) == {(2, 1, 2, 1, "layer")}
    toml = load_toml(Path(report["config"]))
    assert (toml["pp"], toml["dp"], toml["fsdp"], toml["tp"], toml["fsdp_reshard"]) == \
        (2, 1, 2, 1, "layer")
    check_config(TrainConfig(**toml), 4)  # train --config takes it as it is


@pytest.mark.parametrize(("argv", "match"), [
    (["--nproc", "4", "--tp", "3"], "world has 4 ranks"),
    (["--nproc", "4", "--tp", "4"], "tp=4 must divide|no layout of 4 processes"),
])
def test_layout_flags_no_layout_satisfies_exit_2(argv: list[str], match: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--preset", "tiny", "--out", str(tmp_path), "--memory-limit", "1GiB",
                 "--no-calibrate", *argv]) == 2
    assert re.search(match, capsys.readouterr().err)


@pytest.mark.long  # beside test_a_calibration_term_is_fitted_to_the_measured_steps
def test_calibrated_plan_of_sharded_layouts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    code, report = _plan(tmp_path / "plan", capsys, "--memory-limit", "64MiB", "--nproc", "4",
                         "--pp", "2", "--schedules", "1f1b,zb-h1")
    assert list(cwd.iterdir()) == []  # the calibration runs write no files (out="")
    scale = report["scale"]
    assert code == 0 and all(scale[op] > 0 for op in "fiwb") and scale["overhead"] >= 0
    assert report["best"]["fits"] and scale["overhead_bytes"] > 0
    # tp's and FSDP's collectives were timed and their cost around them fitted
    assert set(report["collectives"]) == {f"{k}/2" for k in ("all_reduce", "all_gather",
                                                             "reduce_scatter")}
    assert scale["tp_talk"] != 1.0 and scale["fsdp_talk"] != 1.0
    assert {c["tp"] for c in report["candidates"]} == {1, 2}


@pytest.mark.parametrize(("field", "truths", "policy", "fsdp"), [
    ("replay", (0.4, 1.0, 1.7), "always", 1),  # what recomputation adds to a backward
    ("gap", (0.0005, 0.002, 0.01), "never", 1),  # the runtime's seconds per action
    ("fsdp_talk", (0.5, 2.0, 6.0), "never", 2),  # FSDP2's cost around its all-gathers
])
def test_a_calibration_term_is_fitted_to_the_measured_steps(field: str, truths: tuple[float, ...],
                                                            policy: str, fsdp: int) -> None:
    from pipetrain.plan.measured import _fitted
    from pipetrain.plan.planner import Scale, evaluate
    from pipetrain.plan.shardcost import Sharding
    from pipetrain.schedules import make_schedule
    from test_planner import _profile

    prof, sharding = _profile(2), Sharding(fsdp=fsdp, reshard="layer")
    schedules = [make_schedule("1f1b", 2, 4), make_schedule("zb-h1", 2, 4)]
    for truth in truths:
        truly = Scale(cores=1.5, **{field: truth})
        runs = [{"timelines": [evaluate(prof, s, [3, 3], policy, 0.0, truly, sharding)
                               .simulation.timeline],
                 "schedule": s, "balance": [3, 3], "recompute": policy} for s in schedules]
        assert _fitted(field, runs, prof, Scale(cores=1.5), 8.0, sharding) == pytest.approx(
            truth, rel=1e-4)
    assert _fitted(field, runs, prof, Scale(cores=1.5), truths[0] / 2,
                   sharding) == truths[0] / 2  # capped


def test_pipedream_2bw_only_when_allowed(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Never chosen silently: without --allow-async it is not a candidate, and naming it
    says what to pass; with it, it is one, predicted at its steady state with a second weight
    version (more bytes than 1F1B at the same balance)."""
    assert main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", "1f1b,pipedream-2bw", "--memory-limit", "1GiB",
                 "--no-calibrate"]) == 2
    assert "pass --allow-async" in capsys.readouterr().err
    code, report = _plan(tmp_path, capsys, "--memory-limit", "1GiB", "--no-calibrate")
    assert "pipedream-2bw" not in {c["schedule"] for c in report["candidates"]}
    code = main(["plan", "--preset", "tiny", "--nproc", "2", "--out", str(tmp_path),
                 "--schedules", "1f1b,pipedream-2bw", "--allow-async", "--memory-limit",
                 "1GiB", "--no-calibrate", "--json"])
    found = json.loads(capsys.readouterr().out)["candidates"]
    assert code == 0
    by = {(c["schedule"], c["microbatches"], tuple(c["balance"]), c["recompute"]): c
          for c in found}
    pairs = [(c, by.get(("1f1b", *k[1:]))) for k, c in by.items() if k[0] == "pipedream-2bw"]
    assert pairs and all(o is not None for _, o in pairs)
    for two, one in pairs:  # no flush: never slower; level where stage 0 is the bottleneck
        assert two["predicted_step_s"] <= one["predicted_step_s"]  # (1F1B hides its flush
        # there: tests/test_generators_pipedream.py), faster elsewhere
        assert two["predicted_peak_bytes"][0] > one["predicted_peak_bytes"][0]  # two versions
    assert any(two["predicted_step_s"] < one["predicted_step_s"] for two, one in pairs)
