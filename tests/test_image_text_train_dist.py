"""`pipetrain train --hf DIR --chat --data chats.jsonl` on image-text checkpoints, against
transformers.

Tiny LLaVA and Gemma 3 saved with their processors; rows of 0, 1 or 2 images of two sizes,
text-only rows among them. The step-0 loss is transformers' ``model(**processor(texts,
images), labels=...)`` on the run's rows with -100 on all but the assistant's tokens; a
checkpoint resumes at another layout with the same losses; ``<out>/hf`` loads with
``AutoModelForImageTextToText`` and ``AutoProcessor``; FSDP, ZB-V and ``--freeze-vision``
compose; ``--lora-r`` adapts the language model only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.image_chat import SAVERS, conversations, exchanges, write_images, write_jsonl
from helpers.runs import records as _records
from helpers.runs import train
from pipetrain.cli import main

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")
pytest.importorskip("datasets")

SEQ, ROWS = 64, 8
ARGS = ["--chat", "--seq-len", str(SEQ), "--batch-size", str(ROWS), "--microbatches", "4",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--grad-clip", "0",
        "--lr", "1e-3", "--warmup", "1", "--no-progress"]


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image-text-train")
    for name, save in SAVERS.items():
        save(root / name)
    images = write_images(root / "data", 3)
    write_jsonl(root / "data" / "trl.jsonl", conversations(40, images))
    write_jsonl(root / "data" / "parts.jsonl", conversations(40, images, parts=True))
    write_jsonl(root / "data" / "pairs.jsonl", exchanges(40, images))
    return root


def _train(place: Path, model: str, data: str, out: str, *args: str) -> dict[str, Any]:
    return train(["train", "--hf", str(place / model), "--data", str(place / "data" / data),
                  "--token-cache", str(place / "tokens"), "--out", str(place / out), *ARGS,
                  *args], place / out)


def _template_messages(row: dict[str, Any]) -> tuple[list[Any], list[str]]:
    """A row's messages with bare image parts, and its image files in order (either
    convention), written here apart from pipetrain's reader."""
    names = list(row.get("images") or [])
    out, files = [], []
    for m in row["messages"]:
        parts = []
        for p in m["content"]:
            if p["type"] == "image":
                files.append(p.get("path") or names.pop(0))
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": p["text"]})
        out.append({"role": m["role"], "content": parts})
    return out, files


def _reference(place: Path, model: str, data: str, step: int, directory: Path | None = None
               ) -> float:
    """transformers' loss on the run's batch ``step``: the processor's tensors for the rows'
    texts and images, cut to ``SEQ + 1`` tokens, labels -100 but on the cache's trained
    tokens (the model in ``directory``, default the source)."""
    from PIL import Image

    from pipetrain.hf.image_text import image_token_ids, load_processor
    from pipetrain.train.data.examples import example_batches
    from pipetrain.train.data.image_chats import image_chat_corpus

    root = place / model
    # Mllama's torchvision backend leaves out the aspect ratios of rows without an image, which
    # transformers' Mllama then cannot take; its PIL backend gives every row (pipetrain's feed
    # puts the missing rows back: tests/test_image_chats.py)
    processor = tf.AutoProcessor.from_pretrained(root, **(
        {"backend": "pil"} if model == "mllama" else {}))
    processor.tokenizer.padding_side = "right"
    corpus, _ = image_chat_corpus(load_processor(root), image_token_ids(
        tf.AutoConfig.from_pretrained(root), processor), root, str(place / "data" / data),
        place / "tokens")
    examples = example_batches(corpus, ROWS, SEQ, 0, 1, 1)[0].examples(step)
    rows = [json.loads(line) for line in (place / "data" / data).read_text().splitlines()]
    texts, images, answers = [], [], []
    for e in examples:
        messages, files = _template_messages(rows[e])
        if processor.chat_template:
            texts.append(processor.apply_chat_template(messages, tokenize=False))
        else:  # PaliGemma: the images and the user's text, the assistant's as the suffix
            texts.append("<image>" * len(files) + messages[0]["content"][-1]["text"])
            answers.append(messages[1]["content"][0]["text"])
        images.append([Image.open(place / "data" / f).convert("RGB") for f in files])
    batch = processor(text=texts, images=images if any(images) else None, padding="longest",
                      padding_side="right", add_special_tokens=False, return_tensors="pt",
                      **({"suffix": answers} if answers else {}))
    batch.pop("labels", None)
    width = SEQ + 1
    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    for r, e in enumerate(examples):
        a, n = int(corpus.offsets[e]), int(corpus.offsets[e + 1] - corpus.offsets[e])
        flags = corpus.trained[a:a + n].bool()
        assert torch.equal(ids[r, :n], corpus.ids[a:a + n].long())  # the processor's own ids
        labels[r, :n] = torch.where(flags, ids[r, :n], -100)
    inputs = {k: v[:, :width] if v.shape[:2] == ids.shape[:2] else v for k, v in batch.items()}
    whole = tf.AutoModelForImageTextToText.from_pretrained(directory or root)
    with torch.no_grad():
        return float(whole(**inputs, labels=labels[:, :width]).loss)


def test_llava_step0_loss_is_transformers_a_resume_continues_and_out_hf_loads(
        place: Path) -> None:
    first = _train(place, "llava", "trl.jsonl", "a", "--nproc", "2", "--schedule", "1f1b",
                   "--steps", "3", "--checkpoint-every", "2")
    assert first["layout"]["pp"] == 2
    (data,) = _records(place / "a", "data")
    assert data["reads"] == "chat" and data["examples"] > 30
    logged = _records(place / "a", "step")[0]["loss"]
    assert logged == pytest.approx(_reference(place, "llava", "trl.jsonl", 0), rel=1e-5)
    # the checkpoint of step 2 resumed at another layout (dp 2): the same examples and losses
    shutil.copytree(place / "a" / "checkpoints" / "step_000002",
                    place / "b" / "checkpoints" / "step_000002")
    second = _train(place, "llava", "trl.jsonl", "b", "--nproc", "2", "--dp", "2",
                    "--steps", "3")
    assert second["layout"]["dp"] == 2
    (done,), (again,) = _records(place / "a", "step")[2:], _records(place / "b", "step")
    assert again["step"] == 2 and again["loss"] == pytest.approx(done["loss"], rel=1e-5)
    # <out>/hf: the trained model and its processor, as transformers loads them
    out = place / "a" / "hf"
    processor = tf.AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "LlavaProcessor" and processor.chat_template
    trained = tf.AutoModelForImageTextToText.from_pretrained(out)
    source = tf.AutoModelForImageTextToText.from_pretrained(place / "llava")
    assert set(trained.state_dict()) == set(source.state_dict())
    moved = [k for k, v in trained.state_dict().items()
             if not torch.equal(v, source.state_dict()[k])]
    assert any("vision_tower" in k for k in moved) and any("language_model" in k for k in moved)
    assert _reference(place, "llava", "trl.jsonl", 0, out) < logged  # it learned


def test_gemma3_parts_under_fsdp_and_zbv_with_the_vision_tower_frozen(place: Path) -> None:
    summary = _train(place, "gemma3", "parts.jsonl", "g", "--nproc", "4", "--fsdp", "2",
                     "--schedule", "zbv", "--steps", "2", "--freeze-vision")
    assert (summary["layout"]["pp"], summary["layout"]["fsdp"]) == (2, 2)
    logged = _records(place / "g", "step")[0]["loss"]
    assert logged == pytest.approx(_reference(place, "gemma3", "parts.jsonl", 0), rel=1e-5)
    trained = tf.AutoModelForImageTextToText.from_pretrained(place / "g" / "hf").state_dict()
    source = tf.AutoModelForImageTextToText.from_pretrained(place / "gemma3").state_dict()
    moved = {k for k, v in trained.items() if not torch.equal(v, source[k])}
    assert not any("vision_tower" in k for k in moved)
    assert any("multi_modal_projector" in k for k in moved)
    assert any("language_model" in k for k in moved)


@pytest.mark.long  # beside
# test_verify_checks_an_image_text_model_on_its_processors_chats[mllama-flags2]
def test_mllama_cross_attends_to_padded_image_slots_and_its_loss_is_transformers(
        place: Path) -> None:
    """Mllama gives each row an axis of images: every batch gets as many slots as the data's
    most (empty ones padded, a batch without an image all empty), so one capture serves all;
    the step-0 loss is transformers' on the processor's own batch."""
    _train(place, "mllama", "trl.jsonl", "mllama", "--nproc", "2", "--steps", "2")
    logged = _records(place / "mllama", "step")[0]["loss"]
    assert logged == pytest.approx(_reference(place, "mllama", "trl.jsonl", 0), rel=1e-5)


@pytest.mark.long  # beside tests/test_image_chats.py::
# test_paligemma_trains_the_answer_of_each_prompt
def test_paligemma_trains_each_answer_and_its_loss_is_transformers(place: Path) -> None:
    """PaliGemma has no chat template: each row is a prompt with its image and an answer, the
    processor's prefix and suffix; the step-0 loss is transformers' on the processor's batch
    with the suffix as labels, under ZB-V."""
    _train(place, "paligemma", "pairs.jsonl", "pg", "--nproc", "2", "--schedule", "zbv",
           "--steps", "2")
    logged = _records(place / "pg", "step")[0]["loss"]
    assert logged == pytest.approx(_reference(place, "paligemma", "pairs.jsonl", 0), rel=1e-5)
    assert tf.AutoProcessor.from_pretrained(place / "pg" / "hf").image_seq_length == 16


@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests); in CI: tests/test_image_chats.py::
# test_lora_by_default_adapts_the_language_models_projections_only
def test_lora_adapts_the_language_model_only(place: Path) -> None:
    peft = pytest.importorskip("peft")
    _train(place, "llava", "trl.jsonl", "l", "--nproc", "2", "--steps", "2", "--lora-r", "4")
    adapter = place / "l" / "adapter"
    from safetensors.torch import load_file

    names = list(load_file(adapter / "adapter_model.safetensors"))
    assert names and all("language_model" in n for n in names), names
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in names} == {"q_proj", "v_proj"}
    base = tf.AutoModelForImageTextToText.from_pretrained(place / "llava")
    adapted = peft.PeftModel.from_pretrained(base, str(adapter))
    assert sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n) > 0


def _torchvision() -> bool:
    """Whether torchvision imports (the Qwen-VL processors' video processor needs it; beside
    the CPU torch CI runs on, it does not)."""
    import importlib

    try:
        importlib.import_module("torchvision")
    except (ImportError, RuntimeError):
        return False
    return True


_VISION = pytest.mark.skipif(not _torchvision(), reason="its processor needs torchvision")
"""For the families whose processors need torchvision: Qwen-VL's and SmolVLM's video
processors, Mistral 3's Pixtral processor."""


VISION = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3", "smolvlm", "internvl",
          "llava_onevision")
"""The families whose processors need torchvision (SmolVLM's also num2words)."""


def _saved(place: Path, model: str) -> Path:
    """``place / model``, saved there first for a family the fixture does not save (those whose
    processors need torchvision)."""
    from helpers import image_chat

    if not (place / model).is_dir():
        if model.startswith("qwen"):
            image_chat.save_qwen_vl(place / model, model)
        else:
            getattr(image_chat, f"save_{model}")(place / model)
    return place / model


@pytest.mark.parametrize("model", [
    pytest.param("llava", marks=pytest.mark.long), pytest.param("gemma3", marks=pytest.mark.long),
    "paligemma",
    pytest.param("mllama", marks=pytest.mark.long),
    pytest.param("llava_next", marks=pytest.mark.long),
    pytest.param("idefics3", marks=pytest.mark.long),
    *(pytest.param(f, marks=_VISION) for f in VISION)])
# all but PaliGemma in the long tier for CI's time (CONTRIBUTING.md: tests); in CI: PaliGemma
# here (the command's path; its token types go through generation as Gemma 3's do), and Qwen3-VL
# and Mllama in tests/test_generation_images.py
def test_generate_with_an_image_gives_transformers_greedy_tokens(place: Path, model: str,
                                                                 tmp_path: Path) -> None:
    """``pipetrain generate --hf DIR --image PATH --prompt TEXT --prompt TEXT --batch 2`` on 2
    processes (a KV cache per stage, the vision tower in the first, the shorter prompt padded
    on the left; Mllama's cross-attention to the image states at every step; the Qwen-VL
    family's positions on three axes from the image grid, continued by each row's delta;
    LLaVA-NeXT's crops by image size) against ``model.generate(do_sample=False)`` on each
    prompt's chat of the same image alone. The Qwen-VL models and Mistral 3 run where
    torchvision imports (docs/multimodal.md)."""
    from PIL import Image

    _saved(place, model)
    image, prompts, new = place / "data" / "image1.png", ["what is three", "one two"], 10
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--hf", str(place / model), "--image", str(image), "--batch", "2",
            "--max-new-tokens", str(new), "--nproc", "2", "--out", str(out)]
    assert main([*argv, *(a for p in prompts for a in ("--prompt", p))]) == 0
    got = [json.loads(line)["tokens"] for line in out.read_text().splitlines()]
    processor = tf.AutoProcessor.from_pretrained(place / model)
    whole = tf.AutoModelForImageTextToText.from_pretrained(place / model).eval()
    for prompt, tokens in zip(prompts, got, strict=True):
        chat = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": prompt}]}]
        text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
            if processor.chat_template else "<image>" + prompt  # PaliGemma: a prefix
        batch = processor(text=[text], images=[[Image.open(image).convert("RGB")]],
                          add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            want = whole.generate(**batch, max_new_tokens=new, do_sample=False)
        assert tokens == want[0, batch["input_ids"].shape[1]:].tolist(), prompt
        # a varied answer (PaliGemma's weights are drawn wide for it); the tiny Gemma 3 repeats
        assert len(set(tokens)) > 2 or model == "gemma3"


def test_generate_refuses_an_image_for_a_text_model_and_none_for_an_image_text_one(
        place: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from helpers.chat import save_model

    save_model(tmp_path / "text")
    image = str(place / "data" / "image0.png")
    assert main(["generate", "--hf", str(tmp_path / "text"), "--image", image,
                 "--prompt", "a"]) == 2
    assert "is a text model (its config has no vision_config); drop --image" in \
        capsys.readouterr().err
    assert main(["generate", "--hf", str(place / "llava"), "--prompt", "a"]) == 2
    assert "is an image-text model: give --image PATH" in capsys.readouterr().err
    assert main(["generate", "--hf", str(place / "llava"), "--image", "nowhere.png",
                 "--prompt", "a"]) == 2
    assert "'nowhere.png' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(("model", "flags"), [
    pytest.param("llava", ["--schedule", "zbv"], marks=pytest.mark.long),
    pytest.param("gemma3", ["--layers", "2", "--width", "16"], marks=pytest.mark.long),
    ("mllama", []), pytest.param("paligemma", [], marks=pytest.mark.long),
    pytest.param("idefics3", [], marks=pytest.mark.long)])
# all but Mllama in the long tier for CI's time (CONTRIBUTING.md: tests); in CI: Mllama, its
# processor's chats fed with a row's axis of image slots, padded as the training feed pads them
def test_verify_checks_an_image_text_model_on_its_processors_chats(
        place: Path, model: str, flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``pipetrain verify --hf DIR``: one float64 step on chats with random images made by the
    model's processor, split as ``train`` splits it, every gradient (the vision tower's too)
    within 1e-9 of one process."""
    assert main(["verify", "--hf", str(place / model), "--seq-len", "64", "--pp", "2",
                 *flags]) == 0
    out = capsys.readouterr().out
    assert ("with a random image each" if model == "paligemma" else
            "with 0 to 2 random images of two sizes") in out and "PASS" in out
    assert ("vision_model" if model in ("mllama", "idefics3") else "vision_tower") in out
    assert ("connector" if model == "idefics3" else "multi_modal_projector") in out
    assert main(["verify", "--hf", str(place / model), "--seq-len", "20", "--pp", "2"]) == 2
    assert "is shorter than the check's chats" in capsys.readouterr().err


@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests); in CI: the LLaVA train and PaliGemma
# generate tests above run the same two commands with other flags
def test_the_page_recipe_runs_at_a_tiny_size(place: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/multimodal.md's two commands, as written but for the steps: a tiny LLaVA
    directory in, a fine-tuned one out, and text from it with an image."""
    from test_docs import ROOT, console_line

    page = ROOT / "docs" / "multimodal.md"
    shutil.copytree(place / "llava", tmp_path / "tiny-llava")
    images = write_images(tmp_path, 3)
    write_jsonl(tmp_path / "chats.jsonl", conversations(40, images))
    shutil.copyfile(images[1], tmp_path / "cat.png")
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
        monkeypatch.delenv(key)
    train = console_line(page, "train --hf tiny-llava").split()
    assert train[:4] == ["python3", "-m", "pipetrain", "train"], train
    assert main([*train[3:], "--steps", "2", "--eval-batches", "1", "--no-progress",
                 "--sample-tokens", "0", "--token-cache", str(tmp_path / "tokens")]) == 0
    out = Path(train[train.index("--out") + 1])
    assert len(_records(out, "step")) == 2 and (out / "hf" / "processor_config.json").is_file()
    generate = console_line(page, "generate --hf").split()
    quoted = generate.index("--prompt")
    assert main([*generate[3:quoted], "--prompt", "What is in the picture?",
                 "--max-new-tokens", "4"]) == 0


def test_an_image_text_model_without_chat_data_is_refused_before_any_process(
        place: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--hf", str(place / "llava"), "--steps", "1"]) == 2
    assert "is an image-text model: train it on chats with images, --chat --data" in \
        capsys.readouterr().err
    assert main(["train", "--hf", str(place / "llava"), "--chat", "--data",
                 str(place / "data" / "trl.jsonl"), "--pack"]) == 2
    assert "--pack is not supported for image-text models yet" in capsys.readouterr().err
    bare = place / "no-processor"
    shutil.copytree(place / "llava", bare)
    (bare / "processor_config.json").unlink()
    assert main(["train", "--hf", str(bare), "--chat", "--data",
                 str(place / "data" / "trl.jsonl")]) == 2
    assert "no processor could be loaded" in capsys.readouterr().err


@pytest.mark.parametrize("family", [
    # the long tier for CI's time (CONTRIBUTING.md: tests); in CI: LLaVA-NeXT on meta, its
    # split of mixed sizes and its feed (tests/test_vision_language.py,
    # tests/test_image_chats.py); verify[mllama] above has a row's axis of images too, and
    # Idefics3's split of it runs in tests/test_vision_language.py
    pytest.param("llava_next", marks=pytest.mark.long),
    pytest.param("idefics3", marks=pytest.mark.long),
    *(pytest.param(f, marks=_VISION) for f in VISION)])
def test_more_families_train_through_the_command_and_verify(
        place: Path, family: str, capsys: pytest.CaptureFixture[str]) -> None:
    """More families through ``train`` (rows of 0-2 images of two sizes; the step-0 loss is
    transformers') and ``verify``: LLaVA-NeXT (crops chosen by each image's size, built on
    ``meta`` as every command builds it), Idefics3 (a row's images on an axis of their own),
    the Qwen-VL family (M-RoPE positions from the image grids) and Mistral 3 (images at their
    own size). The last four run where torchvision imports beside torch (docs/multimodal.md
    says how they were run)."""
    _saved(place, family)
    _train(place, family, "trl.jsonl", f"out-{family}", "--nproc", "2", "--steps", "2",
           "--schedule", "zbv")
    logged = _records(place / f"out-{family}", "step")[0]["loss"]
    assert logged == pytest.approx(_reference(place, family, "trl.jsonl", 0), rel=1e-5)
    assert type(tf.AutoProcessor.from_pretrained(place / f"out-{family}" / "hf")).__name__ \
        == type(tf.AutoProcessor.from_pretrained(place / family)).__name__
    assert main(["verify", "--hf", str(place / family), "--seq-len", "96", "--pp", "2"]) == 0
    assert "PASS" in capsys.readouterr().out
