"""A pipeline's lifetime in one process (:mod:`pipetrain.runtime.lifetime`): dropped, it is gone at
once, by reference counting (no cycle keeps it, its stages and its threads until a garbage
collection); closed, or at the end of its ``with`` block, it refuses steps; the interpreter's
exit tells what owns threads and waits for them. Across processes: test_lifetime_dist.py."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp
from pipetrain.errors import PipelineError
from pipetrain.runtime import lifetime

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counting frees objects while the test runs."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _gone(make: Any) -> bool:
    """Whether what ``make()`` returns is freed as soon as its last reference goes."""
    ref = weakref.ref(make())
    return ref() is None


def _stepped(name: str) -> pt.Pipeline:
    v = 2 if name in MULTI else 1
    pipe = pt.Pipeline(mlp(), name, 4, LOSS, local_ranks=2, stages_per_rank=v)
    pipe.step(*batch())
    pipe.eval_step(*batch())
    return pipe


@pytest.mark.parametrize("name", [*SCHEDULES, "pipedream-2bw"])
def test_a_dropped_pipeline_is_freed_at_once(name: str, no_collector: None) -> None:
    assert _gone(lambda: _stepped(name))


class Noisy(nn.Module):
    """A user's module with dropout: its eval step runs an eval graph of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_a_captured_model_with_its_eval_graph_is_freed_at_once(no_collector: None) -> None:
    def make() -> pt.Pipeline:
        x, y = batch()
        pipe = pt.Pipeline(Noisy(), "zbv", 4, LOSS, split_points=["blocks.1", "blocks.2",
                                                                   "blocks.3"],
                           example_inputs=(x,), local_ranks=2)
        pipe.step(x, y)
        pipe.eval_step(x, y)
        assert pipe.engine.evaluator is not None
        return pipe

    assert _gone(make)


def test_a_generator_is_freed_at_once_and_closes(no_collector: None) -> None:
    pytest.importorskip("transformers")
    from helpers.hf import causal_lm, prompts

    def make() -> pt.Generator:
        gen = pt.Generator(causal_lm("llama"), rows=2, length=16, prefill=3, window=2,
                           local_ranks=2)
        gen.generate(prompts((3, 2)), 3)
        return gen

    assert _gone(make)
    with make() as gen:
        pass
    with pytest.raises(PipelineError, match="closed"):
        gen.generate(prompts((3, 2)), 3)


def test_a_closed_pipeline_refuses_steps_and_keeps_its_parameters() -> None:
    pipe = _stepped("1f1b")
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.close()
    pipe.close()  # once only
    with pytest.raises(PipelineError, match=r"\[rank 0\] this pipeline was closed"):
        pipe.step(*batch())
    assert all(torch.equal(p, before[n]) for n, p in pipe.named_parameters())
    with pt.Pipeline(mlp(), "gpipe", 4, LOSS, local_ranks=2) as other:
        other.step(*batch())
    with pytest.raises(PipelineError, match="closed"):
        other.eval_step(*batch())


class _Owner:
    """Owns a thread that runs until told to stop, as a watchdog does."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = lifetime.start(self.stop.wait, (), "pipetrain-test")
        lifetime.own(self)

    def at_exit(self) -> None:
        self.stop.set()


def test_the_exit_tells_owners_and_waits_for_their_threads() -> None:
    owner = _Owner()
    assert owner.thread in lifetime.alive()
    assert lifetime.end(seconds=5.0) == []
    assert not owner.thread.is_alive()
    stuck = lifetime.start(threading.Event().wait, (1.0,), "pipetrain-stuck")
    assert lifetime.end(seconds=0.05) == [stuck]  # bounded: a thread nobody stops is left
