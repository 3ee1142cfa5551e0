"""`pipetrain generate --hf DIR`: a saved tiny Llama with its tokenizer, on 2 processes: the
text for one prompt is transformers' own greedy ``generate`` of the same directory, and what
rank 0 streams of it is whole characters;
the JSON lines for several, sampled, are the tokens of one process; bad flags exit 2, a failed
rank 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.hf import python_text, save_dir
from pipetrain.cli import main
from pipetrain.generation import Generator, Sampling
from pipetrain.train.commands.generate_command import Request, _Printer

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

PROMPTS = ["def ", "class Parser(object):", "import"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_dir("llama", tmp_path_factory.mktemp("gen") / "llama", python_text(2), seed=1)


def _greedy(directory: Path, prompt: str, new: int) -> tuple[list[int], str]:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(directory)
    model = tf.AutoModelForCausalLM.from_pretrained(directory)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    config = model.generation_config
    config.eos_token_id = tok.eos_token_id
    out = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0,
                         generation_config=config)[0, ids.shape[1]:].tolist()
    return out, tok.decode([t for t in out if t != tok.eos_token_id], skip_special_tokens=True)


def test_one_prompt_is_transformers_text(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "greedy.jsonl"
    assert main(["generate", "--hf", str(saved), "--nproc", "2", "--device", "cpu",
                 "--prompt", "def ", "--max-new-tokens", "20", "--window", "3",
                 "--out", str(out)]) == 0
    line = json.loads(out.read_text())
    assert (line["tokens"], line["text"]) == _greedy(saved, "def ", 20)


def test_one_prompt_streams_whole_characters(saved: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """What rank 0 prints for one prompt, window by window: the text gained, a character whose
    bytes are not all there yet held back until they are, the end token left out."""
    tok = _tokenizer(saved)
    ids = tok("é", add_special_tokens=False)["input_ids"] + tok(" x", add_special_tokens=False)[
        "input_ids"] + [tok.eos_token_id, 0]
    request = Request(str(saved), ("def ",), 8, 1, 0.0, 0, 1.0, 0, 256, 1, 60.0, False, None)
    printer = _Printer(tok, request, [[1]], speaks=True)
    printed = []
    for token in ids:  # one token per window
        printer.window([[token]])
        printed.append(capsys.readouterr().out)
    printer.finish([ids])
    printed.append(capsys.readouterr().out)
    assert "".join(printed) == "def é x\n"
    assert len(tok("é", add_special_tokens=False)["input_ids"]) == 2  # split over 2 windows
    assert printed[:2] == ["def ", "é"] and not any("\ufffd" in p for p in printed)


@pytest.mark.long  # beside test_one_prompt_is_transformers_text
def test_several_prompts_as_json(saved: Path, tmp_path: Path) -> None:
    """Three prompts from a file, in groups of 2, sampled: the tokens of one process (the
    greedy text against transformers is the test above, and tests/test_generation.py's)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sampled = tmp_path / "sampled.jsonl"
    assert main(["generate", "--hf", str(saved), "--nproc", "2", "--device", "cpu",
                 "--prompts", str(prompts), "--batch", "2", "--prefill", "3",
                 "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--seed", "3",
                 "--max-new-tokens", "8", "--out", str(sampled)]) == 0
    lines = [json.loads(x) for x in sampled.read_text().splitlines()]
    assert [x["prompt"] for x in lines] == PROMPTS
    assert [x["tokens"] for x in lines] == _one_process(saved, Sampling(0.9, 20, 0.9, seed=3))
    tok = _tokenizer(saved)
    assert [x["text"] for x in lines] == [tok.decode(x["tokens"], skip_special_tokens=True)
                                          for x in lines]


def _tokenizer(directory: Path) -> Any:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(directory)


def _one_process(directory: Path, sampling: Sampling) -> list[list[int]]:
    """The command's prompts and sampling, all ranks of one stage in this process."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(directory)
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    gen = Generator.from_pretrained(str(directory), rows=1, length=32, local_ranks=1)
    return gen.generate(ids, 8, sampling=sampling, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                        else (tok.eos_token_id or 0))


@pytest.mark.parametrize(("extra", "problem"), [
    ([], "at least one --prompt"),
    (["--prompt", "x", "--batch", "0"], "--batch must be at least 1"),
    (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--prompt", "def f(x):", "--max-new-tokens", "64"], "use --max-new-tokens"),
])
def test_bad_flags_exit_2(saved: Path, extra: list[str], problem: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--hf", str(saved), *extra]) == 2
    assert problem in capsys.readouterr().err


def test_more_ranks_than_decoder_layers_exit_2_before_any_capture(
        saved: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """``--nproc 5`` on a 4-layer model: refused in the launcher, naming the layers and the
    --nproc to use (it failed in torch.export's capture on every rank); under torchrun, its
    world is the number asked for."""
    from pipetrain.train.launch import elastic

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process was started")

    monkeypatch.setattr(elastic, "launch_local", started)
    assert main(["generate", "--hf", str(saved), "--prompt", "def ", "--nproc", "5",
                 "--max-new-tokens", "4"]) == 2
    assert ("LlamaForCausalLM has 4 decoder layers, fewer than the 5 stages asked for (--nproc "
            "5: one stage a rank); generation cuts between decoder layers only: use --nproc 4 "
            "or fewer") in capsys.readouterr().err
    monkeypatch.setattr(elastic, "worker", started)
    for key, value in {"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    assert main(["generate", "--hf", str(saved), "--prompt", "def ", "--max-new-tokens", "4"]) == 2
    assert "(6 torchrun processes: one stage a rank)" in capsys.readouterr().err


def test_a_generator_refuses_more_ranks_than_decoder_layers(saved: Path) -> None:
    from pipetrain.hf.model import open_model

    with pytest.raises(ValueError, match="has 4 decoder layers, fewer than the 5 stages asked "
                                         "for .5 ranks: one stage a rank.*use 4 ranks or fewer"):
        Generator(open_model(saved).model, local_ranks=5)


def test_a_directory_without_config_exits_2(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--hf", str(tmp_path), "--prompt", "x"]) == 2
    assert "has no config.json" in capsys.readouterr().err


@pytest.mark.long  # beside test_train_launch.py::test_a_failed_rank_stops_every_rank_within_...
def test_a_failed_rank_exits_1(saved: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """Stored tensors that do not fit the config: each rank refuses them, the job exits 1."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] *= 2
    (broken / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--hf", str(broken), "--nproc", "2", "--device", "cpu",
                 "--prompt", "def ", "--max-new-tokens", "8"]) == 1
    err = capsys.readouterr().err
    assert "pipetrain generate: " in err and "failed first" in err and "has shape" in err, err
