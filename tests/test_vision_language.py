"""Image-text-to-text models of transformers through ``pt.Pipeline``
(:mod:`pipetrain.split.prefix`): tiny configs built here (nothing is downloaded),
``split_points="auto"``, float64, 2 local ranks, rows holding 0, 1 or 2 images of different
sizes, against the same micro-batches built apart and run one after another through the unsplit
model: the loss and every gradient within 1e-9 of the largest reference gradient, and every
parameter held by one stage."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError
from pipetrain.split.lazy import NamedInit
from pipetrain.split.prefix import vision_prefix
from test_zoo import differences as zoo_differences

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

V, S, IMG = 96, 40, 95  # vocabulary, row length, the image placeholder token
TOL = 1e-9
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SIGLIP = dict(image_size=8, patch_size=2, hidden_size=16, intermediate_size=32,
              num_hidden_layers=1, num_attention_heads=2)
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])
QWEN_IDS = dict(image_token_id=IMG, video_token_id=V - 2, vision_start_token_id=V - 3,
                vision_end_token_id=V - 4)
QWEN_VISION = dict(depth=2, num_heads=2, patch_size=2, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3)
Row = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Family:
    """One image-text architecture: its model, and a row of text with ``n`` images."""

    name: str
    build: Callable[[], nn.Module]
    row: Callable[[int, torch.Generator], Row]
    images: tuple[int, ...] = (1, 0, 2, 1)  # per row of the batch


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _text(g: torch.Generator) -> torch.Tensor:
    return torch.randint(1, V - 5, (1, S), generator=g)


def square_images(tokens: int, typed: bool = False) -> Callable[[int, torch.Generator], Row]:
    """Rows for a model whose images are ``[n, 3, 8, 8]`` and fill ``tokens`` placeholders
    each (LLaVA, Gemma 3, PaliGemma); ``typed``: with token types (1 on image tokens)."""
    def row(n: int, g: torch.Generator) -> Row:
        ids = _text(g)
        ids[0, 2:2 + tokens * n] = IMG
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if n:
            out["pixel_values"] = _randn(g, n, 3, 8, 8)
        if typed:
            out["token_type_ids"] = (ids == IMG).long()
        return out
    return row


def qwen_images(g: torch.Generator, n: int) -> Row:
    """A Qwen-VL row: images of grids 1x4x4 and 1x2x4 (4 and 2 placeholders), each between a
    vision start and end token, patches flattened into ``pixel_values``."""
    ids, at, patches, grids = _text(g), 1, [], []
    for i in range(n):
        grid = (1, 4, 4) if i % 2 == 0 else (1, 2, 4)
        tokens = grid[0] * grid[1] * grid[2] // 4
        ids[0, at], ids[0, at + 1:at + 1 + tokens], ids[0, at + 1 + tokens] = V - 3, IMG, V - 4
        at += tokens + 2
        patches.append(_randn(g, grid[0] * grid[1] * grid[2], 3 * 2 * 2 * 2))
        grids.append(grid)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "mm_token_type_ids": (ids == IMG).int()}
    if n:
        out.update(pixel_values=torch.cat(patches), image_grid_thw=torch.tensor(grids))
    return out


def mllama_row(n: int, g: torch.Generator) -> Row:
    """An Mllama row: one image slot of up to 2 tiles (``n``: tiles used), cross-attended from
    the placeholder on."""
    ids = _text(g)
    ids[0, 1] = IMG
    tiles = max(n, 1)
    mask = torch.zeros(1, S, 1, 2, dtype=torch.long)
    mask[0, 1:, 0, :tiles] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": _randn(g, 1, 1, 2, 3, 8, 8),
            "aspect_ratio_ids": torch.tensor([[tiles]]),
            "aspect_ratio_mask": torch.tensor([[[1, int(tiles == 2)]]]),
            "cross_attention_mask": mask}


def sized_images(sizes: list[tuple[int, int, int]], crops: int | None, length: int = S
                 ) -> Callable[[int, torch.Generator], Row]:
    """Rows for a model that takes each image's size (``image_sizes``): image ``i`` of a row
    is ``sizes[i % len(sizes)] = (h, w, placeholders)``, its pixels ``[crops, 3, 8, 8]`` as an
    any-resolution processor pads them (LLaVA-NeXT), or ``[3, h, w]`` without crops (Mistral
    3's Pixtral tower)."""
    def row(n: int, g: torch.Generator) -> Row:
        ids = torch.randint(1, V - 5, (1, length), generator=g)
        at, hw = 1, []
        for i in range(n):
            h, w, tokens = sizes[i % len(sizes)]
            ids[0, at:at + tokens] = IMG
            at += tokens + 1
            hw.append([h, w])
        out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if n:
            shape = (crops, 3, 8, 8) if crops else (3, sizes[0][0], sizes[0][1])
            out.update(pixel_values=_randn(g, n, *shape), image_sizes=torch.tensor(hw))
        return out
    return row


def padded_images(tokens: int, most: int = 2) -> Callable[[int, torch.Generator], Row]:
    """Rows for a model whose ``pixel_values`` are ``[rows, most, 3, 8, 8]``, a row's images
    padded with all-zero ones (Idefics3, SmolVLM), each filling ``tokens`` placeholders."""
    def row(n: int, g: torch.Generator) -> Row:
        ids = _text(g)
        ids[0, 2:2 + tokens * n] = IMG
        pixels = torch.zeros(1, most, 3, 8, 8, dtype=torch.float64)
        pixels[0, :n] = _randn(g, n, 3, 8, 8)
        mask = torch.zeros(1, most, 8, 8, dtype=torch.long)
        mask[0, :n] = 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": pixels, "pixel_attention_mask": mask}
    return row


def _model(cls: str, config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        tf.logging.set_verbosity_error()
        torch.manual_seed(0)
        return getattr(tf, cls)(config()).double()  # type: ignore[no-any-return]
    return build


FAMILIES = [
    Family("llava", _model("LlavaForConditionalGeneration", lambda: tf.LlavaConfig(
        text_config=dict(model_type="llama", **LLAMA),
        vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=2,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, projection_dim=16),
        image_token_index=IMG)), square_images(16)),
    Family("qwen2_vl", _model("Qwen2VLForConditionalGeneration", lambda: tf.Qwen2VLConfig(
        text_config=dict(LLAMA, rope_parameters=MROPE),
        vision_config=dict(QWEN_VISION, embed_dim=16, hidden_size=32), **QWEN_IDS)),
        lambda n, g: qwen_images(g, n)),
    Family("qwen2_5_vl", _model("Qwen2_5_VLForConditionalGeneration",
                                lambda: tf.Qwen2_5_VLConfig(
        text_config=dict(LLAMA, rope_parameters=MROPE),
        vision_config=dict(QWEN_VISION, hidden_size=16, intermediate_size=32,
                           out_hidden_size=32, window_size=8, fullatt_block_indexes=[1]),
        **QWEN_IDS)), lambda n, g: qwen_images(g, n)),
    Family("gemma3", _model("Gemma3ForConditionalGeneration", lambda: tf.Gemma3Config(
        text_config=dict(LLAMA, head_dim=8, sliding_window=8), vision_config=SIGLIP,
        mm_tokens_per_image=4, image_token_index=IMG, boi_token_index=V - 2,
        eoi_token_index=V - 3)), square_images(4, typed=True)),
    Family("paligemma", _model("PaliGemmaForConditionalGeneration", lambda: tf.PaliGemmaConfig(
        text_config=dict(LLAMA, model_type="gemma", head_dim=8),
        vision_config=dict(SIGLIP, model_type="siglip_vision_model"), image_token_index=IMG,
        projection_dim=32)), square_images(16, typed=True), images=(1, 1, 1, 1)),
    Family("mllama", _model("MllamaForConditionalGeneration", lambda: tf.MllamaConfig(
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_global_layers=1, attention_heads=2, image_size=8, patch_size=4,
                           max_num_tiles=2, vision_output_dim=32,
                           intermediate_layers_indices=[0],
                           supported_aspect_ratios=[[1, 1], [1, 2]]),
        text_config=dict(LLAMA, num_hidden_layers=3, cross_attention_layers=[1],
                         pad_token_id=0),
        image_token_index=IMG)), mllama_row, images=(1, 2, 1, 2)),
]
LLAVA_NEXT = _model("LlavaNextForConditionalGeneration", lambda: tf.LlavaNextConfig(
    text_config=dict(model_type="llama", **LLAMA),
    vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=4,
                       hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, projection_dim=16),
    image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]], image_token_index=IMG))
FAMILIES += [
    Family("llava_next", LLAVA_NEXT, sized_images([(8, 8, 10)], 2)),
    Family("llava_onevision", _model("LlavaOnevisionForConditionalGeneration",
                                     lambda: tf.LlavaOnevisionConfig(
        text_config=dict(model_type="qwen2", **LLAMA),
        vision_config=dict(model_type="siglip_vision_model", image_size=8, patch_size=4,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2),
        image_grid_pinpoints=[[8, 8], [8, 16], [16, 8], [16, 16]], image_token_index=IMG,
        video_token_index=V - 2)), sized_images([(8, 8, 10)], 2)),
    Family("smolvlm", _model("SmolVLMForConditionalGeneration", lambda: tf.SmolVLMConfig(
        text_config=dict(model_type="llama", **LLAMA),
        vision_config=dict(SIGLIP, num_hidden_layers=1), scale_factor=2, image_token_id=IMG)),
        padded_images(4)),
    Family("idefics3", _model("Idefics3ForConditionalGeneration", lambda: tf.Idefics3Config(
        text_config=dict(model_type="llama", **LLAMA),
        vision_config=dict(SIGLIP, num_hidden_layers=1), scale_factor=2, image_token_id=IMG)),
        padded_images(4)),
    Family("internvl", _model("InternVLForConditionalGeneration", lambda: tf.InternVLConfig(
        text_config=dict(model_type="qwen2", **LLAMA),
        vision_config=dict(image_size=8, patch_size=2, hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2),
        image_token_id=IMG, image_seq_length=4)), square_images(4)),
    Family("mistral3", _model("Mistral3ForConditionalGeneration", lambda: tf.Mistral3Config(
        text_config=dict(model_type="mistral", head_dim=8, **LLAMA),
        vision_config=dict(model_type="pixtral", image_size=16, patch_size=2, hidden_size=16,
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           head_dim=8),
        spatial_merge_size=2, image_token_index=IMG)), sized_images([(8, 16, 8)], None)),
]
QWEN3_VL = _model("Qwen3VLForConditionalGeneration", lambda: tf.Qwen3VLConfig(
    text_config=dict(LLAMA, head_dim=8, rope_parameters=dict(MROPE, mrope_interleaved=True)),
    vision_config=dict(QWEN_VISION, hidden_size=16, intermediate_size=32, out_hidden_size=32,
                       num_position_embeddings=16, deepstack_visual_indexes=[0]),
    **QWEN_IDS))
FAMILIES.append(Family("qwen3_vl", QWEN3_VL, lambda n, g: qwen_images(g, n)))
BY_NAME = {f.name: f for f in FAMILIES}


def batch(rows: list[Row]) -> Row:
    """Rows made into one batch as a processor makes it: every tensor concatenated along its
    first dimension (``pixel_values`` of every image, one after another)."""
    keys = dict.fromkeys(k for r in rows for k in r)
    return {k: torch.cat([r[k] for r in rows if k in r]) for k in keys}


def lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def rows_of(family: Family, seed: int = 1) -> list[Row]:
    g = torch.Generator().manual_seed(seed)
    return [family.row(n, g) for n in family.images]


def reference(ref: nn.Module, rows: list[Row]) -> float:
    """The batch loss of ``ref`` on the two micro-batches of ``rows``, each built apart (as a
    processor would) and run one after another; gradients accumulate into ``ref``."""
    want = 0.0
    for part in (rows[:2], rows[2:]):
        b = batch(part)
        loss = lm_loss(ref(**b), b["input_ids"]) * 0.5
        loss.backward()  # type: ignore[no-untyped-call]
        want += loss.item()
    return want


def stepped(model: nn.Module, family: Family, schedule: str, ref: nn.Module | None = None,
            **where: Any) -> tuple[pt.Pipeline, nn.Module, float, float]:
    """``model`` stepped once through a pipeline on ``family``'s rows, and ``ref`` (a copy of
    it unless given) on the same micro-batches built apart: the pipeline, ``ref``, the
    pipeline's loss and the reference loss."""
    ref = copy.deepcopy(model) if ref is None else ref
    rows = rows_of(family)
    full = batch(rows)
    pipe = pt.Pipeline(model, schedule, 2, lm_loss, split_points="auto", example_inputs=full,
                       local_ranks=2, **where)
    got = pipe.step(full, full["input_ids"]).loss
    assert got is not None
    return pipe, ref, got.item(), reference(ref, rows)


def differences(pipe: pt.Pipeline, ref: nn.Module) -> list[str]:
    """Gradients farther than ``TOL`` of the largest reference gradient; differing buffers."""
    return zoo_differences(pipe, ref, TOL)


TRAIN_CI = (("llava", "1f1b"), ("qwen2_vl", "1f1b"), ("gemma3", "zbv"), ("paligemma", "1f1b"))
"""The cases CI trains (its time, CONTRIBUTING.md: tests), each schedule at least once: LLaVA
(a tower and a projector), Qwen2-VL (grids, M-RoPE), Gemma 3 and PaliGemma (token types); the
others in the long tier. Mllama's cross-attention runs its pipeline against the model in CI
through ``pipetrain verify`` (test_image_text_train_dist.py). Some of those families train in CI in
the tests below: LLaVA-NeXT and Mistral 3 on images of different sizes, LLaVA-OneVision on its
``batch_num_images``, Qwen3-VL on its deepstack features; the rest take the paths of those in
CI (Qwen2.5-VL Qwen2-VL's, InternVL LLaVA's, Idefics3 and SmolVLM a row's axis of images,
split by rows as Mllama's)."""
TRAINED = [pytest.param(f, s, id=f"{f.name}-{s}",
                        marks=() if (f.name, s) in TRAIN_CI else pytest.mark.long)
           for f in FAMILIES for s in ("1f1b", "zbv")]


@pytest.mark.parametrize(("family", "schedule"), TRAINED)
def test_image_text_models_train_exactly(family: Family, schedule: str) -> None:
    pipe, ref, got, want = stepped(family.build(), family, schedule)
    assert abs(got - want) <= TOL * abs(want)
    assert differences(pipe, ref) == []
    assert {n for n, _ in pipe.named_parameters()} == {n for n, _ in ref.named_parameters()}
    vision = [n for n, _ in pipe.named_parameters(stage=0) if "vision" in n or "visual" in n]
    assert vision, "the vision tower belongs to stage 0"


def test_qwen3_vl_makes_its_deepstack_features_in_the_graph() -> None:
    """Qwen3-VL hands its language model deepstack features that its forward does not take;
    the graph takes the vision tower's outputs as the forward's ``mm_encoder_outputs`` and
    makes them itself, with empty ones for a micro-batch that shows no image."""
    family = Family("qwen3_vl", QWEN3_VL, lambda n, g: qwen_images(g, n), images=(1, 2, 0, 0))
    pipe, ref, got, want = stepped(family.build(), family, "1f1b")
    assert abs(got - want) <= TOL * abs(want)
    assert differences(pipe, ref) == []
    assert pipe.traced is not None and pipe.traced.prefix is not None
    assert pipe.traced.prefix.encoded and not pipe.traced.prefix.dropped
    merger = [p for n, p in pipe.named_parameters(stage=0) if "deepstack_merger" in n]
    assert merger and all(p.grad is not None and p.grad.abs().sum() > 0 for p in merger)


def test_micro_batches_take_the_images_their_rows_show() -> None:
    family = BY_NAME["qwen2_vl"]
    rows = rows_of(family)
    prefix = vision_prefix(family.build(), batch(rows))
    assert prefix is not None and prefix.path == "model.language_model"
    parts = prefix.split(prefix.payload(batch(rows)), 2)
    for part, want in zip(parts, (batch(rows[:2]), batch(rows[2:]))):
        assert set(part) == set(want)
        assert all(torch.equal(part[k], want[k]) for k in want)


def test_a_micro_batch_without_an_image_gets_no_padding_images() -> None:
    """Idefics3 gives every row an axis of images, padded with all-zero ones: a micro-batch of
    rows without an image gets no visual tensors (its forward drops the padding images and
    fails on none left), and the micro-batch with images gets its rows' share."""
    family = BY_NAME["idefics3"]
    g = torch.Generator().manual_seed(1)
    rows = [family.row(n, g) for n in (1, 2, 0, 0)]
    prefix = vision_prefix(family.build(), batch(rows))
    assert prefix is not None
    shown, empty = prefix.split(prefix.payload(batch(rows)), 2)
    assert torch.equal(shown["pixel_values"], batch(rows[:2])["pixel_values"])
    assert not any(k.startswith("pixel_") for k in empty)
    prefix(empty)  # the model's forward as Python up to its language model: it runs


def test_placeholders_that_do_not_fit_the_images_are_refused() -> None:
    family = BY_NAME["qwen2_vl"]
    rows = rows_of(family)
    full = batch(rows)
    prefix = vision_prefix(family.build(), full)
    assert prefix is not None
    short = dict(full, image_grid_thw=full["image_grid_thw"][:-1])
    with pytest.raises(ValueError, match="placeholders"):
        prefix.split(prefix.payload(short), 2)
    llava = BY_NAME["llava"]
    rows = rows_of(llava)
    full = batch(rows)
    prefix = vision_prefix(llava.build(), full)
    assert prefix is not None
    with pytest.raises(ValueError, match="do not share evenly"):
        prefix.split(prefix.payload(dict(full, pixel_values=full["pixel_values"][:3])), 2)


META_CI = ("llava_next",)
ON_META = [f if f.name in META_CI else pytest.param(f, marks=pytest.mark.long) for f in FAMILIES]
"""On meta, in CI: LLaVA-NeXT (a tower and a projector, and ``image_newline``, a parameter its
model holds itself, made real alone); the other families in the long tier (CI's time,
CONTRIBUTING.md: tests): on meta a stage makes real only the modules it holds, whatever their
family, and every command builds its model on meta (LLaVA's train test in CI,
tests/test_image_text_train_dist.py)."""


@pytest.mark.parametrize("family", ON_META, ids=[f.name for f in FAMILIES])
def test_image_text_models_built_on_meta_train_like_the_whole_model_materialised(
        family: Family) -> None:
    """A model described on ``meta`` (too big for one process): each stage made real by name,
    the vision tower for the capture too, then back on ``meta`` where its stage is not."""
    with torch.device("meta"):
        model, ref = family.build(), family.build()
    pipe, ref, got, want = stepped(model, family, "1f1b", NamedInit(ref, 0).materialize(ref),
                                   init_seed=0)
    assert abs(got - want) <= TOL * abs(want)
    assert differences(pipe, ref) == []


def test_a_meta_image_text_model_needs_a_real_example() -> None:
    family = BY_NAME["llava"]
    with torch.device("meta"):
        model = family.build()
        full = batch(rows_of(family))
    with pytest.raises(PartitionError, match="must be real tensors"):
        pt.Pipeline(model, "1f1b", 2, lm_loss, split_points="auto", example_inputs=full,
                    local_ranks=2)


@pytest.mark.long  # beside test_image_text_train_dist.py::
# test_gemma3_parts_under_fsdp_and_zbv_with_the_vision_tower_frozen (--freeze-vision)
def test_a_frozen_vision_tower_trains_the_rest_exactly() -> None:
    """The usual fine-tuning recipe: the vision tower frozen, the projector and the language
    model trained."""
    family = BY_NAME["qwen2_vl"]
    model = family.build()
    for p in model.model.visual.blocks.parameters():  # the merger (projector) still trains
        p.requires_grad_(False)
    pipe, ref, _, _ = stepped(model, family, "zbv")
    assert differences(pipe, ref) == []
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    assert all(g is None for n, g in grads.items() if ".visual.blocks." in n)
    assert all(g is not None for n, g in grads.items() if ".visual.merger." in n)


@pytest.mark.long  # beside test_eval_mode.py::test_dropout_and_batch_norm_evaluate_as_eval_mode
def test_an_eval_step_with_dropout_in_the_config_is_the_models_eval_forward() -> None:
    """Dropout in the language model and the vision tower: the eval step runs the eval graph
    and the prefix in eval mode, and gives the unsplit model's eval loss."""
    config = tf.LlavaConfig(
        text_config=dict(model_type="llama", attention_dropout=0.2, **LLAMA),
        vision_config=dict(model_type="clip_vision_model", image_size=8, patch_size=2,
                           hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, projection_dim=16, attention_dropout=0.2),
        image_token_index=IMG)
    model = _model("LlavaForConditionalGeneration", lambda: config)()
    rows = rows_of(BY_NAME["llava"])
    full = batch(rows)
    pipe = pt.Pipeline(model, "1f1b", 2, lm_loss, split_points="auto", example_inputs=full,
                       local_ranks=2)
    got = pipe.eval_step(full, full["input_ids"]).loss
    assert model.model.vision_tower.training  # the prefix's modules back in training mode
    model.eval()
    with torch.no_grad():
        want = sum(lm_loss(model(**batch(p)), batch(p)["input_ids"]).item() * 0.5
                   for p in (rows[:2], rows[2:]))
    assert got is not None and abs(got.item() - want) <= TOL * abs(want)


@pytest.mark.long  # beside test_lora.py::test_every_schedule_gives_peft_models_gradients
def test_a_peft_lora_model_trains_its_adapters_exactly() -> None:
    """peft's adapters in the model (as ``pipetrain train --lora-r`` puts them: the base
    model changed in place), on the language model's attention only."""
    peft = pytest.importorskip("peft")
    family = BY_NAME["qwen2_vl"]
    config = peft.LoraConfig(r=4, lora_alpha=8,
                             target_modules=r".*language_model.*\.(q_proj|v_proj)")
    model = peft.get_peft_model(family.build(), config).get_base_model()
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero: a gradient of A would be zero
            torch.nn.init.normal_(p, std=0.02)
    pipe, ref, _, _ = stepped(model, family, "zbv")
    assert differences(pipe, ref) == []
    trained = [n for n, p in pipe.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)


def test_a_command_for_text_models_points_an_image_text_directory_to_those_that_take_it(
        ) -> None:
    from pipetrain.hf.model import meta_model

    config = tf.LlavaConfig(text_config=dict(model_type="llama", **LLAMA),
                            vision_config=dict(model_type="clip_vision_model"))
    with pytest.raises(ValueError, match=r"LlavaConfig is an image-text model .*this command "
                       r"takes causal language models only: pipetrain train --chat, verify and "
                       r"generate --image take an image-text model.*docs/multimodal.md"):
        meta_model(config)
    assert type(meta_model(config, images=True)).__name__ == "LlavaForConditionalGeneration"


def test_images_of_different_sizes_go_with_their_rows() -> None:
    """LLaVA-NeXT's any-resolution images fill as many placeholders as their sizes say, which
    the split counts by the model's own packing of their crops (on ``meta``): one image a row
    and 0-2 images a row of two sizes each go with their rows; so do Mistral 3's, counted from
    their sizes as its own ``get_image_features`` splits them. A model whose images of
    different sizes the split cannot count (LLaVA given ``image_sizes``) is refused, naming the
    fix."""
    mistral = BY_NAME["mistral3"].build
    for family in (Family("llava_next_mixed", LLAVA_NEXT, sized_images(
                       [(16, 16, 24), (8, 16, 14)], 5, length=48), images=(1, 1, 1, 1)),
                   Family("llava_next_mixed", LLAVA_NEXT, sized_images(
                       [(16, 16, 24), (8, 16, 14)], 5, length=48)),
                   Family("mistral3_mixed", mistral, sized_images([(8, 16, 8), (8, 8, 4)], None))):
        pipe, ref, got, want = stepped(family.build(), family, "1f1b")
        assert abs(got - want) <= TOL * abs(want), family
        assert differences(pipe, ref) == []
    from pipetrain.split.prefix_images import tokens_per_image

    sizes = {"pixel_values": torch.zeros(4, 3, 8, 16), "image_sizes": torch.tensor([[8, 16]] * 4)}
    with pytest.raises(ValueError, match=r"29 image placeholders do not share evenly among the 4 "
                       r"images.*images of different sizes"):
        tokens_per_image(BY_NAME["llava"].build(), sizes, "pixel_values", "image_grid_thw", 29)


def test_llava_onevision_cuts_into_crops_only_the_image_of_a_row_that_shows_one() -> None:
    """LLaVA-OneVision cuts an image into crops only where its row shows one image (its
    processor's ``batch_num_images``, an entry per row that shows any): the split counts each
    image's placeholders so and gives each micro-batch the entries of its rows."""
    single = sized_images([(8, 8, 10)], 2)

    def row(n: int, g: torch.Generator) -> Row:
        out = single(n, g)
        if n > 1:  # each image whole: its 4 patches and a newline
            ids = torch.randint(1, V - 5, (1, S), generator=g)
            for i in range(n):
                ids[0, 1 + 6 * i:6 + 6 * i] = IMG
            out["input_ids"] = ids
        if n:
            out["batch_num_images"] = torch.tensor([n])
        return out

    family = Family("llava_onevision_rows", BY_NAME["llava_onevision"].build, row,
                    images=(1, 0, 2, 1))
    pipe, ref, got, want = stepped(family.build(), family, "1f1b")
    assert abs(got - want) <= TOL * abs(want)
    assert differences(pipe, ref) == []
