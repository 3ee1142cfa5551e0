"""Generation across 4 processes (gloo), the last stage's tokens going back to rank 0 past two
others: each rank holding one stage and its KV caches, a Llama's greedy tokens equal
transformers' own ``generate(do_sample=False)`` on one process, on every rank; seeded sampling
gives the tokens of a one-process run; a saved checkpoint is read by each rank for its own
stage only. (Llama and Mixtral at 2 and 4 ranks in one process, the same action lists, in
CI, every family in the long tier: tests/test_generation.py; 2 processes:
tests/test_generate_cli.py, tests/test_docs.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import pipetrain as pt
from helpers.hf import causal_lm, hf_generate, prompts
from pipetrain.generation import Generator, Sampling

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

NEW = 12
SAMPLING = Sampling(temperature=0.9, top_k=16, top_p=0.95, seed=5)


FAMILIES = ("llama",)


def _ranks(ctx: pt.RankContext, directory: str) -> dict[str, object]:
    batch = prompts()
    out: dict[str, object] = {}
    for name in FAMILIES:
        gen = Generator(causal_lm(name), rows=2, length=32, prefill=4, window=5)
        out[name] = gen.generate(batch, NEW)
        if name == "llama":
            out["sampled"] = gen.generate(batch, NEW, sampling=SAMPLING)
    saved = Generator.from_pretrained(directory, rows=3, length=32)
    out["saved"] = saved.generate(batch, NEW)
    out["read"] = sorted(saved.pipe.state_dict())
    return out


@pytest.mark.long  # beside test_generate_cli.py::test_one_prompt_is_transformers_text
def test_generation_across_processes(tmp_path: Path) -> None:
    n = 4
    stored = causal_lm("llama", seed=4)
    stored.save_pretrained(tmp_path)
    results = pt.launch(_ranks, n, str(tmp_path), timeout=300)
    batch = prompts()
    for name in FAMILIES:
        want = hf_generate(causal_lm(name), batch, NEW)
        assert all(r[name] == want for r in results), name
    local = Generator(causal_lm("llama"), rows=5, length=32, local_ranks=1)
    assert all(r["sampled"] == local.generate(batch, NEW, sampling=SAMPLING) for r in results)
    assert all(r["saved"] == hf_generate(stored, batch, NEW) for r in results)
    held = [set(r["read"]) for r in results]  # type: ignore[arg-type]
    assert all(a.isdisjoint(b) for i, a in enumerate(held) for b in held[i + 1:])
    assert any("layers.0." in k for k in held[0]) and not any("layers.0." in k for k in held[-1])
