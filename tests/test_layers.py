"""Layers: a traced meta model in one process (local ranks), balance on meta, meta ties in lists."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.lm import TinyLM, lm_batch, lm_loss
from pipetrain.errors import PartitionError
from pipetrain.split.lazy import NamedInit
from pipetrain.testing import grad_mismatches, reference_step

SEED = 11


def meta_lm() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


def example() -> dict[str, torch.Tensor]:
    ids, mask, _ = lm_batch(1)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name, split", [("1f1b", ["blocks.2"]), ("zbv", "auto"),
                                         ("interleaved-1f1b", ["blocks.0", "blocks.2", "norm"])])
def test_local_ranks_train_like_the_whole_model(name: str, split: list[str] | str) -> None:
    ref = meta_lm()
    NamedInit(ref, SEED).materialize(ref)
    pipe = pt.Pipeline(meta_lm(), name, 4, lm_loss, local_ranks=2, split_points=split,
                       example_inputs=example(), init_seed=SEED)
    refs = dict(ref.named_parameters())
    assert {n for n, _ in pipe.named_parameters()} == set(refs)
    assert all(torch.equal(p, refs[n]) for n, p in pipe.named_parameters())
    ids, mask, targets = lm_batch(4)
    inputs = pipe.pack(ids, attention_mask=mask)
    want = reference_step(lambda x: ref(**x), inputs, targets, lm_loss, 4)  # type: ignore
    got = pipe.step(inputs, targets)
    assert got.loss is not None and torch.equal(got.loss, want)
    tied = dict(pipe.named_parameters())["embed.weight"]
    assert tied.grad is not None and ref.embed.weight.grad is not None
    torch.testing.assert_close(tied.grad, ref.embed.weight.grad, rtol=1e-5, atol=1e-7)
    assert grad_mismatches(pipe.named_parameters(), ref, skip={"embed.weight"}) == []


def test_seed_is_the_init_seed() -> None:
    a = pt.Pipeline(meta_lm(), "1f1b", 2, lm_loss, local_ranks=2, split_points=["blocks.2"],
                    example_inputs=example(), init_seed=1)
    b = pt.Pipeline(meta_lm(), "1f1b", 2, lm_loss, local_ranks=2, split_points=["blocks.2"],
                    example_inputs=example(), init_seed=2)
    wa, wb = dict(a.named_parameters()), dict(b.named_parameters())
    assert not torch.equal(wa["blocks.3.attn.qkv.weight"], wb["blocks.3.attn.qkv.weight"])


@pytest.mark.parametrize("mode", ["time", "memory"])
def test_profiling_balance_of_a_meta_model_names_what_works(mode: str) -> None:
    with pytest.raises(PartitionError, match=f"balance='{mode}' profiles.*balance='params'"):
        pt.Pipeline(meta_lm(), "1f1b", 2, lm_loss, local_ranks=2, split_points="auto",
                    balance=mode, example_inputs=example())


def test_params_balance_of_a_meta_layer_list() -> None:
    with torch.device("meta"):
        layers = [nn.Linear(64, 64), *[nn.Linear(8, 8) for _ in range(5)]]  # not run
    pipe = pt.Pipeline(layers, "1f1b", 2, nn.MSELoss(), local_ranks=2, balance="params")
    assert pipe.balance == [1, 5]
    assert not any(p.is_meta for p in pipe.parameters())


def test_meta_layer_list_with_a_tied_weight_is_an_error() -> None:
    with torch.device("meta"):
        embed, head = nn.Linear(8, 8), nn.Linear(8, 8)
    head.weight = embed.weight
    with pytest.raises(ValueError, match=r"meta layers '0' and '2' share the parameter 0.weight"):
        pt.Pipeline([embed, nn.Tanh(), head], "1f1b", 2, nn.MSELoss(), local_ranks=2)
