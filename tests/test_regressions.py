"""Regressions: every test starts with the story of the bug it pins down."""

from __future__ import annotations

import pytest  # (the tier's marker)
import torch
from torch import nn

import pipetrain as pt
from pipetrain.split.partition import named_layers

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)


def test_a_module_used_twice_in_a_sequential_is_not_dropped() -> None:
    # nn.Sequential.named_children() hides a module that appears twice (a layer tied to an
    # earlier one), so the first partitioner silently split 7 of 8 layers and the head vanished.
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    assert [n for n, _ in named_layers(model)] == ["0", "1", "2"]
    pipe = pt.Pipeline(model, "1f1b", 2, nn.MSELoss(), local_ranks=3)
    assert pipe.balance == [1, 1, 1]
    assert [n for n, _ in pipe.named_parameters()] == ["0.weight", "0.bias"]
    x = torch.randn(4, 4)
    result = pipe.eval_step(x)
    with torch.no_grad():  # the same micro-batches, one after another on one device
        assert torch.equal(result.outputs, torch.cat([model(part) for part in x.chunk(2)]))


class WithAux(nn.Module):
    """Returns its activation and a one-element side value that the next stage ignores."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.lin(x)
        return h, h.mean().reshape(1)


class TakeFirst(nn.Module):
    def forward(self, t: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return t[0]


def test_a_one_element_output_without_gradient_is_not_a_loss() -> None:
    # A stage took any one-element output that got no gradient back for a loss and seeded it
    # with ones, so an unused one-element side output (an auxiliary statistic) added its own
    # gradient to the stage's weights. Only the last stage's scalar output is seeded now.
    from helpers.models import batch
    from pipetrain.testing import grad_mismatches, reference_step

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(WithAux(), TakeFirst(), nn.Linear(8, 8))

    ref, pipe_model = model(), model()
    x, y = batch(12)
    want = reference_step(ref, x, y, nn.MSELoss(), 4)
    for name in ("1f1b", "zb-h1"):
        pipe_model.zero_grad()
        pipe = pt.Pipeline(pipe_model, name, 4, nn.MSELoss(), local_ranks=2, balance=[1, 2])
        got = pipe.step(x, y)
        assert got.loss is not None and torch.equal(got.loss, want)
        assert grad_mismatches(pipe.named_parameters(), ref) == [], name


def _steps_under_the_profiler(ctx: pt.RankContext) -> str:
    import gc

    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    for name in ("1f1b", "zbv", "gpipe"):
        for recompute in ("never", "always"):
            model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
            pipe = pt.Pipeline(model, name, 4, nn.MSELoss(), recompute=recompute, timeout=60.0)
            pipe.step(x, y)
            gc.collect()
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
                pipe.step(x, y)
            del pipe
            gc.collect()
    return "ok"


def test_steps_under_torch_profiler_with_memory_do_not_crash() -> None:
    # To save a wait, a step once returned before its own end-of-step sends completed; they
    # were waited for (and freed) during the next step. A torch.profiler session with
    # profile_memory=True around that next step then crashed the process (SIGSEGV or glibc
    # "free(): invalid next size") while the profile's results were freed. Every send is now
    # waited for within the step that made it.
    assert pt.launch(_steps_under_the_profiler, 2, timeout=180) == ["ok", "ok"]
