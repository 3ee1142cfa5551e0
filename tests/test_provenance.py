"""Provenance: a split that would make a stage read a stale copy, or a value from the wrong
stage, is refused with the reason; a grouping that keeps writer and readers together runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError
from pipetrain.provenance import prove_routes
from pipetrain.routes import Ports, Routes
from pipetrain.testing import grad_mismatches, reference_step


class Counting(nn.Module):
    """Reads a buffer in its first block and updates it in place after its second."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("seen", torch.zeros(1))
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x) * (1 + self.seen))
        self.seen.add_(1)
        return self.c(h)


def _pipe(ranks: int, balance: list[int] | None) -> pt.Pipeline:
    return pt.Pipeline(Counting(), "gpipe", 2, nn.MSELoss(), local_ranks=ranks,
                       split_points=["b", "c"], example_inputs=(torch.zeros(2, 4),),
                       balance=balance)


def test_a_buffer_written_in_one_stage_and_read_in_another_is_refused() -> None:
    with pytest.raises(PartitionError, match=r"stage 1 writes 'seen' in place \(aten.add_"
                       r".*stage 0 reads it"):
        _pipe(3, None)


def test_writer_and_reader_in_one_stage_train_like_one_device_step_after_step() -> None:
    pipe, ref = _pipe(2, [2, 1]), Counting()
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # the buffer's updates reach the next step's read
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        ref.zero_grad()
        for _, p in pipe.named_parameters():
            p.grad = None
        got = pipe.step(x, y).loss
        assert got is not None and torch.equal(got, reference_step(ref, x, y, nn.MSELoss(), 2))
        assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_routes_that_deliver_from_another_stage_are_refused() -> None:
    ports = (Ports((), ((1, ("h",)),), (), ()), Ports(((0, ("h",)),), (), (), ()),
             Ports(((0, ("h",)),), (), (), ()))
    routes = Routes(ports, keyed=True)
    prove_routes(routes, [{}, {"h": 0}, {"h": 0}], [0, 1, 2])  # h made in part 0: fine
    with pytest.raises(PartitionError, match="stage 2 reads 'h', made in stage 1, but it "
                       r"arrives from \[0\]"):
        prove_routes(routes, [{}, {"h": 0}, {"h": 1}], [0, 1, 2])
