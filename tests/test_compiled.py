"""Compiled stages: F, I and W cut from one joint graph, exact under every schedule."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp, structured
from pipetrain.errors import StageError
from pipetrain.runtime.backward import backward_full, backward_input
from pipetrain.runtime.compiled import CompiledLayers
from pipetrain.testing import reference_step
from test_verify import Net

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def _block() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters() if p.grad is not None]


def test_input_pass_makes_no_weight_gradient_and_w_makes_them_exactly() -> None:
    """I (the split backward's input pass) leaves every weight without a gradient; W then
    makes them, equal bit for bit to eager autograd's (the graphs run uncompiled here)."""
    ref, block = _block(), _block()
    layers = CompiledLayers(block, backend="eager")
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    y = layers(x)
    got, work = backward_input([y], [g], [x])
    assert all(p.grad is None for p in block.parameters())
    work.run()
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    assert torch.equal(got[0], xr.grad)
    for a, b in zip(_grads(block), _grads(ref), strict=True):
        assert torch.equal(a, b)


def test_the_backward_graph_is_cut_by_what_each_output_needs() -> None:
    """The matrix products of the weight gradients are in W, none in I; I hands W the
    gradients at the layers' outputs instead of W recomputing them."""
    from pipetrain.runtime import compiled

    block = _block()
    seen: dict[str, Any] = {}
    real = compiled.split_backward

    def spy(*args: Any) -> Any:
        seen["graphs"] = real(*args)
        return seen["graphs"]

    compiled.split_backward = spy  # type: ignore[assignment]
    try:
        CompiledLayers(block, backend="eager")(torch.randn(4, 8, requires_grad=True))
    finally:
        compiled.split_backward = real  # type: ignore[assignment]
    i_gm, w_gm, _ = seen["graphs"]

    def mms(gm: Any) -> int:
        return sum(n.target == torch.ops.aten.mm.default for n in gm.graph.nodes)
    assert mms(i_gm) == 2 and mms(w_gm) == 2  # dx of the two linears; dW of the two
    def ops(gm: Any) -> set[Any]:
        return {n.target for n in gm.graph.nodes if n.op == "call_function"}
    gelu = torch.ops.aten.gelu_backward.default
    assert gelu in ops(i_gm) and gelu not in ops(w_gm)  # W reads it from I


def test_full_backward_runs_both_halves() -> None:
    ref, block = _block(), _block()
    layers = CompiledLayers(block, backend="eager")
    x = torch.randn(4, 8, requires_grad=True)
    g = torch.randn(4, 8)
    got = backward_full([layers(x)], [g], [x])
    xr = x.detach().clone().requires_grad_()
    ref(xr).backward(g)
    assert got[0] is not None and torch.equal(got[0], xr.grad)
    for a, b in zip(_grads(block), _grads(ref), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_runs_the_split_graphs_exactly(name: str) -> None:
    """Every schedule over the split graphs (uncompiled: the ``eager`` backend) gives the loss
    and gradients of the uncompiled model run micro-batch by micro-batch, bit for bit; the
    stage boundaries carry dicts, tuples and plain values."""
    for make, balance in ((mlp, None), (structured, [1, 1, 1, 1])):
        ref, model = make(), make()
        x, y = batch(12)
        want = reference_step(ref, x, y, LOSS, 4)
        v = 2 if name in MULTI else 1
        pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=4 // v if balance else 2,
                           stages_per_rank=v, balance=balance, compile="eager")
        got = pipe.step(x, y)
        assert got.loss is not None and torch.equal(got.loss, want)
        grads = dict(pipe.named_parameters())
        for n, p in ref.named_parameters():
            assert torch.equal(grads[n].grad, p.grad), (name, n)


INDUCTOR_CI = ["gpipe", "zb-h1"]
"""The schedules CI compiles with inductor (its time, CONTRIBUTING.md: tests): one stage a
rank, fused and split backward (I and W), the second bit for bit the first; ZB-V, DualPipeV
and the others in the long tier (test_inductor_under_every_schedule); every schedule runs over
stages compiled by the ``eager`` backend in CI (the test above)."""


def test_inductor_under_two_kinds_of_schedule() -> None:
    """:func:`_inductor_under` for :data:`INDUCTOR_CI`."""
    _inductor_under(INDUCTOR_CI)


# in CI: test_inductor_under_two_kinds_of_schedule, and every schedule over stages compiled by
# the eager backend (test_every_schedule_runs_the_split_graphs_exactly above)
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_inductor_under_every_schedule() -> None:
    """:func:`_inductor_under` for every schedule."""
    _inductor_under(SCHEDULES)


def _inductor_under(schedules: list[str]) -> None:
    """Inductor-compiled stages: each schedule's gradients are bit for bit those of the first
    over the same compiled stages, and within 1e-5 (of the largest) of ``torch.compile`` of
    the whole model run micro-batch by micro-batch; a second step compiles nothing, a new
    micro-batch size compiles once more (under GPipe)."""
    x, y = batch(16)
    ref = mlp()
    reference_step(torch.compile(ref), x, y, LOSS, 4)
    want = {n: p.grad for n, p in ref.named_parameters()}
    scale = max(float(g.abs().max()) for g in want.values())
    first: dict[int, dict[str, torch.Tensor]] = {}
    for name in schedules:
        v = 2 if name in MULTI else 1
        pipe = pt.Pipeline(mlp(), name, 4, LOSS, local_ranks=2, stages_per_rank=v,
                           compile=True)
        pipe.step(x, y)
        grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
        for n, g in want.items():
            assert float((grads[n] - g).abs().max()) <= 1e-5 * scale, (name, n)
        if first.setdefault(2 * v, grads) is not grads:
            for n, g in first[2 * v].items():
                assert torch.equal(grads[n], g), (name, n)
        compiles = [s.compiled.compiles for s in pipe.stages.values()]  # type: ignore[union-attr]
        pipe.step(x, y)
        assert [s.compiled.compiles for s in pipe.stages.values()] == compiles == [1] * 2 * v
        if name == "gpipe":
            pipe.step(*batch(8))  # micro-batches of 2 rows: one more program per stage
            assert [s.compiled.compiles for s in pipe.stages.values()] == [2, 2]


# in CI: inductor under two kinds of schedule: test_inductor_under_two_kinds_of_schedule
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_a_captured_hf_llama_compiled_under_zb_h1() -> None:
    """A model we did not write, captured, split into 2 stages and compiled by inductor, under
    a split-backward schedule: the loss and gradients of the unsplit model, within 1e-5 of
    the largest (``torch.compile`` of the whole is compared with in the test above)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    ref = transformers.LlamaForCausalLM(cfg)
    model = transformers.LlamaForCausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (8, 16))

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]
        return nn.functional.cross_entropy(logits.reshape(-1, 128), target[:, 1:].reshape(-1))

    want = reference_step(ref, {"input_ids": ids}, ids, loss_fn, 4)
    pipe = pt.Pipeline(model, "zb-h1", 4, loss_fn, split_points="auto", local_ranks=2,
                       example_inputs={"input_ids": ids[:2]}, compile=True)
    got = pipe.step({"input_ids": ids}, ids)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want, rtol=1e-6, atol=1e-6)
    assert all(s.compiled is not None and s.compiled.compiles == 1 for s in pipe.stages.values())
    grads = dict(pipe.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for n, p in ref.named_parameters():
        assert float((grads[n].grad - p.grad).abs().max()) <= 1e-5 * scale, n


@pytest.mark.parametrize("name", ["mixtral", "modernbert", "whisper", "vit", "clip"])
def test_models_we_did_not_write_run_the_split_graphs_exactly(name: str) -> None:
    """A mixture of experts, an encoder, an encoder-decoder, a vision model and a two-tower
    model (whose outputs include views of one another), captured from transformers and split
    into 4 stages under ZB-V over the split graphs: the zoo's check (loss and every gradient
    within 1e-9 of the largest in float64; Mixtral, float32 there, within 1e-5)."""
    pytest.importorskip("transformers")
    import test_zoo as zoo

    arch = next(a for a in zoo.ZOO if a.name == name)
    pipe, ref, problems = zoo.stepped(arch, compile="eager")
    assert problems + zoo.differences(pipe, ref, arch.tol) == []


def test_a_users_module_stepped_with_a_tuple() -> None:
    """A user's ordinary module, captured with ``split_points="auto"`` and stepped as its
    forward takes its inputs (a tuple), over the split graphs under ZB-V: the loss and every
    gradient of the module run micro-batch by micro-batch, bit for bit."""
    torch.manual_seed(0)  # test_verify's module: two positional arguments, residual blocks
    x, scale, y = torch.randn(32, 8), torch.rand(32, 3) + 1, torch.randn(32, 3)
    ref, model = Net(), Net()
    model.load_state_dict(ref.state_dict())
    want = reference_step(lambda t: ref(*t), (x, scale), y, LOSS, 8)
    pipe = pt.Pipeline(model, "zbv", 8, LOSS, split_points="auto", local_ranks=2,
                       example_inputs=(x[:2], scale[:2]), compile="eager")
    got = pipe.step((x, scale), y).loss
    assert got is not None and torch.equal(got, want)
    grads = dict(pipe.named_parameters())
    for n, p in ref.named_parameters():
        assert torch.equal(grads[n].grad, p.grad), n


def test_a_model_that_draws_is_refused_unless_rng_is_off() -> None:
    """Compiled graphs draw other dropout masks than eager ones: a captured GPT-2 with its
    dropouts is refused, and runs once the caller gives up the random streams."""
    pytest.importorskip("transformers")
    import test_zoo as zoo

    arch = next(a for a in zoo.ZOO if a.name == "gpt2")
    with pytest.raises(ValueError, match="draws random numbers.*rng=False"):
        zoo.stepped(arch, compile="eager")
    inputs, targets = zoo.batch(arch)
    pipe = pt.Pipeline(zoo.build(arch), "zbv", zoo.M, arch.loss, split_points="auto",
                       example_inputs={k: v[:2] for k, v in inputs.items()}, local_ranks=2,
                       compile="eager", rng=False)
    got = pipe.step(inputs, targets).loss
    assert got is not None and torch.isfinite(got)


def test_what_compile_does_not_combine_with_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute"):
        pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2, compile=True, recompute="always")
    with pytest.raises(ValueError, match="parallelize"):
        pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2, compile=True,
                    parallelize=lambda stage, layers: None)
    with pytest.raises(TypeError, match="compile must be"):
        pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2, compile=1)  # type: ignore[arg-type]
    torch.manual_seed(0)
    norm = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh())
    pipe = pt.Pipeline(norm, "1f1b", 4, LOSS, local_ranks=2, compile="eager")
    with pytest.raises(StageError, match=r"stage 0 \| mb 0 \| 0F0.*in place"):
        pipe.step(*batch(12))


def test_old_torch_is_refused_under_split_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's autograd cannot start W at a compiled stage (seen on a GPU machine):
    refused there with what to do, while a fused-backward schedule still runs."""
    from pipetrain.runtime import compiled

    monkeypatch.setattr(compiled, "_torch_version", lambda: (2, 11))
    with pytest.raises(ValueError, match="needs torch >= 2.13"):
        pt.Pipeline(mlp(), "zbv", 4, LOSS, local_ranks=2, compile="eager")
    pt.Pipeline(mlp(), "1f1b", 4, LOSS, local_ranks=2, compile="eager").step(*batch(12))


def test_train_refuses_compile_with_sharding() -> None:
    from pipetrain.train.checks import check_config
    from pipetrain.train.config import TrainConfig

    with pytest.raises(ValueError, match="--compile"):
        check_config(TrainConfig(compile=True, fsdp=2, pp=1, batch_size=16), 2)


def test_the_compiled_graphs_kept_are_bounded_the_least_recently_used_going_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that builds pipeline after pipeline keeps at most ``KEPT`` compiled graphs:
    a graph asked for again is kept (not made again), the one unused longest goes first, and
    a graph without a key (it reads constants of its own) is never kept."""
    from collections import OrderedDict

    from pipetrain.runtime import compiled

    monkeypatch.setattr(compiled, "_COMPILED", OrderedDict())
    monkeypatch.setattr(compiled, "KEPT", 3)
    made: list[str] = []

    def get(name: str | None) -> Any:
        return compiled.kept(None if name is None else (name,),
                             lambda: made.append(str(name)) or nn.Identity())

    first = get("a")
    get("b"), get("c")
    assert get("a") is first and made == ["a", "b", "c"]  # kept, and now the latest used
    get("d")  # b goes: the least recently used
    assert list(compiled._COMPILED) == [("c",), ("a",), ("d",)]
    get("b")
    assert made == ["a", "b", "c", "d", "b"] and len(compiled._COMPILED) == 3
    get(None), get(None)
    assert made[-2:] == ["None", "None"] and len(compiled._COMPILED) == 3
