"""FSDP2 stages: pp 2 x 2 shards on 4 gloo processes equal one device on the whole batch."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

import pipetrain as pt
from pipetrain.parallel.sharded import ShardedStages
from pipetrain.testing import reference_step, reload_mismatches

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

LOSS = nn.MSELoss()
CASES = (("1f1b", "", "step"), ("zb-h1", "", "part"), ("zb-h1", "", "layer"),
         ("zb-h1", "", "step"), ("interleaved-1f1b", "", "layer"), ("1f1b", "module", "part"),
         ("zbv", "weight", "layer"))  # zbv: both holders of the tied weight on rank 0
STEPS, MICROBATCHES = 2, 4


def _model(tied: str = "") -> nn.Sequential:
    """Four blocks; ``tied="module"``: the last block's first Linear is the first block's (an
    embedding and head style tie, across the two pipeline ranks under 1F1B); ``"weight"``:
    its weight is."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(4)]
    if tied == "module":
        blocks[3][0] = blocks[0][0]
    elif tied == "weight":
        blocks[3][0].weight = blocks[0][0].weight
    return nn.Sequential(*blocks)


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each shard's batch of the step: [shard, rows, width]."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 8, generator=g)


def _reference(tied: str) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Per step each shard's loss, and the weights after AdamW on the shards' mean gradient."""
    ref = _model(tied)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        mean = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        losses.append([])
        for shard in range(2):
            ref.zero_grad()
            losses[-1].append(float(reference_step(ref, x[shard], y[shard], LOSS, MICROBATCHES)))
            for n, p in ref.named_parameters():
                mean[n] += p.grad / 2
        for n, p in ref.named_parameters():
            p.grad = mean[n]
        opt.step()
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def _sharded(ctx: pt.RankContext) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "pp"))
    shard = mesh["dp_shard"].get_local_rank()
    problems = []
    for name, tied, reshard in CASES:
        want_losses, want = _reference(tied)
        sharded = ShardedStages(mesh["dp_shard"], reshard)
        pipe = pt.Pipeline(copy.deepcopy(_model(tied)), name, MICROBATCHES, LOSS, timeout=30,
                           group=mesh["pp"].get_group(), parallelize=sharded)
        name += (f" tied {tied}" if tied else "") + f" reshard={reshard}"
        params = dict(pipe.named_parameters())
        full = sum(want[n].numel() for n in params)
        local = sum(p.to_local().numel() for p in params.values() if isinstance(p, DTensor))
        if local * 2 != full:  # each shard holds half of this rank's weights
            problems.append(f"{name}: {local} of {full} elements held locally")
        opt = torch.optim.AdamW(params.values(), lr=0.01)
        for step in range(STEPS):
            x, y = _data(step)
            got = pipe.step(x[shard], y[shard], on_grads_ready=sharded.reduce)
            sharded.finish()
            opt.step()
            opt.zero_grad()
            if got.loss is None or float(got.loss) != want_losses[step][shard]:
                problems.append(f"{name} step {step}: loss {got.loss} != "
                                f"{want_losses[step][shard]}")
        for n, p in pipe.named_parameters():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            if not torch.allclose(value.detach(), want[n], rtol=1e-5, atol=1e-6):
                problems.append(f"{name}: {n} differs by "
                                f"{(value.detach() - want[n]).abs().max():.3g}")
    return problems


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(pipe: pt.Pipeline, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from pipetrain.checkpoint import run as ck

    named = list(pipe.named_parameters())
    return {**ck.model_state(named), **ck.optimizer_state(opt, named)}


def _pipelines(mesh: DeviceMesh, sharded: bool
               ) -> tuple[pt.Pipeline, torch.optim.Optimizer, ShardedStages | None]:
    stages = ShardedStages(mesh["dp_shard"]) if sharded else None
    pipe = pt.Pipeline(_model(), "zb-h1", MICROBATCHES, LOSS, timeout=30,
                       group=mesh["pp"].get_group(), parallelize=stages)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01), stages


def _checkpoints(ctx: pt.RankContext, root: str) -> list[str]:
    """A sharded run's checkpoint loads into replicated stages and back, value for value."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.checkpoint import run as ck

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "pp"))
    shard = mesh["dp_shard"].get_local_rank()
    pipe, opt, stages = _pipelines(mesh, sharded=True)
    assert stages is not None
    x, y = _data(0)
    pipe.step(x[shard], y[shard], on_grads_ready=stages.reduce)
    stages.finish()
    opt.step()
    saved = _state(pipe, opt)
    path = ck.save(root, 1, saved, {})
    want = {k: _full(v) for k, v in saved.items()}
    # into replicated stages, then into sharded ones again
    return reload_mismatches(path, want, [(f"sharded={sharded}", *_pipelines(mesh, sharded)[:2])
                                          for sharded in (False, True)])


def test_pp2_by_two_shards_trains_like_one_device_on_the_whole_batch() -> None:
    results = pt.launch(_sharded, 4, timeout=240)
    assert [p for r in results for p in r] == []


def test_a_sharded_checkpoint_loads_into_replicated_stages_and_back(tmp_path: Path) -> None:
    results = pt.launch(_checkpoints, 4, str(tmp_path), timeout=240)
    assert [p for r in results for p in r] == []


FOREIGN = (("gpt2", "zbv", "part"),  # its tied head on rank 0
           ("llama-lora", "zb-h1", "layer"),  # peft's adapters
           ("resnet", "zb-h1", "part"), ("gpt2", "1f1b", "part"), ("llama", "zb-h1", "layer"))
"""(model, schedule, reshard) of the models we did not write."""
IN_CI = [FOREIGN[1]]
"""CI's (its time, CONTRIBUTING.md: tests): HF Llama with peft's adapters, its base frozen; the
others in the long tier (a weight tied on rank 0 under zbv: CASES, in CI)."""


def _foreign(ctx: pt.RankContext, cases: Sequence[tuple[str, str, str]]) -> list[str]:
    """Models we did not write (HF GPT-2 with its tied head across ranks, and on rank 0 with
    its embedding under zbv, HF Llama, HF Llama with peft's LoRA adapters and its base
    frozen, a BatchNorm ResNet), split by tracing, pp 2 x 2 shards under 1F1B and ZB-H1,
    resharding per layer and per part (the parts the traced graphs call): each shard's loss
    is one device's on its rows, and the reduced gradients are the shards' mean."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.hf import LOSSES, MODELS, batch, points

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "pp"))
    shard = mesh["dp_shard"].get_local_rank()
    problems = []
    for name, schedule, reshard in cases:
        torch.manual_seed(0)
        lora = name.endswith("-lora")
        name = name.removesuffix("-lora")
        model = (_adapted(MODELS[name]()) if lora else MODELS[name]()).double()
        ref = copy.deepcopy(model)
        data = [batch(name, rows=8, seq=10, seed=s) for s in range(2)]
        data = [({k: v.double() if v.is_floating_point() else v for k, v in x.items()}, y)
                for x, y in data]
        mean: dict[str, torch.Tensor] = {}
        losses = []
        for x, y in data:
            ref.zero_grad()
            losses.append(float(reference_step(lambda kw, ref=ref: ref(**kw), x, y, LOSSES[name],
                                               MICROBATCHES)))
            for n, p in ref.named_parameters():
                if p.grad is not None:
                    mean[n] = mean.get(n, 0) + p.grad / 2
        sharded = ShardedStages(mesh["dp_shard"], reshard)
        x, y = data[shard]
        pipe = pt.Pipeline(model, schedule, MICROBATCHES, LOSSES[name], timeout=60,
                           split_points=points(name, 4 if schedule == "zbv" else 2),
                           example_inputs=x,
                           group=mesh["pp"].get_group(), parallelize=sharded)
        got = pipe.step(pipe.pack(**x), y, on_grads_ready=sharded.reduce)
        sharded.finish()
        want = losses[shard]
        if got.loss is None or not math.isclose(float(got.loss), want, rel_tol=1e-12):
            problems.append(f"{name}: loss {got.loss} != {want}")
        for n, p in pipe.named_parameters():
            if not p.requires_grad:  # LoRA's frozen base: no gradient on either side
                if p.grad is not None or mean.get(n) is not None:
                    problems.append(f"{name}: the frozen {n} got a gradient")
                continue
            g = _full(p.grad)
            if not torch.allclose(g, mean[n], rtol=1e-9, atol=1e-12):
                problems.append(f"{name}: gradient of {n} differs by {(g - mean[n]).abs().max()}")
    return problems


def _adapted(model: nn.Module) -> nn.Module:
    """``model`` with peft's LoRA adapters on q_proj and v_proj, its base frozen; B made
    non-zero so that every adapter gets a gradient."""
    import peft

    inner: nn.Module = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])).get_base_model()
    for n, p in inner.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.05)
    return inner


def test_models_we_did_not_write_shard_like_one_device() -> None:
    pytest.importorskip("transformers")
    results = pt.launch(_foreign, 4, IN_CI, timeout=300)
    assert [p for r in results for p in r] == []


@pytest.mark.long  # beside test_models_we_did_not_write_shard_like_one_device
def test_models_we_did_not_write_shard_like_one_device_in_every_case() -> None:
    pytest.importorskip("transformers")
    results = pt.launch(_foreign, 4, [c for c in FOREIGN if c not in IN_CI], timeout=300)
    assert [p for r in results for p in r] == []
