"""Tensor parallel stages: pp 2 x tp 2 on 4 gloo processes equal one device (pipetrain's GPT)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest  # (the tier's marker)
import torch
from torch import nn

import pipetrain as pt
from pipetrain.models.gpt import GPTConfig, gpt_layers, lm_loss
from pipetrain.parallel.tensor_parallel import TensorParallel
from pipetrain.testing import reference_step, reload_mismatches

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

CONFIG = GPTConfig(seq_len=16, d_model=32, n_heads=4, n_layers=4)
CASES = (("1f1b", False), ("zb-h1", False), ("interleaved-1f1b", False), ("1f1b", True),
         ("zb-h1", True), ("interleaved-1f1b", True))  # (schedule, sequence parallel)
MICROBATCHES = 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*gpt_layers(CONFIG))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _mesh() -> object:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))


def _split(ctx: pt.RankContext) -> list[str]:
    """Loss and every gradient of one step equal one device's (to rounding), per schedule,
    with and without sequence parallelism; the split matrices hold half their elements on
    each rank."""
    from torch.distributed.tensor import DTensor

    mesh: object = _mesh()
    problems = []
    ref = _model()
    x, y = _data(0)
    want = float(reference_step(ref, x, y, lm_loss, MICROBATCHES))
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for schedule, sequence in CASES:
        tp = TensorParallel(mesh["tp"], sequence_parallel=sequence)  # type: ignore[index]
        name = schedule + (" sp" if sequence else "")
        pipe = pt.Pipeline(copy.deepcopy(_model()), schedule, MICROBATCHES, lm_loss, timeout=30,
                           group=mesh["pp"].get_group(), parallelize=tp)  # type: ignore[index]
        got = pipe.step(x, y)
        tp.finish()
        if got.loss is None or abs(float(got.loss) - want) > 1e-5:
            problems.append(f"{name}: loss {got.loss} != {want}")
        for n, p in pipe.named_parameters():
            if isinstance(p, DTensor) and p.grad.placements != p.placements:
                problems.append(f"{name}: {n}'s gradient is {p.grad.placements}")
            split = isinstance(p, DTensor) and not p.placements[0].is_replicate()
            if split and p.to_local().numel() * 2 != p.numel():
                problems.append(f"{name}: {n} holds {p.to_local().numel()} of {p.numel()}")
            if not torch.allclose(_full(p.grad), grads[n], rtol=1e-4, atol=1e-6):  # placed
                problems.append(f"{name}: {n}'s gradient differs by "
                                f"{(_full(p.grad) - grads[n]).abs().max():.3g}")
        if tp.split_layers != CONFIG.n_layers // 2:  # each rank holds half of the blocks
            problems.append(f"{name}: {tp.split_layers} layers split on this rank")
    return problems


def test_pp2_by_tp2_gives_one_devices_loss_and_gradients() -> None:
    results = pt.launch(_split, 4, timeout=240)
    assert [p for r in results for p in r] == []


def _state(pipe: pt.Pipeline, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from pipetrain.checkpoint import run as ck

    named = list(pipe.named_parameters())
    return {**ck.model_state(named), **ck.optimizer_state(opt, named)}


def _checkpoints(ctx: pt.RankContext, root: str) -> list[str]:
    """A tensor-parallel run's checkpoint loads into whole stages and back, value for value."""
    from pipetrain.checkpoint import run as ck

    mesh: object = _mesh()
    group = mesh["pp"].get_group()  # type: ignore[index]

    def build(split: bool) -> tuple[pt.Pipeline, torch.optim.Optimizer]:
        tp = TensorParallel(mesh["tp"]) if split else None  # type: ignore[index]
        pipe = pt.Pipeline(_model(), "1f1b", MICROBATCHES, lm_loss, timeout=30, group=group,
                           parallelize=tp)
        return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.01)

    pipe, opt = build(True)
    x, y = _data(0)
    pipe.step(x, y)
    opt.step()
    saved = _state(pipe, opt)
    path = ck.save(root, 1, saved, {})
    want = {k: _full(v).clone() for k, v in saved.items()}
    return reload_mismatches(path, want, [(f"split={split}", *build(split))
                                          for split in (False, True)])


def test_a_tensor_parallel_checkpoint_loads_into_whole_stages_and_back(tmp_path: Path) -> None:
    results = pt.launch(_checkpoints, 4, str(tmp_path), timeout=240)
    assert [p for r in results for p in r] == []


FOREIGN = (("llama", "zb-h1"), ("qwen2", "zbv"))
"""(model, schedule) of the Hugging Face models split by their own plan; CI runs Llama's (its
time, CONTRIBUTING.md: tests), the long tier Qwen2's."""


def _foreign(ctx: pt.RankContext, cases: Sequence[tuple[str, str]]) -> list[str]:
    """Hugging Face models split by their own plan (pipetrain.hf.tp_plan), traced,
    pp 2 x tp 2: Llama (grouped-query attention: 1 of 2 key/value heads per rank) under ZB-H1
    and Qwen2 (biased q, k, v, split with their rows) under zbv; the loss and every gradient
    equal one device's (float64)."""
    import transformers as tf

    from helpers.hf import LOSSES, MODELS, batch, points
    from pipetrain.hf.tp_plan import TracedTensorParallel, shrink

    tf.logging.set_verbosity_error()
    mesh: Any = _mesh()
    torch.set_num_threads(1)
    qwen = dict(num_hidden_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                use_cache=False)
    builders = {"llama": MODELS["llama"],
                "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**qwen))}
    problems = []
    for name, schedule in cases:
        torch.manual_seed(0)
        model = builders[name]().double()
        ref = copy.deepcopy(model)
        x, y = batch("llama", rows=8, seq=10, seed=1)
        want = float(reference_step(lambda kw, ref=ref: ref(**kw), x, y, LOSSES["llama"],
                                    MICROBATCHES))
        splits = shrink(model, 2, mesh["tp"].get_local_rank())
        tp = TracedTensorParallel(mesh["tp"], splits)
        pipe = pt.Pipeline(model, schedule, MICROBATCHES, LOSSES["llama"], timeout=60,
                           split_points=points("llama", 4 if schedule == "zbv" else 2),
                           example_inputs=x, group=mesh["pp"].get_group(), parallelize=tp)
        got = pipe.step(pipe.pack(**x), y)
        if got.loss is None or abs(float(got.loss) - want) > 1e-10 * abs(want):
            problems.append(f"{name} {schedule}: loss {got.loss} != {want}")
        grads = dict(ref.named_parameters())
        for n, p in pipe.named_parameters():
            g = _full(p.grad)
            if not torch.allclose(g, grads[n].grad, rtol=1e-8, atol=1e-12):
                problems.append(f"{name} {schedule}: {n}'s gradient differs by "
                                f"{(g - grads[n].grad).abs().max():.3g}")
        if not tp.split_layers or len(tp.params) != len(splits) // 2:  # this rank's half
            problems.append(f"{name} {schedule}: {len(tp.params)} of {len(splits)} split")
    return problems


def test_hugging_face_models_split_by_their_own_plan_give_one_devices_gradients() -> None:
    pytest.importorskip("transformers")
    results = pt.launch(_foreign, 4, FOREIGN[:1], timeout=300)
    assert [p for r in results for p in r] == []


@pytest.mark.long  # beside test_hugging_face_models_split_by_their_own_plan_give_one_devices_...
def test_a_qwen2_split_by_its_own_plan_gives_one_devices_gradients() -> None:
    pytest.importorskip("transformers")
    results = pt.launch(_foreign, 4, FOREIGN[1:], timeout=300)
    assert [p for r in results for p in r] == []
