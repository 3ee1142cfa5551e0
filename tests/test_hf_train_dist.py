"""`pipetrain train --hf`: a tiny Llama and a tiny GPT-2, saved by transformers with a tokenizer,
train on 2 processes (zbv) and on 4 (1f1b), come back as ``OUT/hf`` that transformers loads,
and end with the same weights (Llama bitwise; GPT-2, whose tied table is summed in another
order, to rounding); the step-0 loss logged is the one ``model(input_ids, labels=...)`` gives,
and the greedy sample at the end is transformers' ``generate`` of ``OUT/hf``.
Every feature at once is tests/test_hf_train_all.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.hf import python_text, save_dir
from pipetrain.checkpoint import run as checkpoint
from pipetrain.checkpoint import store as checkpoint_store
from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

COMMON = ["--seq-len", "32", "--batch-size", "8", "--microbatches", "4", "--steps", "3",
          "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--grad-clip", "0",
          "--warmup", "1", "--lr", "1e-2", "--no-progress"]


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    text = python_text()
    (root / "data.py").write_text(text)
    for name in ("llama", "gpt2"):
        save_dir(name, root / name, text)
    return root


def _env(faults: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    if faults:
        env["PIPETRAIN_FAULTS"] = faults
    return env


def _train(place: Path, name: str, out: str, *args: str, launcher: list[str] | None = None,
           faults: str | None = None) -> dict[str, Any]:
    """``pipetrain train --hf``: through ``launcher`` (torchrun) in a process of its own, else
    the command's ``main`` in this process (what ``python -m pipetrain`` calls; its ranks
    start from this session's forkserver, which has imported torch and transformers)."""
    argv = ["train", "--hf", str(place / name), "--data", str(place / "data.py"),
            "--token-cache", str(place / "tokens"), *COMMON, "--out", str(place / out), *args]
    if launcher:
        done = subprocess.run([*launcher, *argv], env=_env(faults), capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        with pytest.MonkeyPatch.context() as env:
            for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
                env.delenv(key)
            if faults:
                env.setenv("PIPETRAIN_FAULTS", faults)
            assert main(argv) == 0
    return json.loads((place / out / "summary.json").read_text())  # type: ignore[no-any-return]


def _hf_model(path: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path)


def _checkpointed(path: Path) -> dict[str, torch.Tensor]:
    """The parameters of a committed checkpoint, by the model's names."""
    opened = checkpoint_store.open_checkpoint(path)
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
             for k, v in opened.metadata.state_dict_metadata.items() if k.startswith("model/")}
    checkpoint.load(path, state, strict=False)
    return {k[len("model/"):]: v for k, v in state.items()}


def _records(out: Path, kind: str) -> list[dict[str, Any]]:
    lines = (out / "log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def _transformers_loss(place: Path, name: str, weights: Path | None = None,
                       batch: int = 0) -> float:
    """``model(input_ids, labels=...)`` on one process (the weights of ``name``, or of
    ``weights``), on the run's batch ``batch``."""
    import transformers as tf

    from pipetrain.train.data.text import Batches
    from pipetrain.train.data.tokens import token_corpus

    tok = tf.AutoTokenizer.from_pretrained(place / name)
    corpus = token_corpus(tok, place / name, str(place / "data.py"), place / "tokens")
    inputs, targets = Batches(corpus.train, 8, 32, seed=0).batch(batch)
    window = torch.cat([inputs, targets[:, -1:]], dim=1)  # the targets are the inputs shifted
    with torch.no_grad():
        return float(_hf_model(weights or place / name)(input_ids=window,
                                                        labels=window).loss)


@pytest.mark.long  # beside test_examples_train_dist.py::test_step0_loss_is_transformers_masked_...
@pytest.mark.parametrize("name", ["llama", "gpt2"])
# in CI: --hf training against transformers' loss, test_examples_train_dist.py; OUT/hf loaded
# back, tests/test_docs.py::test_the_hf_page_runs_at_a_tiny_size; gpt2 split across processes
# in tests/test_hf_dist.py
def test_two_layouts_end_with_the_same_weights_that_transformers_loads(place: Path,
                                                                        name: str) -> None:
    import transformers as tf

    two = _train(place, name, f"{name}-pp2", "--nproc", "2", "--schedule", "zbv",
                 "--sample-tokens", "6", "--sample-top-k", "0")  # greedy: transformers' own
    four = _train(place, name, f"{name}-pp4", "--nproc", "4" if name == "llama" else "2",
                  "--schedule", "1f1b")  # GPT-2: its tie within a rank, then across ranks
    assert two["layout"]["pp"] == 2 and four["layout"]["pp"] == (4 if name == "llama" else 2)
    a, b = (_hf_model(place / f"{name}-{x}" / "hf") for x in ("pp2", "pp4"))
    assert type(a).__name__ == {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel"}[name]
    tok = tf.AutoTokenizer.from_pretrained(place / f"{name}-pp2" / "hf")
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
    want = _checkpointed(Path(two["checkpoint"]))
    got = a.state_dict()
    assert [n for n, t in want.items() if not torch.equal(got[n], t)] == []  # bitwise
    start = _hf_model(place / name).state_dict()
    for n, t in b.state_dict().items():  # GPT-2: rounding, which AdamW scales up to 1e-4 of
        other, moved = got[n], (got[n] - start[n]).abs().max()  # a step where a gradient is
        same = torch.equal(t, other) if name == "llama" else bool(  # ~0 (the key bias)
            (t - other).abs().max() <= 1e-3 * moved)
        assert same and moved > 0, f"{name} {n}: pp=2 zbv and pp=4 1f1b end elsewhere"
    for load in _records(place / f"{name}-pp4", "start")[0]["load"]:  # each rank its share
        assert load["weights"] == "stored" and load["bytes_read"] == load["share_bytes"]
        assert 0 < load["share_bytes"] < load["model_bytes"]
    logged = _records(place / f"{name}-pp2", "step")[0]["loss"]
    assert logged == pytest.approx(_transformers_loss(place, name), rel=1e-5)
    prompt = tok("def ", add_special_tokens=False, return_tensors="pt")["input_ids"]
    config = a.generation_config
    config.eos_token_id = None  # the sample runs its 6 tokens
    greedy = a.generate(input_ids=prompt, max_new_tokens=6, do_sample=False,
                        generation_config=config, pad_token_id=0)[0]
    assert two["sample"] == tok.decode(greedy)
    assert _records(place / f"{name}-pp2", "sample")[0]["kv_cache"]  # from OUT/hf, cached


@pytest.mark.long  # beside test_image_text_train_dist.py::test_gemma3_parts_under_fsdp_and_zbv_...
def test_fsdp_trains_a_stored_llama_like_dp_and_writes_it_whole(place: Path) -> None:
    """pp=2 x fsdp=2 on 4 processes loads the stored weights into its shards, trains with the
    losses of the pp=2 run above (same global batch), and writes OUT/hf whole, equal to that
    run's (to rounding)."""
    if not (place / "llama-pp2" / "summary.json").exists():  # run alone
        _train(place, "llama", "llama-pp2", "--nproc", "2", "--schedule", "zbv")
    sharded = _train(place, "llama", "llama-fsdp", "--nproc", "4", "--pp", "2", "--fsdp", "2")
    assert sharded["layout"]["fsdp"] == 2
    losses = [[r[k] for r in _records(place / out, "step") for k in ("loss", "grad_norm")]
              for out in ("llama-fsdp", "llama-pp2")]  # norms too: AdamW hides a wrong one
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    a, b = (_hf_model(place / out / "hf").state_dict() for out in ("llama-fsdp", "llama-pp2"))
    start = _hf_model(place / "llama").state_dict()
    assert a.keys() == b.keys()
    for n in a:
        moved = (b[n] - start[n]).abs().max()
        assert (a[n] - b[n]).abs().max() <= 1e-3 * moved + 1e-7, n


# in CI: tp by a model's own plan, tests/test_tensor_parallel_dist.py::
# test_hugging_face_models_split_by_their_own_plan_give_one_devices_gradients; train --tp and its
# resume across layouts, tests/test_train_dist.py::test_tp_trains_like_fsdp_and_resumes_across_them
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_tp_splits_a_stored_llama_by_its_own_plan_and_resumes_across_layouts(
        place: Path) -> None:
    """pp=2 x tp=2 (Llama's base_model_tp_plan: q, k, v, gate and up column-wise, o and down
    row-wise; 2 of its 4 heads and 1 of its 2 key/value heads per rank) trains with the
    losses and gradient norms of the pp=2 run and writes OUT/hf whole and equal to that run's;
    its checkpoint resumes at pp=2 alone, whose next loss is transformers' on those weights."""
    if not (place / "llama-pp2" / "summary.json").exists():  # run alone
        _train(place, "llama", "llama-pp2", "--nproc", "2", "--schedule", "zbv")
    split = _train(place, "llama", "llama-tp", "--nproc", "4", "--pp", "2", "--tp", "2",
                   "--sample-tokens", "6")
    assert split["layout"]["tp"] == 2 and split["sample"].startswith("def ")
    start = _records(place / "llama-tp", "start")[0]  # the whole layout, tp counted
    assert start["world"] == 4 and start["degrees"] == {"pp": 2, "dp": 1, "fsdp": 1, "tp": 2,
                                                        "ep": 1}
    curves = [[r[k] for r in _records(place / out, "step") for k in ("loss", "grad_norm")]
              for out in ("llama-tp", "llama-pp2")]
    assert curves[0] == pytest.approx(curves[1], rel=1e-5)
    a, b = (_hf_model(place / out / "hf").state_dict() for out in ("llama-tp", "llama-pp2"))
    start = _hf_model(place / "llama").state_dict()
    for n in a:  # whole: transformers loads it as it is
        moved = (b[n] - start[n]).abs().max()
        assert (a[n] - b[n]).abs().max() <= 1e-3 * moved + 1e-7, n
    want = _transformers_loss(place, "llama", weights=place / "llama-tp" / "hf", batch=3)
    _train(place, "llama", "llama-tp", "--nproc", "2", "--steps", "4", "--sample-tokens", "0")
    resumed = _records(place / "llama-tp", "step")[-1]
    assert resumed["step"] == 3 and resumed["loss"] == pytest.approx(want, rel=1e-5)


def test_tp_refuses_a_model_without_a_plan_or_weights(place: Path, tmp_path: Path) -> None:
    from pipetrain.hf.model import open_model
    from pipetrain.hf.tp_plan import shrink

    with pytest.raises(ValueError, match="GPT2LMHeadModel declares no tensor-parallel plan"):
        shrink(open_model(place / "gpt2").model, 2)
    with pytest.raises(ValueError, match="tp=3 must divide the model's num_attention_heads=4"):
        shrink(open_model(place / "llama").model, 3)
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.sources.hf_source import HFSource

    bare = save_dir("llama", tmp_path / "bare", (place / "data.py").read_text(), weights=False)
    cfg = TrainConfig(hf=str(bare), tp=2)
    with pytest.raises(ValueError, match="--tp with --hf needs the checkpoint's weights"):
        HFSource(cfg).tensor_parallel(cfg, None)  # refused before any mesh is used
