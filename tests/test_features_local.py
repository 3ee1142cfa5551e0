"""Recomputation (per stage, every k-th layer) and frozen parameters: single-device gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


def _v(name: str) -> int:
    return 2 if name in MULTI else 1


def dropout_mlp(p: float, seed: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Tanh())
                           for _ in range(8)])


def frozen(model: nn.Sequential, trainable: set[int]) -> nn.Sequential:
    for i, layer in enumerate(model):
        for p in layer.parameters():
            p.requires_grad_(i in trainable)
    return model


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("policy", ["always", "except_last", [1]])
def test_recompute_matches_single_device(name: str, policy: object) -> None:
    ref, model = dropout_mlp(0.0), dropout_mlp(0.0)
    x, y = batch(12)
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=_v(name),
                       recompute=policy)  # type: ignore[arg-type]
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []


@pytest.mark.parametrize("name", ["1f1b", "zbv", "dualpipev"])
def test_recompute_replays_dropout_masks(name: str) -> None:
    x, y = batch(12)
    runs = []
    for policy in ("never", "always"):
        model = dropout_mlp(0.3)
        pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=_v(name),
                           recompute=policy)
        torch.manual_seed(9)
        runs.append((pipe.step(x, y).loss, model))
    (loss_a, a), (loss_b, b) = runs
    assert loss_a is not None and loss_b is not None and torch.equal(loss_a, loss_b)
    assert grad_mismatches(a.named_parameters(), b) == []


def test_recompute_policy_errors() -> None:
    with pytest.raises(ValueError, match="recompute must be one of"):
        pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2, recompute="sometimes")
    with pytest.raises(ValueError, match=r"recompute names stages \[5\], but stages are 0..1"):
        pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2, recompute=[5])


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("trainable", [{5}, {0, 7}, set(range(4, 8))])
def test_frozen_parameters(name: str, trainable: set[int]) -> None:
    ref, model = frozen(mlp(), trainable), frozen(mlp(), trainable)
    x, y = batch(12)
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=_v(name))
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []


class Counted(nn.Module):
    """A layer that counts how often its forward runs (F, and replays)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer, self.runs = layer, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return self.layer(x)


def counted(model: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(*[Counted(layer) for layer in model])


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_recompute_every_kth_layer_matches_single_device(name: str, k: int) -> None:
    ref, model = counted(dropout_mlp(0.0)), counted(dropout_mlp(0.0))
    x, y = batch(12)
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=_v(name),
                       recompute=("every", k))
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []
    # layers 0, k, 2k, ... ran once more per micro-batch (once, even where I and W are split)
    assert [layer.runs for layer in model] == [8 if i % k == 0 else 4 for i in range(8)]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zbv"])
def test_recompute_every_kth_layer_replays_dropout_masks(name: str) -> None:
    x, y = batch(12)
    runs = []
    for policy in ("never", ("every", 2)):
        model = dropout_mlp(0.3)
        pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=_v(name),
                           recompute=policy)  # type: ignore[arg-type]
        torch.manual_seed(9)
        runs.append((pipe.step(x, y).loss, model))
    (loss_a, a), (loss_b, b) = runs
    assert loss_a is not None and loss_b is not None and torch.equal(loss_a, loss_b)
    assert grad_mismatches(a.named_parameters(), b) == []


def test_recomputed_layers_keep_nothing_until_the_replay() -> None:
    pipe = pt.Pipeline(dropout_mlp(0.0), "zb-h1", 2, LOSS, local_ranks=2,
                       recompute=("every", 2))  # stage 0: layers 0..3, segments [0] 1 [2] 3
    stage = pipe.stages[0]
    assert [(len(s.layers), s.recompute) for s in stage.segments] == [(1, True), (1, False)] * 2
    stage.forward(0, [([torch.randn(3, 8)], {"t": 0}, [False])])
    replays = stage._flight[0].replays
    assert len(replays) == 2 and all(r.saved is None and r.count > 0 for r in replays)
    stage.prepare_backward(0)
    assert all(r.saved is not None and len(r.saved) == r.count for r in replays)


def test_per_layer_policy_errors() -> None:
    for bad in (("every", 0), ("each", 2), ("every", 1.5)):
        with pytest.raises(ValueError, match=r"per-layer recompute policy is \('every', k\)"):
            pt.Pipeline(mlp(), "1f1b", 2, LOSS, local_ranks=2, recompute=bad)  # type: ignore[arg-type]


def test_grad_mismatches_names_a_stage_left_out() -> None:
    ref, model = dropout_mlp(0.0), dropout_mlp(0.0)
    x, y = batch(12)
    reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, "1f1b", 4, LOSS, local_ranks=2)
    pipe.step(x, y)
    named = list(pipe.named_parameters())
    assert grad_mismatches(named, ref) == []
    first_half = [(n, p) for n, p in named if int(n.split(".")[0]) < 4]  # stage 1 left out
    assert grad_mismatches(first_half, ref) == [f"{n}: held by no stage" for n, _ in named
                                                if int(n.split(".")[0]) >= 4]
    assert grad_mismatches(named, ref, skip={"0.0.weight"}) == []
    assert grad_mismatches(named[1:], ref, skip={"0.0.weight"}) == []  # compared elsewhere
