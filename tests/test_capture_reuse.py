"""Recall: a second model of the same structure reuses the first one's capture, with its own
parameters, and gives exactly what a fresh capture gives; anything that could change the graph
misses."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.split import capture_reuse
from pipetrain.split.capture import RECALL, capture
from pipetrain.testing import grad_mismatches, reference_step


class Net(nn.Module):
    def __init__(self, scale: float = 2.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.scale = scale
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.scale)


def test_a_model_of_the_same_structure_reuses_the_capture_with_its_own_weights() -> None:
    RECALL.clear()
    x = torch.randn(4, 8)
    first = capture(Net(seed=0), (x,))
    second_model = Net(seed=1)
    second = capture(second_model, (x,))
    assert first.seconds > 0 and second.seconds == 0.0  # a hit: export did not run
    assert second.attrs["a.weight"] is second_model.a.weight
    y = torch.randn(8, 8)
    pipe = pt.Pipeline(second_model, "1f1b", 4, nn.MSELoss(), local_ranks=2,
                       split_points=["b"], example_inputs=(x,))
    ref = Net(seed=1)
    got = pipe.step(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), y).loss
    want = reference_step(ref, torch.randn(8, 8, generator=torch.Generator().manual_seed(0)),
                          y, nn.MSELoss(), 4)
    assert got is not None and torch.equal(got, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []


@pytest.mark.parametrize("change", ["attribute", "shape", "training", "dtype", "tied",
                                    "dynamic"])
def test_what_could_change_the_graph_misses(change: str) -> None:
    x = torch.randn(4, 8)
    base = capture_reuse.key(Net(), (x,))
    other = Net()
    example: tuple[torch.Tensor, ...] = (x,)
    if change == "attribute":
        other.scale = 3.0
    elif change == "shape":
        example = (torch.randn(4, 1, 8),)
    elif change == "training":
        other.eval()
    elif change == "dtype":
        other.double()
    elif change == "dynamic":  # a capture at fixed shapes serves no symbolic request
        assert capture_reuse.key(other, example, dynamic=False) != base
        return
    else:
        other.b.weight = other.a.weight
    assert capture_reuse.key(other, example) != base


def test_the_cache_keeps_no_model_alive() -> None:
    RECALL.clear()
    model = Net()
    capture(model, (torch.randn(4, 8),))
    alive = weakref.ref(model.a.weight)
    del model
    gc.collect()
    assert alive() is None


def test_a_second_hf_gpt2_recalls_the_capture_and_steps_like_a_fresh_one() -> None:
    pytest.importorskip("transformers")
    from helpers.hf import gpt2, lm_loss

    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    losses = []
    for fresh in (True, False):
        if fresh:
            RECALL.clear()
        torch.manual_seed(0)
        pipe = pt.Pipeline(gpt2(), "zbv", 4, lm_loss, local_ranks=2, split_points="auto",
                           example_inputs=(ids[:2],))
        assert pipe.traced is not None and (pipe.traced.captured.seconds > 0) is fresh
        losses.append(pipe.step(ids, ids).loss)
    assert losses[0] is not None and losses[1] is not None and torch.equal(*losses)
