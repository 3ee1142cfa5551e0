"""``eval_step`` runs what ``model.eval()`` runs: a model captured in training mode with dropout
and batch norm gets a second graph, captured in eval mode and sharing the stages' tensors;
a layer list runs in eval mode while the eval step lasts. Training steps keep their graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

import pipetrain as pt
from helpers.hf import MODELS, batch, lm_loss
from pipetrain.testing import reference_step


class Noisy(nn.Module):
    """A user's module: dropout, then a batch norm, in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16),
                                                  nn.ReLU(), nn.Dropout(0.5)) for _ in range(3))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.inp(x), 0.2, self.training)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("ranks", [3])
def test_dropout_and_batch_norm_evaluate_as_eval_mode(ranks: int) -> None:
    torch.manual_seed(0)
    model = Noisy().double()
    for block in model.blocks:  # running statistics that are not the defaults
        block[1].running_mean.uniform_(-1, 1)
        block[1].running_var.uniform_(0.5, 2)
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 6, dtype=torch.float64), torch.randint(0, 3, (12,))
    pipe = pt.Pipeline(model, "1f1b", 4, _loss, split_points=["blocks.1", "blocks.2"][:ranks - 1],
                       example_inputs=(x,), local_ranks=ranks)
    assert pipe.engine.evaluator is None  # captured by the first eval step
    stats = {n: b.clone() for n, b in pipe.named_buffers()}
    got = pipe.eval_step(x, y).loss
    assert pipe.engine.evaluator is not None
    with torch.no_grad():
        want = _loss(ref.eval()(x), y)
    assert got is not None and torch.allclose(got, want, rtol=1e-12, atol=0)
    assert all(torch.equal(b, stats[n]) for n, b in pipe.named_buffers())  # stats kept
    assert model.training and ref.training is False
    ref.train()  # a training step still drops out and updates the statistics, as before
    torch.manual_seed(7)
    step = pipe.step(x, y)
    torch.manual_seed(7)
    expect = reference_step(ref, x, y, _loss, 4, rng=True)
    assert step.loss is not None and torch.allclose(step.loss, expect, rtol=1e-12, atol=0)


@pytest.mark.long  # beside test_dropout_and_batch_norm_evaluate_as_eval_mode
def test_hf_gpt2_with_dropout_evaluates_as_eval_mode() -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    model = tf.GPT2LMHeadModel(cfg).double()
    inputs, targets = batch("gpt2", rows=8, seq=10)
    pipe = pt.Pipeline(model, "1f1b", 4, lm_loss, split_points=["transformer.h.1"],
                       example_inputs=inputs, local_ranks=2)
    got = pipe.eval_step(pipe.pack(**inputs), targets).loss
    with torch.no_grad():
        want = lm_loss(copy.deepcopy(model).eval()(**inputs), targets)
    assert got is not None and torch.allclose(got, want, rtol=1e-10, atol=0)
    with torch.no_grad():  # what the training graph gives instead: dropped out
        dropped = lm_loss(copy.deepcopy(model)(**inputs), targets)
    assert not torch.allclose(dropped, want, rtol=1e-6, atol=0)


def test_a_model_without_dropout_keeps_one_graph() -> None:
    model = MODELS["llama"]()
    inputs, _ = batch("llama", rows=4, seq=8)
    pipe = pt.Pipeline(model, "1f1b", 2, lm_loss, split_points=["model.layers.2"],
                       example_inputs=inputs, local_ranks=2)
    pipe.eval_step(pipe.pack(**inputs))
    assert pipe.engine.evaluator is None
    x = torch.randn(4, 6)
    pipe = pt.Pipeline(Noisy().eval(), "1f1b", 2, _loss, split_points=["blocks.1"],
                       example_inputs=(x,), local_ranks=2)
    pipe.eval_step(x)
    assert pipe.engine.evaluator is None  # captured in eval mode: its graph is the eval graph


def test_a_layer_list_evaluates_in_eval_mode() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5)), nn.BatchNorm1d(8),
              nn.Linear(8, 2)]
    ref = copy.deepcopy(nn.Sequential(*layers)).eval()
    pipe = pt.Pipeline(layers, "gpipe", 2, _loss, local_ranks=3)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    got = pipe.eval_step(x, y).loss
    with torch.no_grad():
        want = _loss(ref(x), y)
    assert got is not None and torch.allclose(got, want, rtol=1e-6, atol=0)
    assert all(m.training for m in layers)  # modes restored
