"""Local Hugging Face directories in and out, on one process: split points at decoder layers,
each rank's tensors read by name (never another's), token ids cached and memory-mapped, a
save_pretrained directory that transformers loads bitwise, and the loss pipetrain computes
equal to ``model(input_ids, labels=...)``."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain.schedules as ps
from helpers.hf import python_text, save_dir, tokenizer
from pipetrain.hf import model as hfmodel
from pipetrain.hf.save import save_pretrained
from pipetrain.train.commands.export_command import size_bytes
from pipetrain.train.config import TrainConfig
from pipetrain.train.data import tokens
from pipetrain.train.data.text import Batches

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def text() -> str:
    return python_text(3)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, text: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dirs")
    return {name: save_dir(name, root / name, text) for name in ("llama", "gpt2")}


# --------------------------------------------------------------------------------- model


def test_split_points_are_decoder_layers_or_every_unit(dirs: dict[str, Path]) -> None:
    llama = hfmodel.open_model(dirs["llama"]).model
    assert hfmodel.split_points(llama, 4) == ["model.layers.1", "model.layers.2",
                                              "model.layers.3"]
    units = hfmodel.split_points(llama, 8)  # more stages than layers: every unit
    assert units[0] == "model.layers.0" and "lm_head" in units and len(units) >= 7
    with pytest.raises(ValueError, match="fewer than the 16 stages"):
        hfmodel.split_points(llama, 16)


def test_a_rank_reads_only_its_own_tensors_a_tied_one_under_any_name(
        dirs: dict[str, Path]) -> None:
    import transformers as tf

    hf = hfmodel.open_model(dirs["gpt2"])
    stored = tf.AutoModelForCausalLM.from_pretrained(dirs["gpt2"]).state_dict()
    state = {n: torch.zeros_like(stored[n]) for n in ("transformer.h.1.attn.c_attn.weight",
                                                      "lm_head.weight")}  # tied: not stored
    report = hfmodel.load_weights(hf, state)
    assert report.tensors == 2 and report.bytes == hfmodel.share_bytes(state)
    assert all(torch.equal(t, stored[n]) for n, t in state.items())
    with pytest.raises(ValueError, match="has shape"):
        hfmodel.load_weights(hf, {"transformer.wpe.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="lack model.nope"):
        hfmodel.load_weights(hf, {"model.nope": torch.zeros(1)})


def test_a_sharded_directory_is_read_through_its_index(dirs: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """transformers' own sharded save (many files and an index): a rank opens only the files
    that hold its tensors."""
    import transformers as tf

    source = tf.AutoModelForCausalLM.from_pretrained(dirs["llama"])
    sharded = tmp_path / "sharded"
    source.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / hfmodel.INDEX).is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    hf = hfmodel.open_model(sharded)
    stored = source.state_dict()
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    state = {n: torch.zeros_like(stored[n]) for n in names}
    report = hfmodel.load_weights(hf, state)
    holding = {json.loads((sharded / hfmodel.INDEX).read_text())["weight_map"][n] for n in names}
    assert report.tensors == 2 and report.files == len(holding)
    assert all(torch.equal(t, stored[n]) for n, t in state.items())


def test_a_directory_without_weights_or_with_pickles_only(dirs: dict[str, Path],
                                                          tmp_path: Path, text: str) -> None:
    bare = save_dir("llama", tmp_path / "bare", text, weights=False)
    hf = hfmodel.open_model(bare)
    assert hf.weights == {} and hfmodel.load_weights(hf, {"x": torch.zeros(1)}).tensors == 0
    (bare / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="does not unpickle"):
        hfmodel.open_model(bare)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hfmodel.open_model(tmp_path)


def test_the_pipeline_loss_is_the_one_transformers_computes(dirs: dict[str, Path]) -> None:
    """Stages read from the files, local ranks: the loss of ``model(ids, labels=ids)``."""
    import transformers as tf

    from pipetrain.train.sources.choice import source_for
    from pipetrain.train.sources.hf_source import HFSource

    for name, directory in dirs.items():
        cfg = TrainConfig(hf=str(directory), seq_len=16, microbatches=2)
        source = source_for(cfg)
        assert isinstance(source, HFSource)
        schedule = ps.make_schedule("zbv", 2, 2)
        pipe = source.pipeline(cfg, schedule, 2, 0, lambda f: f, local_ranks=2)
        assert source.loaded(pipe)["tensors_read"] == len(pipe.state_dict())
        window = torch.randint(0, len(source.tokenizer), (4, 17),
                               generator=torch.Generator().manual_seed(1))
        got = pipe.step(source.feed(window[:, :-1]), window[:, 1:]).loss
        with torch.no_grad():
            want = tf.AutoModelForCausalLM.from_pretrained(directory)(input_ids=window,
                                                                       labels=window).loss
        assert got is not None and float(got.detach()) == pytest.approx(float(want), rel=1e-6), name


# -------------------------------------------------------------------------------- tokens


class Counting:
    """A tokenizer that counts the calls that encode."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0
        self.eos_token_id = inner.eos_token_id

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(text, **kwargs)


def test_a_corpus_is_tokenized_once_and_memory_mapped(tmp_path: Path, text: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.py").write_text(text[:4000])
    (data / "b.txt").write_text(text[4000:9000])
    directory = save_dir("gpt2", tmp_path / "m", text, weights=False)
    tok = Counting(tokenizer(text))
    first = tokens.token_corpus(tok, directory, str(data), tmp_path / "cache")
    calls = tok.calls
    again = tokens.token_corpus(tok, directory, str(data), tmp_path / "cache")
    assert calls == 2 and tok.calls == calls and torch.equal(first.data, again.data)
    assert first.data.dtype == torch.int32 and first.files == ("a.py", "b.txt")
    want = [*tok.inner(text[:4000])["input_ids"], tok.eos_token_id,
            *tok.inner(text[4000:9000])["input_ids"], tok.eos_token_id]
    assert first.data.tolist() == want
    assert first.n_train == len(want) - round(len(want) * 0.05)
    x, y = Batches(first.train, 4, 8, seed=3).batch(0)
    assert x.dtype == torch.long and torch.equal(x[:, 1:], y[:, :-1])
    (data / "b.txt").write_text(text[4000:9001])  # a changed file: tokenized again
    tokens.token_corpus(tok, directory, str(data), tmp_path / "cache")
    assert tok.calls > calls


def test_a_rank_waits_for_the_one_tokenizing_and_takes_over_a_stale_lock(
        tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "d.py").write_text(text[:3000])
    directory = save_dir("gpt2", tmp_path / "m", text, weights=False)
    tok = tokenizer(text)
    files = [tmp_path / "d.py"]
    key = tokens.cache_key(directory, files[0], files, None)
    cache = tmp_path / "cache"
    cache.mkdir()
    lock = cache / f"{key}.lock"
    lock.touch()  # another process is tokenizing
    done: list[Any] = []
    waiter = threading.Thread(target=lambda: done.append(tokens.token_corpus(
        tok, directory, str(files[0]), cache)))
    waiter.start()
    time.sleep(0.5)
    assert not done  # still waiting for the other process
    monkeypatch.setattr(tokens, "STALE_S", 0.0)  # the other process stopped touching it
    os.utime(lock, (time.time() - 10, time.time() - 10))
    waiter.join(timeout=30)
    assert done and len(done[0]) > 100 and not lock.exists()


# ---------------------------------------------------------------------------------- save


def test_save_pretrained_writes_what_transformers_loads_bitwise(dirs: dict[str, Path],
                                                                tmp_path: Path) -> None:
    import transformers as tf

    source = tf.AutoModelForCausalLM.from_pretrained(dirs["gpt2"])
    state = {n: p.detach() + 1 for n, p in source.named_parameters()}  # tied: one name
    out = save_pretrained(tmp_path / "hf", state, source.config,
                          tf.AutoTokenizer.from_pretrained(dirs["gpt2"]), dirs["gpt2"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state) and "lm_head.weight" not in state
    loaded = tf.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in state.items())
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert tf.AutoTokenizer.from_pretrained(out).decode([70, 71]) != ""
    again = save_pretrained(tmp_path / "hf", state, source.config, None, None)  # replaces it
    assert again == out and not (tmp_path / "hf.partial").exists()


def test_shard_sizes_parse() -> None:
    assert size_bytes("2GiB") == 2 << 30 and size_bytes("500MB") == 500_000_000
    assert size_bytes("4096") == 4096 and size_bytes("1.5 KiB") == 1536
    for bad in ("", "GiB", "2 parsecs", "0"):
        with pytest.raises(ValueError, match="shard-size"):
            size_bytes(bad)
