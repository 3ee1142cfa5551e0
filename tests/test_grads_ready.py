"""on_grads_ready: once per hosted stage per training step, when that stage's gradients are final.

Each test snapshots the gradients a stage holds when its call comes and compares them with the
gradients it holds when the step returns: equal means nothing wrote to them afterwards.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from helpers.models import MULTI, SCHEDULES, batch, mlp
from pipetrain.runtime.executor import grads_final_after
from pipetrain.schedules.action import Op

LOSS = nn.MSELoss()


class Recorder:
    """The hook: remembers, per call, the stage and a copy of its gradients at that moment."""

    def __init__(self, pipe: pt.Pipeline) -> None:
        self.pipe = pipe
        self.calls: list[tuple[int, dict[str, torch.Tensor | None]]] = []

    def __call__(self, stage: int) -> None:
        self.calls.append((stage, _grads(self.pipe, stage)))

    def problems(self, hosted: list[int]) -> list[str]:
        out = []
        if sorted(s for s, _ in self.calls) != sorted(hosted):
            out.append(f"calls for stages {[s for s, _ in self.calls]}, hosted {hosted}")
        for stage, then in self.calls:
            now = _grads(self.pipe, stage)
            out += [f"stage {stage}: {name} changed after its call" for name in now
                    if not _same(then[name], now[name])]
        return out


def _grads(pipe: pt.Pipeline, stage: int) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in pipe.named_parameters(stage)}


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def tied_mlp() -> nn.Sequential:
    torch.manual_seed(5)
    shared = nn.Linear(8, 8)
    return nn.Sequential(shared, nn.Tanh(), *mlp(6), shared)


@pytest.mark.parametrize("name", SCHEDULES)
def test_fires_once_per_stage_after_its_last_gradient_write(name: str) -> None:
    model = mlp()
    for layer in model[4:]:  # the last stage(s) have no trainable parameters: called too
        layer.requires_grad_(False)
    v = 2 if name in MULTI else 1
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, stages_per_rank=v)
    for step in range(2):  # the second step accumulates onto the first one's gradients
        hook = Recorder(pipe)
        pipe.step(*batch(12, seed=step), on_grads_ready=hook)
        assert hook.problems(list(range(2 * v))) == []


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_weight_tied_between_stages_waits_for_both(name: str) -> None:
    pipe = pt.Pipeline(tied_mlp(), name, 4, LOSS, local_ranks=2)
    hook = Recorder(pipe)
    pipe.step(*batch(12), on_grads_ready=hook)
    assert hook.problems(list(range(pipe.schedule.n_stages))) == []
    last = pipe.schedule.n_stages - 1
    calls = [s for s, _ in hook.calls]
    assert abs(calls.index(0) - calls.index(last)) == 1  # both once the later of them is done


def test_not_called_by_eval_and_a_raising_hook_fails_the_step() -> None:
    pipe = pt.Pipeline(mlp(), "zb-h1", 4, LOSS, local_ranks=2)
    pipe.eval_step(*batch(12))

    def boom(stage: int) -> None:
        raise RuntimeError(f"no all-reduce for stage {stage}")

    with pytest.raises(pt.PipelineError, match=r"\| mb 3 \| ([01])W3\] step 1 on_grads_ready"
                                               r"\(\1\) raised RuntimeError\('no all-reduce"):
        pipe.step(*batch(12), on_grads_ready=boom)


def test_points_come_from_the_action_lists() -> None:
    # ZB-H1 on 2 ranks: each stage's last W; 1F1B: each stage's last B
    for name, op in (("zb-h1", Op.W), ("1f1b", Op.B)):
        sched = ps.make_schedule(name, 2, 4)
        for rank in range(2):
            order = [(rank, a) for a in sched.actions[rank]]
            ready = grads_final_after(order, {}, set())
            (index, stages), = ready.items()
            assert stages == (rank,) and order[index][1].op is op
            assert all(a.op is not op for _, a in order[index + 1:])
