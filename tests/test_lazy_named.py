"""NamedInit: parts of a traced meta model materialise like the whole model, ties kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.lm import TinyLM, lm_batch
from pipetrain.models import gpt
from pipetrain.split.autosplit import cut_points
from pipetrain.split.lazy import NamedInit
from pipetrain.split.trace import split_model


def _meta_lm() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


@pytest.mark.parametrize("order", [  # [0, 3, 7]: long tier, beside [7, 3, 0]
    pytest.param([0, 3, 7], marks=pytest.mark.long), [7, 3, 0], [7]])
def test_parts_in_any_order_equal_the_whole_model(order: list[int]) -> None:
    whole = _meta_lm()
    init = NamedInit(whole, 5)
    init.materialize(whole)
    expected = dict(whole.named_parameters())
    assert whole.head.weight is whole.embed.weight
    meta = _meta_lm()
    ids, _, _ = lm_batch()
    split = split_model(meta, cut_points(meta, (ids,)), (ids,), check=False)
    parts = NamedInit(meta, 5)
    for k in order:
        parts.materialize(split.stages[k])
        for name, p in split.stages[k].named_parameters():
            assert not p.is_meta
            assert torch.equal(p, expected[split.param_names[k][name]]), (k, name)
    if 0 in order and 7 in order:  # one tensor for the tied weight within a process
        assert split.stages[7].get_parameter("head.weight") is split.stages[0].get_parameter(
            "embed.weight")


def test_seed_changes_values_and_each_module_has_its_own_stream() -> None:
    a, b = _meta_lm(), _meta_lm()
    NamedInit(a, 0).materialize(a)
    NamedInit(b, 1).materialize(b)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, b.blocks[0].attn.qkv.weight)
    assert not torch.equal(a.blocks[0].attn.qkv.weight, a.blocks[1].attn.qkv.weight)


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 3))


def test_parameter_without_reset_is_an_error() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), NoReset())
    with pytest.raises(ValueError, match=r"\['1.w'\] were built on the meta device"):
        NamedInit(model, 0).materialize(model)


def test_shared_parameter_whose_owner_cannot_reset_is_an_error() -> None:
    with torch.device("meta"):
        owner, user = NoReset(), nn.Linear(3, 3, bias=False)
    user.weight = owner.w
    model = nn.Sequential(owner, user)
    with pytest.raises(ValueError, match=r"first owner '0' has no reset_parameters"):
        NamedInit(model, 0).materialize(model)


class Scale(nn.Module):
    """A module holding a parameter itself; tracing goes through its forward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _meta_gpt() -> nn.Sequential:
    with torch.device("meta"):
        cfg = gpt.GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=2)
        first, *rest = gpt.gpt_layers(cfg)
        return nn.Sequential(first, Scale(16), *rest)


def test_modules_traced_through_are_initialised_by_their_own_reset() -> None:
    # Scale and gpt.Head hold parameters and are captured through, so a stage holds those in
    # bare containers; their own reset_parameters() must still run (the Head's tied weight
    # takes the Embedding's value).
    whole = _meta_gpt()
    NamedInit(whole, 2).materialize(whole)
    expected = dict(whole.named_parameters())
    meta = _meta_gpt()
    x = torch.zeros(1, 8, dtype=torch.long)
    split = split_model(meta, ["2", "4"], (x,), check=False)
    assert type(split.stages[0].get_submodule("0")) is nn.Module  # a bare container
    assert type(split.stages[2].get_submodule("4")) is nn.Module
    parts = NamedInit(meta, 2)
    for k in (2, 0, 1):
        parts.materialize(split.stages[k])
        for name, p in split.stages[k].named_parameters():
            assert torch.equal(p, expected[split.param_names[k][name]]), (k, name)
    assert split.stages[0].get_parameter("1.weight").std() > 0.1  # initialised, not empty
