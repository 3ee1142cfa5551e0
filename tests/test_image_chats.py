"""Chats with images (:mod:`pipetrain.train.data.image_chats`) through a tiny LLaVA's own
processor: both conventions read alike, the loss on the assistant's tokens only and never on
an image's, text-only rows among them, examples whose images do not fit dropped, the feed
giving the processor's tensors, and each bad input named by its line with the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.image_chat import (
    conversations,
    exchanges,
    save_llava,
    save_paligemma,
    write_images,
    write_jsonl,
)

tf = pytest.importorskip("transformers")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image-chats")
    save_llava(root / "llava")
    save_paligemma(root / "paligemma")
    images = write_images(root / "data", 3)
    write_jsonl(root / "data" / "pairs.jsonl", exchanges(6, images))
    write_jsonl(root / "data" / "trl.jsonl", conversations(12, images))
    write_jsonl(root / "data" / "parts.jsonl", conversations(12, images, parts=True))
    return root


def _corpus(place: Path, data: Path | str, cache: str = "cache", model: str = "llava"
            ) -> Any:
    from pipetrain.hf.image_text import image_token_ids, load_processor
    from pipetrain.train.data.image_chats import image_chat_corpus

    processor = load_processor(place / model)
    config = tf.AutoConfig.from_pretrained(place / model)
    return image_chat_corpus(processor, image_token_ids(config, processor), place / model,
                             str(data), place / cache)


def test_both_conventions_give_the_same_examples_trained_on_the_assistant_only(
        place: Path) -> None:
    trl, _ = _corpus(place, place / "data" / "trl.jsonl")
    parts, _ = _corpus(place, place / "data" / "parts.jsonl")
    assert torch.equal(trl.ids, parts.ids) and torch.equal(trl.trained, parts.trained)
    image = int(tf.AutoConfig.from_pretrained(place / "llava").image_token_id)
    tok = tf.AutoTokenizer.from_pretrained(place / "llava")
    for e in range(len(trl)):
        a, b = int(trl.offsets[e]), int(trl.offsets[e + 1])
        ids, flags = trl.ids[a:b], trl.trained[a:b].bool()
        shown = len(trl.media[e]["images"])
        assert int((ids == image).sum()) == 16 * shown  # 16 placeholders an image, as its size
        assert not flags[ids == image].any()  # never an image token
        trained = tok.decode(ids[flags].tolist())
        assert "<|im_end|>" in trained and "user" not in trained  # the assistant's turns
        assert trl.media[e]["last_image"] == (int((ids == image).nonzero().max())
                                              if shown else -1)
    assert {len(m["images"]) for m in trl.media} == {0, 1, 2}


def test_the_feed_gives_the_processors_tensors_fit_to_the_rows(place: Path) -> None:
    from pipetrain.train.data.examples import example_batches

    corpus, feed = _corpus(place, place / "data" / "trl.jsonl")
    batches = example_batches(corpus, 3, 64, 0, 1, 1)[0]
    inputs, targets = batches.batch(0)
    fed = feed(inputs)
    assert list(fed)[:2] == ["input_ids", "attention_mask"] and "example" not in fed
    assert fed["input_ids"].shape == (3, 64) and torch.equal(fed["input_ids"],
                                                             inputs["input_ids"])
    shown = sum(len(corpus.media[e]["images"]) for e in batches.examples(0))
    assert fed.get("pixel_values", torch.zeros(0)).shape[0] == shown
    assert targets["labels"].shape == (3, 64)


def test_an_example_whose_image_does_not_fit_is_dropped(place: Path) -> None:
    """An answer, then a question with an image that ``--seq-len`` cuts: the example trains on
    tokens before the cut, but its image would not match its placeholders."""
    late = {"messages": [{"role": "user", "content": [TEXT]},
                         {"role": "assistant", "content": [{"type": "text", "text": "four"}]},
                         {"role": "user", "content": [{"type": "image"}, TEXT]},
                         {"role": "assistant", "content": [{"type": "text", "text": "five"}]}],
            "images": ["image1.png"]}
    path = write_jsonl(place / "data" / "late.jsonl", [late] * 2 + [_chat([TEXT])] * 2)
    corpus, _ = _corpus(place, path, cache="cache-late")
    image = corpus.media[0]["last_image"]
    kept, counts = corpus.usable(0, len(corpus), image)
    assert counts["image_cut"] == 2 and kept.tolist() == [2, 3]
    assert counts["examples"] == 2 and counts["dropped"] == 0
    kept, counts = corpus.usable(0, len(corpus), image + 1)
    assert counts["image_cut"] == 0 and kept.tolist() == [0, 1, 2, 3]


def _bad(place: Path, name: str, rows: list[dict[str, Any]], model: str = "llava") -> str:
    path = write_jsonl(place / "data" / name, rows)
    with pytest.raises(ValueError) as e:
        _corpus(place, path, cache=f"cache-{name}", model=model)
    return str(e.value)


def _chat(content: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": "four"}]}],
            **extra}


TEXT = {"type": "text", "text": "what is three"}


def test_bad_images_are_named_by_their_line(place: Path) -> None:
    good = _chat([{"type": "image"}, TEXT], images=["image0.png"])
    missing = _bad(place, "missing.jsonl", [good, _chat([{"type": "image"}, TEXT],
                                                        images=["nowhere.png"])])
    assert "line 2" in missing and "'nowhere.png' does not exist" in missing
    (place / "data" / "broken.png").write_bytes(b"not a png")
    broken = _bad(place, "broken.jsonl", [_chat([{"type": "image", "path": "broken.png"},
                                                 TEXT])])
    assert "line 1" in broken and "does not decode as an image" in broken
    more = _bad(place, "more.jsonl", [_chat([{"type": "image"}, {"type": "image"}, TEXT],
                                            images=["image0.png"])])
    assert "line 1" in more and "more {\"type\": \"image\"} placeholders than images" in more
    fewer = _bad(place, "fewer.jsonl", [_chat([TEXT], images=["image0.png"])])
    assert "beyond the 0" in fewer and "one placeholder per image" in fewer
    web = _bad(place, "web.jsonl", [_chat([{"type": "image", "url": "https://x.org/a.png"},
                                           TEXT])])
    assert "on the web" in web and "download it" in web


def test_a_text_model_given_images_is_told_so(tmp_path: Path) -> None:
    from helpers.chat import save_model
    from pipetrain.train.data.examples import example_corpus

    save_model(tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", [_chat([{"type": "image"}, TEXT],
                                                    images=["a.png"])])
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"row 0, turn 0: an image, but the model is a text "
                                         r"model .* give --hf an image-text checkpoint"):
        example_corpus(tok, tmp_path / "m", str(data), tmp_path / "cache", chat=True)


def test_a_directory_without_a_processor_says_how_to_save_one(place: Path,
                                                              tmp_path: Path) -> None:
    from pipetrain.hf.image_text import load_processor

    for f in (place / "llava").iterdir():
        if f.name not in ("processor_config.json", "preprocessor_config.json"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llava"
    with pytest.raises(FileNotFoundError, match=r"AutoProcessor\.from_pretrained\(.*\)"
                                                r"\.save_pretrained\(DIR\)"):
        load_processor(tmp_path)


def test_freezing_names_the_parts_and_refuses_a_model_without_them(place: Path) -> None:
    from pipetrain.train.sources.image_text_source import freeze

    model = tf.AutoModelForImageTextToText.from_pretrained(place / "llava")
    n = freeze(model, vision=True, projector=False)
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}
    assert n == sum(p.numel() for k, p in model.named_parameters() if k in frozen)
    assert frozen and all(".vision_tower." in "." + k for k in frozen)
    freeze(model, vision=False, projector=True)
    assert any("multi_modal_projector" in k for k, p in model.named_parameters()
               if not p.requires_grad)
    assert all(p.requires_grad for k, p in model.named_parameters() if "language_model" in k)
    with pytest.raises(ValueError, match="--freeze-vision: LlamaForCausalLM has no module"):
        freeze(tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=1, hidden_size=8,
                                                  intermediate_size=8, num_attention_heads=2,
                                                  vocab_size=16)), vision=True,
               projector=False)


def test_the_command_line_refuses_what_it_cannot_train_yet(tmp_path: Path) -> None:
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.sources.image_text_source import image_text_problems

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava"}))
    (problem,) = image_text_problems(TrainConfig(hf=str(tmp_path), tp=2), True)
    assert problem == "--tp is not supported for image-text models yet: drop it (--fsdp and " \
        "--dp compose)"
    flags = image_text_problems(TrainConfig(hf=str(tmp_path), freeze_vision=True), False)
    assert flags == ["--freeze-vision belongs to an image-text model (--hf DIR of LLaVA, "
                     "Gemma 3, Qwen2-VL, ...); drop it"]


def test_lora_by_default_adapts_the_language_models_projections_only(place: Path) -> None:
    """``--lora-r`` on an image-text model: peft's default targets for its text model, under
    its language model only (the CLIP tower has ``q_proj`` and ``v_proj`` too)."""
    pytest.importorskip("peft")
    from pipetrain.hf import lora

    model = tf.AutoModelForImageTextToText.from_pretrained(place / "llava")
    lora.add_adapters(model, lora.lora_config(4, 0.0, 0.0, "", model.config))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A" in n}
    assert adapted and all(".language_model." in n for n in adapted)
    assert {n.rsplit(".", 1)[1] for n in adapted} == {"q_proj", "v_proj"}
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


def test_a_processor_that_needs_a_missing_library_says_to_install_it(place: Path,
                                                                      tmp_path: Path) -> None:
    """A Qwen2-VL processor where torchvision does not import (its video processor needs it):
    refused with what to install, not as a missing processor."""
    import importlib

    try:
        importlib.import_module("torchvision")
        pytest.skip("torchvision imports here: the processor loads")
    except (ImportError, RuntimeError):
        pass
    from pipetrain.hf.image_text import load_processor

    for f in (place / "llava").iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "processor_config.json").write_text('{"processor_class": "Qwen2VLProcessor"}')
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 2, "merge_size": 2,
         "temporal_patch_size": 2}))
    with pytest.raises(ImportError, match=r"its processor needs a library that is not "
                                          r"installed \(.*[Tt]orchvision.*\); install it"):
        load_processor(tmp_path)


def test_paligemma_trains_the_answer_of_each_prompt(place: Path) -> None:
    """PaliGemma's processor has no chat template: a row's user turn is its prompt (prefix),
    the assistant's its answer (suffix), and only the answer's tokens train; the feed gives the
    processor's token types (1 on the answer) and not its labels."""
    from pipetrain.train.data.examples import example_batches

    corpus, feed = _corpus(place, place / "data" / "pairs.jsonl", "cache-pg", "paligemma")
    rows = [json.loads(line) for line in (place / "data" / "pairs.jsonl").read_text()
            .splitlines()]
    tok = tf.AutoTokenizer.from_pretrained(place / "paligemma")
    for e in range(len(corpus)):
        a, b = int(corpus.offsets[e]), int(corpus.offsets[e + 1])
        ids, flags = corpus.ids[a:b], corpus.trained[a:b].bool()
        answer = rows[e]["messages"][1]["content"][0]["text"]
        assert tok.decode(ids[flags].tolist()) == answer + tok.eos_token
        prompt = rows[e]["messages"][0]["content"][1]["text"]
        assert tok.decode(ids[~flags].tolist()) == "<image>" * 16 + "<bos>" + prompt + "\n"
    batches = example_batches(corpus, 3, 64, 0, 1, 1)[0]
    fed = feed(batches.batch(0)[0])
    assert "labels" not in fed and fed["pixel_values"].shape[0] == 3
    for r, e in enumerate(batches.examples(0)):
        a, b = int(corpus.offsets[e]), int(corpus.offsets[e + 1])
        assert fed["token_type_ids"][r, :b - a].tolist() == corpus.trained[a:b].tolist()


def test_paligemma_rows_that_are_not_one_prompt_and_its_answer_are_refused(place: Path) -> None:
    two = conversations(4, [Path("image0.png")])[3]  # two exchanges
    assert "a row is one user turn then one assistant turn, not the roles ['user', " \
        "'assistant', 'user', 'assistant']" in _bad(place, "pg-two.jsonl", [two], "paligemma")
    text = _chat([TEXT])
    said = _bad(place, "pg-text.jsonl", [text], "paligemma")
    assert "line 1: no image; PaliGemmaProcessor takes images with every prompt" in said


def test_rows_a_processor_leaves_out_for_want_of_an_image_get_empty_slots_back() -> None:
    """Mllama's torchvision backend gives aspect ratios for the rows with an image only (its
    PIL backend for every row): the feed puts zeros (empty slots) in the other rows' places."""
    from pipetrain.train.data.image_feed import _rows_of_images

    fitted = {"aspect_ratio_ids": torch.tensor([[1, 0], [1, 1]]),
              "pixel_values": torch.ones(3, 2, 1), "input_ids": torch.ones(3, 4)}
    _rows_of_images(fitted, [True, False, True])
    assert fitted["aspect_ratio_ids"].tolist() == [[1, 0], [0, 0], [1, 1]]
    assert fitted["pixel_values"].shape == (3, 2, 1)  # a row each already: as given


def test_images_one_after_another_are_not_taken_for_rows(place: Path) -> None:
    """LLaVA's pixels are its batch's images one after another: with one image in each of two
    of three rows they are two, not three rows' slots."""
    corpus, feed = _corpus(place, place / "data" / "trl.jsonl")
    by_count = {len(m["images"]): e for e, m in enumerate(corpus.media)}
    rows = [by_count[1], by_count[0], by_count[1]]
    images = [[feed._image(r, e) for r in corpus.media[e]["images"]] for e in rows]
    out = feed.tensors([corpus.media[e]["text"] for e in rows], images, 64)
    assert out["pixel_values"].shape[0] == 2


def test_crops_of_each_image_are_not_taken_for_a_rows_images(place: Path) -> None:
    """LLaVA-NeXT's pixels have five dimensions, (images, crops, ...), as Mllama's have a row's
    images on an axis: with one image in each of two of three rows, they stayed two images, not
    three rows (the feed made them three, an all-zero one in the middle, and the model read the
    first two: the wrong pixels for the third row, a loss off by 5e-4 and no error)."""
    from helpers.image_chat import save_llava_next

    if not (place / "llava_next").is_dir():
        save_llava_next(place / "llava_next")
    corpus, feed = _corpus(place, place / "data" / "trl.jsonl", "cache-next", "llava_next")
    by_count = {len(m["images"]): e for e, m in enumerate(corpus.media)}
    rows = [by_count[1], by_count[0], by_count[1]]
    images = [[feed._image(r, e) for r in corpus.media[e]["images"]] for e in rows]
    out = feed.tensors([corpus.media[e]["text"] for e in rows], images, 64)
    assert out["pixel_values"].dim() == 5
    assert out["pixel_values"].shape[0] == out["image_sizes"].shape[0] == 2
