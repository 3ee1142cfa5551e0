"""Architectures through ``--hf``'s path, each saved by transformers from a tiny config: read
back stage by stage (stored names renamed as transformers renames them), pipelined under zbv
on two local ranks, they give the loss ``model(input_ids, labels=...)`` gives. A mixture of
experts, whose expert weights transformers fuses at load, is fused by transformers' own
conversion (more in tests/test_hf_moe_weights.py). The README's table of architectures lists
these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain.schedules as ps
from helpers.hf import python_text, tokenizer

tf = pytest.importorskip("transformers")

SMALL = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
GQA = dict(SMALL, num_key_value_heads=2)
CONFIGS: dict[str, Any] = {
    "mistral": lambda: tf.MistralConfig(**GQA, sliding_window=16),
    "qwen2": lambda: tf.Qwen2Config(**GQA),
    "qwen3": lambda: tf.Qwen3Config(**GQA, head_dim=8),
    "gemma2": lambda: tf.Gemma2Config(**GQA, head_dim=8, sliding_window=16),
    "phi3": lambda: tf.Phi3Config(**GQA),
    "olmo2": lambda: tf.Olmo2Config(**GQA),
    "gpt_neox": lambda: tf.GPTNeoXConfig(**SMALL),  # stored as embed_out, renamed at load
    "opt": lambda: tf.OPTConfig(**{k: v for k, v in SMALL.items() if k != "intermediate_size"},
                                ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
    "bloom": lambda: tf.BloomConfig(n_layer=4, hidden_size=32, n_head=4, hidden_dropout=0.0,
                                    attention_dropout=0.0, bos_token_id=0, eos_token_id=0),
}
IN_CI = ("mistral", "gpt_neox")
"""The architectures CI loads (its time, CONTRIBUTING.md: tests): a Llama-like one and GPT-NeoX,
whose stored names are renamed at load; the others in the long tier."""


@pytest.fixture(scope="module")
def tok() -> Any:
    return tokenizer(python_text(2))


def _saved(config: Any, tok: Any, path: Path) -> Path:
    config.vocab_size = len(tok)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", [
    n if n in IN_CI else pytest.param(n, marks=pytest.mark.long) for n in CONFIGS])
def test_an_architecture_gives_transformers_loss_through_the_pipeline(
        name: str, tok: Any, tmp_path: Path) -> None:
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.sources.choice import source_for

    directory = _saved(CONFIGS[name](), tok, tmp_path / name)
    cfg = TrainConfig(hf=str(directory), seq_len=16, microbatches=2)
    source = source_for(cfg)
    pipe = source.pipeline(cfg, ps.make_schedule("zbv", 2, 2), 2, 0, lambda f: f, local_ranks=2)
    assert source.loaded(pipe)["tensors_read"] == len(pipe.state_dict())
    window = torch.randint(0, len(tok), (4, 17), generator=torch.Generator().manual_seed(1))
    got = pipe.step(source.feed(window[:, :-1]), window[:, 1:]).loss
    with torch.no_grad():
        want = tf.AutoModelForCausalLM.from_pretrained(directory)(input_ids=window,
                                                                   labels=window).loss
    assert got is not None and float(got.detach()) == pytest.approx(float(want), rel=1e-6)


def test_fused_expert_weights_are_fused_as_transformers_fuses_them(tok: Any,
                                                                   tmp_path: Path) -> None:
    from pipetrain.hf.model import load_weights, open_model

    config = tf.MixtralConfig(**GQA, num_local_experts=4, num_experts_per_tok=2)
    directory = _saved(config, tok, tmp_path / "mixtral")
    hf = open_model(directory)
    state = {n: torch.empty(p.shape) for n, p in hf.model.named_parameters()}
    report = load_weights(hf, state)  # each expert stored apart, 3 tensors each
    want = tf.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert [n for n, t in state.items() if not torch.equal(t, want[n])] == []
    assert report.tensors == len(state) + 4 * (4 * 3 - 2)  # 4 layers: 2 fused of 12 stored
