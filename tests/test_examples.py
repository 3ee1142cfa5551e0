"""Data sets as ``--data``: formats, chat labels, padded batches, errors and the cache lock.

JSONL, Parquet, CSV and ``save_to_disk`` read the chosen column, ``--chat`` trains on the
assistant's tokens only, batches are padded whole examples from (seed, step), bad input fails
with how to fix it, and a cache lock names its holder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.chat import TEMPLATE, conversations, save_model, tokenizer, write_jsonl
from pipetrain.train.checks import check_config
from pipetrain.train.config import TrainConfig
from pipetrain.train.data import tokens
from pipetrain.train.data.examples import ExampleCorpus, example_batches, example_corpus
from pipetrain.train.data.records import Encoder

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

TEXTS = ["add one and two", "say the sum of the numbers in words please", "what is three",
         "four five six seven", "eight nine ten"] * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(tmp_path_factory.mktemp("chat") / "m")


@pytest.fixture(scope="module")
def tok(model: Path) -> Any:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(model)


def _examples(corpus: ExampleCorpus) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(len(corpus)):
        a, b = int(corpus.offsets[i]), int(corpus.offsets[i + 1])
        out.append((corpus.ids[a:b].tolist(), corpus.trained[a:b].tolist()))
    return out


class _NoOffsets:
    """A tokenizer that gives no character offsets (as a slow, Python one)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.chat_template = inner, inner.chat_template

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.apply_chat_template(*args, **kwargs)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if kwargs.get("return_offsets_mapping"):
            raise NotImplementedError("no offsets")
        return self.inner(text, **kwargs)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "save_to_disk"])
def test_each_format_reads_the_chosen_column(kind: str, model: Path, tok: Any,
                                             tmp_path: Path) -> None:
    rows = datasets.Dataset.from_list([{"id": i, "body": t} for i, t in enumerate(TEXTS)])
    path = tmp_path / ("data" if kind == "save_to_disk" else f"data.{kind}")
    {"jsonl": rows.to_json, "parquet": rows.to_parquet, "csv": rows.to_csv,
     "save_to_disk": rows.save_to_disk}[kind](str(path))
    corpus = example_corpus(tok, model, str(path), tmp_path / "cache", text_field="body")
    assert len(corpus) == len(TEXTS) and corpus.n_train == len(TEXTS) - 1  # 5 %: at least 1
    assert corpus.kind == "text column 'body'"
    for text, (ids, trained) in zip(TEXTS, _examples(corpus), strict=True):
        assert ids == [*tok(text)["input_ids"], tok.eos_token_id] and all(trained)
    again = example_corpus(tok, model, str(path), tmp_path / "cache", text_field="body")
    assert torch.equal(again.ids, corpus.ids)  # mapped from the cache
    assert len(list((tmp_path / "cache").glob("*.tokens"))) == 1


def test_chat_trains_on_the_assistant_turns_only(model: Path, tok: Any, tmp_path: Path) -> None:
    talks = conversations(6)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in talks])
    corpus = example_corpus(tok, model, str(path), tmp_path / "cache", chat=True)
    assert corpus.kind == "chat"
    for talk, (ids, trained) in zip(talks, _examples(corpus), strict=True):
        assert ids == tok.apply_chat_template(talk, tokenize=True)["input_ids"]  # its own
        said = [i for i, t in zip(ids, trained, strict=True) if t]
        want = "".join(m["content"] + "<|im_end|>\n" for m in talk if m["role"] == "assistant")
        assert tok.decode(said) == want  # the replies and their end-of-turn, nothing else
    slow = Encoder(_NoOffsets(tok), "text", True, "x").encode(talks, 0)
    assert slow == Encoder(tok, "text", True, "x").encode(talks, 0)  # without offsets: pieces
    inputs, targets = example_batches(corpus, 4, 64, 0, 1, 1)[0].batch(0)
    labels = targets["labels"]
    assert inputs["input_ids"].shape == labels.shape == (4, 64)
    trained = labels != -100
    assert trained.any() and not trained.all()
    inner = trained[:, :-1]  # labels are the next tokens: the inputs shifted by one
    assert torch.equal(labels[:, :-1][inner], inputs["input_ids"][:, 1:][inner])


def test_sharegpt_conversations_under_chat_field_are_the_same_examples(
        model: Path, tok: Any, tmp_path: Path) -> None:
    """ShareGPT's form ({from: human/gpt/system, value}) in a ``conversations`` column, named by
    --chat-field, gives the tokens and trained flags of the same talks as {role, content}."""
    talks = conversations(5)
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [[{"from": names[m["role"]], "value": m["content"]} for m in talk] for talk in talks]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"messages": m} for m in talks])
    share = write_jsonl(tmp_path / "share.jsonl", [{"conversations": m, "id": i}
                                                   for i, m in enumerate(shared)])
    want = example_corpus(tok, model, str(plain), tmp_path / "c", chat=True)
    got = example_corpus(tok, model, str(share), tmp_path / "c", chat=True,
                         chat_field="conversations")
    assert _examples(got) == _examples(want)
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"conversations": [{"from": "robot",
                                                                   "value": "hi"}]}])
    with pytest.raises(ValueError, match=r"row 0, turn 0: neither \{role, content\} nor "
                                         r"ShareGPT's \{from, value\}"):
        example_corpus(tok, model, str(odd), tmp_path / "c", chat=True,
                       chat_field="conversations")


def test_a_malformed_jsonl_line_is_named_by_its_number(
        model: Path, tok: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "broken.jsonl"
    lines = [json.dumps({"text": t}) for t in TEXTS[:4]]
    lines.insert(2, '{"text": "unterminated')
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl: line 3 is not JSON \(Unterminated "
                                         r"string"):
        example_corpus(tok, model, str(path), tmp_path / "c")
    captured = capfd.readouterr()
    assert "Failed to load JSON" not in captured.out + captured.err + caplog.text  # ours only
    path.write_text(json.dumps({"text": "fine"}) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match="line 2 holds a list, not a JSON object"):
        example_corpus(tok, model, str(path), tmp_path / "c")


def test_batches_are_whole_examples_padded_from_seed_and_step(model: Path, tok: Any,
                                                               tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(30)])
    corpus = example_corpus(tok, model, str(path), tmp_path / "cache", chat=True)
    batches, held_out, record = example_batches(corpus, 4, 48, seed=5, replicas=2,
                                                eval_batches=2)
    assert record["examples"] + record["dropped"] == corpus.n_train
    assert record["layout"] == "padded" and 0 < record["trained_fraction"] < 1
    other = example_batches(corpus, 4, 48, seed=5, replicas=2, eval_batches=2)[0]
    seen = []
    for step in (0, 7, 3):
        (x, y), (x2, y2) = batches.batch(step), other.batch(step)
        assert torch.equal(x["input_ids"], x2["input_ids"]) and torch.equal(y["labels"],
                                                                             y2["labels"])
        seen += batches.examples(step)
        for r, e in enumerate(batches.examples(step)):  # a row is its example, then padding
            a, b = int(corpus.offsets[e]), int(corpus.offsets[e + 1])
            n = min(b - a, 49)
            ids = corpus.ids[a:a + n].long()
            assert torch.equal(x["input_ids"][r, :n - 1], ids[:-1])
            real = min(n, 48)  # its last token's label is padding
            assert x["attention_mask"][r].tolist() == [1] * real + [0] * (48 - real)
            flags = corpus.trained[a + 1:a + n].bool()
            assert torch.equal(y["labels"][r, :n - 1], torch.where(flags, ids[1:], -100))
            assert (y["labels"][r, n - 1:] == -100).all()
        assert torch.allclose(y["weight"], torch.full((4,), 2 / int((y["labels"] != -100
                                                                    ).sum())))
    assert len(set(batches.examples(0) + batches.examples(1))) == 8  # an epoch has no repeats
    batches.load_state_dict({"seed": 5, "step": 3})
    assert torch.equal(next(batches)[0]["input_ids"], other.batch(3)[0]["input_ids"])
    assert corpus.n_train < len(corpus) and all(e < corpus.n_train for e in seen)  # held out
    assert len(held_out) == 2


def test_bad_input_says_how_to_fix_it(model: Path, tok: Any, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    text = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in TEXTS])
    with pytest.raises(ValueError, match="--text-field 'body'.*its columns: text"):
        example_corpus(tok, model, str(text), tmp_path / "c", text_field="body")
    with pytest.raises(ValueError, match="no 'messages' column.*--chat-field.*--text-field"):
        example_corpus(tok, model, str(text), tmp_path / "c", chat=True)
    bare = save_model(tmp_path / "bare", template=None)
    import transformers as tf

    untemplated = tf.AutoTokenizer.from_pretrained(bare)
    with pytest.raises(ValueError, match="no chat template.*tok.chat_template"):
        example_corpus(untemplated, bare, str(text), tmp_path / "c", chat=True)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"messages": "hello"}] * 3)
    with pytest.raises(ValueError, match="row 0: 'messages' must be a non-empty list"):
        example_corpus(tok, model, str(bad), tmp_path / "c", chat=True)
    cfg = TrainConfig(hf="", data=str(text), batch_size=8, microbatches=2, chat=True)
    with pytest.raises(ValueError, match="is a data set: it needs --hf"):
        check_config(cfg, 2)
    with pytest.raises(ValueError, match="--chat needs --data to be a .jsonl"):
        check_config(TrainConfig(hf=str(model), batch_size=8, microbatches=2, chat=True), 2)
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[data\]"'):
        example_corpus(tok, model, str(text), tmp_path / "c2")
    with pytest.raises(ValueError, match=r'datasets, which is not installed.*\.\[data\]'):
        check_config(TrainConfig(hf=str(model), data=str(text), batch_size=8,
                                 microbatches=2), 2)


def test_a_lock_from_another_host_is_explained_and_one_whose_process_exited_taken_over(
        tmp_path: Path) -> None:
    lock, done = tmp_path / "k.lock", tmp_path / "k.json"
    lock.write_text(json.dumps({"host": "node-7", "pid": 4242, "since": 0}))
    said: list[str] = []
    filled: list[int] = []

    def fill() -> None:
        filled.append(os.getpid())
        done.write_text("{}")

    waiter = threading.Thread(target=lambda: tokens.fill_once(lock, done, fill, what="--data x",
                                                              say=said.append))
    waiter.start()
    deadline = time.monotonic() + 10
    while not said and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said and not filled, "a lock on another host must be explained at once"
    assert "pid 4242 on host node-7" in said[0] and f"delete {lock}" in said[0]
    lock.unlink()  # what the message says to do: the waiter goes on
    waiter.join(timeout=10)
    assert filled and done.is_file() and not lock.exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    done.unlink()
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "since": 0}))
    tokens.fill_once(lock, done, fill, what="--data x", say=said.append)  # no wait: taken over
    assert len(filled) == 2 and len(said) == 1


def test_a_template_set_on_the_tokenizer_is_part_of_the_cache_key(model: Path,
                                                                   tmp_path: Path) -> None:
    root = model
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in conversations(4)])
    first = example_corpus(tokenizer(), root, str(path), tmp_path / "c", chat=True)
    other = tokenizer(TEMPLATE.replace("<|im_end|>\n", "<|im_end|>"))
    second = example_corpus(other, root, str(path), tmp_path / "c", chat=True)
    assert len(list((tmp_path / "c").glob("*.tokens"))) == 2
    assert first.ids.numel() > second.ids.numel()
