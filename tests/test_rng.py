"""Random streams (pipetrain.runtime.rng): dropout draws what one device draws, at any layout.

Regression: T5 (dropout 0.1 by default) split at ``encoder.block.1`` or ``decoder`` was off by
up to 1e-3 in the loss and 90 % in gradients, because the stages drew their dropout masks from
the process's generator in schedule order, not in one device's order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx, nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES
from pipetrain.runtime import rng
from pipetrain.testing import grad_mismatches, reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def _dropout_mlp(p: float = 0.3) -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(p))
                           for _ in range(8)])


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


# -- units --------------------------------------------------------------------------------
def test_a_stream_starts_from_base_and_mb_and_puts_the_generator_back() -> None:
    cpu = torch.device("cpu")
    assert rng.start(5, 1, cpu) == rng.start(5, 1, cpu) != rng.start(5, 2, cpu)
    torch.manual_seed(0)
    own = torch.get_rng_state()
    ended: list[str] = []
    with rng.stream(cpu, rng.start(5, 1, cpu), ended):
        drawn = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), own)
    torch.manual_seed(5 + 1)
    assert torch.equal(drawn, torch.rand(3)) and ended == [rng.get(cpu)]


def _graph(fn: Any, *args: Any) -> fx.GraphModule:
    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> Any:
            return fn(x)
    return torch.export.export(M(), args, strict=False).module()


@pytest.mark.parametrize("fn,draws", [
    (lambda x: nn.functional.dropout(x, 0.5, True), True),
    (lambda x: nn.functional.dropout(x, 0.0, True), False),
    (lambda x: nn.functional.dropout(x, 0.5, False), False),
    (lambda x: nn.functional.scaled_dot_product_attention(x, x, x), False),
    (lambda x: nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.1), True),
    (lambda x: x + torch.rand_like(x), True),
    (lambda x: x * 2, False),
])
def test_a_graph_draws_when_an_op_draws_with_a_nonzero_probability(fn: Any, draws: bool) -> None:
    assert rng.graph_draws(_graph(fn, torch.randn(2, 3, 4))) is draws


def test_a_layer_draws_when_a_dropout_module_is_on() -> None:
    layer = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    assert rng.module_draws(layer) and not rng.module_draws(layer.eval())
    assert not rng.module_draws(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)))
    from pipetrain.models.gpt import GPTConfig, gpt_layers

    for p, draws in ((0.0, False), (0.1, True)):  # GPT calls F.dropout with its own float
        layers = gpt_layers(GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_layers=1, n_heads=2,
                                      dropout=p))
        assert any(rng.module_draws(m) for m in layers) is draws


# -- a layer list: every schedule, with recomputation --------------------------------------
CASES = [(name, rec) for name in SCHEDULES for rec in ("never", "always")]


@pytest.mark.parametrize("name,recompute", CASES)
def test_dropout_layers_match_one_device_under_every_schedule(name: str, recompute: str) -> None:
    model, ref = _dropout_mlp(), _dropout_mlp()
    x, y = _xy()
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, recompute=recompute,
                       stages_per_rank=2 if name in MULTI else None)
    assert pipe.rng
    for step in range(2):
        torch.manual_seed(10 + step)
        got = pipe.step(x, y).loss
        after = torch.rand(1)
        torch.manual_seed(10 + step)
        want = reference_step(ref, x, y, LOSS, 4, rng=True)
        assert got is not None and torch.equal(got, want)
        assert grad_mismatches(pipe.named_parameters(), ref) == []
        assert torch.equal(after, torch.rand(1))  # one draw of the process's generator


def test_the_masks_do_not_depend_on_the_layout() -> None:
    x, y = _xy()
    losses = []
    for ranks, name in [(1, "gpipe"), (2, "1f1b"), (4, "zbv"), (2, "dualpipev")]:
        torch.manual_seed(4)
        pipe = pt.Pipeline(_dropout_mlp(), name, 4, LOSS, local_ranks=ranks)
        losses.append(pipe.step(x, y).loss)
    assert all(torch.equal(loss, losses[0]) for loss in losses)  # type: ignore[arg-type]


def test_without_dropout_nothing_is_carried_or_drawn() -> None:
    torch.manual_seed(3)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)], nn.Dropout(0.0))
    pipe = pt.Pipeline(model, "1f1b", 4, LOSS, local_ranks=2)
    x, y = _xy()
    torch.manual_seed(0)
    pipe.step(x, y)
    after = torch.rand(1)
    torch.manual_seed(0)
    assert not pipe.rng and torch.equal(after, torch.rand(1))


# -- a captured model: T5 with its default dropout ----------------------------------------
def _t5() -> nn.Module:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                      num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                      pad_token_id=0, use_cache=False)  # dropout_rate: the default 0.1
    return tf.T5ForConditionalGeneration(cfg).double()  # type: ignore[no-any-return]


def _t5_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 64, (8, 10), generator=g),
            "labels": torch.randint(1, 64, (8, 7), generator=g)}


def _own_loss(out: Any, _: Any) -> torch.Tensor:
    return out.loss  # type: ignore[no-any-return]


def t5_problems(pipe: pt.Pipeline, ref: nn.Module) -> list[str]:
    """Loss and every gradient of one step against the unsplit T5 (float64, 1e-12)."""
    batch, rows = _t5_batch(), torch.zeros(8)
    torch.manual_seed(1)
    got = pipe.step(batch, rows).loss
    torch.manual_seed(1)
    want = reference_step(ref, batch, rows, _own_loss, 4, rng=pipe.rng)
    problems = [] if got is not None and torch.equal(got, want) else [f"loss {got} != {want}"]
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in pipe.named_parameters():
        g, r = p.grad, grads[name]
        if g is None or r is None or (g - r).abs().max() > 1e-12 * r.abs().max():
            problems.append(f"gradient of {name} differs")
    return problems


@pytest.mark.parametrize("schedule,points,ranks", [
    ("gpipe", ["encoder.block.1"], 2), ("gpipe", ["decoder"], 2), ("zbv", "auto", 2),
    pytest.param("1f1b", "auto", 4, marks=pytest.mark.long)])  # beside the gpipe cases
def test_t5_with_dropout_matches_one_device_once_split(
        schedule: str, points: Any, ranks: int) -> None:
    model, ref = _t5(), _t5()
    example = {k: v[:2] for k, v in _t5_batch().items()}
    pipe = pt.Pipeline(model, schedule, 4, _own_loss, local_ranks=ranks, split_points=points,
                       example_inputs=example)
    assert pipe.rng and len(pipe.balance) >= 2
    assert {n for n, _ in pipe.named_parameters()} == {n for n, _ in ref.named_parameters()}
    assert t5_problems(pipe, ref) == []


# -- two processes --------------------------------------------------------------------------
TWO_RANKS = ("1f1b", "zbv", "t5")
"""The layer list under 1F1B and ZB-V, then T5 under ZB-V, split at ``"auto"``."""
IN_CI = TWO_RANKS[:2]
"""CI's (its time, CONTRIBUTING.md: tests): the layer list; T5 across processes in the long
tier (in CI on local ranks: test_t5_with_dropout_matches_one_device_once_split)."""


def _layer_list(name: str) -> list[str]:
    x, y = _xy()
    ref = _dropout_mlp()
    pipe = pt.Pipeline(_dropout_mlp(), name, 4, LOSS, timeout=30)
    torch.manual_seed(7)
    got = pipe.step(x, y).loss
    torch.manual_seed(7)
    want = reference_step(ref, x, y, LOSS, 4, rng=True)
    problems = [] if got is not None and torch.equal(got, want) else [f"loss {got} != {want}"]
    return problems + grad_mismatches(pipe, ref)


def _captured_t5() -> list[str]:
    model, ref = _t5(), _t5()
    example = {k: v[:2] for k, v in _t5_batch().items()}
    pipe = pt.Pipeline(model, "zbv", 4, _own_loss, split_points="auto", example_inputs=example,
                       timeout=30)
    return t5_problems(pipe, ref)


def _two_ranks(ctx: pt.RankContext, cases: tuple[str, ...]) -> list[str]:
    return [f"{case}: {m}" for case in cases
            for m in (_captured_t5() if case == "t5" else _layer_list(case))]


def test_dropout_matches_one_device_on_two_processes() -> None:
    results = pt.launch(_two_ranks, 2, IN_CI, timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []


@pytest.mark.long  # beside test_dropout_matches_one_device_on_two_processes
def test_dropout_of_a_captured_t5_matches_one_device_on_two_processes() -> None:
    results = pt.launch(_two_ranks, 2, TWO_RANKS[len(IN_CI):], timeout=240)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []
