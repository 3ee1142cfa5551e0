"""Byte corpus and batches: loading, the held-out split, determinism and exact resume."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from pipetrain.train.data.text import Batches, ByteCorpus, decode, default_corpus, encode


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_file() -> None:
    corpus = ByteCorpus.from_bytes(b"0123456789" * 10, eval_fraction=0.1)
    assert corpus.train.dtype == torch.uint8 and len(corpus) == 100
    assert decode(corpus.eval) == "0123456789" and len(corpus.train) == 90


def test_file_path(tmp_path: Path) -> None:
    write(tmp_path, {"a.txt": "héllo wörld\n" * 20})
    corpus = ByteCorpus.from_path(tmp_path / "a.txt")
    assert corpus.files == ("a.txt",)
    assert decode(corpus.data) == "héllo wörld\n" * 20


def test_directory_is_recursive_sorted_and_filtered(tmp_path: Path) -> None:
    write(tmp_path, {"b.py": "B", "a.md": "A", "sub/c.rst": "C", "sub/d.txt": "D",
                     "skip.bin": "X", "e.csv": "X", "site-packages/f.py": "X"})
    corpus = ByteCorpus.from_path(tmp_path, eval_fraction=0.0)
    assert corpus.files == ("a.md", "b.py", "sub/c.rst", "sub/d.txt")
    assert decode(corpus.data) == "ABCD"


def test_max_bytes_cuts_the_corpus(tmp_path: Path) -> None:
    write(tmp_path, {"a.txt": "a" * 10, "b.txt": "b" * 10, "c.txt": "c" * 10})
    corpus = ByteCorpus.from_path(tmp_path, max_bytes=15, eval_fraction=0.0)
    assert decode(corpus.data) == "a" * 10 + "b" * 5 and corpus.files == ("a.txt", "b.txt")


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        ByteCorpus.from_path(missing)


@pytest.mark.parametrize("files", [{"empty.txt": ""}, {"data.bin": "x"}])
def test_no_text_is_named(tmp_path: Path, files: dict[str, str]) -> None:
    write(tmp_path, files)
    target = tmp_path / "empty.txt" if "empty.txt" in files else tmp_path
    with pytest.raises(ValueError, match=re.escape(str(target))):
        ByteCorpus.from_path(target)


def test_bad_eval_fraction() -> None:
    with pytest.raises(ValueError, match="eval_fraction"):
        ByteCorpus.from_bytes(b"abc", eval_fraction=1.0)


def test_default_corpus_has_a_disjoint_eval_split() -> None:
    corpus = default_corpus(max_bytes=1 << 20)
    assert len(corpus) == 1 << 20 and corpus.files
    n_eval = len(corpus.eval)
    assert n_eval == round(0.05 * len(corpus)) and len(corpus.train) + n_eval == len(corpus)
    assert corpus.train.data_ptr() + len(corpus.train) == corpus.eval.data_ptr()


def test_batches_shapes_and_shift() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    inputs, targets = next(Batches(data, 5, 16, seed=3))
    assert inputs.shape == targets.shape == (5, 16)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:]) and torch.equal(targets, inputs + 1)


def test_batches_stay_inside_the_training_bytes() -> None:
    corpus = ByteCorpus.from_bytes(b"t" * 100 + b"e" * 10, eval_fraction=10 / 110)
    batches = Batches(corpus.train, 8, 20)
    for _ in range(50):
        inputs, targets = next(batches)
        assert decode(inputs.flatten()) == "t" * 160 and decode(targets.flatten()) == "t" * 160
    ev = Batches(corpus.eval, 2, 9).eval_batches(3)
    assert all(decode(x.flatten()) == "e" * 18 for x, _ in ev)


def test_batches_are_deterministic_and_seeded() -> None:
    data = torch.randint(256, (1000,), dtype=torch.uint8)
    a = [x for x, _ in zip(Batches(data, 4, 8, seed=1), range(3))]
    b = [x for x, _ in zip(Batches(data, 4, 8, seed=1), range(3))]
    c = [x for x, _ in zip(Batches(data, 4, 8, seed=2), range(3))]
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b))
    assert not torch.equal(a[0][0], c[0][0]) and not torch.equal(a[0][0], a[1][0])


def test_resume_yields_the_same_batches() -> None:
    data = torch.randint(256, (1000,), dtype=torch.uint8)
    run = Batches(data, 4, 8, seed=7)
    want = [next(run) for _ in range(5)]
    first = Batches(data, 4, 8, seed=7)
    next(first), next(first)
    resumed = Batches(data, 4, 8, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.state_dict() == {"seed": 7, "step": 2}
    for (x, y), (wx, wy) in zip([next(resumed) for _ in range(3)], want[2:]):
        assert torch.equal(x, wx) and torch.equal(y, wy)


def test_data_shorter_than_a_window() -> None:
    with pytest.raises(ValueError, match="seq_len \\+ 1 = 17"):
        Batches(torch.zeros(16, dtype=torch.uint8), 2, 16)


def test_encode_decode_round_trip() -> None:
    assert decode(encode("pipé ✓")) == "pipé ✓"
    assert encode("A").tolist() == [65]
