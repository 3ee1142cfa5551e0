"""``pipetrain plan --cluster``: each cost term against a hand computation, the search's ranking,
the command's contract (JSON keys, pins, exit codes) and published runs recomputed
(:mod:`pipetrain.plan.cluster.job` and its parts). Milliseconds each, but the command's runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipetrain.plan.cluster.arch import Arch
from pipetrain.plan.cluster.collectives import Fabric, Link
from pipetrain.plan.cluster.hardware import gpu, load_toml
from pipetrain.plan.cluster.job import Job, Layout, predict, with_microbatches
from pipetrain.plan.cluster.kernels import Kernels
from pipetrain.plan.cluster.layer_cost import Shard, kept_bytes, layer_cost
from pipetrain.plan.cluster.published import rows
from pipetrain.plan.cluster.search import Pins, check_layout, search

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

GPT = Arch(layers=24, hidden=2048, heads=16, kv_heads=16, ffn=8192, vocab=51200, gated=False)
LLAMA = Arch.from_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                          "num_attention_heads": 32, "num_key_value_heads": 8,
                          "intermediate_size": 14336, "vocab_size": 128256,
                          "hidden_act": "silu"})


def test_a_gemm_at_a_measured_shape_takes_the_measured_rate() -> None:
    kernels = Kernels.of(gpu("H200"))
    row = next(r for r in kernels.table["gemm"]
               if (r["m"], r["n"], r["k"], r["layout"]) == (4096, 4096, 4096, "nt"))
    want = 2 * 4096**3 / (row["tflops"] * 1e12)
    assert kernels.gemm(4096, 4096, 4096) == pytest.approx(want, rel=1e-6)
    # another GPU keeps the shape's efficiency, scaled to its own best matmul
    a100 = Kernels.of(gpu("A100-80GB"))
    best = max(r["tflops"] for r in kernels.table["gemm"]) * 1e12
    assert a100.gemm(4096, 4096, 4096) == pytest.approx(want * best / 267.9e12, rel=1e-6)


def test_a_ring_all_reduce_inside_a_node_and_across() -> None:
    a100 = gpu("A100-80GB")
    fabric = Fabric.of(a100)
    size = 1 << 30
    inside = fabric.group(8, 1)  # tp 8: one node, at nccl-tests' 208 GB/s of NVLink's 300
    assert inside is fabric.nvlink
    ring = 2 * 7 / 8 * size / (300e9 * 0.69) + 2 * 7 * 5e-6
    assert inside.all_reduce(size, 8) == pytest.approx(ring)
    nic = 25e9 * 0.96  # one HDR NIC per GPU, at 96 % of its line rate
    across = fabric.group(4, 8)  # 4 replicas 8 ranks apart: 4 nodes, one NIC each
    assert across.all_reduce(size, 4) == pytest.approx(2 * 3 / 4 * size / nic + 6 * 15e-6)
    # 32 replicas side by side (tp 1): 8 in each node, whose 8 NICs carry 8 rings at once
    wide = fabric.group(32, 1)
    assert wide.bandwidth == pytest.approx(min(8 * nic, 300e9 * 0.69))
    assert fabric.group(16, 2).bandwidth == pytest.approx(4 * nic)  # 4 of each node's NICs
    # a small message: the tree's log2(n) latency steps beat the ring's n - 1
    small = Link(100e9, 1e-5)
    assert small.all_reduce(8, 64) == pytest.approx(2 * 8 / 100e9 + 2 * 6 * 1e-5)


def test_a_pipeline_hop_is_latency_plus_bytes_over_the_link() -> None:
    fabric = Fabric.of(gpu("H100-SXM"))
    nic, nvlink = 50e9 * 0.96, 450e9 * 0.82  # what NCCL reaches of the line rates
    assert fabric.hop(8).send(1e6) == pytest.approx(1e6 / nic + 15e-6)  # next node: NIC
    assert fabric.hop(2).send(1e6) == pytest.approx(1e6 / nvlink + 5e-6)  # same node
    assert fabric.hop(2).send(0) == 0.0


def test_attention_with_its_scores_in_memory_keeps_what_its_dropout_needs() -> None:
    link = Link(1e11, 1e-6)
    kernels = Kernels.of(gpu("A100-80GB"))
    kept = {}
    for dropout in (True, False):
        shard = Shard(1, 1, 1, link, link, link, flash=False, attention_dropout=dropout)
        kept[dropout] = layer_cost(GPT, kernels, 2, 2048, shard, "never").kept
    # softmax output (2 bytes), and with a dropout its mask (1) and output (2): 5 a s^2 b
    assert kept[True] - kept[False] == pytest.approx(3 * GPT.heads * 2048 * 2048 * 2)


def test_a_layers_activation_bytes_are_korthikantis() -> None:
    link = Link(1e11, 1e-6)
    tokens, h = 2048 * 2, GPT.hidden
    for t, sp, per_token in [(1, True, 34), (8, True, 34 / 8), (8, False, 10 + 24 / 8)]:
        shard = Shard(t, 1, 1, link, link, link, sequence_parallel=sp)
        assert kept_bytes(GPT, tokens, shard, "never") == pytest.approx(per_token * tokens * h)
    shard = Shard(8, 1, 1, link, link, link)
    assert kept_bytes(GPT, tokens, shard, "always") == pytest.approx(2 * tokens * h / 8)


def test_torchtitans_per_op_recomputation_keeps_every_other_multiply() -> None:
    """``op``: the layer's input, attention's output and the outputs of q, v, the gate and
    down (the first, third, ... multiply) kept; k, the output projection and up run again."""
    link = Link(1e11, 1e-6)
    shard = Shard(1, 1, 1, link, link, link)
    kept = (4096 + 4096 + 4096 + 1024 + 14336 + 4096) * 2  # bytes a token
    assert kept_bytes(LLAMA, 1000, shard, "op") == pytest.approx(1000 * kept)
    again = 4096 * 1024 + 4096 * 4096 + 4096 * 14336  # k, o, up: parameters a token uses
    assert LLAMA.hardware_flops(8192, "op") - LLAMA.model_flops(8192) == pytest.approx(
        2 * 32 * again)
    kernels = Kernels.of(gpu("H100"))
    plain, op = (layer_cost(LLAMA, kernels, 1, 8192, shard, r) for r in ("never", "op"))
    rerun = sum(kernels.gemm(8192, o, i) for i, o in [(4096, 1024), (4096, 4096),
                                                       (4096, 14336)])
    assert rerun < op.i - plain.i < rerun + plain.f - sum(
        kernels.gemm(8192, o, i) for i, o in LLAMA.projections())  # + the memory-bound work


def test_flops_are_palms_and_megatrons() -> None:
    s, h, l_, v = 2048, GPT.hidden, GPT.layers, GPT.vocab
    # Megatron-LM (Narayanan et al. 2021): 96 B s l h^2 (1 + s/6h + V/16lh) per step with
    # full recomputation, 72 B s l h^2 (1 + s/6h + V/12lh) without
    per_token = 96 * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))
    assert GPT.hardware_flops(s, "always") == pytest.approx(per_token, rel=1e-3)
    assert GPT.model_flops(s) == pytest.approx(72 * l_ * h * h * (1 + s / (6 * h)
                                                                    + v / (12 * l_ * h)),
                                               rel=1e-3)
    assert LLAMA.params() == pytest.approx(8.03e9, rel=0.01)  # Llama 3 8B


def test_a_moe_counts_its_active_experts() -> None:
    mixtral = Arch.from_config({"model_type": "mixtral", "hidden_size": 4096,
                                "num_hidden_layers": 32, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "intermediate_size": 14336,
                                "vocab_size": 32000, "num_local_experts": 8,
                                "num_experts_per_tok": 2})
    assert mixtral.params() == pytest.approx(46.7e9, rel=0.01)  # Mixtral 8x7B
    assert mixtral.active_params() == pytest.approx(12.9e9, rel=0.01)


def _job(gpus: int = 64, batch: int = 512, arch: Arch = GPT, limit: float = 0.0) -> Job:
    return Job(arch, gpu("H100"), gpus, 2048, batch, memory_limit=limit)


def test_the_search_ranks_fitting_layouts_fastest_first_and_honours_pins() -> None:
    found = search(_job(), Pins())
    fits = [p.fits for p in found]
    assert fits == sorted(fits, reverse=True)
    steps = [p.step_s for p in found if p.fits]
    assert steps == sorted(steps)
    pinned = search(_job(), Pins(tp=2, pp=4, schedule="zbv"))
    assert {(p.layout.tp, p.layout.pp, p.layout.schedule) for p in pinned} == {(2, 4, "zbv")}
    assert all(p.layout.gpus == 64 for p in found)
    # the best is at least as fast as any one layout it could have taken
    given = predict(_job(), with_microbatches(_job(), Layout(tp=2, pp=4, dp=8,
                                                             schedule="1f1b")))
    assert found[0].step_s <= given.step_s


def test_layouts_a_job_cannot_take_say_how_to_fix_them() -> None:
    job = _job()
    with pytest.raises(ValueError, match="not the 64 of --gpus"):
        check_layout(job, Layout(tp=2, pp=2, dp=2))
    with pytest.raises(ValueError, match="must divide the model's 16 attention heads"):
        check_layout(job, Layout(tp=32, dp=2))
    with pytest.raises(ValueError, match="exceeds the model's 24 layers"):
        check_layout(job, Layout(pp=32, dp=2))
    with pytest.raises(ValueError, match="divisible by 48"):
        check_layout(_job(gpus=48, batch=100), Layout(dp=48))


def _command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipetrain", "plan", *args],
                          capture_output=True, text=True, timeout=120)


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``pipetrain plan ARGS`` run in this process (``main``, as the console script runs it):
    its exit code and what it wrote to stderr."""
    from pipetrain.cli import main

    code = main(["plan", *args])
    return code, capsys.readouterr().err


def _llama_config(where: Path, hidden: int, layers: int, heads: int, ffn: int, *,
                  kv_heads: int = 8, vocab: int = 32000) -> Path:
    """A Llama's ``config.json`` of this shape, written under ``where``."""
    config = where / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": hidden,
                                  "num_hidden_layers": layers, "num_attention_heads": heads,
                                  "num_key_value_heads": kv_heads, "intermediate_size": ffn,
                                  "vocab_size": vocab, "hidden_act": "silu"}))
    return config


def test_the_command_prints_the_json_contract_and_its_exit_codes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON contract through a process of its own; the exit codes of bad input in this
    process (a process each costs seconds of imports)."""
    config = _llama_config(tmp_path, 2048, 16, 16, 5632)
    base = ("--cluster", "H100", "--gpus", "16", "--config-json", str(config), "--seq-len",
            "4096", "--global-batch", "64")
    done = _command(*base, "--pp", "2", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    best = report["best"]
    assert set(best["layout"]) == {"tp", "pp", "dp", "fsdp", "cp", "ep", "schedule",
                                   "stages_per_rank", "microbatches", "micro_batch_size",
                                   "recompute"}
    for key in ("step_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu",
                "hardware_tflops_per_gpu", "mfu", "peak_bytes_per_gpu", "fits"):
        assert key in best
    assert best["layout"]["pp"] == 2 and report["candidates"]
    assert 0 < best["mfu"] < 1 and best["fits"] is True
    code, err = _in_process(capsys, *base, "--tp", "3")
    assert code == 2 and "must divide the model's 16 attention heads" in err
    code, err = _in_process(capsys, "--cluster", "V100", "--gpus", "8", "--global-batch", "8",
                            "--seq-len", "128")
    assert code == 2 and "A100-80GB" in err
    code, err = _in_process(capsys, *base, "--memory-limit", "3GiB")
    assert code == 3 and "the closest needs" in err


def test_the_table_run_writes_a_timeline_and_a_config_train_accepts(tmp_path: Path) -> None:
    import dataclasses

    from pipetrain.train.checks import check_config
    from pipetrain.train.commands.train_command import load_toml
    from pipetrain.train.config import TrainConfig

    done = _command("--cluster", "H100", "--gpus", "16", "--preset", "1b", "--seq-len", "2048",
                    "--global-batch", "64", "--pp", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "plan.png").stat().st_size > 0
    cfg = dataclasses.replace(TrainConfig(), **load_toml(tmp_path / "plan.toml"))
    assert (cfg.nproc, cfg.pp, cfg.seq_len, cfg.batch_size) == (16, 2, 2048, 64)
    check_config(cfg, cfg.nproc)  # pipetrain train --config runs it as it is


def test_a_context_parallel_plan_writes_a_config_train_runs(tmp_path: Path) -> None:
    """A layout with cp (a long sequence) is no longer predicted only: its plan.toml holds
    the cp degree, and train --config accepts it as it is."""
    import dataclasses

    from pipetrain.train.checks import check_config
    from pipetrain.train.commands.train_command import load_toml
    from pipetrain.train.config import TrainConfig

    done = _command("--cluster", "H100", "--gpus", "16", "--preset", "1b", "--seq-len", "2048",
                    "--global-batch", "16", "--pp", "2", "--cp", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "no plan.toml" not in done.stdout
    cfg = dataclasses.replace(TrainConfig(), **load_toml(tmp_path / "plan.toml"))
    assert (cfg.nproc, cfg.pp, cfg.cp) == (16, 2, 2)
    check_config(cfg, cfg.nproc)


def test_the_table_reads_whole_at_80_columns_and_boxed_at_120(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.plan.cluster.cluster_command import _print
    from pipetrain.plan.cluster.job import Prediction

    wide = Layout(tp=8, pp=4, dp=2, fsdp=8, schedule="interleaved-1f1b", stages_per_rank=2,
                  microbatches=48, recompute="selective")
    shown = [Prediction(wide, 29.451, 417.0, 0.0, 0.0, 0.601, 66.3 * 2**30, True, {}),
             Prediction(Layout(pp=2, fsdp=256, schedule="zbv", stages_per_rank=2,
                               microbatches=8), 0.139, 58_862.0, 0.0, 0.0, 0.503,
                        9.4 * 2**30, False, {})]
    headers = ("layout", "schedule", "v", "m", "b", "recompute", "step", "s", "tokens/s", "per",
               "GPU", "MFU", "peak", "GiB", "fits")
    cells = ("tp8", "pp4", "dp2", "fsdp8", "interleaved-1f1b", "48", "selective", "29.451", "417",
             "0.601", "66.3", "yes", "pp2", "fsdp256", "zbv", "58,862", "9.4", "NO")
    for width in (80, 120):
        monkeypatch.setenv("COLUMNS", str(width))  # rich's width off a terminal
        _print(shown, _job(gpus=512, batch=1536))
        text = capsys.readouterr().out
        assert max(map(len, text.splitlines())) <= width, text
        assert "…" not in text and set(headers + cells) <= set(text.split()), text
        assert ("┃ layout" in text) == (width == 120), text  # boxed where it fits
        assert text.startswith("512 x H100-SXM, 1.4 B parameters, 2048 tokens x 1536 "), text


def test_a_hardware_file_describes_another_gpu(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('name = "mine"\nbf16_tflops = 500\nhbm_gb = 96\nhbm_gbps = 4000\n'
                    'nvlink_gbps = 450\nnic_gbps = 400\ngpus_per_node = 8\n')
    card = load_toml(path)
    assert (card.bf16_flops, card.nic_bw, card.hbm_bytes) == (500e12, 50e9, 96e9)
    assert (card.nvlink_efficiency, card.nic_efficiency) == (0.82, 0.96)  # nccl-tests'
    text = path.read_text()
    path.write_text('name = "mine"\n')
    with pytest.raises(ValueError, match="missing key"):
        load_toml(path)
    path.write_text(text + "nvlink_efficiency = 1.5\n")
    with pytest.raises(ValueError, match="at most 1"):
        load_toml(path)


@pytest.mark.parametrize("key", [
    "megatron-145b", "korthikanti-1t-full", "zb-6.2b-zb2p", "nemo-llama3.1-70b-64gpu",
    *(pytest.param(k, marks=pytest.mark.long)  # beside the four above
      for k in ("megatron-1.7b", "megatron-39b", "korthikanti-22b-selective",
                "korthikanti-530b-full", "nemo-nemotron4-340b-128gpu",
                "nemo-llama3.1-405b-576gpu", "nemo-llama3.1-8b-8gpu"))])
def test_published_runs_are_predicted_within_ten_percent(key: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from published import compare

    (row,) = rows([key])
    got = compare(row, with_search=False)
    assert math.isclose(got["ratio"], 1.0, abs_tol=0.10), got
    assert got["fits"], got


@pytest.mark.parametrize("key", ["zb-1.5b-1f1b", "zb-6.2b-1f1b", "zb-14.6b-1f1b",
                                 "zb-28.3b-1f1b"])
def test_published_peak_memory_is_predicted_within_ten_percent(key: str) -> None:
    """The Zero Bubble paper's measured peak memory of its 1F1B runs, against the memory model
    (attention's scores in memory without a dropout over them: see published.py's ZB rows)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from published import compare

    (row,) = rows([key])
    got = compare(row, with_search=False)
    assert math.isclose(got["peak_bytes"] / row.peak_memory, 1.0, abs_tol=0.10), got


def _table_rows() -> dict[str, list[str]]:
    """docs/planning.md's published-vs-predicted table: its cells by run."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "planning.md").read_text()
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and any(cells[0] == r.key for r in rows()):
            out[cells[0]] = cells
    return out


def test_every_documented_row_is_its_command_s_figure() -> None:
    """Each row of docs/planning.md's table, recomputed by the row's own ``pipetrain plan
    --cluster ... --json`` command (its ``--trainer`` included): the figure as printed (4
    significant digits), whether it fits and the recomputation it ran (searched where the
    source does not say)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from published import compare

    table = _table_rows()
    assert set(table) == {r.key for r in rows()}
    for row in rows():
        got = compare(row, with_search=False)
        cells = table[row.key]
        assert f"{got['predicted']:.4g}" == cells[3], (row.key, got["predicted"], cells)
        assert ("yes" if got["fits"] else "no") == cells[5], (row.key, cells)
        assert got["recompute"] == cells[7], (row.key, got["recompute"], cells)
        assert got["command"].startswith("pipetrain plan --cluster ") \
            and f"--trainer {row.trainer}" in got["command"]


def test_the_trainer_changes_the_figure_a_user_types(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron-LM's 145.6B run typed as published: 2021's Megatron-LM (no flash attention, no
    sequence parallelism, gradients reduced after the backward) gives the documented figure;
    today's trainers are faster on the same layout, and a flag overrides a preset's
    setting."""
    from pipetrain.cli import main

    (row,) = rows(["megatron-145b"])
    config = tmp_path / "gpt.json"
    config.write_text(json.dumps(row.config()))

    def hardware(*extra: str) -> tuple[float, dict[str, Any]]:
        argv = [a for a in row.command(str(config)) if a not in ("--trainer", row.trainer)]
        assert main([*argv, *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        return report["best"]["hardware_tflops_per_gpu"], report["trainer"]

    old, said = hardware("--trainer", "megatron-lm-2021")
    assert f"{old:.4g}" == _table_rows()["megatron-145b"][3]
    assert said == {"preset": "megatron-lm-2021", "flash_attention": False,
                    "attention_dropout": True, "sequence_parallel": False,
                    "distributed_optimizer": False, "overlap_grad_reduce": False,
                    "cp_exchange": "ring", "grad_bytes": 4, "state_bytes": 12}
    core, _ = hardware("--trainer", "megatron-core")
    assert core > old * 1.1
    flash_only, said = hardware("--trainer", "megatron-lm-2021", "--flash-attention")
    assert said["flash_attention"] is True and old < flash_only < core
    assert hardware()[1]["preset"] == "pipetrain"  # the default: what pipetrain train runs


def test_context_parallel_over_heads_costs_its_four_all_to_alls() -> None:
    """The all-to-all exchange (what pipetrain train runs) against a hand count: Q, K, V and
    the output of this GPU's tokens and tp rank's heads, each an all-to-all over cp, in F and
    again in I; the ring's K and V hide under attention instead."""
    fabric, kernels = Fabric.of(gpu("H100")), Kernels.of(gpu("H100"))
    link = fabric.group(4, 2)
    seq, tp, cp = 32768, 2, 4
    kwargs = {"tp_link": fabric.group(tp, 1), "ep_link": link}
    a2a = Shard(tp, cp, 1, cp_link=link, cp_exchange="all-to-all", **kwargs)
    ring = Shard(tp, cp, 1, cp_link=link, cp_exchange="ring", **kwargs)
    one = layer_cost(LLAMA, kernels, 1, seq, a2a, "never")
    other = layer_cost(LLAMA, kernels, 1, seq, ring, "never")
    tokens = seq / cp
    row = tokens * LLAMA.dim * 2  # a head's bytes
    kv = math.lcm(LLAMA.kv_heads // tp, cp)  # 4 key-value heads a tp rank: divide by 4
    want = sum(link.all_to_all(row * n, cp) for n in (16, kv, kv, 16))
    assert one.f - other.f == pytest.approx(want, rel=1e-9)
    assert one.i - other.i == pytest.approx(want, rel=1e-9)


def test_all_to_all_context_parallelism_needs_heads_that_divide(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Heads per tp rank that cp does not divide: refused with the fix under the default
    (all-to-all) exchange, accepted as a ring."""
    config = _llama_config(tmp_path, 1536, 8, 12, 4096, kv_heads=4)
    base = ("--cluster", "H100", "--gpus", "16", "--config-json", str(config), "--seq-len",
            "16384", "--global-batch", "16", "--cp", "8", "--json")
    code, err = _in_process(capsys, *base)
    assert code == 2 and "the 12 heads of each tp rank must divide by it" in err
    assert "--cp-exchange ring" in err
    code, _ = _in_process(capsys, *base, "--cp-exchange", "ring")
    assert code == 0
    code, _ = _in_process(capsys, *base, "--trainer", "megatron-core")
    assert code == 0


def test_fp8_says_its_speed_up_over_bf16_on_the_same_layout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--precision fp8's report carries the best layout's bf16 step and peak, which the bf16
    command pinned to that layout predicts too, and their ratio."""
    from pipetrain.cli import main

    config = _llama_config(tmp_path, 4096, 32, 32, 14336, vocab=128256)
    base = ["plan", "--cluster", "H100", "--gpus", "8", "--config-json", str(config),
            "--seq-len", "8192", "--global-batch", "32", "--fsdp", "8", "--json"]
    assert main([*base, "--precision", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    lay = fp8["best"]["layout"]
    assert main([*base, "--micro-batch-size", str(lay["micro_batch_size"]), "--recompute",
                 lay["recompute"], "--pp", "1"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert "bf16" not in bf16 and bf16["best"]["layout"] == lay
    assert fp8["bf16"]["step_s"] == pytest.approx(bf16["best"]["step_s"], rel=1e-9)
    assert fp8["bf16"]["peak_bytes_per_gpu"] == bf16["best"]["peak_bytes_per_gpu"]
    assert fp8["bf16"]["speedup"] == pytest.approx(
        bf16["best"]["step_s"] / fp8["best"]["step_s"], rel=1e-9)
    assert 1.0 < fp8["bf16"]["speedup"] < 2.0


def test_fp8_casts_each_operand_for_each_use_and_reduces_its_scale_over_tp() -> None:
    """fp8 as torchao runs it, against a hand count: 5 bytes an element for each cast (the
    maximum's read, the cast's read and write), X and W in F, dY and W in I, dY and X in W;
    one all-reduce of a maximum over tp per activation cast; the running layer's fp8 weights
    in memory."""
    from pipetrain.plan.cluster import fp8

    h200 = gpu("H200")
    kernels, fabric = Kernels.of(h200), Fabric.of(h200)
    m, n, k = 8192.0, 1536.0, 4096.0
    f, i, w = fp8.casts(kernels, [(m, n, k)])
    assert f == pytest.approx(kernels.memory(5 * (m * k + n * k)), rel=1e-12)
    assert i == pytest.approx(kernels.memory(5 * (m * n + n * k)), rel=1e-12)
    assert w == pytest.approx(kernels.memory(5 * (m * n + m * k)), rel=1e-12)
    link = fabric.group(4, 1)
    assert fp8.scale_reductions([(m, n, k)] * 4, 1, link) == (0.0, 0.0, 0.0)
    one = link.all_reduce(4.0, 4)
    assert fp8.scale_reductions([(m, n, k)] * 4, 4, link) == (4 * one, 4 * one, 8 * one)
    job = Job(LLAMA, h200, 8, 4096, 64)
    layout = with_microbatches(job, Layout(tp=4, fsdp=2, micro_batch_size=2))
    bf16 = predict(job, layout)
    quarter = predict(Job(LLAMA, h200, 8, 4096, 64, precision="fp8"), layout)
    layer_params = (4096 * (32 + 16) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) / 4
    assert quarter.peak_bytes_per_gpu - bf16.peak_bytes_per_gpu == pytest.approx(
        layer_params, rel=1e-3)
    assert quarter.step_s < bf16.step_s


def test_the_fewest_layers_recomputed_wholly_that_fit_are_chosen(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 3 405B at its published 8K layout (tp 8, pp 16, interleaved over 32 stages of 3
    or 4 layers) does not fit 80 GB without recomputation; unpinned, the command recomputes
    the fewest of each stage's layers wholly that fit (3), pinned it predicts any number, each
    a layer's kept bytes lighter per stage-activation alive and slower, and --recompute
    always costs the most time."""
    from pipetrain.cli import main

    (row,) = rows(["llama3-405b-8k-8192gpu"])
    config = tmp_path / "405b.json"
    config.write_text(json.dumps(row.config()))
    argv = row.command(str(config))
    assert "--recompute" not in argv  # Table 4 does not say: searched

    def best(*extra: str) -> dict[str, Any]:
        code = main([*argv, *extra])
        report = json.loads(capsys.readouterr().out)
        assert code == (0 if report["best"]["fits"] else 3)
        return report["best"]  # type: ignore[no-any-return]

    chosen = best()
    assert chosen["fits"] and chosen["layout"]["recompute"] == "never"
    assert chosen["layout"]["recompute_layers"] == 3
    assert "recompute_layers" not in best("--recompute", "always")["layout"]
    steps, peaks = [], []
    for k in range(4):
        got = best("--recompute", "never", "--recompute-layers", str(k))
        assert got["fits"] == (k == 3)
        steps.append(got["step_s"])
        peaks.append(got["peak_bytes_per_gpu"])
    assert steps == sorted(steps) and peaks == sorted(peaks, reverse=True)
    assert best("--recompute", "always")["step_s"] > steps[-1]
    # each layer recomputed sheds the same bytes on the rank holding the most
    assert peaks[0] - peaks[1] == pytest.approx(peaks[1] - peaks[2], rel=1e-9)
    assert main([*argv, "--recompute-layers", "2"]) == 2
    assert "give --recompute never, selective or op" in capsys.readouterr().err
    assert main([*argv, "--recompute", "never", "--recompute-layers", "4"]) == 2
    assert "must be 0 to 3" in capsys.readouterr().err


def test_cp_ranks_reduce_the_gradients_and_share_the_shards_of_the_states() -> None:
    """Context-parallel ranks hold the same weights and compute gradients on other tokens: the
    gradients are averaged over dp x fsdp x cp, FSDP shards over fsdp x cp (torchtitan's
    ``dp_shard_cp``) and a distributed optimizer over dp x fsdp x cp (Megatron-core's)."""
    h100 = gpu("H100-SXM")
    job = Job(LLAMA, h100, 8, 8192, 16, overlap_grad_reduce=False)

    def at(**degrees: Any) -> Any:
        return predict(job, with_microbatches(job, Layout(micro_batch_size=1, **degrees)))

    # no data parallelism, cp 2: the two cp ranks still all-reduce (or reduce-scatter) grads
    alone = at(tp=4, cp=2)
    assert alone.parts["grad_reduce"] > 0
    params = LLAMA.params() / 4  # tp 4; the embedding and the output projection on one rank
    sharded, whole = alone, predict(
        replace(job, distributed_optimizer=False),
        with_microbatches(job, Layout(tp=4, cp=2, micro_batch_size=1)))
    assert whole.peak_bytes_per_gpu - sharded.peak_bytes_per_gpu == pytest.approx(
        params * 12 / 2, rel=0.02)  # the states halved over the two cp ranks
    # FSDP over fsdp x cp: fsdp 2 x cp 2 shards weights, grads and states four ways
    fsdp = predict(replace(job, distributed_optimizer=False),
                   with_microbatches(job, Layout(fsdp=2, cp=2, tp=2, micro_batch_size=1)))
    unsharded = predict(replace(job, distributed_optimizer=False),
                        with_microbatches(job, Layout(dp=2, cp=2, tp=2, micro_batch_size=1)))
    state = LLAMA.params() / 2 * (2 + 4 + 12)
    assert unsharded.peak_bytes_per_gpu - fsdp.peak_bytes_per_gpu == pytest.approx(
        state * 3 / 4, rel=0.02)


def test_an_interleaved_rank_holds_one_vocabulary_matrix() -> None:
    """pp 4 with 1 or 2 stages a rank: the same layers on each rank, and one embedding (or
    output projection) whatever the stages per rank; without a pipeline, both."""
    job = Job(LLAMA, gpu("H100-SXM"), 4, 4096, 32)

    def state(**kw: Any) -> float:
        layout = with_microbatches(job, Layout(micro_batch_size=1, recompute="always", **kw))
        p = predict(job, layout)
        return p.peak_bytes_per_gpu
    one = state(pp=4, schedule="1f1b")
    two = state(pp=4, schedule="interleaved-1f1b", stages_per_rank=2)
    vocab = LLAMA.vocab * LLAMA.hidden * (2 + 4 + 12)
    assert abs(two - one) < vocab / 4  # activations differ a little; not a second matrix
    mono = Job(LLAMA, gpu("H100-SXM"), 1, 4096, 4)
    a = predict(mono, with_microbatches(mono, Layout(micro_batch_size=1, recompute="always")))
    assert a.peak_bytes_per_gpu > LLAMA.params() * (2 + 4 + 12)  # every weight, both ends


def test_gpus_hold_the_memory_the_device_reports() -> None:
    """The datasheets' '80 GB' is binary: the planner's limit is what nvidia-smi reports."""
    assert gpu("A100-80GB").hbm_bytes == 81920 * 2**20
    assert gpu("H100-SXM").hbm_bytes == 81559 * 2**20
    assert gpu("A100-40GB").hbm_bytes == 40960 * 2**20


def test_bf16_gradients_and_optimizer_states_are_flags_and_a_preset(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--grad-dtype and --optimizer-dtype change the memory by the bytes they save a
    parameter; NeMo's preset syncs its gradients in bf16; a wrong value exits 2."""
    from pipetrain.cli import main

    config = tmp_path / "llama.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 4096,
                                  "num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "intermediate_size": 14336,
                                  "vocab_size": 128256}))
    base = ["plan", "--cluster", "H100", "--gpus", "8", "--config-json", str(config),
            "--seq-len", "4096", "--global-batch", "32", "--tp", "1", "--pp", "1", "--dp", "8",
            "--micro-batch-size", "1", "--recompute", "always", "--trainer", "megatron-core",
            "--json"]

    def peak(*extra: str) -> tuple[float, dict[str, Any]]:
        assert main([*base, *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        return report["best"]["peak_bytes_per_gpu"], report["trainer"]

    fp32, said = peak()
    assert (said["grad_bytes"], said["state_bytes"]) == (4, 12)
    bf16_grads, said = peak("--grad-dtype", "bf16")
    assert said["grad_bytes"] == 2
    assert fp32 - bf16_grads == pytest.approx(LLAMA.params() * 2, rel=1e-6)
    bf16_states, _ = peak("--optimizer-dtype", "bf16")
    assert fp32 - bf16_states == pytest.approx(LLAMA.params() * 6 / 8, rel=1e-6)  # over dp 8
    nemo, said = peak("--trainer", "nemo")
    assert said["grad_bytes"] == 2 and nemo == bf16_grads
    assert main([*base, "--grad-dtype", "fp16"]) == 2
    assert "--grad-dtype" in capsys.readouterr().err
