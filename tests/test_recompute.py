"""Recompute: per-layer flags from a policy; a replay's saved tensors and when they are dropped."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.runtime.recompute import Replay, layer_flags, segments


def test_layer_flags_follow_the_policy() -> None:
    assert layer_flags("always", [2, 1]) == [True, True, True]
    assert layer_flags("except_last", [2, 1]) == [True, True, False]
    assert layer_flags({1}, [2, 1]) == [False, False, True]
    assert layer_flags(("every", 2), [2, 1]) == [True, False, True]
    with pytest.raises(ValueError, match="stages are 0..1"):
        layer_flags({2}, [2, 1])


def _replayed(last_use: bool) -> tuple[Replay, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    segment = segments([nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)], [True] * 3)[0]
    x = torch.randn(3, 4, requires_grad=True)
    replay = Replay(segment, x, torch.device("cpu"))
    y = replay.forward(x)
    replay.replay()
    replay.last_use = last_use
    return replay, x, y


def test_replay_gives_the_same_gradients_as_no_recomputation() -> None:
    replay, x, y = _replayed(last_use=False)
    y.sum().backward()
    want = torch.autograd.grad(replay.segment.run(x).sum(), x)[0]
    assert x.grad is not None and torch.equal(x.grad, want)


def test_the_last_backward_drops_each_replayed_tensor_as_autograd_takes_it() -> None:
    kept, _, y = _replayed(last_use=False)
    y.sum().backward(retain_graph=True)
    assert kept.saved is not None and all(t is not None for t in kept.saved)
    dropped, _, y = _replayed(last_use=True)
    y.sum().backward(retain_graph=True)
    assert dropped.saved is not None and all(t is None for t in dropped.saved)


class _ReadsTwice(torch.autograd.Function):
    """A custom layer whose backward reads its saved tensors twice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        first = ctx.saved_tensors[0]
        return grad * (first + ctx.saved_tensors[0])


class _Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReadsTwice.apply(x)


def test_reading_a_saved_tensor_twice_in_the_last_backward_is_a_clear_error() -> None:
    x = torch.randn(3, requires_grad=True)
    replay = Replay(segments([_Square()], [True])[0], x, torch.device("cpu"))
    y = replay.forward(x)
    replay.replay()
    y.sum().backward(retain_graph=True)  # not the last backward: reading twice is fine
    assert x.grad is not None and torch.equal(x.grad, 2 * x.detach())
    replay.last_use = True
    with pytest.raises(RuntimeError, match="read ctx.saved_tensors once in backward"):
        y.sum().backward()
