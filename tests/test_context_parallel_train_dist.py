"""``pipetrain train --cp``: the command trains what ``--cp 1`` trains, says how it is laid out,
holds less per rank, resumes across cp degrees, and refuses what it cannot slice (exit 2).

The float64 equivalence of every model and schedule is ``tests/test_context_parallel_dist.py``;
here the whole command runs in float32, so step losses agree within 1e-4 (rounding, amplified
by Adam over the steps). CI runs the GPT preset's and the refusals; the long tier the stored
Llama's (and its resume across cp), packed chats, LoRA, a mixture of experts under --ep, and
FSDP and TP beside cp."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers.chat import conversations, save_model, write_jsonl
from helpers.hf import python_text, save_dir
from helpers.runs import records, train
from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

COMMON = ["--steps", "4", "--eval-every", "0", "--eval-batches", "1", "--batch-size", "8",
          "--microbatches", "4", "--sample-tokens", "0", "--no-progress", "--warmup", "1",
          "--seq-len", "32"]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in records(out, "step")]


def _close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


def test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_memory_a_rank(tmp_path: Path) -> None:
    one = train(["train", "--nproc", "2", "--pp", "2", *COMMON, "--sample-tokens", "6",
                 "--out", str(tmp_path / "one")], tmp_path / "one")
    two = train(["train", "--nproc", "4", "--pp", "2", "--cp", "2", *COMMON, "--sample-tokens",
                 "6", "--out", str(tmp_path / "two")], tmp_path / "two")
    assert _close(_losses(tmp_path / "one"), _losses(tmp_path / "two"))
    assert abs(one["eval_loss"] - two["eval_loss"]) < 1e-4
    assert one["sample"] == two["sample"]  # the whole window's logits, joined from the slices
    (start,) = records(tmp_path / "two", "start")
    assert start["layout"]["cp"] == 2 and start["layout"]["tokens_per_rank"] == 16
    assert start["degrees"]["cp"] == 2 and {r["cp"] for r in start["ranks"]} == {0, 1}
    assert max(two["peak_memory_bytes"]) < max(one["peak_memory_bytes"])


@pytest.mark.long  # beside test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_memory_a_rank
def test_cp_composes_with_fsdp_and_tp_through_the_command(tmp_path: Path) -> None:
    """8 ranks: pp 2 x fsdp 2 x cp 2 (FSDP2 over dp_shard_cp) trains as pp 2 x dp 2, and
    pp 2 x cp 2 x tp 2 as pp 2."""
    runs = {"dp": ["--nproc", "4", "--dp", "2"], "fsdp_cp": ["--nproc", "8", "--fsdp", "2",
                                                             "--cp", "2", "--dp", "1"],
            "one": ["--nproc", "2"], "cp_tp": ["--nproc", "8", "--cp", "2", "--tp", "2"]}
    for name, args in runs.items():
        train(["train", "--pp", "2", *args, *COMMON, "--out", str(tmp_path / name)],
              tmp_path / name)
    assert _close(_losses(tmp_path / "dp"), _losses(tmp_path / "fsdp_cp"))
    assert _close(_losses(tmp_path / "one"), _losses(tmp_path / "cp_tp"))
    (start,) = records(tmp_path / "fsdp_cp", "start")
    assert start["layout"]["fsdp"] == 2 and start["layout"]["cp"] == 2


@pytest.mark.long  # beside test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_memory_a_rank
def test_cp_2_with_ep_2_trains_a_mixture_of_experts_as_ep_2_alone(tmp_path: Path) -> None:
    """``benchmarks/moe.py --tiny``'s stored Mixtral (no router loss: its balance term is not
    additive over tokens): pp 2 x dp 2 x ep 2 x cp 2 on 8 ranks trains as pp 2 x dp 2 x ep 2,
    the experts' gradients summed over every cp rank holding them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "moe_bench", Path(__file__).parents[1] / "benchmarks" / "moe.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    size = bench.SIZES["tiny"]
    bench.save_model(tmp_path, size)
    base = bench.train_args(tmp_path, size, "pp2 x ep2")
    outs = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        argv = [*base, "--steps", "3", "--nproc", str(4 * cp), "--cp", str(cp),
                "--out", str(out)]
        train(argv, out)
        outs[cp] = out
    assert _close(_losses(outs[1]), _losses(outs[2]))
    norms = [[r["grad_norm"] for r in records(outs[cp], "step")] for cp in (1, 2)]
    assert _close(*norms)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cp")
    text = python_text()
    (root / "data.py").write_text(text)
    save_dir("llama", root / "llama", text)
    return root


def _hf(place: Path, out: Path, *args: str) -> dict[str, Any]:
    return train(["train", "--hf", str(place / "llama"), "--data", str(place / "data.py"),
                  "--token-cache", str(place / "tokens"), *COMMON, "--out", str(out), *args],
                 out)


@pytest.mark.long  # beside test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_memory_a_rank
def test_cp_2_trains_a_stored_llama_as_cp_1_and_resumes_across_cp(llama: Path,
                                                                  tmp_path: Path) -> None:
    """Four steps at cp 2 and cp 1 agree; a checkpoint of step 2 at cp 2 resumes at cp 1 and
    goes on as the cp 2 run did, and one at cp 1 resumes at cp 2 likewise."""
    runs = {cp: tmp_path / f"cp{cp}" for cp in (1, 2)}
    for cp, out in runs.items():
        _hf(llama, out, "--nproc", str(2 * cp), "--pp", "2", "--cp", str(cp),
            "--checkpoint-every", "2")
    assert _close(_losses(runs[1]), _losses(runs[2]))
    for saved, resumed in ((2, 1), (1, 2)):
        out = tmp_path / f"from{saved}"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(runs[saved] / "checkpoints" / "step_000002",
                        out / "checkpoints" / "step_000002")
        _hf(llama, out, "--nproc", str(2 * resumed), "--pp", "2", "--cp", str(resumed),
            "--checkpoint-every", "2")
        assert _close(_losses(out), _losses(runs[saved])[2:], 2e-6), (saved, resumed)


@pytest.mark.long  # beside test_cp_2_trains_a_stored_llama_as_cp_1_and_resumes_across_cp
def test_cp_2_trains_lora_adapters_as_cp_1(llama: Path, tmp_path: Path) -> None:
    """LoRA's adapters (per-token linear layers beside the frozen ones) at cp 2 as at cp 1."""
    pytest.importorskip("peft")
    for cp in (1, 2):
        _hf(llama, tmp_path / f"cp{cp}", "--nproc", str(2 * cp), "--pp", "2", "--cp", str(cp),
            "--lora-r", "4")
    assert _close(_losses(tmp_path / "cp1"), _losses(tmp_path / "cp2"))
    assert (tmp_path / "cp2" / "adapter" / "adapter_config.json").is_file()


@pytest.mark.long  # beside test_context_parallel_dist.py's packed documents (IN_CI)
def test_cp_2_trains_packed_chats_as_cp_1(tmp_path: Path) -> None:
    """Packed examples (positions restarting inside a slice and across slices) at cp 2 and
    under ZB-V against cp 1: each example attends to itself only on every rank."""
    pytest.importorskip("datasets")
    saved = save_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(40)])
    common = ["train", "--hf", str(saved), "--data", str(data), "--chat", "--pack",
              "--pp", "2", "--schedule", "zbv", "--steps", "2", "--seq-len", "96",
              "--batch-size", "4", "--microbatches", "2", "--eval-every", "0",
              "--sample-tokens", "0", "--no-progress", "--token-cache", str(tmp_path / "t")]
    for cp in (1, 2):
        train([*common, "--nproc", str(2 * cp), "--cp", str(cp), "--out",
               str(tmp_path / f"cp{cp}")], tmp_path / f"cp{cp}")
    assert _close(_losses(tmp_path / "cp1"), _losses(tmp_path / "cp2"))


@pytest.mark.parametrize(("args", "said"), [
    (["--nproc", "4", "--pp", "1", "--cp", "4", "--seq-len", "30"],
     "--seq-len 30 does not divide; use a multiple of 4"),
    (["--nproc", "8", "--pp", "1", "--cp", "8"], "preset's 4 heads do not divide"),
    (["--nproc", "4", "--pp", "2", "--cp", "3"], "the world has 4 ranks"),
    (["--cp", "0"], "--cp must be at least 1"),
], ids=["seq-len", "heads", "world", "zero"])
def test_bad_cp_exits_2_naming_the_fix(args: list[str], said: str,
                                       capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *args, "--steps", "1", "--out", ""]) == 2
    assert said in capfd.readouterr().err


def test_a_model_cp_cannot_slice_is_refused_before_any_process(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """ALiBi (Bloom), attention that bypasses transformers' interface, and heads that do not
    spread: exit 2 from the launcher, naming the kind and what to do."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    bloom = tmp_path / "bloom"
    tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64).save_pretrained(bloom)
    assert main(["train", "--hf", str(bloom), "--nproc", "4", "--pp", "2", "--cp", "2",
                 "--out", ""]) == 2
    assert "ALiBi" in capfd.readouterr().err
    odd = tmp_path / "odd"
    tf.LlamaConfig(num_hidden_layers=2, hidden_size=48, num_attention_heads=6,
                   num_key_value_heads=3, vocab_size=64).save_pretrained(odd)
    assert main(["train", "--hf", str(odd), "--nproc", "8", "--pp", "2", "--cp", "4",
                 "--out", ""]) == 2
    assert "6 heads (per tensor-parallel rank) do not divide by cp=4" in capfd.readouterr().err


def test_the_sliced_attention_check_refuses_what_bypasses_it() -> None:
    """A model whose attention does not call transformers' interface (Bloom's own), and one
    whose layers all do (Llama, Mistral with a window, Gemma 2 with capped logits)."""
    import transformers as tf

    from pipetrain.hf.sequence_attention import check_model

    tf.logging.set_verbosity_error()
    with pytest.raises(ValueError, match="without transformers' attention interface"):
        check_model(tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64), "b")
    for config in (tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=64, vocab_size=64),
                   tf.MistralConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64,
                                    vocab_size=64, sliding_window=4),
                   tf.Gemma2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, head_dim=8,
                                   vocab_size=64)):
        check_model(config, type(config).__name__)


def test_an_image_text_model_is_refused_under_cp() -> None:
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.sources.image_text_source import image_text_problems

    found = image_text_problems(TrainConfig(cp=2), True)
    assert any("--cp is not supported for image-text models yet" in p for p in found)


def test_the_start_line_says_cp_and_tokens_a_rank() -> None:
    from pipetrain.train.logs.report import describe_layout

    line = describe_layout({"world": 4, "dp": 1, "cp": 2, "tokens_per_rank": 16, "pp": 2})
    assert line == "4 ranks (dp 1 x cp 2, 16 tokens of each sequence per rank x pp 2)"


def test_cp_refuses_only_what_cannot_slice() -> None:
    """--compile, pipedream-2bw, --ft and --verify compose with --cp (the long tier's tests
    below); the option checks refuse a --seq-len that does not slice, and nothing else."""
    from pipetrain.train.checks import _cp_problems
    from pipetrain.train.config import TrainConfig

    assert _cp_problems(TrainConfig(cp=2, compile=True, schedule="pipedream-2bw", ft=True,
                                    verify=True)) == []
    (slice_problem,) = _cp_problems(TrainConfig(cp=4, seq_len=24, tp=4))
    assert "each slice of 6 tokens must divide by tp" in slice_problem


@pytest.mark.long  # beside test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_memory_a_rank
@pytest.mark.parametrize("flags", [["--schedule", "pipedream-2bw"], ["--compile"]],
                         ids=["pipedream-2bw", "compile"])
def test_cp_2_trains_as_cp_1_under_pipedream_2bw_and_compile(flags: list[str],
                                                             tmp_path: Path) -> None:
    """The exchanges are operators of the model (no hook on its weights), so the asynchronous
    schedule's weight versions and torch.compile's graphs hold them as any other."""
    for name, args in (("one", ["--nproc", "2"]), ("two", ["--nproc", "4", "--cp", "2"])):
        train(["train", "--pp", "2", *args, *flags, *COMMON, "--out", str(tmp_path / name)],
              tmp_path / name)
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert one[0] is None if flags[0] == "--schedule" else one[0] is not None
    assert _close([x for x in one if x is not None], [x for x in two if x is not None])


@pytest.mark.long  # 12 processes; beside test_cp_2_trains_the_gpt_preset_as_cp_1_with_less_...
def test_cp_2_replicas_under_ft_train_as_dp_2(tmp_path: Path) -> None:
    """--ft with 2 replicas of pp 2 x cp 2 (8 processes) trains as pp 2 x dp 2 without
    torchft: each replica averages over its cp ranks, then torchft over the replicas."""
    train(["train", "--nproc", "4", "--pp", "2", "--dp", "2", *COMMON, "--out",
           str(tmp_path / "dp")], tmp_path / "dp")
    assert main(["train", "--nproc", "8", "--pp", "2", "--dp", "2", "--cp", "2", "--ft",
                 *COMMON, "--out", str(tmp_path / "ft")]) == 0
    want = _losses(tmp_path / "dp")
    for replica in (0, 1):
        out = tmp_path / "ft" / f"replica-{replica}"
        assert _close(_losses(out), want)
        (end,) = records(out, "end")
        assert end["replicas_bitwise_equal"]
        (start,) = records(out, "start")
        assert start["layout"]["cp"] == 2


@pytest.mark.long  # beside test_cp_2_trains_a_stored_llama_as_cp_1_and_resumes_across_cp
def test_verify_checks_the_pipeline_then_cp_trains(llama: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--verify under --cp checks the run's pipeline on whole sequences (the sliced
    attention has its own check, run first), then trains."""
    _hf(llama, tmp_path / "out", "--nproc", "4", "--pp", "2", "--cp", "2", "--verify")
    assert "PASS: the loss and all" in capsys.readouterr().out
    (start,) = records(tmp_path / "out", "start")
    assert start["layout"]["cp"] == 2 and len(_losses(tmp_path / "out")) == 4
