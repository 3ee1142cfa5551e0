"""autosplit: the units of a traced model and the places between them, in execution order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.lm import lm_batch, tiny_lm
from pipetrain.errors import PartitionError
from pipetrain.split.autosplit import cut_points, units
from pipetrain.split.trace import split_model


def test_units_open_containers_recursively() -> None:
    model = nn.Module()
    model.a = nn.Linear(2, 2)
    model.seq = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Tanh()]))
    model.d = nn.ModuleDict({"x": nn.Linear(2, 2)})
    assert units(model) == ["a", "seq.0", "seq.1.0", "seq.1.1", "d.x"]


def test_cut_points_of_a_transformer_follow_execution_order() -> None:
    ids, mask, _ = lm_batch()
    points = cut_points(tiny_lm(), {"input_ids": ids, "attention_mask": mask})
    assert points == ["pos", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]


class Reversed(nn.Module):
    """Registers its layers in the opposite order to the one forward uses them in."""

    def __init__(self) -> None:
        super().__init__()
        self.last = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.first = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.first(x)))


def test_registration_order_and_unused_units_do_not_matter() -> None:
    assert units(Reversed()) == ["last", "unused", "first"]
    assert cut_points(Reversed(), (torch.randn(2, 4),)) == ["last"]


def test_cutting_at_every_unit_runs_the_model_bitwise() -> None:
    model = tiny_lm()
    ids, mask, _ = lm_batch()
    example = {"input_ids": ids, "attention_mask": mask}
    split = split_model(model, cut_points(model, example), example)
    assert len(split.stages) == 8
    out = split.run(split.pack(ids, attention_mask=mask))
    assert torch.equal(out, model(ids, attention_mask=mask))


def test_one_unit_is_nothing_to_cut_between() -> None:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.only = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.only(x) * 2

    with pytest.raises(PartitionError, match=r"found 1 unit\(s\) .*\['only'\].*by hand"):
        cut_points(One(), (torch.randn(2, 3),))
