"""LoRA through the pipeline (:mod:`pipetrain.hf.lora`): peft's adapters on a Hugging Face Llama
give one process's loss and gradients under every schedule (float64, 1e-9); ``pipetrain train
--lora-r`` trains only them, under data parallelism as on one process, writes
peft's ``adapter`` that ``PeftModel.from_pretrained`` loads, merges under ``--merge``, keeps
no base weight in its checkpoints, and resumes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain as pt
from helpers.chat import save_model
from helpers.hf import llama, lm_loss
from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

peft = pytest.importorskip("peft")


def _adapted(targets: list[str] | None = None) -> Any:
    torch.manual_seed(0)
    model = peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8,
                                                          target_modules=targets))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: no gradient would reach A
            torch.nn.init.normal_(p, std=0.05)
    return model


IN_CI = ("1f1b", "interleaved-1f1b", "zbv")
"""The schedules CI runs LoRA under (its time, CONTRIBUTING.md: tests): one stage a rank,
interleaved, and ZB-V (split backward, a V); GPipe, ZB-H1 and DualPipeV in the long tier."""


@pytest.mark.parametrize("schedule", [
    s if s in IN_CI else pytest.param(s, marks=pytest.mark.long)
    for s in ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")])
def test_every_schedule_gives_peft_models_gradients(schedule: str) -> None:
    model = _adapted(["q_proj", "v_proj", "down_proj"])
    inner = model.get_base_model()  # the model peft changed in place: what a run cuts
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    result = pt.verify(inner, {"input_ids": ids}, targets=ids, loss_fn=lm_loss,
                       schedule=schedule, ranks=2, microbatches=4)
    assert result.passed, result.table()
    trained = {n for n, p in inner.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)  # the base is frozen
    assert len(trained) == 3 * 4 * 2  # 3 modules x 4 layers x (A, B)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("lora") / "base")


def _train(base: Path, out: Path, *extra: str) -> None:
    assert main(["train", "--hf", str(base), "--lora-r", "4", "--lora-targets",
                 "q_proj,v_proj", "--seq-len", "32", "--batch-size", "8", "--microbatches",
                 "2", "--lr", "1e-2", "--warmup", "0", "--eval-every", "0",
                 "--sample-tokens", "0", "--no-progress", "--out", str(out), *extra]) == 0


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


# in CI: LoRA's gradients under every schedule: test_every_schedule_gives_peft_models_gradients
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_a_run_writes_peft_adapter_merges_checkpoints_only_it_and_resumes(
        base: Path, tmp_path: Path) -> None:
    """Two data-parallel replicas train the adapter one process trains (float32, within
    1e-5; 2 pipeline ranks x 2 FSDP shards are test_sharded_dist's, in float64); peft loads
    it, ``--merge`` gives its logits, the checkpoint holds no base weight, a run resumes."""
    import transformers as tf
    from torch.distributed.checkpoint import FileSystemReader

    out, alone = tmp_path / "run", tmp_path / "alone"
    _train(base, out, "--nproc", "2", "--pp", "1", "--dp", "2", "--steps", "2",
           "--checkpoint-every", "2", "--merge")
    _train(base, alone, "--nproc", "1", "--steps", "2")
    stored = _adapter(out)
    for key, value in _adapter(alone).items():
        assert torch.allclose(stored[key], value, rtol=1e-5, atol=1e-6), key
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["r"] == 4
    model = tf.AutoModelForCausalLM.from_pretrained(base)
    adapted = peft.PeftModel.from_pretrained(model, str(out / "adapter"))
    assert len(stored) == 4 * 2 * 2 and all(
        torch.equal(p, stored[n.replace(".default", "")])
        for n, p in adapted.named_parameters() if ".lora_" in n)
    assert any(bool(t.abs().sum()) for n, t in stored.items() if "lora_B" in n)  # trained
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        merged = tf.AutoModelForCausalLM.from_pretrained(out / "hf")(input_ids=ids).logits
    assert torch.allclose(merged, want, atol=1e-5)  # --merge: the adapter merged in
    names = FileSystemReader(str(out / "checkpoints" / "step_000002")).read_metadata()
    held = list(names.state_dict_metadata)
    assert any("lora_A" in n for n in held) and not any("base_layer" in n for n in held)
    _train(base, out, "--nproc", "2", "--pp", "1", "--dp", "2", "--steps", "3")  # resumes
    starts = [r for r in map(json.loads, (out / "log.jsonl").read_text().splitlines())
              if r["kind"] == "start"]
    assert starts[-1]["start_step"] == 2


def test_bad_lora_flags_say_how_to_fix_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--lora-r", "4"]) == 2
    assert "--lora-r adapts a Hugging Face model: give --hf" in capsys.readouterr().err
    assert main(["train", "--merge"]) == 2
    assert "--merge merges a LoRA adapter: give --lora-r too" in capsys.readouterr().err
