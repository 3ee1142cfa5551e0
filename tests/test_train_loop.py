"""The training loop's single-process parts: LR schedule, decay groups, clipping, loss scale,
non-finite verdicts, measured costs, configuration checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.models.gpt import GPTConfig, gpt_layers, lm_loss
from pipetrain.split.partition import stage_bounds
from pipetrain.testing import reference_step
from pipetrain.train.checks import check_config, run_schedule
from pipetrain.train.config import TrainConfig
from pipetrain.train.infer import pick
from pipetrain.train.launch import faults
from pipetrain.train.mesh import _buckets, layout
from pipetrain.train.nonfinite import NONFINITE, OK, OVERFLOW, NaNInjector, Verdict, finding
from pipetrain.train.optim import (
    build_optimizer,
    clip_grads_,
    counted_parameters,
    global_grad_norm,
    lr_at,
    no_decay_names,
    param_groups,
)
from pipetrain.train.precision import LossScale, autocast
from pipetrain.train.sources.source import hosted_layers
from pipetrain.train.sources.source import parse_balance as _balance
from pipetrain.train.timing import measured_costs, predict

SMALL = GPTConfig(seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _model(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return gpt_layers(SMALL)


def _batch(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (n, SMALL.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# -- learning rate ----------------------------------------------------------------------------
def test_lr_warms_up_linearly_then_follows_a_cosine_to_min_lr() -> None:
    lrs = [lr_at(s, peak=1.0, min_lr=0.1, warmup=4, steps=20) for s in range(22)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == 1.0 and lrs[19] == 0.1 and lrs[20:] == [0.1, 0.1]
    assert all(a > b for a, b in zip(lrs[4:19], lrs[5:20]))
    middle = 4 + (19 - 4) / 2  # cosine half-way: the mean of peak and min_lr
    assert lr_at(int(middle), peak=1.0, min_lr=0.1, warmup=4, steps=20) > 0.55 > lrs[12]


def test_lr_is_a_pure_function_of_the_step() -> None:
    kw = dict(peak=3e-3, min_lr=3e-4, warmup=5, steps=50)
    assert [lr_at(s, **kw) for s in range(50)] == [lr_at(s, **kw) for s in range(50)]
    assert lr_at(0, peak=1.0, min_lr=0.0, warmup=0, steps=3) == 1.0  # no warm-up


# -- parameter groups -------------------------------------------------------------------------
def test_no_decay_for_biases_norms_and_embeddings_including_the_tied_head() -> None:
    model = nn.Sequential(*_model())
    plain = no_decay_names(model)
    assert {"0.tokens", "0.positions", "1.ln1.weight", "1.attn.qkv.bias", "3.ln.weight"} <= plain
    assert "1.attn.qkv.weight" not in plain and "2.mlp.0.weight" not in plain
    groups = param_groups(model.named_parameters(), plain, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decayed = {id(p) for p in groups[0]["params"]}
    assert all(p.dim() == 2 for p in groups[0]["params"])
    assert id(model[0].tokens) not in decayed
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_optimizer_rejects_negative_settings() -> None:
    with pytest.raises(ValueError, match="lr and weight_decay"):
        build_optimizer(nn.Linear(2, 2).named_parameters(), set(), lr=-1.0, weight_decay=0.1)


# -- global norm and clipping -----------------------------------------------------------------
def test_clipping_matches_clip_grad_norm_and_counts_the_tied_table_once() -> None:
    inputs, targets = _batch()
    reference = nn.Sequential(*_model())
    reference_step(reference, inputs, targets, lm_loss, 2)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    pipe = pt.Pipeline(_model(), "1f1b", 2, lm_loss, local_ranks=2)
    pipe.step(inputs, targets)
    counted = counted_parameters(pipe)
    assert len(counted) == len(list(reference.parameters()))  # the tied table once
    norm = global_grad_norm(counted, None, torch.device("cpu"))
    factor = clip_grads_(pipe.parameters(), norm, 0.1)
    torch.testing.assert_close(norm, want)
    assert 0 < factor < 1
    ref = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad)


def test_clipping_leaves_small_gradients_and_can_be_off() -> None:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 0.5)
    assert clip_grads_([p], torch.tensor(0.866), 1.0) == 1.0
    assert clip_grads_([p], torch.tensor(100.0), 0.0) == 1.0
    assert torch.equal(p.grad, torch.full((3,), 0.5))


# -- precision --------------------------------------------------------------------------------
def test_loss_scale_halves_on_overflow_and_doubles_after_clean_steps() -> None:
    scale = LossScale(enabled=True, init=8.0, growth_interval=2)
    scaled = scale.wrap(lambda out, t: (out - t).square().mean())
    assert float(scaled(torch.ones(2), torch.zeros(2))) == 8.0
    scale.update(overflow=True)
    assert scale.value == 4.0
    scale.update(overflow=False)
    scale.update(overflow=False)
    assert scale.value == 8.0 and scale.state_dict() == {"value": 8.0, "clean_steps": 0.0}
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([8.0, 24.0])
    scale.unscale_([p])
    assert torch.equal(p.grad, torch.tensor([1.0, 3.0])) and scale.unscale_loss(16.0) == 2.0
    other = LossScale(enabled=True)
    other.load_state_dict(scale.state_dict())
    assert other.value == 8.0


def test_disabled_loss_scale_changes_nothing() -> None:
    scale = LossScale(enabled=False)
    scale.update(overflow=True)
    loss = scale.wrap(lambda out, t: out.sum())(torch.ones(2), None)
    assert scale.value == 1.0 and float(loss) == 2.0 and scale.unscale_loss(3.0) == 3.0


def test_autocast_runs_matmuls_in_bf16_and_rejects_unknown_precisions() -> None:
    a = torch.randn(4, 4)
    with autocast("bf16", torch.device("cpu")):
        assert (a @ a).dtype == torch.bfloat16
    with autocast("fp32", torch.device("cpu")):
        assert (a @ a).dtype == torch.float32
    with pytest.raises(ValueError, match="precision must be one of"):
        autocast("fp8", torch.device("cpu"))


# -- non-finite verdicts ----------------------------------------------------------------------
def test_findings_tell_overflow_from_non_finite() -> None:
    assert finding(2.0, 4.0, fp16=False) == OK
    assert finding(math.nan, 4.0, fp16=True) == NONFINITE
    assert finding(2.0, math.inf, fp16=True) == OVERFLOW
    assert finding(2.0, math.nan, fp16=False) == NONFINITE


def test_verdict_error_names_the_ranks_the_step_and_the_fix() -> None:
    verdict = Verdict(NONFINITE, (OK, NONFINITE, OK, NONFINITE))
    assert verdict.skip and verdict.ranks(NONFINITE) == [1, 3]
    text = str(verdict.error(2, 17))
    assert "[rank 2] step 17" in text and "rank(s) [1, 3]" in text and "--nonfinite skip" in text


def test_nan_injector_poisons_outputs_only_while_armed() -> None:
    layer = nn.Linear(3, 3)
    injector = NaNInjector([layer])
    x = torch.ones(1, 3)
    assert torch.isfinite(layer(x)).all()
    injector.armed = True
    assert torch.isnan(layer(x)).all()
    injector.armed = False
    injector.remove()
    assert torch.isfinite(layer(x)).all()


@pytest.mark.parametrize("recompute", ["never", "always", "except_last", ("every", 2)],
                         ids=str)
def test_nan_injector_reaches_the_loss_and_every_gradient_under_recomputation(
        recompute: object) -> None:
    # the injector once hooked each stage's nn.Sequential, which a recomputing stage never
    # calls (it runs its layers segment by segment): a nan fault was silently not injected
    torch.manual_seed(0)
    pipe = pt.Pipeline([nn.Linear(4, 4) for _ in range(4)], "1f1b", 2, nn.functional.mse_loss,
                       local_ranks=2, recompute=recompute)  # type: ignore[arg-type]
    injector = NaNInjector.for_pipeline(pipe)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    injector.armed = True
    loss = pipe.step(x, y).loss
    injector.armed = False
    assert loss is not None and math.isnan(float(loss))
    assert all(p.grad is not None and torch.isnan(p.grad).all() for p in pipe.parameters())
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.step(x, y).loss
    assert loss is not None and math.isfinite(float(loss))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pipe.parameters())


# -- measured costs ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_measured_costs_recover_the_costs_of_a_timeline(name: str) -> None:
    schedule = ps.make_schedule(name, 2, 4)
    n = schedule.n_stages
    costs = (ps.Costs(F=tuple(1.0 + s for s in range(n)), I=(1.5,) * n, W=(0.5,) * n)
             if schedule.split_backward else ps.Costs(F=(1.0, 2.0), B=(2.0, 3.0)))
    simulated = ps.simulate(schedule, costs, comm=0.25)
    assert measured_costs(simulated.timeline, schedule) == costs
    # the prediction also reads the message delay off the step
    assert predict(simulated.timeline, schedule).makespan == pytest.approx(simulated.makespan)
    assert ps.simulate(schedule, costs).makespan < simulated.makespan


def test_measured_costs_need_every_stage() -> None:
    schedule = ps.make_schedule("1f1b", 2, 2)
    timeline = ps.simulate(schedule).timeline
    partial = type(timeline)(2, tuple(s for s in timeline.spans if s.action.stage == 0))
    with pytest.raises(ValueError, match="no F action of stage 1"):
        measured_costs(partial, schedule)


# -- configuration and layout -----------------------------------------------------------------
def test_layout_fills_pp_and_rejects_a_world_that_is_not_dp_x_pp() -> None:
    assert layout(8, 2, None) == (2, 4)
    with pytest.raises(ValueError, match="dp=2 x pp=3 = 6"):
        layout(8, 2, 3)
    with pytest.raises(ValueError, match="dp=3 does not divide"):
        layout(8, 3, None)
    assert layout(8, 1, None, fsdp=2) == (1, 4) and layout(8, 2, 2, fsdp=2) == (2, 2)
    with pytest.raises(ValueError, match=r"dp=2 x fsdp=2 x pp=3 = 12; .* change --dp/--fsdp"):
        layout(8, 2, 3, fsdp=2)
    assert layout(8, 1, None, fsdp=2, tp=2) == (1, 2)
    with pytest.raises(ValueError, match=r"dp=1 x tp=2 x pp=3 = 6; .* change --dp/--tp/--pp"):
        layout(8, 1, 3, tp=2)


def test_check_config_names_a_tensor_parallel_size_the_model_cannot_split() -> None:
    with pytest.raises(ValueError, match=r"tp=3 must divide the preset's 4 heads and 256 MLP"):
        check_config(TrainConfig(preset="tiny", tp=3, pp=1), 3)
    with pytest.raises(ValueError, match=r"seq_len=63 must divide by tp=2 .* "
                                         r"--no-sequence-parallel"):
        check_config(TrainConfig(preset="tiny", tp=2, pp=1, seq_len=63), 2)
    check_config(TrainConfig(preset="tiny", tp=2, pp=1, seq_len=63, sequence_parallel=False), 2)


def test_check_config_lists_every_problem_at_once() -> None:
    cfg = TrainConfig(preset="huge", precision="fp8", nonfinite="ignore", dp=2, pp=2,
                      batch_size=6, microbatches=4)
    with pytest.raises(ValueError) as e:
        check_config(cfg, 4)
    text = str(e.value)
    for part in ("unknown preset 'huge'", "precision must be", "nonfinite must be",
                 "batch_size=6", "multiple of 2 that is >= 8"):
        assert part in text
    with pytest.raises(ValueError, match="the world has 3 ranks"):
        check_config(TrainConfig(dp=2, pp=2), 3)
    check_config(TrainConfig(dp=2, batch_size=16, microbatches=8), 4)


def test_a_schedule_file_runs_as_written_and_must_fit_the_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pipetrain.schedules.generators import Target

    searched = ps.make_schedule("zb-auto", 2, 4, 1, Target(memory_limit=4.0))
    path = tmp_path / "zb.csv"
    searched.save(path)
    cfg = TrainConfig(schedule=str(path), microbatches=4, batch_size=8)
    got = run_schedule(cfg, 2)
    assert got.actions == searched.actions != ps.make_schedule("zb-auto", 2, 4).actions
    check_config(cfg, 2)
    with pytest.raises(ValueError, match=r"has ranks \(--pp\) 2 where the run has 4, "
                                         r"micro-batches \(--microbatches\) 4 where the run has 8"):
        run_schedule(TrainConfig(schedule=str(path), microbatches=8), 4)
    (tmp_path / "bad.csv").write_text("rank 0,rank 1\n0F0,1B0\n0B0,1F0\n")
    with pytest.raises(ValueError, match="bad.csv: schedule .custom. out of order"):
        run_schedule(TrainConfig(schedule=str(tmp_path / "bad.csv"), microbatches=1), 2)


def test_balance_flag_reads_modes_even_and_layer_counts() -> None:
    assert _balance("params") == "params" and _balance("even") is None
    assert _balance("3,4,4,3") == [3, 4, 4, 3]


def test_gradient_buckets_split_by_size_and_dtype() -> None:
    params = [nn.Parameter(torch.zeros(10)), nn.Parameter(torch.zeros(10)),
              nn.Parameter(torch.zeros(10, dtype=torch.float64)), nn.Parameter(torch.zeros(5))]
    sizes = [[p.numel() for p in b] for b in _buckets(params, limit=80)]
    assert sizes == [[10, 10], [10], [5]]


def test_pick_is_greedy_without_top_k_and_seeded_with_it() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert pick(logits, 0, torch.Generator()) == 1
    draws = [pick(logits, 2, torch.Generator().manual_seed(s)) for s in range(20)]
    assert set(draws) == {1, 2}
    assert draws == [pick(logits, 2, torch.Generator().manual_seed(s)) for s in range(20)]


def test_a_failing_step_names_the_callers_step_number() -> None:
    # a resumed training loop's step 8 failed with "step 3", the pipeline's own count
    torch.manual_seed(0)
    pipe = pt.Pipeline([nn.Linear(4, 4) for _ in range(4)], "1f1b", 2, nn.functional.mse_loss,
                       local_ranks=2)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x, y, step=7)
    assert pipe.eval_step(x, y, step=7).loss is not None
    with pytest.raises(TypeError, match="step must be an int"):
        pipe.step(x, y, step=8.0)  # type: ignore[arg-type]
    with pytest.raises(pt.PipelineError, match=r"\| 1F0\] step 8 failed"), \
            faults.wrong_shape(pipe):
        pipe.step(x, y, step=8)


@pytest.mark.parametrize(("schedule", "ranks"), [("1f1b", 2), ("zbv", 2), ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("balance", ["params", "even", "2,1,1,2,1,1"])
def test_each_rank_builds_the_layers_pipeline_gives_it(schedule: str, ranks: int,
                                                       balance: str) -> None:
    cfg = GPTConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=6, seq_len=8)
    sched = ps.make_schedule(schedule, ranks, 4)
    mode = _balance(balance)
    if isinstance(mode, list) and sched.n_stages != len(mode):
        mode = [1] * (sched.n_stages - 1) + [8 - (sched.n_stages - 1)]
    torch.manual_seed(0)
    pipe = pt.Pipeline(gpt_layers(cfg), sched, loss_fn=lm_loss, balance=mode, local_ranks=ranks)
    bounds = stage_bounds(pipe.balance)
    for rank in range(ranks):
        want = {i for s in sched.stages_of(rank) for i in range(*bounds[s])}
        assert hosted_layers(cfg, sched, mode, rank) == want


def test_profiling_balances_build_every_layer_on_every_rank() -> None:
    cfg = GPTConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=2, seq_len=8)
    assert hosted_layers(cfg, ps.make_schedule("1f1b", 2, 4), "time", 1) is None


def test_the_layout_line_names_every_parallel_dimension() -> None:
    from pipetrain.train.logs.report import describe_layout

    assert describe_layout({"world": 8, "dp": 1, "fsdp": 2, "pp": 2, "tp": 2}) == \
        "8 ranks (dp 1 x fsdp 2 x pp 2 x tp 2)"
    assert describe_layout({"world": 4, "dp": 2, "pp": 2}) == "4 ranks (dp 2 x pp 2)"
