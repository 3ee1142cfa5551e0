"""Generation with images through the pipeline in one process (``local_ranks``), for every
image-text family the zoo of tests/test_vision_language.py builds (tiny configs, float64): the
tokens of transformers' own ``generate(do_sample=False)`` on each prompt alone, for two
prompts of different lengths and images in one group (the shorter padded on the left),
without a processor: the inputs are made as the processors make them."""

from __future__ import annotations

import pytest
import torch

from pipetrain.generation import Generator
from test_vision_language import FAMILIES, IMG, LLAMA, SIGLIP, Family, Row, S, V, _model

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

NEW = 8
GEMMA3 = _model("Gemma3ForConditionalGeneration", lambda: tf.Gemma3Config(
    text_config=dict(LLAMA, head_dim=8, sliding_window=S + NEW), vision_config=SIGLIP,
    mm_tokens_per_image=4, image_token_index=IMG, boi_token_index=V - 2, eoi_token_index=V - 3))
"""The zoo's Gemma 3 with a sliding window as long as the generation (the zoo's window of 8,
shorter, is refused: :func:`test_a_sliding_window_shorter_than_the_positions_is_refused`)."""


def _shorter(row: Row, cut: int) -> Row:
    """``row`` without its last ``cut`` text positions (its images are near its start)."""
    out = {}
    for k, v in row.items():
        if k in ("pixel_values", "image_grid_thw", "image_sizes", "aspect_ratio_ids",
                 "aspect_ratio_mask", "pixel_attention_mask"):
            out[k] = v
        elif v.dim() > 1 and v.shape[1] == S:
            out[k] = v[:, :S - cut]
        else:
            out[k] = v
    return out


def _want(model: torch.nn.Module, row: Row) -> list[int]:
    with torch.no_grad():
        out = model.generate(**row, max_new_tokens=NEW, do_sample=False)  # type: ignore[operator]
    return [int(t) for t in out[0, row["input_ids"].shape[1]:]]


IN_CI = ("qwen3_vl", "mllama")
"""The families CI generates with (CI's time, CONTRIBUTING.md: tests): M-RoPE and deepstack,
and cross-attention. The others, in the long tier, share their paths (PaliGemma, whose token
types go as Gemma 3's, runs in CI through the command: tests/test_image_text_train_dist.py;
the refusal below reads Gemma 3's sliding window in CI)."""


@pytest.mark.parametrize("family", [
    f if f.name in IN_CI else pytest.param(f, marks=pytest.mark.long) for f in FAMILIES],
    ids=[f.name for f in FAMILIES])
def test_generate_with_images_gives_transformers_greedy_tokens(family: Family) -> None:
    model = (GEMMA3 if family.name == "gemma3" else family.build)().eval()
    g = torch.Generator().manual_seed(3)
    rows = [family.row(1, g), _shorter(family.row(1, g), 5)]
    gen = Generator(model, rows=2, length=S + NEW, local_ranks=2, images=rows[0])
    got = gen.generate([r["input_ids"][0].tolist() for r in rows], NEW,
                       images=[{k: v for k, v in r.items() if k != "attention_mask"}
                               for r in rows])
    gen.close()
    assert got == [_want(model, r) for r in rows]


def test_a_sliding_window_shorter_than_the_positions_is_refused() -> None:
    """Gemma 3's layers of a window of 8 positions: a static cache of 48 would not be exact."""
    family = next(f for f in FAMILIES if f.name == "gemma3")
    row = family.row(1, torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="sliding window of 8 positions, shorter than 48"):
        Generator(family.build().eval(), rows=2, length=S + NEW, local_ranks=2, images=row)
