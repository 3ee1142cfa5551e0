"""``pt.verify`` and ``pipetrain verify``: one float64 pipelined step against one process.

It passes on a user's module (positional arguments, cut by tracing), a layer list and a tiny
Llama; it fails, naming the group and the stage, when one gradient of the pipeline is off
by a part in a million, when a parameter gets no gradient in the pipeline, and when the
model's layers share state that the schedule's order changes. The command passes on a saved
Llama config (shrunk), and ``train --verify`` checks before it starts any worker and does not
start them when the check fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.hf import llama, saved_config
from pipetrain.cli import main
from pipetrain.verify import Row, VerificationFailed, default_loss, group_of, verify_with

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


class Net(nn.Module):
    """A user's model: two positional arguments, a stack of residual blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh())
                                    for _ in range(4))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h) * scale


def _net() -> tuple[Net, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Net(), (torch.randn(8, 8), torch.rand(8, 3) + 1)


def test_a_user_module_passes_and_every_parameter_is_counted() -> None:
    model, inputs = _net()
    result = pt.verify(model, inputs, schedule="zbv", ranks=2, microbatches=4)
    assert result.passed, result.table()
    assert sum(r.tensors for r in result.rows) == len(list(model.parameters()))
    assert [r.name for r in result.rows][:3] == ["inp.weight", "inp.bias", "blocks.*.*.weight"]
    assert [r.stages[0] for r in result.stages] == [0, 1, 2, 3]
    assert result.loss_difference <= 1e-12 and "PASS" in result.table()
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched
    result.check()


def test_pipedream_2bw_passes_through_its_drain_and_pipedream_is_refused() -> None:
    """2BW's first step leaves no gradients; its drain leaves that step's, which equal one
    device's. PipeDream applies them inside the step, so there is nothing to compare."""
    model, inputs = _net()
    result = pt.verify(model, inputs, schedule="pipedream-2bw", ranks=2, microbatches=4)
    assert result.passed, result.table()
    with pytest.raises(ValueError, match="ReferenceStash"):
        pt.verify(model, inputs, schedule="pipedream", ranks=2, microbatches=4)


def test_a_layer_list_passes_under_1f1b() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(4)]
    result = pt.verify(layers, torch.randn(6, 8), schedule="1f1b", split_points=None,
                       loss_fn=lambda out, y: (out - y).pow(2).mean(), targets=torch.ones(6, 8))
    assert result.passed and result.balance == (2, 2), result.table()


@pytest.mark.long  # beside test_the_command_passes_on_a_shrunk_saved_llama
def test_a_hugging_face_llama_passes_on_its_own_loss() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(1))
    result = pt.verify(llama(), {"input_ids": ids, "labels": ids}, schedule="1f1b",
                       microbatches=2, split_points=["model.layers.2"])
    assert result.passed, result.table()
    assert "model.layers.*.self_attn.q_proj.weight" in [r.name for r in result.rows]
    assert 3.5 < result.reference_loss < 5  # .loss: cross-entropy over 64 tokens, not squares


def _build(scale: float, name: str = "blocks.2.0.weight", grad: bool = True) -> Any:
    """A pipeline of Net as verify builds it, with one parameter's gradient scaled by
    ``scale`` (or none at all) in the pipeline only."""
    def build(copied: nn.Module) -> pt.Pipeline:
        pipe = pt.Pipeline(copied, "zbv", 4, default_loss, local_ranks=2,
                           split_points="auto", example_inputs=inputs)
        p = dict(pipe.named_parameters())[name]
        p.register_hook(lambda g: g * scale)
        p.requires_grad_(grad)
        return pipe

    model, (x, s) = _net()
    inputs = {"x": x.double(), "scale": s.double()}
    return build, model, inputs


@pytest.mark.parametrize("scale", [1.0, 1 + 1e-6])
def test_a_gradient_off_by_a_part_in_a_million_fails_and_is_named(scale: float) -> None:
    build, model, inputs = _build(scale)
    result = verify_with(build, model, inputs)
    if scale == 1.0:  # the same pipeline without the error passes: the test can fail
        assert result.passed, result.table()
        return
    assert not result.passed
    assert [(r.name, r.worst) for r in result.failed] == [("blocks.*.*.weight",
                                                            "blocks.2.0.weight")]
    assert 5e-7 < result.failed[0].difference < 2e-6
    assert [r.passed for r in result.stages] == [True, True, False, True]  # block 2: stage 2
    assert "FAIL" in result.table()
    with pytest.raises(VerificationFailed, match=r"blocks\.\*\.\*\.weight .*blocks\.2\.0"):
        result.check()


def test_a_parameter_without_gradient_in_the_pipeline_fails() -> None:
    build, model, inputs = _build(1.0, "out.bias", grad=False)
    result = verify_with(build, model, inputs)
    assert [(r.name, r.note) for r in result.failed] == [("out.bias",
                                                           "no gradient in the pipeline")]


class _Counts(nn.Module):
    """Counts the forwards it has seen, in a dict it shares with a later layer."""

    def __init__(self, seen: dict[str, int]) -> None:
        super().__init__()
        self.lin, self.seen = nn.Linear(8, 8), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["n"] += 1
        return self.lin(x)


class _ScaledByCount(_Counts):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.seen["n"]


def test_layers_sharing_state_that_the_schedule_reorders_fail() -> None:
    torch.manual_seed(0)
    seen = {"n": 0}
    model = nn.Sequential(_Counts(seen), nn.Linear(8, 8), nn.Linear(8, 8),
                          _ScaledByCount(seen))
    result = pt.verify(model, torch.randn(8, 8), schedule="gpipe", split_points=None)
    assert not result.passed and result.loss_difference > 1e-3
    assert "*.lin.weight" in [r.name for r in result.failed]


def test_groups_collapse_layer_indices() -> None:
    assert group_of("model.layers.12.mlp.up_proj.weight") == "model.layers.*.mlp.up_proj.weight"
    assert group_of("3.weight") == "*.weight" and group_of("lm_head.weight") == "lm_head.weight"


# ---------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's config.json (4 layers x 32, 300 tokens): all verify reads."""
    directory = tmp_path_factory.mktemp("llama")
    saved_config("llama", 300).save_pretrained(directory)
    return directory


def test_the_command_passes_on_a_shrunk_saved_llama(saved: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--hf", str(saved), "--schedule", "zbv", "--pp", "2",
                 "--microbatches", "2", "--width", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "LlamaForCausalLM" in out and "hidden 16 (saved: 32)" in out
    assert "parameter group" in out and "model.embed_tokens.weight" in out
    assert "units per stage 1,1,1,1" in out and "PASS" in out


@pytest.mark.parametrize("name", ["Qwen3MoeConfig",
                                  pytest.param("MixtralConfig", marks=pytest.mark.long)])
def test_the_command_passes_on_a_stored_moe_at_its_defaults(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Their experts default to grouped_mm, which has no float64 kernel: verify runs them as
    transformers' batched_mm (the run itself keeps its own)."""
    import transformers as tf

    experts = {"Qwen3MoeConfig": {"num_experts": 4, "moe_intermediate_size": 16,
                                  "head_dim": 8},
               "MixtralConfig": {"num_local_experts": 4}}[name]
    config = getattr(tf, name)(num_hidden_layers=4, hidden_size=32, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               num_experts_per_tok=2, max_position_embeddings=64, **experts)
    assert config.to_dict().get("experts_implementation") in (None, "grouped_mm")
    config.save_pretrained(tmp_path)
    assert main(["verify", "--hf", str(tmp_path)]) == 0
    assert "PASS" in capsys.readouterr().out


def test_an_encoder_decoder_is_out_of_scope_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers as tf

    tf.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                vocab_size=128).save_pretrained(tmp_path)
    assert main(["verify", "--hf", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "T5Config is an encoder-decoder" in err and "causal language models only" in err
    assert "pt.verify(model, inputs)" in err and "GPT2Config" not in err  # no list of configs


def _page() -> str:
    return (Path(__file__).resolve().parents[1] / "docs" / "verify.md").read_text()


@pytest.mark.long  # beside test_the_command_passes_on_a_shrunk_saved_llama
def test_the_docs_command_passes_as_written(saved: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """docs/verify.md's ``pipetrain verify`` line, on this smaller saved Llama: same layout."""
    page = _page()
    line = next(x for x in page.splitlines() if x.startswith("$ python3 -m pipetrain verify"))
    argv = line.split()[5:]
    assert argv[:2] == ["--hf", "tiny-llama"], line
    assert main(["verify", "--hf", str(saved), *argv[2:]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] in page and out[-1].startswith("PASS"), out  # the layout line


def test_the_docs_snippet_passes(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    code = next(b for b in re.findall(r"```python\n(.*?)```", _page(), re.S)
                if "pt.verify(" in b)
    exec(compile(code, "docs/verify.md", "exec"), {})
    assert capsys.readouterr().out.startswith("PASS: the loss and all 16 gradients")


def test_train_verify_checks_before_it_starts_the_workers(
        saved: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.train.commands import verify_hf
    from pipetrain.train.launch import elastic

    started: list[Any] = []
    monkeypatch.setattr(elastic, "launch_local", lambda cfg, **_: started.append(cfg))
    monkeypatch.setattr(verify_hf, "WIDTH", 16)
    argv = ["train", "--hf", str(saved), "--verify", "--schedule", "1f1b", "--balance", "even",
            "--microbatches", "2", "--seq-len", "16", "--batch-size", "4"]
    assert main(argv) == 0 and len(started) == 1
    out = capsys.readouterr().out
    assert "pipetrain train --verify: LlamaForCausalLM" in out and "PASS" in out
    assert main(["train", "--verify"]) == 2 and len(started) == 1  # the GPT preset: refused
    assert "--verify checks a --hf model" in capsys.readouterr().err

    failed = pt.Verification((Row("lm_head.weight", (1,), 1, 9, 1.0, "lm_head.weight", "",
                                  False),), (), 1.0, 1.0, 1e-9, "1f1b", 2, 2, (2, 2), (0, 1),
                             torch.float64, 0.1)
    monkeypatch.setattr(verify_hf, "before_training", lambda cfg, announce: failed)
    assert main(argv) == 1 and len(started) == 1  # no worker started
    assert "--verify failed, not training: 1 of 1 parameter groups" in capsys.readouterr().err
