"""Peer steps: what peers.py and peers_gpt.py share: a DeepSpeed pipeline step, an optimizer
step around any step, the libraries timed in turn, and which peers are installed."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere
ROWS, WIDTH = 2, 8  # rows per micro-batch, features of a sleep layer


def installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing(*peers: str) -> list[str]:
    """A line for each of ``peers`` not installed: skipped, and how to install it."""
    return [f"{peer}: not installed (pip install -e '.[bench]'), skipped"
            for peer in peers if not installed(peer)]


def deepspeed_step(layers: list[Any], ranks: int, loss_fn: Callable[..., Any], x: torch.Tensor,
                   y: torch.Tensor, m: int) -> Callable[[], None]:
    """DeepSpeed's PipelineModule over ``layers`` (split evenly), one ``train_batch`` of ``x``
    and ``y`` in ``m`` micro-batches of ROWS rows per call; SGD with lr 0."""
    import logging

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.utils import logger

    logger.setLevel(logging.ERROR)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # its banners
        deepspeed.init_distributed(dist_backend="gloo")
        net = PipelineModule(layers=layers, num_stages=ranks, loss_fn=loss_fn,
                             partition_method="uniform")
        engine, *_ = deepspeed.initialize(
            model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.0),
            config={"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**9,
                    "gradient_accumulation_steps": m})

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield from zip(x.split(ROWS), y.split(ROWS), strict=True)
    it = batches()
    return lambda: engine.train_batch(it)


def trained(model: Any, step: Callable[[], None]) -> Callable[[], None]:
    """``step`` followed by an optimizer step (SGD, lr 0) on ``model``'s parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def run() -> None:
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def timed(steps: dict[str, Callable[[], None]], case: Any) -> dict[str, list[float]]:
    """Each library's step times, the libraries alternating, between barriers."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for k in range(case.warmup + case.steps):
        for name, step in steps.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if k >= case.warmup:
                times[name].append(time.perf_counter() - start)
    return times
