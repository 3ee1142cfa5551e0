"""Generation through the pipeline in one process (``local_ranks``): the tokens of
transformers' own ``generate(do_sample=False)`` for Llama, GPT-2, Mixtral (MoE) and Qwen2 on
prompts of different lengths, whatever the ranks, groups, prefill slices and windows; sampling
the same under every layout; end tokens; streaming; a saved directory; clear errors."""

from __future__ import annotations

import pytest
import torch

from helpers.hf import GENERATING, causal_lm, hf_generate, prompts
from pipetrain.generation import Generator, Sampling

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

NEW = 10
GREEDY_CI = (("llama", 2), ("llama", 4), ("mixtral", 2))
"""The cases CI generates with (its time, CONTRIBUTING.md: tests): a dense Llama at 2 and 4
ranks, and the mixture of experts; the others in the long tier (Qwen2's tokens are
transformers' in CI with end tokens, and GPT-2 streams in CI)."""
GREEDY = [pytest.param(n, r, id=f"{n}-{r}", marks=() if (n, r) in GREEDY_CI else pytest.mark.long)
          for n in GENERATING for r in (2, 4)]


@pytest.mark.parametrize(("name", "ranks"), GREEDY)
def test_greedy_equals_transformers(name: str, ranks: int) -> None:
    """Groups of 2 (the 5 prompts padded to 3 groups), prefill slices of 3 positions, windows
    of 4 decode steps. (Every generator here has 2 rows and 32 positions where it can: one
    capture per family, recalled for the other layouts.)"""
    model = causal_lm(name)
    batch = prompts()
    gen = Generator(model, rows=2, length=32, prefill=3, window=4, local_ranks=ranks)
    assert gen.generate(batch, NEW) == hf_generate(model, batch, NEW)


@pytest.mark.long  # beside test_sampling_is_the_same_under_every_layout
def test_layouts_and_slices() -> None:
    """One sequence per group, a prefill of one position per step, a window of 1, a group
    larger than the batch: the same tokens."""
    model = causal_lm("llama")
    batch = prompts((7, 1, 4))
    want = hf_generate(model, batch, NEW)
    for ranks, rows, prefill, window in [(2, 1, 1, 1), (3, 8, 2, 5), (1, 2, 16, 3)]:
        gen = Generator(model, rows=rows, length=32, prefill=prefill, window=window,
                        local_ranks=ranks)
        assert gen.generate(batch, NEW) == want, (ranks, rows, prefill, window)
    assert gen.generate(batch, 1) == [w[:1] for w in want]  # prefill only
    assert gen.generate(batch[:1], NEW) == hf_generate(model, batch[:1], NEW)  # caches reset


def test_bfloat16_equals_transformers() -> None:
    model = causal_lm("llama").to(torch.bfloat16)
    batch = prompts()
    gen = Generator(model, rows=2, length=32, prefill=4, window=4, local_ranks=2)
    assert gen.generate(batch, NEW) == hf_generate(model, batch, NEW)


def test_end_tokens() -> None:
    model = causal_lm("qwen2")
    batch = prompts()
    free = hf_generate(model, batch, NEW)
    eos = free[1][3]  # row 1's fourth token ends it (and any row that meets it earlier)
    want = hf_generate(model, batch, NEW, eos=eos)
    assert want[1] == free[1][:4]
    gen = Generator(model, rows=2, length=32, prefill=4, window=3, local_ranks=2)
    assert gen.generate(batch, NEW, eos_token_id=eos) == want
    single = [batch[1]]  # this row alone stops after the window that holds its end token
    steps = gen.pipe.engine.stepper.count
    gen.generate(single, NEW)
    # windows: prefill + 3 steps (4 tokens), 3, 3
    assert gen.pipe.engine.stepper.count - steps == 3
    steps = gen.pipe.engine.stepper.count
    assert gen.generate(single, NEW, eos_token_id=eos) == [want[1]]
    # its end token (the 4th) is in the first window
    assert gen.pipe.engine.stepper.count - steps == 1


def test_streaming_windows() -> None:
    model = causal_lm("gpt2")
    batch = prompts((4, 6))
    gen = Generator(model, rows=2, length=32, prefill=8, window=4, local_ranks=2)
    seen: list[list[list[int]]] = []
    out = gen.generate(batch, NEW, on_tokens=seen.append)
    assert [len(w[0]) for w in seen] == [5, 4, 1]  # the first token comes with the prefill
    assert [sum((w[r] for w in seen), []) for r in range(2)] == out


def test_sampling_is_the_same_under_every_layout() -> None:
    model = causal_lm("llama")
    batch = prompts()
    sampling = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    outs = [Generator(model, rows=rows, length=32, prefill=prefill, window=window,
                      local_ranks=ranks).generate(batch, NEW, sampling=sampling)
            for ranks, rows, prefill, window in [(1, 8, 32, 16), (2, 2, 3, 4), (4, 1, 2, 2)]]
    assert outs[0] == outs[1] == outs[2]
    gen = Generator(model, rows=2, length=32, local_ranks=2)
    assert gen.generate(batch, NEW, sampling=Sampling(0.8, 20, 0.9, seed=8)) != outs[0]
    assert gen.generate(batch, NEW, sampling=Sampling(1.0, top_k=1, seed=3)) == \
        hf_generate(model, batch, NEW)  # top-1 sampling is greedy


def test_sampling_cuts() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0])
    picks = {Sampling(1.0, top_k=2, seed=s).pick(logits, 0, 0) for s in range(40)}
    assert picks == {1, 2}
    picks = {Sampling(1.0, top_p=0.5, seed=s).pick(logits, 0, 0) for s in range(40)}
    assert picks == {1}  # token 1 alone holds half the probability
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        Sampling(top_p=0.0)


@pytest.mark.long  # beside test_generate_cli.py::test_one_prompt_is_transformers_text
def test_from_pretrained(tmp_path: object) -> None:
    model = causal_lm("llama", seed=3)
    model.save_pretrained(tmp_path)
    batch = prompts()
    gen = Generator.from_pretrained(str(tmp_path), rows=2, length=32, local_ranks=2)
    assert gen.generate(batch, NEW) == hf_generate(model, batch, NEW)


def test_errors() -> None:
    gen = Generator(causal_lm("llama"), rows=2, length=32, local_ranks=2)
    with pytest.raises(ValueError, match="needs 39 cached positions; the generator holds 32"):
        gen.generate([[3] * 30], 10)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[3], []], 2)
    with pytest.raises(ValueError, match="rows, length, prefill and window must be >= 1"):
        Generator(causal_lm("llama"), rows=0, local_ranks=2)
    assert gen.generate([[3]], 0) == [[]]
