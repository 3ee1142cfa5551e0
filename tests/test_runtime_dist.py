"""Multi-process gloo: every schedule matches single-device training bitwise, over two steps.

Each test launches one process group and runs many cases inside it (starting processes costs
seconds); every rank checks its own parameters against a reference model it builds itself.
"""

from __future__ import annotations

from typing import Any

import pytest  # (the tier's marker)
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp, structured
from pipetrain.runtime import microbatch
from pipetrain.testing import grad_mismatches, reference_step
from test_grads_ready import Recorder, tied_mlp

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def _case(name: str, m: int, v: int, n_layers: int, steps: int = 2) -> list[str]:
    ref, model = mlp(n_layers), mlp(n_layers)
    pipe = pt.Pipeline(model, name, m, LOSS, stages_per_rank=v, timeout=30)
    opt, opt_ref = (torch.optim.AdamW(pipe.parameters(), lr=0.01),
                    torch.optim.AdamW(ref.parameters(), lr=0.01))
    problems = []
    for step in range(steps):
        x, y = batch(10 + step, seed=step)  # a different batch size on the second step
        want = reference_step(ref, x, y, LOSS, m)
        got = pipe.step(x, y)
        if got.loss is None or not torch.equal(got.loss, want.to(got.loss.dtype)):
            problems.append(f"{name} m={m} v={v} step {step}: loss {got.loss} != {want}")
        problems += [f"{name} m={m} v={v} step {step}: {b}" for b in grad_mismatches(pipe, ref)]
        spans = [len(got.timeline.of_rank(r)) for r in range(pipe.schedule.n_ranks)]
        if spans != [len(acts) for acts in pipe.schedule.actions]:  # every rank's, through the root
            problems.append(f"{name} m={m} v={v} step {step}: timeline spans per rank {spans}")
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    return problems


def _all_schedules(ctx: pt.RankContext, ms: list[int]) -> list[str]:
    problems = []
    for name in SCHEDULES:
        for v in ((2, 3) if name == "interleaved-1f1b" else (2,) if name in MULTI else (1,)):
            for m in ms:
                problems += _case(name, m, v, n_layers=ctx.world_size * v * 2 - 1)
    return problems


def _structured(ctx: pt.RankContext) -> list[str]:
    ref, model = structured(), structured()
    x, y = batch(8)
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, "zbv", 4, LOSS)  # 2 ranks x 2 stages, one layer each
    got = pipe.step(x, y, return_outputs=True)
    problems = [] if got.loss is not None and torch.equal(got.loss, want) else ["loss differs"]
    with torch.no_grad():  # the same micro-batches, one after another on one device
        ref_out = microbatch.merge([ref(part) for part in microbatch.split(x, 4)])
    if ctx.rank == 0 and not torch.equal(got.outputs, ref_out):
        problems.append("outputs differ")
    timeline = got.timeline
    if {s.rank for s in timeline.spans} != {0, 1} or not 0 <= got.bubble_fraction < 1:
        problems.append(f"timeline incomplete: {timeline}")
    return problems + grad_mismatches(pipe, ref)


def _features(ctx: pt.RankContext) -> list[str]:
    problems = []
    for name in ("1f1b", "interleaved-1f1b", "zbv"):
        for what in ("recompute", "frozen"):
            ref, model = mlp(), mlp()
            if what == "frozen":  # only layer 5 trains (an adapter); stage 0 has no grads at all
                for m_ in (ref, model):
                    for i, layer in enumerate(m_):
                        layer.requires_grad_(i == 5)
            x, y = batch(12)
            want = reference_step(ref, x, y, LOSS, 4)
            pipe = pt.Pipeline(model, name, 4, LOSS, timeout=30,
                               recompute="always" if what == "recompute" else "never")
            got = pipe.step(x, y)
            if got.loss is None or not torch.equal(got.loss, want):
                problems.append(f"{name} {what}: loss {got.loss} != {want}")
            problems += [f"{name} {what}: {b}" for b in grad_mismatches(pipe, ref)]
    return problems


def _grads_ready(ctx: pt.RankContext) -> list[str]:
    """The hook fires once per stage of this rank, after its last gradient write; a weight tied
    across ranks waits for the end-of-step all-reduce, one tied within a rank for both stages."""
    problems = []
    for name in ("1f1b", "zbv"):
        for model in (mlp(), tied_mlp()):
            pipe = pt.Pipeline(model, name, 4, LOSS, timeout=30)
            for step in range(2):
                hook = Recorder(pipe)
                pipe.step(*batch(12, seed=step), on_grads_ready=hook)
                problems += [f"{name} step {step}: {p}"
                             for p in hook.problems(list(pipe.schedule.stages_of(ctx.rank)))]
    return problems


def _two_ranks(ctx: pt.RankContext) -> list[str]:
    # m below p, at p, above and not a multiple, above and a multiple
    return (_all_schedules(ctx, [1, 2, 3, 4]) + _structured(ctx) + _features(ctx)
            + _grads_ready(ctx))


def _four_ranks(ctx: pt.RankContext) -> list[str]:
    return _all_schedules(ctx, [3, 8])


def _flatten(results: list[Any]) -> list[str]:
    return [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs]


def test_every_schedule_two_ranks() -> None:
    assert _flatten(pt.launch(_two_ranks, 2, timeout=240)) == []


@pytest.mark.long  # beside test_every_schedule_two_ranks
def test_every_schedule_four_ranks() -> None:
    assert _flatten(pt.launch(_four_ranks, 4, timeout=240)) == []
