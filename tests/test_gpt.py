"""GPT layer list: shapes, causality, tying, preset sizes, pipelined exactness and training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.models.gpt as gpt
from pipetrain.models.gpt import PRESETS, GPTConfig, gpt_layers, gpt_specs, lm_loss
from pipetrain.split.lazy import materialize
from pipetrain.testing import grad_mismatches, reference_step

CFG = GPTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=4)


def model(cfg: GPTConfig = CFG, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*gpt_layers(cfg))


def ids(b: int = 4, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(256, (b, t), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_layer_list() -> None:
    layers = gpt_layers(CFG)
    assert len(layers) == CFG.n_layers + 2
    assert isinstance(layers[0], gpt.Embedding) and isinstance(layers[-1], gpt.Head)
    x = ids(3, 10)
    h = layers[0](x)
    assert h.shape == (3, 10, 32) and layers[1](h).shape == h.shape
    assert nn.Sequential(*layers)(x).shape == (3, 10, 256)


def test_too_long_sequence_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="seq_len 16"):
        model()(ids(1, 17))


def test_causal() -> None:
    m, x = model(), ids(2, 16)
    y = x.clone()
    y[:, 9] = (y[:, 9] + 1) % 256
    a, b = m(x), m(y)
    torch.testing.assert_close(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_head_is_tied_to_the_embedding() -> None:
    layers = gpt_layers(CFG)
    assert layers[-1].weight is layers[0].tokens
    assert sum(p.numel() for p in nn.Sequential(*layers).parameters()) == CFG.n_params


def test_specs_build_an_untied_head() -> None:
    built = pt.build_layers(gpt_specs(CFG), seed=0)
    assert built[-1].weight is not built[0].tokens
    n = sum(p.numel() for layer in built for p in layer.parameters())
    assert n == CFG.n_params + CFG.vocab_size * CFG.d_model


def test_init_is_deterministic_and_scaled() -> None:
    a, b = model(seed=5), model(seed=5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    block = a[1]
    assert torch.count_nonzero(block.attn.qkv.bias) == 0
    std_in, std_out = block.mlp[0].weight.std().item(), block.mlp[2].weight.std().item()
    assert abs(std_in - 0.02) < 0.002
    assert abs(std_out - 0.02 / (2 * CFG.n_layers) ** 0.5) < 0.001


def test_meta_layers_materialize_like_reset_parameters() -> None:
    with torch.device("meta"):
        block = gpt.Block(CFG)
    real = materialize(block, index=1, seed=0)
    assert abs(real.attn.proj.weight.std().item() - 0.02 / 8 ** 0.5) < 0.001
    assert torch.equal(real.ln1.weight, torch.ones(32))


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_parameter_counts(name: str) -> None:
    cfg = PRESETS[name]
    if name in ("tiny", "small"):
        assert sum(p.numel() for p in model(cfg).parameters()) == cfg.n_params
    if name == "tiny":
        assert cfg.n_params < 1_000_000
    if name == "1b":
        assert 1.2e9 < cfg.n_params < 1.5e9


def test_docstring_table_matches_presets() -> None:
    doc = gpt.__doc__
    assert doc is not None
    assert gpt.preset_table() in doc.replace("\n    ", "\n")


def test_invalid_config_names_every_problem() -> None:
    with pytest.raises(ValueError, match="n_heads=5 must divide d_model=64.*dropout"):
        GPTConfig(n_heads=5, dropout=1.0)


def test_pipeline_matches_single_device() -> None:
    ref, layers = model(seed=3), list(model(seed=3))
    x, y = ids(8, 16, seed=1), ids(8, 16, seed=2)
    want = reference_step(ref, x, y, lm_loss, 4)
    pipe = pt.Pipeline(layers, "1f1b", 4, lm_loss, local_ranks=2)
    got = pipe.step(x, y)
    assert got.loss is not None and torch.equal(got.loss, want)
    # the tied table sums head and embedding gradients in another order: equal to rounding
    tied = "0.tokens"
    assert [m for m in grad_mismatches(pipe.named_parameters(), ref)
            if not m.startswith(f"{tied}:")] == []
    params = dict(pipe.named_parameters())
    torch.testing.assert_close(params[tied].grad, dict(ref.named_parameters())[tied].grad)


def test_tiny_model_learns() -> None:
    m = model(PRESETS["tiny"], seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = ids(8, 32, seed=4)
    inputs, targets = x[:, :-1], x[:, 1:]
    losses = []
    for _ in range(30):
        loss = lm_loss(m(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 5.0  # about ln(256) = 5.55 at initialisation
    assert losses[-1] < 0.7 * losses[0]


def test_kept_layers_equal_the_whole_model_and_the_others_hold_no_memory() -> None:
    cfg = GPTConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=4, seq_len=8)
    torch.manual_seed(3)
    whole = gpt_layers(cfg)
    after_whole = torch.randn(3)  # the global RNG goes on exactly as after the whole model
    torch.manual_seed(3)
    part = gpt_layers(cfg, keep={2, 3}.__contains__)
    assert torch.equal(torch.randn(3), after_whole)
    assert [m.weight.device.type for m in (part[1].ln1, part[2].ln1, part[3].ln1, part[4].ln1)
            ] == ["meta", "cpu", "cpu", "meta"]
    assert part[5].weight is part[0].tokens  # embedding and head always kept, still tied
    for i in (0, 2, 3, 5):
        for (name, a), b in zip(whole[i].state_dict().items(), part[i].state_dict().values()):
            assert torch.equal(a, b), (i, name)
