"""The router's load-balancing loss of a mixture of experts, cut into pipeline stages.

With ``output_router_logits=True`` a Hugging Face MoE causal LM (Mixtral, Qwen3-MoE) collects
every decoder layer's router logits and adds ``router_aux_loss_coef * aux_loss`` to its loss.
Pipelined at 4 stages in one process (local ranks), the last stage needs the router logits of
the layers of every stage, and every router needs the gradient of that term back: the loss and
every parameter's gradient, the routers' (``mlp.gate.weight``) included, equal transformers'
model run on the same micro-batches one after another (float64, ``batched_mm`` experts). The
term is made large (``router_aux_loss_coef=0.5``) and the routers' gradients checked to differ
from those without it, so that a pipeline which dropped it would fail. ``pipetrain train
--hf``'s loss (:func:`pipetrain.train.sources.hf_source.causal_lm_loss_of`) adds it as transformers'
``model(input_ids, labels=...)`` does.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

M, ROWS, SEQ, V, LAYERS, COEF = 4, 8, 12, 64, 4, 0.5
POINTS = [f"model.layers.{i}" for i in (1, 2, 3)]  # 4 stages, a layer each
ROUTERS = [f"model.layers.{i}.mlp.gate.weight" for i in range(LAYERS)]
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, head_dim=8, moe_intermediate_size=32)),
}


def config(name: str, router: bool = True) -> Any:
    """A tiny config of ``name``: 4 layers of 4 experts, top-2, its router loss on or off."""
    cfg, _, extra = FAMILIES[name]
    return getattr(tf, cfg)(
        num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=V, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=2,
        experts_implementation="batched_mm", output_router_logits=router,
        router_aux_loss_coef=COEF, **extra)


def build(name: str, router: bool = True) -> nn.Module:
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    return getattr(tf, FAMILIES[name][1])(config(name, router)).double()  # type: ignore[no-any-return]


def labelled(padded: bool) -> dict[str, torch.Tensor]:
    """Token ids with themselves as ``labels``; ``padded``: rows padded on the right, masked
    and labelled -100 there."""
    ids = torch.randint(1, V, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    if not padded:
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones_like(ids)
    for r in range(1, ROWS, 3):
        mask[r, SEQ - 2 - r % 5:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class OwnLoss:
    """The loss as a user writes it: the model's own ``out.loss`` (it was given ``labels``);
    it keeps each micro-batch's ``aux_loss``."""

    def __init__(self) -> None:
        self.aux: list[float] = []

    def __call__(self, out: Any, _: Any) -> torch.Tensor:
        self.aux.append(float(out.aux_loss.detach()))
        return out.loss  # type: ignore[no-any-return]


def grad_problems(got: dict[str, torch.Tensor | None], ref: nn.Module, tol: float) -> list[str]:
    """Gradients missing, or farther than ``tol`` of the largest reference gradient."""
    names = dict(ref.named_parameters())
    bad = [f"{name}: not the model's" for name in got if name not in names]
    for name, p in names.items():
        if name not in got:
            bad.append(f"{name}: in no stage")
            continue
        g = got[name]
        if g is None or p.grad is None:
            bad.append(f"{name}: no gradient")
        elif (g - p.grad).abs().max() > tol * p.grad.abs().max():
            bad.append(f"{name}: max |diff| {(g - p.grad).abs().max().item():.3g}")
    return bad


def routers_changed(got: dict[str, torch.Tensor | None], name: str, inputs: Any) -> None:
    """Every router's gradient differs from the one without the router loss."""
    plain = build(name, router=False)
    assert plain(**inputs).aux_loss is None
    reference_step(lambda x: plain(**x), inputs, inputs["input_ids"],
                   lambda out, _: out.loss, M)
    for r in ROUTERS:
        g, without = got[r], dict(plain.named_parameters())[r].grad
        assert g is not None and without is not None
        assert (g - without).abs().max() > 1e-3 * without.abs().max(), r


@pytest.mark.parametrize(("name", "schedule", "ranks", "padded"), [
    ("mixtral", "1f1b", 4, False), ("mixtral", "zbv", 2, True),
    # long tier, beside the zbv cases (whose backward is split into I and W too)
    pytest.param("qwen3_moe", "zb-h1", 4, False, marks=pytest.mark.long),
    ("qwen3_moe", "zbv", 2, False)])
def test_router_loss_and_every_gradient_match_transformers(
        name: str, schedule: str, ranks: int, padded: bool) -> None:
    model = build(name)
    ref = copy.deepcopy(model)
    inputs = labelled(padded)
    targets = inputs["input_ids"]
    piped, eager = OwnLoss(), OwnLoss()
    pipe = pt.Pipeline(model, schedule, M, piped, local_ranks=ranks, split_points=POINTS,
                       example_inputs={k: v[:2] for k, v in inputs.items()})
    assert len(pipe.balance) == 4
    got = pipe.step(pipe.pack(**inputs), targets).loss
    want = reference_step(lambda x: ref(**x), inputs, targets, eager, M)
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # the router loss is in it, and is the one transformers computes on each micro-batch
    assert len(piped.aux) == M and min(piped.aux) > 0.1
    assert sorted(piped.aux) == pytest.approx(sorted(eager.aux), rel=1e-12)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    assert grad_problems(grads, ref, 1e-9) == []
    routers_changed(grads, name, inputs)


def test_train_hf_loss_adds_the_router_loss_as_transformers_labels_do() -> None:
    from pipetrain.train.config import TrainConfig
    from pipetrain.train.sources.hf_source import causal_lm_loss, causal_lm_loss_of, hf_pipeline

    assert causal_lm_loss_of(build("mixtral", router=False)) is causal_lm_loss
    model = build("mixtral")
    ref = copy.deepcopy(model)
    window = torch.randint(1, V, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    x, y = window[:, :-1], window[:, 1:].contiguous()
    cfg = TrainConfig(seq_len=SEQ, microbatches=M, balance="even")
    pipe = hf_pipeline(model, cfg, ps.make_schedule("zbv", 2, M), ROWS // M, lambda f: f,
                       local_ranks=2)
    got = pipe.step({"input_ids": x}, y).loss
    assert got is not None
    with torch.no_grad():  # transformers' own loss: cross-entropy in fp32, + COEF * aux_loss
        own = [ref(input_ids=a, labels=b, shift_labels=b) for a, b in
               zip(x.chunk(M), y.chunk(M))]
    assert float(got) == pytest.approx(sum(float(o.loss) for o in own) / M, rel=1e-6)
    assert min(COEF * float(o.aux_loss) for o in own) > 0.05
    want = reference_step(lambda ids: ref(input_ids=ids), x, y, causal_lm_loss_of(ref), M)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert grad_problems({n: p.grad for n, p in pipe.named_parameters()}, ref, 1e-9) == []
