"""Mixtures of experts stored as transformers stores them, in and out through ``--hf``.

transformers 5 keeps each expert's weights apart on disk (Mixtral:
``model.layers.1.block_sparse_moe.experts.3.w1.weight``; Qwen3-MoE and DeepSeek-V3:
``model.layers.1.mlp.experts.3.gate_proj.weight``) and fuses them at load into one tensor per
layer (``model.layers.1.mlp.experts.gate_up_proj``, experts x 2 intermediate x hidden), and its
``save_pretrained`` splits them back. A tiny Mixtral, Qwen3-MoE and DeepSeek-V3 with seeded
random weights, saved by transformers: each pipeline stage (2 and 4 stages on local ranks)
reads and fuses its own experts to exactly the tensors ``from_pretrained`` gives, and the
pipeline's loss is transformers'; a ``Shard(0)`` DTensor takes its experts' slice; pipetrain's
save writes the stored names transformers writes, and ``from_pretrained`` of it holds
pipetrain's tensors; ``pipetrain train --hf`` on a stored Mixtral (2 ranks, 2 steps) writes
``OUT/hf`` holding the trained weights, and ``export-hf`` of its checkpoint writes the same.
gpt-oss, which transformers stores fused, goes in and out as it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain as pt
import pipetrain.schedules as ps
from helpers.hf import VOCAB, python_text, tokenizer
from pipetrain.hf.model import load_weights, open_model
from pipetrain.hf.save import save_pretrained
from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.hf_source import hf_pipeline

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
MOE = dict(num_experts_per_tok=2)
CONFIGS: dict[str, Any] = {
    "mixtral": lambda: tf.MixtralConfig(**SMALL, **MOE, num_local_experts=4),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(**SMALL, **MOE, num_experts=4, head_dim=8,
                                           moe_intermediate_size=16),
    "deepseek_v3": lambda: tf.DeepseekV3Config(  # layer 0 dense, 1-3 experts; MLA: no GQA
        **{**SMALL, "num_key_value_heads": 4}, **MOE, n_routed_experts=4,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}
STORED = {"mixtral": "model.layers.1.block_sparse_moe.experts.3.w1.weight",
          "qwen3_moe": "model.layers.1.mlp.experts.3.gate_proj.weight",
          "deepseek_v3": "model.layers.1.mlp.experts.3.up_proj.weight"}
"""One stored name per architecture: transformers writes each expert apart."""
FUSED = "model.layers.1.mlp.experts.gate_up_proj"


def _saved(config: Any, path: Path, tok: Any = None) -> Path:
    """transformers' ``save_pretrained`` of ``config`` with seeded random weights (every
    expert its own values), and ``tok`` (when given, the vocabulary is its size)."""
    if tok is not None:
        config.vocab_size = len(tok)
        tok.save_pretrained(path)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    return path


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of transformers' save ``directory``, by stored name."""
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _index(directory: Path) -> dict[str, str]:
    """The stored names of pipetrain's save ``directory`` -> their shard."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return index["weight_map"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: _saved(make(), root / name) for name, make in CONFIGS.items()}


def _loaded(directory: Path, ranks: int) -> tuple[pt.Pipeline, Any]:
    """The ``--hf`` pipeline of ``directory`` on ``ranks`` local ranks (1f1b: one stage each),
    its tensors read by :func:`load_weights`; and what it read."""
    hf = open_model(directory)
    cfg = TrainConfig(hf=str(directory), seq_len=16, microbatches=2)
    pipe = hf_pipeline(hf.model, cfg, ps.make_schedule("1f1b", ranks, 2), 2, lambda f: f,
                       local_ranks=ranks)
    # pipetrain train --hf captures at its fixed shapes: 2 rows of seq_len tokens
    assert pipe.traced is not None and not pipe.traced.captured.dynamic
    assert [leaf.static for leaf in pipe.traced.captured.inputs] == [((0, 2), (1, 16))]
    return pipe, load_weights(hf, pipe.state_dict())


FUSED_IN_CI = ("qwen3_moe",)
"""The family CI fuses at 2 and 4 stages (its time, CONTRIBUTING.md: tests); Mixtral and
DeepSeek-V3 in the long tier (their stored experts still load in CI, in the tests below)."""


@pytest.mark.parametrize("name", [
    n if n in FUSED_IN_CI else pytest.param(n, marks=pytest.mark.long) for n in CONFIGS])
def test_stored_experts_are_fused_into_the_stages_as_transformers_fuses_them(
        name: str, saved: dict[str, Path]) -> None:
    stored = _stored(saved[name])
    assert STORED[name] in stored and not any("gate_up_proj" in n for n in stored)
    reference = tf.AutoModelForCausalLM.from_pretrained(saved[name])
    want = reference.state_dict()
    for ranks in (2, 4):
        pipe, report = _loaded(saved[name], ranks)
        state = pipe.state_dict()
        assert set(state) == set(want) and FUSED in state
        assert [n for n, t in state.items() if not torch.equal(t, want[n])] == [], ranks
        assert (report.tensors, report.files) == (len(stored), 1)  # each stored tensor once
        assert report.bytes == sum(t.numel() * t.element_size() for t in stored.values())
    ids = torch.randint(1, VOCAB, (4, 17), generator=torch.Generator().manual_seed(1))
    got = pipe.step({"input_ids": ids[:, :-1]}, ids[:, 1:]).loss
    with torch.no_grad():
        loss = reference(input_ids=ids, labels=ids).loss
    assert got is not None and float(got.detach()) == pytest.approx(float(loss), rel=1e-5)


def test_a_rank_reads_only_its_own_experts_and_a_missing_one_is_named(
        saved: dict[str, Path], tmp_path: Path) -> None:
    directory = saved["mixtral"]
    want = tf.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    hf = open_model(directory)
    state = {FUSED: torch.zeros_like(want[FUSED])}  # layer 1's w1 and w3 of 4 experts
    report = load_weights(hf, state)
    assert torch.equal(state[FUSED], want[FUSED]) and report.tensors == 8
    assert report.bytes == want[FUSED].numel() * 4
    from safetensors.torch import save_file

    stored = _stored(directory)  # expert 3 of layer 1 lost
    del stored["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((directory / "config.json").read_text())
    save_file(stored, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"model.safetensors: .*experts.0.w1.weight.* could "
                                         rf"not fuse them into the model's {FUSED}"):
        load_weights(open_model(broken), state)
    with pytest.raises(ValueError, match=rf"has shape \(4, 128, 32\), the model's {FUSED} "
                                         r"\(4, 64, 32\)"):
        load_weights(hf, {FUSED: torch.zeros(4, 64, 32)})


def _expert_slice(ctx: pt.RankContext, directory: str, want: torch.Tensor) -> bool:
    """Rank ``ctx.rank``'s ``Shard(0)`` slice of layer 1's fused experts, loaded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    target = distribute_tensor(torch.zeros(want.shape), mesh, [Shard(0)])
    load_weights(open_model(directory), {FUSED: target})
    mine = want.chunk(ctx.world_size)[ctx.rank]
    return torch.equal(target.to_local(), mine) and target.to_local().shape[0] == 2


def test_an_expert_parallel_slice_takes_its_experts_of_the_fused_value(
        saved: dict[str, Path]) -> None:
    """2 processes, a ``Shard(0)`` DTensor each (2 of the 4 experts, as expert parallelism and
    FSDP2 split it): each rank's slice holds its experts' stored values."""
    want = tf.AutoModelForCausalLM.from_pretrained(saved["qwen3_moe"]).state_dict()[FUSED]
    assert pt.launch(_expert_slice, 2, str(saved["qwen3_moe"]), want, timeout=120) == [True] * 2


def test_experts_stored_fused_are_read_and_written_as_they_are(tmp_path: Path) -> None:
    """gpt-oss: transformers stores its ``experts.gate_up_proj`` as the model holds it."""
    config = tf.GptOssConfig(**{**SMALL, "num_hidden_layers": 2}, **MOE, num_local_experts=4,
                             head_dim=8)
    directory = _saved(config, tmp_path / "gpt_oss")
    assert FUSED in _stored(directory)
    hf = open_model(directory)
    assert hf.fused == {}
    state = {n: torch.zeros(t.shape) for n, t in hf.model.state_dict().items()}
    load_weights(hf, state)
    want = tf.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert [n for n, t in state.items() if not torch.equal(t, want[n])] == []
    out = save_pretrained(tmp_path / "hf", state, hf.config, None, None)
    assert set(_index(out)) == set(_stored(directory))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_saved_back_in_the_layout_transformers_writes_and_loads(
        name: str, saved: dict[str, Path], tmp_path: Path) -> None:
    pipe, _ = _loaded(saved[name], 2)
    state = {n: t.detach() + 0.25 for n, t in pipe.state_dict().items()}  # not the source's
    hf = open_model(saved[name])
    out = save_pretrained(tmp_path / "hf", state, hf.config, None, None)
    assert set(_index(out)) == set(_stored(saved[name]))  # transformers' own stored names
    back = tf.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert [n for n, t in state.items() if not torch.equal(back[n], t)] == []
    again = {n: torch.zeros_like(t) for n, t in state.items()}
    load_weights(open_model(out), again)  # and pipetrain reads it back
    assert [n for n, t in state.items() if not torch.equal(again[n], t)] == []


@pytest.mark.parametrize(("name", "ranks"), [  # qwen3_moe: long tier, beside deepseek_v3
    pytest.param("qwen3_moe", 2, marks=pytest.mark.long), ("deepseek_v3", 2)])
def test_train_hf_on_a_stored_moe_writes_the_trained_experts(tmp_path: Path, name: str,
                                                             ranks: int) -> None:
    """2 ranks, 2 steps (a stored Mixtral trains at 4 in tests/test_expert_parallel_dist.py):
    ``OUT/hf`` in transformers' layout holds the last checkpoint's weights, which moved from
    the stored ones; ``export-hf`` of that checkpoint, in shards smaller than a layer, writes
    the same."""
    from pipetrain.cli import main
    from test_hf_train_dist import _checkpointed

    text = python_text(2)
    (tmp_path / "data.py").write_text(text)
    source = _saved(CONFIGS[name](), tmp_path / name, tokenizer(text))
    out = tmp_path / "out"
    argv = ["train", "--hf", str(source), "--data", str(tmp_path / "data.py"),
            "--token-cache", str(tmp_path / "tokens"), "--seq-len", "16", "--batch-size", "4",
            "--microbatches", "2", "--steps", "2", "--eval-every", "0", "--sample-tokens", "0",
            "--warmup", "1", "--lr", "1e-2", "--nproc", str(ranks), "--no-progress", "--out",
            str(out)]
    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
            env.delenv(key)
        assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(_index(out / "hf")) == set(_stored(source))
    trained = tf.AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    want = _checkpointed(Path(summary["checkpoint"]))
    assert set(want) == set(trained)
    assert [n for n, t in want.items() if not torch.equal(trained[n], t)] == []
    start = tf.AutoModelForCausalLM.from_pretrained(source).state_dict()
    assert all(not torch.equal(trained[n], start[n]) for n in trained if "experts" in n)
    exported = tmp_path / "exported"
    assert main(["export-hf", summary["checkpoint"], str(exported), "--shard-size",
                 "20KB"]) == 0
    assert len(list(exported.glob("model-*.safetensors"))) > 2
    again = tf.AutoModelForCausalLM.from_pretrained(exported).state_dict()
    assert [n for n, t in trained.items() if not torch.equal(again[n], t)] == []
