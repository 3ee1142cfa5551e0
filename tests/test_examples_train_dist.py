"""`pipetrain train --hf DIR --data chat.jsonl --chat` on 2 processes, against transformers.

The step-0 loss is transformers' ``model(input_ids, attention_mask=..., labels=...)`` with -100
on all but the assistant's tokens (micro-batches holding different numbers of trained
tokens); a run resumed at another layout (dp 2) continues with the same examples; docs/hf.md's
chat example runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.chat import conversations, save_model, write_jsonl
from helpers.runs import records as _records
from helpers.runs import train
from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")
pytest.importorskip("datasets")

ARGS = ["--chat", "--seq-len", "64", "--batch-size", "8", "--microbatches", "4", "--steps", "4",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--grad-clip", "0",
        "--lr", "1e-3", "--warmup", "1", "--checkpoint-every", "2", "--no-progress"]


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("chat-train")
    save_model(root / "m")
    write_jsonl(root / "chat.jsonl", [{"messages": m} for m in conversations(40)])
    return root


def _train(place: Path, out: str, *args: str) -> dict[str, Any]:
    return train(["train", "--hf", str(place / "m"), "--data", str(place / "chat.jsonl"),
                  "--token-cache", str(place / "tokens"), "--out", str(place / out), *ARGS,
                  *args], place / out)


def _reference(place: Path, step: int) -> tuple[float, float, list[int]]:
    """transformers' loss on the run's batch ``step`` (rows built from the cache, not from
    the batches), the micro-batch-row-weighted mean a loss per micro-batch would give, and
    the trained tokens of each of the 4 micro-batches."""
    import transformers as tf

    from pipetrain.train.data.examples import example_batches, example_corpus

    tok = tf.AutoTokenizer.from_pretrained(place / "m")
    corpus = example_corpus(tok, place / "m", str(place / "chat.jsonl"), place / "tokens",
                            chat=True)
    rows = example_batches(corpus, 8, 64, 0, 1, 1)[0].examples(step)
    ids = torch.zeros(8, 65, dtype=torch.long)
    mask = torch.zeros(8, 65, dtype=torch.long)
    labels = torch.full((8, 65), -100)
    for r, e in enumerate(rows):
        a = int(corpus.offsets[e])
        n = min(int(corpus.offsets[e + 1]) - a, 65)
        ids[r, :n], mask[r, :n] = corpus.ids[a:a + n], 1
        labels[r, :n] = torch.where(corpus.trained[a:a + n].bool(), ids[r, :n], -100)
    model = tf.AutoModelForCausalLM.from_pretrained(place / "m")
    with torch.no_grad():
        loss = float(model(input_ids=ids, attention_mask=mask, labels=labels).loss)
        parts = [float(model(input_ids=ids[i:i + 2], attention_mask=mask[i:i + 2],
                             labels=labels[i:i + 2]).loss) for i in range(0, 8, 2)]
    counts = [int((labels[i:i + 2, 1:] != -100).sum()) for i in range(0, 8, 2)]
    return loss, sum(parts) / 4, counts


def test_step0_loss_is_transformers_masked_loss_and_a_resume_continues_the_examples(
        place: Path) -> None:
    from pipetrain.train.data.examples import describe

    first = _train(place, "a", "--nproc", "2", "--schedule", "1f1b")
    assert first["steps"] == 4 and first["layout"]["pp"] == 2
    (data,) = _records(place / "a", "data")
    assert data["reads"] == "chat" and data["layout"] == "padded" and data["dropped"] == 0
    assert 0.1 < data["trained_fraction"] < 0.9
    printed = describe(data)  # the line rank 0 prints (the ranks' stdout is not this test's)
    assert "loss on the assistant's tokens only" in printed and "not packed" in printed
    want, per_microbatch, counts = _reference(place, 0)
    assert len(set(counts)) > 1, counts  # the micro-batches hold different numbers
    logged = _records(place / "a", "step")[0]["loss"]
    assert logged == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert abs(per_microbatch - want) > 1e-4  # what weighting micro-batches by rows gives
    # the checkpoint of step 2 resumed at another layout: the same examples, the same losses
    shutil.copytree(place / "a" / "checkpoints" / "step_000002",
                    place / "b" / "checkpoints" / "step_000002")
    second = _train(place, "b", "--nproc", "2", "--dp", "2")
    assert second["layout"]["dp"] == 2
    assert [s["start_step"] for s in _records(place / "b", "start")] == [2]
    done, again = _records(place / "a", "step")[2:], _records(place / "b", "step")
    assert [r["step"] for r in again] == [2, 3]
    for a, b in zip(done, again, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
    assert second["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-5)


@pytest.mark.long  # beside test_step0_loss_is_transformers_masked_loss_and_a_resume_continues_...
def test_the_hf_page_chat_example_runs_at_a_tiny_size(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/hf.md's make_tiny.py and make_chat.py snippets, then its ``--chat`` command for 2
    steps (the command's ``main``, in this process)."""
    from test_docs import ROOT, console_line, python_blocks

    page = ROOT / "docs" / "hf.md"
    blocks = python_blocks(page)
    monkeypatch.chdir(tmp_path)
    for code in (next(b for b in blocks if 'save_pretrained("tiny-llama")' in b),
                 next(b for b in blocks if "chat.jsonl" in b)):
        exec(compile(code, "snippet.py", "exec"), {"__name__": "__main__"})
    command = console_line(page, "--chat").split()
    assert command[:4] == ["python3", "-m", "pipetrain", "train"], command
    for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
        monkeypatch.delenv(key)
    assert main([*command[3:], "--steps", "2", "--eval-batches", "1", "--no-progress",
                 "--token-cache", str(tmp_path / "tokens")]) == 0
    out = Path(command[command.index("--out") + 1])
    (data,) = _records(out, "data")
    assert (data["reads"], data["examples"], data["held_out"]) == ("chat", 190, 10), data
    assert len(_records(out, "step")) == 2
