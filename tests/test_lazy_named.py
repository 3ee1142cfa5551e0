"""NamedInit: parts of a traced meta model materialise like the whole model, ties kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lm import TinyLM, lm_batch
from pipetrain.autosplit import cut_points
from pipetrain.lazy import NamedInit
from pipetrain.trace import split_model


def _meta_lm() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


@pytest.mark.parametrize("order", [[0, 3, 7], [7, 3, 0], [7]])
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
