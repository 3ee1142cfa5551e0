"""Regressions: every test starts with the story of the bug it pins down."""

from __future__ import annotations

import torch
from torch import nn

import pipetrain as pt
from pipetrain.partition import named_layers


def test_a_module_used_twice_in_a_sequential_is_not_dropped() -> None:
    # nn.Sequential.named_children() hides a module that appears twice (a layer tied to an
    # earlier one), so the first partitioner silently split 7 of 8 layers and the head vanished.
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    assert [n for n, _ in named_layers(model)] == ["0", "1", "2"]
    pipe = pt.Pipeline(model, "1f1b", 2, nn.MSELoss(), local_ranks=3)
    assert pipe.balance == [1, 1, 1]
    assert [n for n, _ in pipe.named_parameters()] == ["0.weight", "0.bias"]
    x = torch.randn(4, 4)
    result = pipe.eval_step(x)
    with torch.no_grad():
        assert torch.equal(result.outputs, model(x))
