"""PipeDream-2BW and PipeDream in one process: weights, gradients and losses bitwise equal to
their update rules applied on one process: W(t+1) = W(t) - lr * grad f(W(t-1))
(testing.Reference2BW), and weight stashing, an update after every backward
(testing.ReferenceStash)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import batch, mlp
from pipetrain.testing import Reference2BW, ReferenceStash
from test_grads_ready import tied_mlp

LOSS = nn.MSELoss()
Optimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def differences(pipe: pt.Pipeline, ref: nn.Module) -> list[str]:
    got = dict(pipe.named_parameters())
    return [n for n, q in ref.named_parameters()
            if not (torch.equal(got[n], q) and _same(got[n].grad, q.grad))]


def run(pipe: pt.Pipeline, ref: Reference2BW, optimizer: Optimizer,
        batches: list[tuple[Any, Any]], drain: bool = True) -> list[str]:
    """Step both through ``batches`` (and the drain), the optimizer after each; what differs."""
    mine, theirs = optimizer(list(pipe.parameters())), optimizer(list(ref.model.parameters()))
    problems = []
    for t, (x, y) in enumerate(batches):
        got, want = pipe.step(x, y).loss, ref.step(x, y)
        if not torch.equal(got, want):
            problems.append(f"step {t}: loss {float(got)} != {float(want)}")
        problems += [f"step {t}: {n}" for n in differences(pipe, ref.model)]
        mine.step()
        theirs.step()
    if drain:
        pipe.drain()
        ref.drain()
        problems += [f"drain: {n}" for n in differences(pipe, ref.model)]
        mine.step()
        theirs.step()
    return problems + [f"after: {n}" for n in differences(pipe, ref.model)]


def batches(k: int) -> list[tuple[Any, Any]]:
    return [batch(12, seed=t) for t in range(k)]


@pytest.mark.parametrize(("ranks", "optimizer"), [(2, sgd), (4, adamw)])
def test_a_layer_list_follows_the_rule_bitwise(ranks: int, optimizer: Optimizer) -> None:
    model = mlp()
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=ranks)
    assert run(pipe, ref, optimizer, batches(5)) == []


def test_the_update_is_delayed_one_step_against_1f1b() -> None:
    """The same batches under 1F1B part from 2BW's losses at step 2: the first update 2BW
    makes (after step 1) uses step 0's gradient, 1F1B's after step 0 already did."""
    flushed = pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2)
    delayed = pt.Pipeline(mlp(), "pipedream-2bw", 4, LOSS, local_ranks=2)
    losses: dict[str, list[float]] = {"1f1b": [], "2bw": []}
    for pipe, key in ((flushed, "1f1b"), (delayed, "2bw")):
        opt = sgd(list(pipe.parameters()))
        for x, y in batches(3):
            losses[key].append(float(pipe.step(x, y).loss))  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
    assert losses["1f1b"][0] == losses["2bw"][0]
    assert losses["1f1b"][1] != losses["2bw"][1]  # 1F1B updated after step 0, 2BW did not


def test_a_weight_tied_between_the_first_and_last_stage() -> None:
    """Its two gradients (stage 0's and the last stage's) are summed in another order than
    one backward sums them: to rounding (7.5e-9 measured, as under 1F1B), and never
    missing; every other weight follows bitwise until that rounding reaches it."""
    model = tied_mlp()
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=2)
    opt, ref_opt = sgd(list(pipe.parameters())), sgd(list(ref.model.parameters()))
    for t, (x, y) in enumerate(batches(4)):
        torch.testing.assert_close(pipe.step(x, y).loss, ref.step(x, y), rtol=1e-6, atol=0)
        got = dict(pipe.named_parameters())
        for n, q in ref.model.named_parameters():
            torch.testing.assert_close(got[n], q, rtol=0, atol=1e-7)
            if t == 1 and not n.startswith("0."):  # the first gradients: only the tied
                assert _same(got[n].grad, q.grad), n  # weight's are summed otherwise
            if q.grad is not None:
                torch.testing.assert_close(got[n].grad, q.grad, rtol=0, atol=1e-7)
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize(("name", "tolerance"), [("bert", 0.0), ("llama", 1e-3)])
def test_captured_hf_models_with_adamw(name: str, tolerance: float) -> None:
    """Models we did not write, captured and called with keywords: an encoder (BERT)
    bitwise; a decoder (Llama) within 1e-3 of each tensor's largest value: its capture
    rounds otherwise than eager (an explicit causal mask where eager passes is_causal=True;
    see test_hf.py), and AdamW turns that into 1.8e-4 of the weights over 4 steps."""
    pytest.importorskip("transformers")
    from helpers import hf

    model = getattr(hf, name)()
    loss_fn = hf.LOSSES[name]
    ref = Reference2BW(_Keywords(copy.deepcopy(model)), loss_fn, 4)
    data = [hf.batch(name, seed=t) for t in range(4)]
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, loss_fn, local_ranks=2,
                       split_points=hf.points(name, 2), example_inputs=data[0][0])
    mine, theirs = adamw(list(pipe.parameters())), adamw(list(ref.model.parameters()))

    def close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        if a is None or b is None:
            return a is b
        scale = float(b.detach().abs().max()) or 1.0
        return torch.equal(a, b) if tolerance == 0.0 else float(
            (a - b).abs().max()) <= tolerance * scale

    for x, y in data:
        assert close(pipe.step(pipe.pack(**x), y).loss, ref.step(x, y))
        mine.step()
        theirs.step()
    pipe.drain()
    ref.drain()
    got = dict(pipe.named_parameters())
    for n, q in ref.model.inner.named_parameters():
        assert close(got[n], q) and close(got[n].grad, q.grad), n


@pytest.mark.parametrize("name", ["t5", "vit"])
def test_an_encoder_decoder_and_a_vision_model_we_did_not_write(name: str) -> None:
    """T5 (its own loss from ``labels``, padding mask, relative position bias) and ViT (patch
    embedding, class token), captured in float64 from test_zoo's configs with dropout 0 and
    fed their keyword inputs: losses, weights and gradients within 1e-12 of each tensor's
    largest value of Reference2BW's, SGD with momentum, 3 steps and the drain."""
    pytest.importorskip("transformers")
    import transformers as tf

    import test_zoo as zoo

    arch = zoo.BY_NAME[name]
    config = arch.config()
    for attr in ("dropout_rate", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        if hasattr(config, attr):
            setattr(config, attr, 0.0)
    torch.manual_seed(0)
    model = getattr(tf, arch.cls)(config).to(arch.dtype)
    ref = Reference2BW(_Keywords(copy.deepcopy(model)), arch.loss, 4)
    x, y = zoo.batch(arch)
    data = [({k: v.roll(3 * t, 0) for k, v in x.items()}, y.roll(3 * t, 0))
            for t in range(3)]  # each step its rows in another order: other micro-batches
    example = {k: v[:2] for k, v in x.items()}
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, arch.loss, local_ranks=2,
                       split_points="auto", example_inputs=example)
    mine, theirs = sgd(list(pipe.parameters())), sgd(list(ref.model.parameters()))

    def close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        if a is None or b is None:
            return a is b
        return float((a - b).abs().max()) <= 1e-12 * (float(b.detach().abs().max()) or 1.0)

    for t, (x, y) in enumerate(data):
        assert close(pipe.step(x, y).loss, ref.step(x, y)), t
        mine.step()
        theirs.step()
    pipe.drain()
    ref.drain()
    got = dict(pipe.named_parameters())
    assert len(got) == len(dict(ref.model.inner.named_parameters()))
    for n, q in ref.model.inner.named_parameters():
        assert close(got[n], q) and close(got[n].grad, q.grad), n


class _Pair(nn.Module):
    """A user's layer that takes and returns a tuple: (activations, a per-row scale that
    needs no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, scale = xs
        return torch.tanh(self.lin(x)) * scale, scale


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(xs[0])


def test_tuples_between_stages_follow_the_rule_bitwise() -> None:
    """A layer list whose layers pass a tuple (one member without gradient) between stages,
    its input a tuple too: bitwise Reference2BW's with AdamW at p = 3."""
    torch.manual_seed(0)
    model = nn.Sequential(_Pair(), _Pair(), _Pair(), _Pair(), _Pair(), _Head())
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=3)
    data = []
    for t in range(4):
        x, _ = batch(12, seed=t)
        g = torch.Generator().manual_seed(100 + t)
        data.append(((x, torch.rand(12, 1, generator=g) + 0.5), torch.randn(12, 4, generator=g)))
    assert run(pipe, ref, adamw, data) == []


class _Keywords(nn.Module):
    """A model called with a dict of keyword arguments, as the pipeline's packed input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: dict[str, torch.Tensor]) -> Any:
        return self.inner(**x)


def test_an_eval_step_between_steps_changes_nothing() -> None:
    model = mlp()
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=2)
    opt, ref_opt = sgd(list(pipe.parameters())), sgd(list(ref.model.parameters()))
    for t, (x, y) in enumerate(batches(4)):
        assert torch.equal(pipe.step(x, y).loss, ref.step(x, y))  # type: ignore[arg-type]
        opt.step()
        ref_opt.step()
        if t == 1:  # on the newest weights, with micro-batches in flight
            with torch.no_grad():
                want = LOSS(ref.model(x), y)
            torch.testing.assert_close(pipe.eval_step(x, y).loss, want)
    assert differences(pipe, ref.model) == []


def test_drain_then_fill_again() -> None:
    model = mlp()
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=4)
    assert run(pipe, ref, sgd, batches(2)) == []
    assert run(pipe, ref, sgd, batches(3)[1:]) == []
    with pytest.raises(ValueError, match="none are"):
        pipe.drain()


def test_what_it_does_not_run_with_is_refused() -> None:
    with pytest.raises(ValueError, match="flushes every step"):
        pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2).drain()
    with pytest.raises(ValueError, match=r"compile= yet"):
        pt.Pipeline(mlp(), "pipedream-2bw", 4, LOSS, local_ranks=2, compile=True)
    with pytest.raises(ValueError, match="m >= p"):
        pt.Pipeline(mlp(), "pipedream-2bw", 2, LOSS, local_ranks=4)


# -- PipeDream: weight stashing, an update after every backward --------------------------


def stash_pair(model: nn.Module, ranks: int, optimizer: Optimizer, m: int = 4,
               replicas: int = 1, **kw: Any) -> tuple[pt.Pipeline, ReferenceStash, nn.Module]:
    """A PipeDream pipeline and its one-process reference over the same stages (``replicas``:
    the reference's data-parallel replicas)."""
    ref_model = copy.deepcopy(model)
    pipe = pt.Pipeline(model, "pipedream", m, LOSS, optimizer=optimizer, **kw)
    layers, bounds = list(ref_model), [0]
    for size in pipe.balance:
        bounds.append(bounds[-1] + size)
    stages = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    return pipe, ReferenceStash(stages, LOSS, m, optimizer, replicas), ref_model


@pytest.mark.parametrize(("ranks", "optimizer"), [(2, sgd), (4, adamw)])
def test_pipedream_follows_weight_stashing_bitwise(ranks: int, optimizer: Optimizer) -> None:
    """Every step's loss (its micro-batches on each stage's version of the moment) and the
    weights after the drain equal ReferenceStash's; twice, the pipeline filled again."""
    pipe, ref, ref_model = stash_pair(mlp(), ranks, optimizer, local_ranks=ranks)
    for rounds in range(2):
        for x, y in batches(4):
            assert torch.equal(pipe.step(x, y).loss, ref.step(x, y))  # type: ignore[arg-type]
        pipe.drain()
        ref.drain()
        got = dict(pipe.named_parameters())
        for n, q in ref_model.named_parameters():
            assert torch.equal(got[n], q) and got[n].grad is None, (rounds, n)


def test_pipedream_keeps_the_versions_of_the_micro_batches_in_flight() -> None:
    pipe, _, _ = stash_pair(mlp(), 4, sgd, m=8, local_ranks=4)
    pipe.step(*batch(16))
    assert pipe.engine.async_steps is not None
    held = {s: {v for v, leaves in pipe.engine.async_steps.versions.leaves.items()
                if any(id(p) in leaves for p in st.parameters())}
            for s, st in pipe.stages.items()}
    assert [len(held[s]) for s in range(4)] == [3, 2, 1, 0]  # d micro-batches after a step


def test_pipedream_refusals() -> None:
    with pytest.raises(ValueError, match="pass optimizer="):
        pt.Pipeline(mlp(), "pipedream", 4, LOSS, local_ranks=2)
    with pytest.raises(ValueError, match="optimizer= is for schedule 'pipedream'"):
        pt.Pipeline(mlp(), "pipedream-2bw", 4, LOSS, local_ranks=2, optimizer=sgd)
    with pytest.raises(ValueError, match="optimizer= is for schedule 'pipedream'"):
        pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2, optimizer=sgd)
    with pytest.raises(ValueError, match="tied between stages .* drift apart"):
        pt.Pipeline(tied_mlp(), "pipedream", 4, LOSS, local_ranks=2, optimizer=sgd)


def test_a_2bw_run_stopped_between_steps_resumes_bitwise_through_refill() -> None:
    """Saved mid-stream (parameters, optimizer, in_flight_state) after step 2, resumed in a
    new pipeline by refill() on step 2's batch: steps 3-5 and the drain equal the
    uninterrupted run's, bitwise."""
    data = batches(6)
    whole = pt.Pipeline(mlp(), "pipedream-2bw", 4, LOSS, local_ranks=2)
    opt = adamw(list(whole.parameters()))
    want = []
    for x, y in data:
        want.append(whole.step(x, y).loss)
        opt.step()
    whole.drain()
    opt.step()
    first = pt.Pipeline(mlp(), "pipedream-2bw", 4, LOSS, local_ranks=2)
    opt = adamw(list(first.parameters()))
    for x, y in data[:3]:
        first.step(x, y)
        opt.step()
    saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(first.in_flight_state()))
    del first, opt
    model = mlp(seed=7)  # other values: every one must come from the checkpoint
    model.load_state_dict(saved[0])
    second = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=2)
    opt = adamw(list(second.parameters()))
    opt.load_state_dict(saved[1])
    assert torch.equal(second.refill(*data[2], saved[2]).loss, want[2])  # type: ignore[arg-type]
    for t in range(3, 6):
        assert torch.equal(second.step(*data[t]).loss, want[t])  # type: ignore[arg-type]
        opt.step()
    second.drain()
    opt.step()
    got = dict(second.named_parameters())
    for n, p in whole.named_parameters():
        assert torch.equal(got[n], p), n
    with pytest.raises(ValueError, match="nothing in flight"):
        second.refill(*data[2], saved[2])  # (drained: allowed) then twice in a row is not
        second.refill(*data[2], saved[2])
