"""Provenance: a split that would make a stage read a stale copy, or a value from the wrong
stage, is refused with the reason; a grouping that keeps writer and readers together runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError
from pipetrain.runtime.transport.routes import Ports, Routes
from pipetrain.split.provenance import prove_routes
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


class Shifted(nn.Module):
    """Makes a copy and writes into it in place (mBART's ``shift_tokens_right``), then reads it
    in its last block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[:, 1:] = x[:, :-1].clone()
        return self.b(self.a(x)) + y


class Residual(nn.Module):
    """Adds in place into the value it received (HF ResNet's ``hidden_state += residual``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h += self.b(x)
        return h


class Halve(nn.Module):
    """Writes into the first half of the value it is given, through a view."""

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        v[:, :2].mul_(2)
        return v.sum(-1, keepdim=True)


class Bumped(nn.Module):
    """Unit ``a`` makes v, unit ``w`` writes into it through a view, unit ``c`` reads v."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.w, self.c = nn.Linear(4, 4), Halve(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.a(x)
        s = self.w(v)
        return self.c(v) + s


def _exact(model: nn.Module, ref: nn.Module, points: list[str], ranks: int,
           balance: list[int] | None = None) -> None:
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = pt.Pipeline(model, "1f1b", 4, nn.MSELoss(), local_ranks=ranks, split_points=points,
                       example_inputs=(x[:2],), balance=balance)
    got = pipe.step(x, y).loss
    assert got is not None and torch.equal(got, reference_step(ref, x, y, nn.MSELoss(), 4))
    assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_a_value_written_by_the_stage_that_made_it_is_sent_written() -> None:
    _exact(Shifted(), Shifted(), ["b"], 2)


def test_a_stage_writes_in_place_into_its_own_copy_of_a_received_value() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Residual(), nn.Linear(4, 4))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), Residual(), nn.Linear(4, 4))
    _exact(model, ref, ["1.b", "2"], 3)  # stage 1 writes h += ..., h made in stage 0


def test_a_write_between_maker_and_reader_is_refused_unless_grouped() -> None:
    with pytest.raises(PartitionError, match=r"stage 1 writes 'linear' in place \(aten.mul_"
                       r".*stage 2 reads it"):
        _exact(Bumped(), Bumped(), ["w", "c"], 3)
    _exact(Bumped(), Bumped(), ["w", "c"], 2, balance=[1, 2])  # w copies v, hands c its copy


class Indexed(nn.Module):
    """Indexes with a Python list (Falcon's ``fused_qkv[..., [-2], :]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)[..., [-1]])


def test_a_tensor_made_from_python_values_on_meta_is_refused_with_its_line() -> None:
    with torch.device("meta"):
        model = Indexed()
    with pytest.raises(PartitionError, match=r"tensor from Python values \(.*test_provenance.py"
                       r":\d+ \(`return self.b\(self.a\(x\)\[..., \[-1\]\]\)`\)"):
        pt.Pipeline(model, "1f1b", 2, nn.MSELoss(), local_ranks=2, split_points=["b"],
                    example_inputs=(torch.zeros(2, 4),))
    real = Indexed()  # with real tensors the constant holds its values
    pipe = pt.Pipeline(real, "1f1b", 2, nn.MSELoss(), local_ranks=2, split_points=["b"],
                       example_inputs=(torch.zeros(2, 4),))
    x = torch.randn(4, 4)
    assert torch.equal(pipe.eval_step(x).outputs, real(x))
