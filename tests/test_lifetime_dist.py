"""Pipelines built, stepped and dropped one after another in one process, as users do (a sweep,
a notebook, an eval pipeline beside a training one): each ends with its last reference, its
``with`` block or ``close()``, and leaves nothing behind: no pipetrain thread, no open file or
socket, no key in the job's store. (One process: test_lifetime.py; the speed of the next
pipeline: benchmarks/lifetimes.py.)"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import pytest  # (the tier's marker)
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, batch, mlp
from pipetrain.runtime import lifetime

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev", "pipedream-2bw"]


def _held() -> dict[str, Any]:
    """What this process holds now: open files and sockets, pipetrain's threads."""
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return {"files": len(links), "sockets": sum(link.startswith("socket:") for link in links),
            "threads": sorted(t.name for t in threading.enumerate()
                              if t.name.startswith("pipetrain"))}


def _steps(pipe: pt.Pipeline) -> None:
    pipe.step(*batch(16))
    pipe.eval_step(*batch(16))
    if pipe.schedule.update is not None:  # an asynchronous schedule: its last step's sends
        pipe.drain()                      # complete in its drain (docs/schedules.md)


def _one(name: str, how: int) -> None:
    """Build, step, eval-step and end a pipeline: dropped (0), closed (1), a with block (2)."""
    torch.manual_seed(0)
    v = 2 if name in MULTI else 1
    pipe = pt.Pipeline(mlp(n_layers=8), name, 8, LOSS, stages_per_rank=v)
    if how == 2:
        with pipe:
            _steps(pipe)
        return
    _steps(pipe)
    if how == 1:
        pipe.close()
    pipe = None  # the user's variable, rebound


def _many(ctx: pt.RankContext) -> dict[str, Any]:
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    before, keys = _held(), store.num_keys()
    dist.barrier()
    for i, name in enumerate(SCHEDULES * 2):
        _one(name, i % 3)
    dist.barrier()  # every rank's pipelines have ended
    got = {"before": before, "after": _held(), "keys": (keys, store.num_keys()),
           "alive": [t.name for t in lifetime.alive()]}
    dist.barrier()  # every rank has counted
    pipe = pt.Pipeline(mlp(n_layers=8), "pipedream-2bw", 8, LOSS)
    pipe.step(*batch(16))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pipe.close()  # not drained: its sends stay, and close says so
    return {**got, "warned": [str(w.message) for w in seen]}


def test_many_pipelines_in_one_process_leave_nothing_behind() -> None:
    for rank, got in enumerate(pt.launch(_many, 4, timeout=240)):
        assert got["after"] == got["before"], (rank, got)
        assert got["alive"] == [], (rank, got)
        assert got["keys"][1] == got["keys"][0], (rank, got)
        assert any(f"[rank {rank}] a pipedream-2bw pipeline ended without drain()" in text
                   for text in got["warned"]), got["warned"]
