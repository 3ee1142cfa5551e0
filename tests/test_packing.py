"""``--pack`` (:mod:`pipetrain.train.data.packing`): rows of whole examples whose positions restart,
labels that never cross into the next example; the packed step's loss and gradients equal the
same examples unpacked (float64, Llama and Qwen2), pipelined too; a model whose attention
does not keep packed examples apart (OPT, BLOOM) is refused; a run prints both paddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)

import pipetrain as pt
from helpers.chat import conversations, save_model, write_jsonl
from pipetrain.cli import main
from pipetrain.train.data.examples import IGNORE, describe, example_corpus, masked_lm_loss
from pipetrain.train.data.packing import PackedBatches, check_model

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("pack") / "m")


@pytest.fixture(scope="module")
def corpus(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    place = tmp_path_factory.mktemp("data")
    data = write_jsonl(place / "chat.jsonl", [{"messages": m} for m in conversations(40)])
    tok = tf.AutoTokenizer.from_pretrained(saved)
    return example_corpus(tok, saved, str(data), place / "cache", chat=True)


def _packed(corpus: Any, seq_len: int = 96) -> PackedBatches:
    return PackedBatches(corpus, torch.arange(corpus.n_train), 4, seq_len, seed=3)


def test_rows_hold_whole_examples_with_positions_restarting(corpus: Any) -> None:
    batches = _packed(corpus)
    rows = batches.rows(0)
    assert sorted(e for row in rows for e in row) == list(range(corpus.n_train))  # once each
    assert any(len(row) > 1 for row in rows)
    (inputs, targets), seen = batches.batch(0), 0
    for r, row in enumerate(batches._row_lists(0)):
        at = 0
        for e in row:
            n = int(corpus.offsets[e + 1] - corpus.offsets[e])
            ids = corpus.ids[int(corpus.offsets[e]):int(corpus.offsets[e]) + n].long()
            assert torch.equal(inputs["input_ids"][r, at:at + n - 1], ids[:-1])
            assert inputs["position_ids"][r, at:at + n].tolist()[:n - 1] == list(range(n - 1))
            flags = corpus.trained[int(corpus.offsets[e]) + 1:int(corpus.offsets[e]) + n].bool()
            assert torch.equal(targets["labels"][r, at:at + n - 1],
                               torch.where(flags, ids[1:], IGNORE))
            if at + n - 1 < 96:
                assert targets["labels"][r, at + n - 1] == IGNORE  # never the next example's
            at += n
            seen += 1
    assert seen == len(batches.examples(0))
    again = _packed(corpus)
    again.load_state_dict({"seed": 3, "step": 5})  # resumed: the batch an unbroken run takes
    assert torch.equal(next(again)[0]["input_ids"], batches.batch(5)[0]["input_ids"])


def _model(name: str, vocab: int) -> Any:
    config = getattr(tf, name)(num_hidden_layers=3, hidden_size=32, intermediate_size=64,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                               max_position_embeddings=128, use_cache=False)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64)


def _grads(model: Any) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("name", ["LlamaConfig",
                                  pytest.param("Qwen2Config", marks=pytest.mark.long)])
def test_a_packed_step_equals_the_examples_apart(name: str, corpus: Any) -> None:
    batches = _packed(corpus)
    model = _model(name, 320)
    assert any(len(row) > 1 for row in batches._row_lists(1))  # examples do share rows
    inputs, targets = batches.batch(1)
    packed = masked_lm_loss(model(**inputs), targets)
    packed.backward()
    want_grads = _grads(model)
    weight = float(targets["weight"][0])
    apart = torch.zeros((), dtype=torch.float64)
    for e in batches.examples(1):  # each example alone, its trained tokens, the same weight
        a = int(corpus.offsets[e])
        n = min(int(corpus.offsets[e + 1]) - a, 97)
        ids = corpus.ids[a:a + n].long()[None]
        labels = torch.where(corpus.trained[a + 1:a + n].bool(), ids[0, 1:], IGNORE)
        logits = model(input_ids=ids[:, :-1]).logits[0]
        apart = apart + F.cross_entropy(logits, labels, ignore_index=IGNORE,
                                        reduction="sum") * weight
    apart.backward()
    assert torch.allclose(packed, apart, rtol=1e-12, atol=0)
    for got, want in zip(_grads(model), want_grads, strict=True):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    result = pt.verify(model, inputs, targets=targets, loss_fn=masked_lm_loss,
                       schedule="zbv", ranks=2, microbatches=2)  # and pipelined
    assert result.passed, result.table()


@pytest.mark.parametrize("config", [
    lambda: tf.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                         vocab_size=64, word_embed_proj_dim=32),
    lambda: tf.BloomConfig(n_layer=2, hidden_size=32, n_head=4, vocab_size=64),
], ids=["opt", "bloom"])
def test_a_model_that_lets_packed_examples_meet_is_refused(config: Any) -> None:
    with pytest.raises(ValueError, match="lets packed examples attend to each other"):
        check_model(config(), "x")
    check_model(_model("LlamaConfig", 64).config, "x")  # passes


@pytest.mark.long  # beside test_a_packed_step_equals_the_examples_apart
def test_a_packed_run_prints_both_paddings(saved: Path, corpus: Any, tmp_path: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(40)])
    assert main(["train", "--hf", str(saved), "--data", str(data), "--chat", "--pack",
                 "--nproc", "2", "--steps", "2", "--seq-len", "96", "--batch-size", "4",
                 "--microbatches", "2", "--eval-every", "0", "--sample-tokens", "0",
                 "--no-progress", "--out", str(tmp_path / "run")]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").open()]
    (data,) = [r for r in records if r["kind"] == "data"]
    assert data["layout"] == "packed" and data["padding_fraction"] < data["padding_unpacked"]
    line = describe(data)  # the line the run prints
    assert "packed into" in line and "one example a row:" in line, line
    capfd.readouterr()
    assert main(["train", "--hf", str(saved), "--pack"]) == 2
    assert "--pack packs the examples of a data set" in capfd.readouterr().err
