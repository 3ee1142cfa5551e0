"""Lazy layers: each rank builds only its own stages, with the whole model's initial values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch
from pipetrain.split.lazy import is_meta, materialize
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


def specs() -> list[pt.LayerSpec]:
    return [pt.LayerSpec(nn.Linear, 8, 8) if i % 2 == 0 else pt.LayerSpec(nn.Tanh)
            for i in range(8)]


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
                               for _ in range(4)])


def test_spec_build_is_per_layer_deterministic() -> None:
    a = pt.build_layers(specs(), seed=7)
    b = pt.LayerSpec(nn.Linear, 8, 8).build(4, seed=7)
    assert torch.equal(a[4].weight, b.weight)
    assert not torch.equal(a[0].weight, a[2].weight)


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zbv"])
def test_specs_train_like_the_whole_model(name: str) -> None:
    ref = nn.Sequential(*pt.build_layers(specs(), seed=3))
    x, y = batch(12)
    want = reference_step(ref, x, y, LOSS, 4)
    v = 1 if name == "1f1b" else 2
    pipe = pt.Pipeline(specs(), name, 4, LOSS, local_ranks=2, stages_per_rank=v, init_seed=3)
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_meta_model_materialises_like_the_whole_model() -> None:
    full = meta_model()
    ref = nn.Sequential(*[materialize(layer, i, seed=5) for i, layer in enumerate(full)])
    pipe = pt.Pipeline(meta_model(), "1f1b", 2, LOSS, local_ranks=2, init_seed=5)
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        assert not p.is_meta and torch.equal(p, refs[name]), name


def test_meta_layer_without_reset_parameters_is_an_error() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        layer = Bare()
    with pytest.raises(ValueError, match=r"parameters \['w'\] were built on the meta device"):
        materialize(layer, 0, seed=0)


BUILT: list[int] = []


def counted_linear(index: int) -> nn.Module:
    BUILT.append(index)
    return nn.Linear(8, 8)


def _only_own(ctx: pt.RankContext) -> list[str]:
    layers = [pt.LayerSpec(counted_linear, i) for i in range(8)]
    pt.Pipeline(layers, "1f1b", 2, LOSS, init_seed=3)
    built = sorted(BUILT)
    want = [0, 1, 2, 3] if ctx.rank == 0 else [4, 5, 6, 7]
    meta = pt.Pipeline(meta_model(), "1f1b", 2, LOSS, init_seed=3)
    still_meta = [n for n, p in meta.named_parameters() if p.is_meta]
    return ([] if built == want else [f"rank {ctx.rank} built layers {built}"]) + still_meta


def test_each_rank_builds_only_its_layers() -> None:
    assert pt.launch(_only_own, 2, timeout=60) == [[], []]


def test_is_meta() -> None:
    assert is_meta(meta_model()) and not is_meta(nn.Linear(2, 2))
