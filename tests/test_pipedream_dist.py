"""PipeDream-2BW and PipeDream on 2 and 4 processes (gloo): every rank's weights and gradients
bitwise equal to their update rules on one process (testing.Reference2BW, ReferenceStash), a
tied weight to rounding, data parallel x pipeline, an eval step between windows, failures."""

from __future__ import annotations

import copy
import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from helpers.models import batch, mlp
from pipetrain.testing import Reference2BW
from test_grads_ready import tied_mlp
from test_pipedream import adamw, batches, sgd, stash_pair

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


def _compare(pipe: pt.Pipeline, ref: nn.Module, where: str, atol: float = 0.0) -> list[str]:
    own = dict(pipe.named_parameters())
    theirs = dict(ref.named_parameters())
    problems = []
    for n, p in own.items():
        q = theirs[n]
        pairs = [("weight", p, q)] + ([("grad", p.grad, q.grad)]
                                      if p.grad is not None or q.grad is not None else [])
        for what, a, b in pairs:
            if a is None or b is None:
                problems.append(f"{where}: {n} {what}: one side is None")
            elif (atol == 0.0 and not torch.equal(a, b)) or (
                    atol > 0.0 and float((a - b).abs().max()) > atol):
                problems.append(f"{where}: {n} {what} differs by {float((a - b).abs().max())}")
    return problems


def _rule(ctx: pt.RankContext, optimizer: Any, tied: bool = False, m: int = 4,
          steps: int = 4) -> list[str]:
    model = tied_mlp() if tied else mlp(2 * ctx.world_size)
    ref = Reference2BW(copy.deepcopy(model), LOSS, m)
    pipe = pt.Pipeline(model, "pipedream-2bw", m, LOSS, timeout=30)
    mine, theirs = optimizer(list(pipe.parameters())), optimizer(list(ref.model.parameters()))
    atol = 1e-7 if tied else 0.0  # the tied weight's two gradients add in another order
    problems: list[str] = []
    losses = []
    last = ctx.rank == ctx.world_size - 1
    for t in range(steps):
        x, y = batch(12, seed=t)
        got, want = pipe.step(x, y), ref.step(x, y)
        losses.append(want)
        if last and (got.loss is None or not torch.allclose(got.loss, want, rtol=0, atol=atol)):
            problems.append(f"step {t}: loss {got.loss} != {want}")
        if not last and got.loss is not None:
            problems.append(f"step {t}: a loss on a rank without the last stage")
        before = None if t == 0 else losses[t - 1]
        if (before is None) != (got.previous_loss is None) or (
                before is not None and not torch.allclose(got.previous_loss, before, rtol=0,
                                                          atol=atol)):
            problems.append(f"step {t}: previous_loss {got.previous_loss} != {before}")
        problems += _compare(pipe, ref.model, f"step {t}", atol)
        mine.step()
        theirs.step()
    result = pipe.drain()
    ref.drain()
    if result.loss is not None or len(result.timeline.spans) == 0:
        problems.append("the drain has a loss, or no timeline")
    problems += _compare(pipe, ref.model, "drain", atol)
    mine.step()
    theirs.step()
    return problems + _compare(pipe, ref.model, "after", atol)


def _eval_between(ctx: pt.RankContext) -> list[str]:
    model = mlp(2 * ctx.world_size)
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, timeout=30)
    mine, theirs = sgd(list(pipe.parameters())), sgd(list(ref.model.parameters()))
    problems = []
    for t in range(3):
        x, y = batch(12, seed=t)
        pipe.step(x, y)
        ref.step(x, y)
        mine.step()
        theirs.step()
        got = pipe.eval_step(x, y)  # with micro-batches in flight, on the newest weights
        with torch.no_grad():
            want = LOSS(ref.model(x), y)
        if got.loss is None or not torch.allclose(got.loss, want, rtol=1e-6):
            problems.append(f"eval after step {t}: {got.loss} != {want}")
    pipe.drain()
    ref.drain()
    return problems + _compare(pipe, ref.model, "after the evals")


def _stash(ctx: pt.RankContext, optimizer: Any, m: int = 4) -> list[str]:
    """PipeDream on every rank: the last rank's losses, everyone's previous_loss, and each
    rank's weights after the drain, bitwise ReferenceStash's."""
    pipe, ref, ref_model = stash_pair(mlp(2 * ctx.world_size), ctx.world_size, optimizer, m,
                                      timeout=30)
    problems, losses = [], []
    last = ctx.rank == ctx.world_size - 1
    for t, (x, y) in enumerate(batches(4)):
        got, want = pipe.step(x, y), ref.step(x, y)
        losses.append(want)
        if last and (got.loss is None or not torch.equal(got.loss, want)):
            problems.append(f"stash step {t}: loss {got.loss} != {want}")
        before = None if t == 0 else losses[t - 1]
        if not (before is None and got.previous_loss is None) and not (
                before is not None and got.previous_loss is not None
                and torch.equal(got.previous_loss, before)):
            problems.append(f"stash step {t}: previous_loss {got.previous_loss} != {before}")
    pipe.drain()
    ref.drain()
    return problems + _compare(pipe, ref_model, "stash after the drain")


def _dropped(ctx: pt.RankContext) -> list[str]:
    """A 2BW pipeline dropped with micro-batches in flight (no drain) goes at once, though
    its last sends are for a step no peer will run; a new pipeline then trains."""
    import gc

    pipe = pt.Pipeline(mlp(4), "pipedream-2bw", 4, LOSS, timeout=20)
    for t in range(2):
        pipe.step(*batch(12, seed=t))
    start = time.monotonic()
    del pipe
    gc.collect()
    took = time.monotonic() - start
    after = pt.Pipeline(mlp(4), "1f1b", 4, LOSS, timeout=20).step(*batch(12)).loss
    problems = [] if took < 5 else [f"dropping the pipeline took {took:.1f} s"]
    return problems + ([] if ctx.rank == 0 or after is not None else ["no loss after"])


def _refill(ctx: pt.RankContext) -> list[str]:
    """Each rank saves its part mid-stream (parameters, optimizer, in_flight_state) after
    step 2; a new pipeline refills step 2 and goes on: the last rank's losses and every
    rank's weights after the drain equal the uninterrupted run's, bitwise."""
    data = batches(5)

    def run(pipe: pt.Pipeline, opt: Any, part: list[Any]) -> list[Any]:
        losses = []
        for x, y in part:
            losses.append(pipe.step(x, y).loss)
            opt.step()
        return losses

    whole = pt.Pipeline(mlp(4), "pipedream-2bw", 4, LOSS, timeout=30)
    opt = adamw(list(whole.parameters()))
    want = run(whole, opt, data)
    whole.drain()
    opt.step()
    first = pt.Pipeline(mlp(4), "pipedream-2bw", 4, LOSS, timeout=30)
    opt = adamw(list(first.parameters()))
    run(first, opt, data[:3])
    saved = (copy.deepcopy(first.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(first.in_flight_state()))
    first.drain()  # (the old pipeline's peers must not be left with its sends)
    model = mlp(4, seed=7)
    model.load_state_dict({**model.state_dict(), **saved[0]})
    second = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, timeout=30)
    opt = adamw(list(second.parameters()))
    opt.load_state_dict(saved[1])
    second.refill(*data[2], saved[2])
    got = run(second, opt, data[3:])
    second.drain()
    opt.step()
    problems = []
    if ctx.rank == ctx.world_size - 1 and not all(
            torch.equal(a, b) for a, b in zip(got, want[3:], strict=True)):
        problems.append(f"refilled losses {got} != {want[3:]}")
    mine = dict(whole.named_parameters())
    return problems + [f"refill: {n} differs" for n, p in second.named_parameters()
                       if not torch.equal(p, mine[n])]


def _two(ctx: pt.RankContext) -> list[str]:
    return (_rule(ctx, sgd) + _rule(ctx, adamw, m=5) + _rule(ctx, sgd, tied=True)
            + _eval_between(ctx) + _stash(ctx, sgd) + _dropped(ctx) + _refill(ctx))


def _four(ctx: pt.RankContext) -> list[str]:
    return (_rule(ctx, adamw, m=6) + _data_parallel(ctx) + _stash(ctx, adamw, m=5)
            + _stash_data_parallel(ctx))


def _data_parallel(ctx: pt.RankContext) -> list[str]:
    """2 replicas x 2 pipeline ranks: each replica steps its half of the batch, the replicas
    average their gradients (all-reduce, then / 2) before the optimizer step; the reference
    does the same with two one-process models."""
    replica, pp_rank = divmod(ctx.rank, 2)
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model = mlp(4)
    refs = [Reference2BW(copy.deepcopy(model), LOSS, 4) for _ in range(2)]
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, group=pipes[replica], timeout=30)
    mine = sgd(list(pipe.parameters()))
    theirs = [sgd(list(r.model.parameters())) for r in refs]
    problems: list[str] = []
    for t in range(4):
        x, y = batch(16, seed=t)
        halves = [(x[:8], y[:8]), (x[8:], y[8:])]
        pipe.step(*halves[replica])
        for r, half in zip(refs, halves):
            r.step(*half)
        for p in pipe.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dps[pp_rank])
                p.grad /= 2
        named = [dict(r.model.named_parameters()) for r in refs]
        for n in named[0]:
            a, b = named[0][n], named[1][n]
            if a.grad is not None:
                a.grad = (a.grad + b.grad) / 2
                b.grad = a.grad.clone()
        problems += _compare(pipe, refs[0].model, f"dp step {t}")
        mine.step()
        for opt in theirs:
            opt.step()
    pipe.drain()  # (a pipeline dropped with micro-batches in flight leaves its sends behind)
    return problems


def _stash_data_parallel(ctx: pt.RankContext) -> list[str]:
    """PipeDream, 2 replicas x 2 pipeline ranks: ``on_grads_ready`` averages each backward's
    gradient over the replicas before the stage's optimizer steps (in the steps and the
    drain); losses and weights bitwise ``ReferenceStash(replicas=2)``'s."""
    replica, pp_rank = divmod(ctx.rank, 2)
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dps = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe, ref, ref_model = stash_pair(mlp(4), 2, adamw, replicas=2, group=pipes[replica],
                                      timeout=30)
    calls = []

    def average(stage: int) -> None:
        calls.append(stage)
        for _, p in pipe.named_parameters(stage):
            if p.grad is not None:
                dist.all_reduce(p.grad, group=dps[pp_rank])
                p.grad /= 2

    problems: list[str] = []
    for t in range(3):
        x, y = batch(16, seed=t)
        mine = slice(8 * replica, 8 * replica + 8)
        got, want = pipe.step(x[mine], y[mine], on_grads_ready=average), ref.step(x, y)
        if pp_rank == 1:
            loss = got.loss.clone() if got.loss is not None else torch.tensor(float("nan"))
            dist.all_reduce(loss, group=dps[1])
            if not torch.equal(loss / 2, want):
                problems.append(f"stash dp step {t}: loss {float(loss) / 2} != {float(want)}")
    pipe.drain(on_grads_ready=average)
    ref.drain()
    if calls != [pp_rank] * 12:  # one call per backward: 3 steps of 4 micro-batches
        problems.append(f"stash dp: on_grads_ready calls {calls}")
    return problems + _compare(pipe, ref_model, "stash dp after the drain")


def _flatten(results: list[Any]) -> list[str]:
    return [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs]


def test_two_ranks_sgd_adamw_tied_and_eval() -> None:
    assert _flatten(pt.launch(_two, 2, timeout=240)) == []


def test_four_ranks_and_data_parallel() -> None:
    assert _flatten(pt.launch(_four, 4, timeout=240)) == []


class FailAt(nn.Module):
    """Raises (or kills its process) in the forward of the given call."""

    def __init__(self, call: int, how: str) -> None:
        super().__init__()
        self.call, self.how, self.calls = call, how, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.call:
            if self.how == "die":
                os._exit(3)
            raise RuntimeError("injected failure")
        return x


def _fail(ctx: pt.RankContext, how: str) -> str:
    # 3 ranks, 2BW with m = 4: stage 1 fails in the F of mb 1 of step 2, a steady window in
    # which its peers are on other steps' micro-batches
    model = nn.Sequential(nn.Linear(8, 8), FailAt(10, how), nn.Linear(8, 8))
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, timeout=3.0)
    start = time.monotonic()
    try:
        for t in range(4):
            pipe.step(*batch(12, seed=t))
    except pt.PipelineError as e:
        raise pt.PipelineError(f"elapsed={time.monotonic() - start:.1f}s: {e}") from None
    return "no error"


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_failure_in_a_steady_window_reaches_every_rank(how: str) -> None:
    with pytest.raises(pt.PipelineError) as info:
        pt.launch(_fail, 3, how, timeout=60)
    text = str(info.value)
    if how == "raise":
        assert "3 of 3 ranks failed" in text
        assert "[rank 1 | stage 1 | mb 1 | 1F1@0] step 2 failed: RuntimeError('injected " \
               "failure')" in text, text
    else:
        assert "process exited with code 3" in text
    elapsed = [float(x) for x in re.findall(r"elapsed=(\d+\.\d)s", text)]
    assert elapsed and max(elapsed) < 10, text
