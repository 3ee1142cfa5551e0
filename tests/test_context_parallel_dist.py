"""Context parallelism: each rank holds a slice of every sequence, and a step equals one process.

On 4 gloo processes, in float64, every case's loss and every gradient (averaged over the
context-parallel ranks, as ``train`` averages them) are within 1e-9 of the same micro-batches
run whole, one after another, on one process (:func:`pipetrain.testing.reference_step`):

- pp 2 x cp 2: transformers' Llama (GQA), Qwen2 (a sliding-window layer beside a full one),
  Mistral (a window shorter than the sequence) and pipetrain's GPT, each under 1F1B and ZB-V
  (split backward: the exchanges run in I); Llama on packed documents (positions restarting);
- pp 1 x cp 4: each of them (Llama's, Qwen2's and Mistral's 2 key-value heads repeated to
  spread over 4 ranks); Mistral's window on packed documents; GPT under interleaved 1F1B and
  Llama under DualPipeV;
- FSDP2 sharding every weight over the 2 context-parallel ranks of each stage (pp 2, as
  ``train --fsdp`` shards over ``dp_shard_cp``), and pipetrain's tensor parallelism on cp 2 x
  tp 2 (GPT).

CI runs :data:`IN_CI` and GPT under FSDP2 and tp; the long tier the other cases and Llama
under FSDP2.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from pipetrain.models.gpt import GPTConfig, gpt_layers
from pipetrain.models.gpt import lm_loss as gpt_loss
from pipetrain.parallel.context_parallel import ContextParallel
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

transformers = pytest.importorskip("transformers")

M, ROWS, SEQ = 2, 4, 16
GPT = GPTConfig(seq_len=SEQ, d_model=32, n_heads=4, n_layers=4)


def _hf(name: str) -> nn.Module:
    tf = transformers
    tf.logging.set_verbosity_error()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                  max_position_embeddings=64)
    config = {"llama": lambda: tf.LlamaConfig(**common),
              "qwen2": lambda: tf.Qwen2Config(**common, use_sliding_window=True,
                                              sliding_window=5, max_window_layers=2),
              "mistral": lambda: tf.MistralConfig(**common, sliding_window=5)}[name]()
    torch.manual_seed(0)
    config.use_cache = False  # as train runs it: transformers looks for packed rows only then
    model: nn.Module = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    return model.train()


def _hf_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(vocab: int, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, their next tokens and positions (restarting at 5 and 11 when ``packed``)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).repeat(ROWS, 1)
    if packed:
        positions = torch.cat([torch.arange(5), torch.arange(6), torch.arange(5)]).repeat(ROWS, 1)
    return ids[:, :-1], ids[:, 1:], positions


def _compare(pipe: pt.Pipeline, got: Any, want: torch.Tensor, ref: nn.Module,
             cp: ContextParallel, group: dist.ProcessGroup | None, name: str) -> list[str]:
    """The pipeline's loss and gradients (averaged over the cp ranks) against one process's."""
    problems = []
    if got.loss is not None:
        loss = got.loss.detach().clone()
        dist.all_reduce(loss, group=cp.shards.group)
        if abs(float(loss) / cp.size - float(want)) > 1e-9:
            problems.append(f"loss {float(loss) / cp.size} != {float(want)}")
    refs = dict(ref.named_parameters())
    for n, p in pipe.named_parameters():
        grad = _whole(p.grad).clone()
        dist.all_reduce(grad, group=group)
        grad /= cp.size
        r = refs[n].grad
        assert r is not None
        if not torch.allclose(grad, r, rtol=1e-9, atol=1e-9 * float(r.abs().max())):
            problems.append(f"gradient of {n} differs by {(grad - r).abs().max():.3g}")
    return [f"rank {dist.get_rank()} {name}: {p}" for p in problems]


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _case(name: str, schedule: str, cp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup,
          *, packed: bool = False, parallelize: Callable[..., Any] | None = None,
          grad_group: dist.ProcessGroup | None = None) -> list[str]:
    """One step of ``name`` under ``schedule`` with each sequence cut over ``cp_group``."""
    hf = name != "gpt"
    model = _hf(name) if hf else _gpt()
    ref = copy.deepcopy(model)
    ids, labels, positions = _data(97 if hf else GPT.vocab_size, packed)
    with ContextParallel(cp_group, documents=packed) as cp:
        if hf:
            from pipetrain.hf.sequence_attention import shard_attention

            shard_attention(model)
            inputs = {"input_ids": ids, "position_ids": positions}
            ranks = dist.get_world_size(pp_group)
            stages = ranks * (1 if schedule == "1f1b" else 2)
            cuts = {1: [], 2: [2], 4: [1, 2, 3]}[stages]
            pipe = pt.Pipeline(model, schedule, M, _hf_loss,
                               split_points=[f"model.layers.{i}" for i in cuts],
                               example_inputs=cp.take(inputs, SEQ), group=pp_group,
                               parallelize=parallelize, timeout=60)
            got = pipe.step(pipe.pack(**cp.take(inputs, SEQ)), cp.take(labels, SEQ))
            want = reference_step(lambda x: ref(**x), inputs, labels, _hf_loss, M)
        else:
            pipe = pt.Pipeline(cp.apply(nn.Sequential(*model)), schedule, M, gpt_loss,
                               group=pp_group, parallelize=parallelize, timeout=60)
            got = pipe.step(cp.take(ids, SEQ), cp.take(labels, SEQ))
            ref = nn.Sequential(*ref)
            want = reference_step(ref, ids, labels, gpt_loss, M)
        if hasattr(parallelize, "finish"):
            parallelize.finish()  # type: ignore[union-attr]
        label = f"{name} {schedule}" + (" packed" if packed else "")
        problems = _compare(pipe, got, want, ref, cp, grad_group or cp_group, label)
        pipe.close()
    return problems


def _gpt() -> list[nn.Module]:
    torch.manual_seed(0)
    return [layer.double() for layer in gpt_layers(GPT)]


def _groups(cp: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's cp group, its pp group) of 4 ranks, cp innermost."""
    rank = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    pp = 4 // cp
    for kind, lists in (("cp", [[p * cp + c for c in range(cp)] for p in range(pp)]),
                        ("pp", [[p * cp + c for p in range(pp)] for c in range(cp)])):
        for ranks in lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = group
    return mine["cp"], mine["pp"]


NAMES = ("llama", "qwen2", "mistral", "gpt")
CASES = ([(name, schedule, 2, False) for name in NAMES for schedule in ("1f1b", "zbv")]
         + [(name, "1f1b", 4, False) for name in NAMES]
         + [("llama", "zbv", 2, True), ("mistral", "1f1b", 2, True),
            ("gpt", "interleaved-1f1b", 2, False), ("llama", "dualpipev", 2, False)])
"""(model, schedule, cp, packed): every case, pp = 4 / cp."""
IN_CI = [("mistral", "zbv", 2, False), ("llama", "zbv", 2, True)]
"""The cases CI runs (CI's time, CONTRIBUTING.md: tests): transformers' attention under ZB-V,
a window and packed documents (pipetrain's GPT under 1F1B and ZB-V: CI's FSDP2 and tp test);
the others (Qwen2's, and cp 4 with key-value heads repeated, among them) in the long tier."""


def _slices(ctx: pt.RankContext, cases: list[tuple[str, str, int, bool]]) -> list[str]:
    problems: list[str] = []
    groups = {cp: _groups(cp) for cp in sorted({c[2] for c in cases})}
    for name, schedule, cp, packed in cases:
        problems += _case(name, schedule, *groups[cp], packed=packed)
    return problems


def test_sliced_sequences_give_one_process_loss_and_gradients() -> None:
    results = pt.launch(_slices, 4, IN_CI, timeout=600)
    assert [p for r in results for p in r] == []


@pytest.mark.long  # beside test_sliced_sequences_give_one_process_loss_and_gradients
def test_sliced_sequences_give_one_process_loss_and_gradients_in_every_case() -> None:
    results = pt.launch(_slices, 4, [c for c in CASES if c not in IN_CI], timeout=600)
    assert [p for r in results for p in r] == []


def _sharded(ctx: pt.RankContext, cases: tuple[str, ...]) -> list[str]:
    """FSDP2 over each stage's cp ranks (pp 2 x dp_shard_cp 2), then cp 2 x tp 2 (GPT)."""
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.parallel.sharded import ShardedStages
    from pipetrain.parallel.tensor_parallel import TensorParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard_cp"))
    cp_group, pp_group = mesh["dp_shard_cp"].get_group(), mesh["pp"].get_group()
    problems = []
    for name, schedule in ((n, s) for n, s in (("gpt", "zbv"), ("llama", "1f1b"))
                           if n in cases):
        problems += _case(name, schedule, cp_group, pp_group,
                          parallelize=ShardedStages(mesh["dp_shard_cp"], "part"))
    rank = dist.get_rank()  # cp 2 x tp 2, one pipeline rank: ranks (c * 2 + t)
    cps = [dist.new_group([t, 2 + t]) for t in range(2)]
    tps = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))["tp"]
    alone = [dist.new_group([r]) for r in range(4)]
    problems += _case("gpt", "1f1b", cps[rank % 2], alone[rank],
                      parallelize=TensorParallel(tps, sequence_parallel=False))
    return problems


def test_sliced_sequences_compose_with_fsdp_and_tensor_parallel() -> None:
    results = pt.launch(_sharded, 4, ("gpt",), timeout=600)
    assert [p for r in results for p in r] == []


@pytest.mark.long  # beside test_sliced_sequences_compose_with_fsdp_and_tensor_parallel
def test_sliced_sequences_compose_with_fsdp_on_a_transformers_llama() -> None:
    results = pt.launch(_sharded, 4, ("gpt", "llama"), timeout=600)
    assert [p for r in results for p in r] == []
