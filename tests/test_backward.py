"""Split backward: I (input grads) then W (weight grads) equals one plain ``.backward()``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from pipetrain.models.gpt import Block, GPTConfig
from pipetrain.runtime.backward import WeightWork, backward_full, backward_input

Grads = list[torch.Tensor | None]


# -- models ------------------------------------------------------------------------------------

def block() -> nn.Module:
    """The GPT model's pre-norm transformer block (attention, GELU MLP, residuals)."""
    return Block(GPTConfig(d_model=16, n_heads=4, n_layers=1))


class TwiceUsed(nn.Module):
    """One Linear applied twice: its weight is reached from two places in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class WithConstOutput(nn.Module):
    """A second output computed from weights and a buffer only, not from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.side = nn.Linear(6, 6), nn.Linear(3, 2)
        self.register_buffer("const", torch.linspace(-1, 1, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), torch.tanh(self.side(self.const))


class ThreeHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h), self.c(h), h.sum(-1)


class PassThrough(nn.Module):
    """``x + a + b`` with full-shape a, b: autograd hands the same gradient tensor to x, a and b."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a + self.b


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * mask + y


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 6))


def embedding_stage() -> nn.Module:
    return nn.Sequential(nn.Embedding(20, 6), nn.Linear(6, 6), nn.Tanh())


def frozen_mlp() -> nn.Sequential:
    model = mlp()
    model[0].weight.requires_grad_(False)
    model[4].bias.requires_grad_(False)
    model[2].requires_grad_(False)
    return model


# -- the comparison ----------------------------------------------------------------------------

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _float_input(*shape: int) -> list[torch.Tensor]:
    return [torch.randn(*shape)]


def _leaves(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]


def _outputs(out: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _plain_backward(module: nn.Module, inputs: Sequence[torch.Tensor], grads: Grads) -> Grads:
    leaves = _leaves(inputs)
    outs = _outputs(module(*leaves))
    pairs = [(y, g) for y, g in zip(outs, grads) if g is not None]
    torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
    return [x.grad for x in leaves]


def _split_backward_i(module: nn.Module, inputs: Sequence[torch.Tensor],
                      grads: Grads) -> tuple[Grads, WeightWork]:
    leaves = _leaves(inputs)
    outs = _outputs(module(*leaves))
    return backward_input(outs, grads, leaves)


def _check(module: nn.Module, batches: list[tuple[list[torch.Tensor], Grads]], *,
           fallback: bool = False) -> None:
    """Plain backward on a copy of ``module`` vs. all I's then all W's (zero-bubble order)."""
    torch.manual_seed(0)
    ref = copy.deepcopy(module)
    want = [_plain_backward(ref, inputs, grads) for inputs, grads in batches]

    got, works = [], []
    for inputs, grads in batches:
        gx, work = _split_backward_i(module, inputs, grads)
        got.append(gx)
        works.append(work)
        assert work.done is fallback
    if not fallback:  # I computed no weight gradient
        assert {n: p.grad for n, p in module.named_parameters() if p.grad is not None} == {}
    got_before_w = [[None if g is None else g.clone() for g in gx] for gx in got]
    for work in works:
        work.run()
        assert work.done and work.groups == []

    for gx, gx_before, wx in zip(got, got_before_w, want):
        _assert_equal_grads(gx, wx)
        _assert_equal_grads(gx, gx_before)  # W did not write into gradients I handed out
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in module.named_parameters():
        _assert_equal_grads([p.grad], [ref_grads[name]], name)
        if p.grad is not None:
            assert p.grad.stride() == p.stride(), name


def _assert_equal_grads(got: Grads, want: Grads, what: str = "") -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None), what
        if g is not None and w is not None:
            assert torch.equal(g, w), (what, (g - w).abs().max())


def _batches(inputs: list[list[torch.Tensor]], out_shapes: list[tuple[int, ...] | None]
             ) -> list[tuple[list[torch.Tensor], Grads]]:
    """Pair each micro-batch's inputs with random output grads (None where the shape is None)."""
    g = _gen(1)
    return [(xs, [None if s is None else torch.randn(s, generator=g) for s in out_shapes])
            for xs in inputs]


# -- cases -------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_mb", [1, 2, 3])
def test_mlp(n_mb: int) -> None:
    torch.manual_seed(0)
    _check(mlp(), _batches([_float_input(5, 6) for _ in range(n_mb)], [(5, 6)]))


@pytest.mark.parametrize("n_mb", [1, 2])
def test_transformer_block(n_mb: int) -> None:
    torch.manual_seed(0)
    _check(block(), _batches([_float_input(2, 8, 16) for _ in range(n_mb)], [(2, 8, 16)]))


@pytest.mark.parametrize("n_mb", [1, 2])
def test_first_stage_with_integer_inputs(n_mb: int) -> None:
    torch.manual_seed(0)
    tokens = [[torch.randint(0, 20, (3, 5))] for _ in range(n_mb)]
    batches = _batches(tokens, [(3, 5, 6)])
    _check(embedding_stage(), batches)
    gx, work = _split_backward_i(embedding_stage(), *batches[0])
    assert gx == [None]  # nothing to send back
    assert len(work.groups) == 1  # every weight gradient waits for W


@pytest.mark.parametrize("n_mb", [1, 2])
def test_weight_used_twice_falls_back_to_full_backward(n_mb: int) -> None:
    torch.manual_seed(0)
    model = TwiceUsed()
    _check(model, _batches([_float_input(4, 6) for _ in range(n_mb)], [(4, 6)]), fallback=True)
    gx, work = _split_backward_i(model, *_batches([_float_input(4, 6)], [(4, 6)])[0])
    assert work.done and work.groups == []
    assert gx[0] is not None


@pytest.mark.parametrize("n_mb", [1, 2])
def test_frozen_parameters(n_mb: int) -> None:
    torch.manual_seed(0)
    model = frozen_mlp()
    _check(model, _batches([_float_input(5, 6) for _ in range(n_mb)], [(5, 6)]))
    assert [n for n, p in model.named_parameters() if p.grad is None] == [
        "0.weight", "2.weight", "2.bias", "4.bias"]


def test_output_that_does_not_depend_on_the_input() -> None:
    torch.manual_seed(0)
    _check(WithConstOutput(), _batches([_float_input(4, 6) for _ in range(2)], [(4, 6), (2,)]))


def test_no_output_depends_on_the_input() -> None:
    torch.manual_seed(0)
    model = WithConstOutput()
    x = torch.randn(4, 6)
    batches = _batches([[x]], [None, (2,)])  # only the input-free output gets a gradient
    _check(model, batches)
    assert model.lin.weight.grad is None and model.side.weight.grad is not None


def test_several_outputs_one_gradient_none() -> None:
    torch.manual_seed(0)
    model = ThreeHeads()
    _check(model, _batches([_float_input(4, 6) for _ in range(2)], [(4, 3), None, (4,)]))
    assert model.c.weight.grad is None and model.b.weight.grad is not None


def test_several_inputs_some_without_grad() -> None:
    torch.manual_seed(0)
    inputs = [[torch.randn(3, 6), torch.randint(0, 2, (3, 6)), torch.randn(3, 6)]
              for _ in range(2)]
    _check(TwoInputs(), _batches(inputs, [(3, 6)]))
    gx, _ = _split_backward_i(TwoInputs(), *_batches(inputs[:1], [(3, 6)])[0])
    assert gx[0] is not None and gx[1] is None and gx[2] is not None


def test_scalar_output_without_gradient_is_a_loss() -> None:
    # the last stage passes grads=[None] for its loss: it is seeded with ones, like .backward()
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(5, 6)
    ref = copy.deepcopy(model)
    leaf = _leaves([x])[0]
    ref(leaf).pow(2).mean().backward()
    got = _leaves([x])
    gx, work = backward_input([model(got[0]).pow(2).mean()], [None], got)
    work.run()
    _assert_equal_grads(gx, [leaf.grad])
    for p, q in zip(model.parameters(), ref.parameters()):
        _assert_equal_grads([p.grad], [q.grad])


@pytest.mark.parametrize("n_mb", [1, 3])
def test_gradient_passed_through_to_several_weights(n_mb: int) -> None:
    # x + a + b: autograd gives x, a and b one and the same gradient tensor; storing it as
    # a.grad and b.grad and then adding the next micro-batch into it in place corrupted all
    torch.manual_seed(0)
    _check(PassThrough(), _batches([_float_input(4, 6) for _ in range(n_mb)], [(4, 6)]))


def test_backward_full_matches_plain_backward() -> None:
    torch.manual_seed(0)
    model, x, g = block(), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    ref = copy.deepcopy(model)
    want = _plain_backward(ref, [x], [g])
    leaves = _leaves([x])
    got = backward_full([model(*leaves)], [g], leaves)
    _assert_equal_grads(got, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        _assert_equal_grads([p.grad], [q.grad])


class WeightOut(nn.Module):
    """Returns one of its weights itself, next to an output that also uses it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * self.scale, self.scale


@pytest.mark.parametrize("n_mb", [1, 2])
def test_weight_returned_as_an_output_falls_back(n_mb: int) -> None:
    # a leaf weight as an output has no autograd node, so W never gave it its gradient
    torch.manual_seed(0)
    model = WeightOut()
    _check(model, _batches([_float_input(4, 6) for _ in range(n_mb)], [(4, 6), (4, 6)]),
           fallback=True)
