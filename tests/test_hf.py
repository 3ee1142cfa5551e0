"""Models we did not write, captured by torch.export and pipelined in one process (local ranks):
Hugging Face GPT-2, Llama and BERT and a residual CNN with BatchNorm train like the same
micro-batches run one after another through the unsplit model."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from helpers.hf import LOSSES, MODELS, batch, materialized, on_meta, points
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")

M = 4


def build(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]().to(dtype)


def differences(pipe: pt.Pipeline, ref: nn.Module, rtol: float) -> list[str]:
    """Parameters (and buffers) whose value after the step differs from the reference's."""
    refs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    bad = []
    for name, p in pipe.named_parameters():
        r = refs[name]
        if p.grad is None or r.grad is None:
            bad.append(f"{name}: no gradient")
        elif rtol == 0 and not torch.equal(p.grad, r.grad) or rtol and not torch.allclose(
                p.grad, r.grad, rtol=rtol, atol=rtol * r.grad.abs().max().item()):
            bad.append(f"{name}: max diff {(p.grad - r.grad).abs().max().item():.3g}")
    for name, b in pipe.named_buffers():
        if not torch.equal(b, refs[name]):
            bad.append(f"buffer {name} differs")
    held = {name for name, _ in pipe.named_parameters()}
    bad += [f"{name}: in no stage" for name, _ in ref.named_parameters() if name not in held]
    return bad


def run_case(name: str, schedule: str, dtype: torch.dtype, ranks: int = 2,
             rows: int = 8, seq: int = 12, **options: Any) -> tuple[Any, Any, list[str]]:
    model = build(name, dtype)
    ref = copy.deepcopy(model)
    inputs, targets = batch(name, rows, seq)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    stages = ps.make_schedule(schedule, ranks, M).n_stages
    pipe = pt.Pipeline(model, schedule, M, LOSSES[name], local_ranks=ranks,
                       split_points=points(name, stages), example_inputs=inputs, **options)
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: ref(**x), inputs, targets, LOSSES[name], M)
    rtol = 1e-9 if dtype == torch.float64 else 0.0
    return got.loss, want, differences(pipe, ref, rtol)


@pytest.mark.parametrize("name", [  # llama: long tier, beside the gpt2 case
    "gpt2", pytest.param("llama", marks=pytest.mark.long), "bert", "resnet"])
def test_float64_matches_one_process(name: str) -> None:  # more schedules: test_hf_dist.py
    got, want, bad = run_case(name, "1f1b", torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert bad == []


@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_fp32_is_bitwise_where_nothing_is_tied(name: str) -> None:
    got, want, bad = run_case(name, "interleaved-1f1b", torch.float32)
    assert torch.equal(got, want)
    assert bad == []


MEMORY = list(itertools.product(["bert", "resnet"], ["looped-bfs", "zb-auto", "v-half", "v-min"]))
MEMORY_CI = (("bert", "looped-bfs"), ("resnet", "zb-auto"), ("bert", "v-half"))
"""The memory-controlled cases CI runs (its time, CONTRIBUTING.md: tests): each model, a looped
schedule, a split-backward one and a V; the others in the long tier."""


@pytest.mark.parametrize(("name", "schedule"), [
    case if case in MEMORY_CI else pytest.param(*case, marks=pytest.mark.long) for case in MEMORY])
def test_memory_controlled_schedules_are_bitwise_on_models_we_did_not_write(
        name: str, schedule: str) -> None:
    got, want, bad = run_case(name, schedule, torch.float32)
    assert torch.equal(got, want)
    assert bad == []


@pytest.mark.long  # beside test_fp32_is_bitwise_where_nothing_is_tied
def test_gpt2_fp32_bitwise_except_the_tied_embedding() -> None:
    got, want, bad = run_case("gpt2", "dualpipev", torch.float32)
    assert torch.equal(got, want)
    # the tied table's two gradients are summed in another order: to rounding (measured
    # 7.5e-9), and never missing
    tied = "transformer.wte.weight: max diff "
    assert all(b.startswith(tied) and float(b[len(tied):]) <= 1e-7 for b in bad), bad


@pytest.mark.long  # beside test_fp32_is_bitwise_where_nothing_is_tied
def test_llama_fp32_is_bitwise_to_its_capture_and_rounding_to_eager() -> None:
    # under capture, transformers builds an explicit causal mask where eager passes
    # is_causal=True to SDPA (masking_utils), so fp32 gradients differ from eager in the last
    # bits (measured: 3.8e-7 of the largest); against the captured graph run one micro-batch
    # after another on one process, the pipeline is bitwise
    from pipetrain.split.trace import split_model

    model = build("llama", torch.float32)
    eager, whole = copy.deepcopy(model), copy.deepcopy(model)
    inputs, targets = batch("llama")
    pipe = pt.Pipeline(model, "zbv", M, LOSSES["llama"], local_ranks=2,
                       split_points=points("llama", 4), example_inputs=inputs)
    got = pipe.step(pipe.pack(**inputs), targets)
    one = split_model(whole, [], inputs)
    want = reference_step(lambda x: one.run(one.pack(**x)), inputs, targets, LOSSES["llama"], M)
    assert torch.equal(got.loss, want)
    assert differences(pipe, whole, 0.0) == []
    reference_step(lambda x: eager(**x), inputs, targets, LOSSES["llama"], M)
    assert differences(pipe, eager, 1e-5) == []


def test_batchnorm_statistics_update_once_per_micro_batch_under_recompute() -> None:
    got, want, bad = run_case("resnet", "zbv", torch.float64, recompute="always")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert bad == []


def test_named_buffers_and_state_dict_use_the_models_own_names() -> None:
    model = build("resnet", torch.float32)
    inputs, _ = batch("resnet")
    pipe = pt.Pipeline(model, "1f1b", M, LOSSES["resnet"], local_ranks=2,
                       split_points=points("resnet", 2), example_inputs=inputs)
    assert {n for n, _ in pipe.named_buffers()} == {n for n, _ in model.named_buffers()}
    assert all(b is model.get_buffer(n) for n, b in pipe.named_buffers())
    state = pipe.state_dict()
    assert set(state) == set(model.state_dict())
    llama = build("llama", torch.float32)
    pipe = pt.Pipeline(llama, "1f1b", M, LOSSES["llama"], local_ranks=2,
                       split_points=points("llama", 2), example_inputs=batch("llama")[0])
    assert set(pipe.state_dict()) == set(llama.state_dict())  # rotary tables: not persistent
    assert "model.rotary_emb.inv_freq" in dict(pipe.named_buffers())


def test_labels_inside_the_model_and_outputs_as_the_model_returns_them() -> None:
    model = build("gpt2", torch.float64)
    ref = copy.deepcopy(model)
    inputs, labels = batch("gpt2")
    example = {"input_ids": inputs["input_ids"], "labels": labels}
    pipe = pt.Pipeline(model, "zbv", M, lambda out, _: out.loss, local_ranks=2,
                       split_points=points("gpt2", 4), example_inputs=example)
    got = pipe.step(pipe.pack(**example), labels, return_outputs=True)
    assert type(got.outputs).__name__ == "CausalLMOutputWithCrossAttentions"
    assert got.outputs.logits.shape == (8, 12, 64)
    want = reference_step(lambda x: ref(**x).loss, example, labels, lambda out, _: out, M)
    torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=0)


def test_sequence_length_and_batch_size_change_between_steps() -> None:
    model = build("gpt2", torch.float64)
    ref = copy.deepcopy(model)
    example, _ = batch("gpt2", 8, 12)
    pipe = pt.Pipeline(model, "1f1b", M, LOSSES["gpt2"], local_ranks=2,
                       split_points=points("gpt2", 2), example_inputs=example)
    for rows, seq in [(8, 12), (6, 20), (7, 5)]:  # 7 rows: uneven micro-batches
        inputs, targets = batch("gpt2", rows, seq, seed=rows)
        got = pipe.step(pipe.pack(**inputs), targets)
        want = reference_step(lambda x: ref(**x), inputs, targets, LOSSES["gpt2"], M)
        torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=0)
    assert differences(pipe, ref, 1e-9) == []


def test_meta_llama_materialised_per_rank_equals_the_whole_model() -> None:
    whole = materialized(on_meta("llama"), 3)
    inputs, targets = batch("llama")
    pipe = pt.Pipeline(on_meta("llama"), "zbv", M, LOSSES["llama"], local_ranks=2, init_seed=3,
                       split_points=points("llama", 4), example_inputs=inputs)
    refs = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    assert all(torch.equal(p, refs[n]) for n, p in pipe.named_parameters())
    assert all(torch.equal(b, refs[n]) for n, b in pipe.named_buffers())
    inv = dict(pipe.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv.max().item() == 1.0 and inv.min().item() > 0  # the rotary table, not garbage
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: whole(**x), inputs, targets, LOSSES["llama"], M)
    assert torch.equal(got.loss, want)


# frozen parameters under split backward in CI: test_lora.py's zbv case
@pytest.mark.long  # beside test_batchnorm_statistics_update_once_per_micro_batch_under_recompute
def test_recompute_and_frozen_parameters_on_llama_under_split_backward() -> None:
    model = build("llama", torch.float64)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen, on the first stage
    ref = copy.deepcopy(model)
    inputs, targets = batch("llama")
    pipe = pt.Pipeline(model, "zbv", M, LOSSES["llama"], local_ranks=2, recompute="always",
                       split_points=points("llama", 4), example_inputs=inputs)
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: ref(**x), inputs, targets, LOSSES["llama"], M)
    torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=0)
    frozen = dict(pipe.named_parameters())["model.embed_tokens.weight"]
    assert frozen.grad is None
    refs = dict(ref.named_parameters())
    assert [n for n, p in pipe.named_parameters() if p.requires_grad and not torch.allclose(
        p.grad, refs[n].grad, rtol=1e-9, atol=1e-9 * refs[n].grad.abs().max().item())] == []


@pytest.mark.parametrize("balance", ["params", "time", "memory"])
def test_auto_split_of_an_hf_model_under_every_balance_mode(balance: str) -> None:
    model = build("gpt2", torch.float64)
    ref = copy.deepcopy(model)
    inputs, targets = batch("gpt2")
    pipe = pt.Pipeline(model, "interleaved-1f1b", M, LOSSES["gpt2"], local_ranks=2,
                       split_points="auto", balance=balance, example_inputs=inputs)
    assert pipe.traced is not None and len(pipe.traced.stages) >= 8  # wte, wpe, h.0-3, ...
    got = pipe.step(pipe.pack(**inputs), targets)
    want = reference_step(lambda x: ref(**x), inputs, targets, LOSSES["gpt2"], M)
    torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=0)
    assert differences(pipe, ref, 1e-9) == []


def test_llama_rotary_tables_and_mask_are_sent_straight_to_every_stage() -> None:
    from pipetrain.split.trace import split_model

    model = build("llama", torch.float32)
    inputs, _ = batch("llama")
    split = split_model(model, points("llama", 4), inputs)
    out = split.stages[0](split.pack(**inputs))
    shared = [k for k, s in split.made_in.items() if s == 0 and split.used_in[k] == (0, 1, 2, 3)
              and isinstance(out[k], torch.Tensor) and out[k].is_floating_point()]
    assert len(shared) >= 2  # cos and sin, made once in stage 0
    pairs = split.routes([1, 1, 1, 1]).pairs()
    for key in shared:
        assert all(key in (pairs[("act", 0, d)] or ()) for d in (1, 2, 3))
        assert all(key not in (pairs.get(("act", s, d)) or ()) for s, d in [(1, 2), (2, 3)])
