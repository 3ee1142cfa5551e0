"""Pipeline(parallelize=fn): the hook wraps each stage's layers; names and gradients follow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch
from pipetrain.errors import PartitionError, PipelineError
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])


def _replace_weights(stage: int, layers: list[nn.Module]) -> None:
    """What a wrapper does: new Parameter objects (same values) under the same names."""
    for layer in layers:
        for module in layer.modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                setattr(module, pname, nn.Parameter(p.detach().clone()))


def test_parallelize_sees_every_stage_and_names_follow_the_new_parameters() -> None:
    seen: list[tuple[int, int]] = []

    def hook(stage: int, layers: list[nn.Module]) -> None:
        seen.append((stage, len(layers)))
        _replace_weights(stage, layers)

    ref = _model()
    pipe = pt.Pipeline(_model(), "zb-h1", 4, LOSS, local_ranks=2, parallelize=hook)
    assert seen == [(0, 2), (1, 2)]
    ids = {id(p) for layer in pipe.stages[0].module for p in layer.parameters()}
    assert ids <= {id(p) for p in pipe.parameters()}  # the replaced ones are the pipeline's
    x, y = batch(8)
    assert torch.equal(pipe.step(x, y).loss, reference_step(ref, x, y, LOSS, 4))
    assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_parallelize_may_not_add_parameters() -> None:
    def adds(stage: int, layers: list[nn.Module]) -> None:
        layers[0].register_parameter("extra", nn.Parameter(torch.zeros(1)))

    with pytest.raises(PipelineError, match=r"stage 0's layer '0' \(2 before, 3 after\)"):
        pt.Pipeline(_model(), "1f1b", 4, LOSS, local_ranks=2, parallelize=adds)


def test_a_tied_weight_a_hook_copies_per_stage_stays_one_weight() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))
        model[3].weight = model[0].weight  # one weight in two stages, an embedding and head
        return model

    ref, model = make(), make()
    pipe = pt.Pipeline(model, "1f1b", 4, LOSS, local_ranks=2, parallelize=_replace_weights)
    assert model[3].weight is not model[0].weight  # the hook cut the tie: two copies
    names = [n for n, _ in pipe.named_parameters()]
    assert names.count("0.weight") == 1 and "3.weight" not in names  # the first copy only
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(3):
        x, y = batch(8, seed=k)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(x, y).loss
        assert torch.allclose(loss, reference_step(ref, x, y, LOSS, 4), rtol=1e-6)
        # the copy's gradient went into the first's: the tied weight's whole gradient
        assert model[3].weight.grad is None
        assert torch.allclose(model[0].weight.grad, ref[0].weight.grad, rtol=1e-5, atol=1e-7)
        opt.step()
        ref_opt.step()
    pipe.step(*batch(8), )  # the next step's start hands the first copy's values on
    assert torch.equal(model[3].weight, model[0].weight)


def test_parallelize_that_keeps_a_shared_weight_trains_like_one_device() -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))
        model[3].weight = model[0].weight
        return model

    ref, model = make(), make()

    def wraps_the_others(stage: int, layers: list[nn.Module]) -> None:  # not the shared one
        _replace_weights(stage, [layer for layer in layers if layer is model[2]])

    pipe = pt.Pipeline(model, "1f1b", 4, LOSS, local_ranks=2, parallelize=wraps_the_others)
    x, y = batch(8)
    assert torch.equal(pipe.step(x, y).loss, reference_step(ref, x, y, LOSS, 4))
    named = dict(pipe.named_parameters())  # the tied weight's two parts add in another order
    assert grad_mismatches(named.items(), ref, skip={"0.weight"}) == []
    assert torch.allclose(named["0.weight"].grad, ref[0].weight.grad, rtol=1e-6, atol=1e-7)


def test_sharded_stages_refuse_a_weight_two_layers_of_one_stage_share() -> None:
    from pipetrain.parallel.sharded import _refuse_sharing

    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(PartitionError, match=r"stage 3: its layers 0 and 2 share a weight"):
        _refuse_sharing(3, [a, nn.ReLU(), b])
    _refuse_sharing(3, [a, nn.Linear(4, 4)])  # nothing shared: no error


def test_sharded_stages_refuse_a_module_another_local_stage_sharded() -> None:
    from pipetrain.parallel.sharded import _refuse_sharded

    shared = nn.Linear(4, 4)
    with pytest.raises(PartitionError, match=r"stage 3: its layer 1 holds '0.weight'.*share "
                       r"a module.*Tie the weight, not the module"):
        _refuse_sharded(3, [nn.ReLU(), nn.Sequential(shared)], {id(shared.weight): object()})
    _refuse_sharded(3, [shared], {})


def test_tensor_parallel_plans_and_their_misuse() -> None:
    from types import SimpleNamespace

    from pipetrain.models.gpt import Block, Embedding, GPTConfig, Head
    from pipetrain.parallel.tensor_parallel import TensorParallel, gpt_plan

    config = GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=1)
    plain, sequence = gpt_plan(False), gpt_plan(True)
    assert set(plain(Block(config))) == {"attn.qkv", "attn.proj", "mlp.0", "mlp.2"}
    assert set(sequence(Block(config))) == {"ln1", "attn.qkv", "attn.proj", "ln2", "mlp.0",
                                            "mlp.2"}
    assert plain(Embedding(config)) == {} and set(sequence(Embedding(config))) == {""}
    assert set(sequence(Head(config))) == {""} and sequence(nn.Linear(2, 2)) == {}
    one = SimpleNamespace(ndim=1, mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="sequence_parallel applies to the default plan"):
        TensorParallel(one, {"mlp.0": None}, sequence_parallel=True)  # type: ignore[arg-type, dict-item]
    with pytest.raises(ValueError, match="needs a 1-D mesh"):
        TensorParallel(SimpleNamespace(ndim=2, mesh_dim_names=("a", "b")))  # type: ignore[arg-type]
