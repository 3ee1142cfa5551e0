"""CUDA: local mode on one GPU, NCCL across GPUs. Skipped cleanly where there is no GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.models import MULTI, SCHEDULES, batch, mlp
from pipetrain.testing import reference_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
LOSS = nn.MSELoss()


def _compare(pipe: pt.Pipeline, ref: nn.Module) -> None:
    got = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        assert p.grad is not None and got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad, p.grad, msg=name)


@needs_cuda
@pytest.mark.parametrize("name", SCHEDULES)
def test_local_mode_on_one_gpu(name: str) -> None:
    ref, model = mlp().cuda(), mlp()
    x, y = (t.cuda() for t in batch(12))
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, device="cuda",
                       stages_per_rank=2 if name in MULTI else 1)
    got = pipe.step(x, y)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want)
    _compare(pipe, ref)


def _nccl(ctx: pt.RankContext) -> str:
    ref, model = mlp().to(ctx.device), mlp()
    x, y = (t.to(ctx.device) for t in batch(12))
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, "zbv", 4, LOSS)
    got = pipe.step(x, y)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want)
    _compare(pipe, ref)
    return str(pipe.device)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_gpus() -> None:
    assert pt.launch(_nccl, 2, backend="nccl", timeout=300) == ["cuda:0", "cuda:1"]


@needs_cuda
@pytest.mark.parametrize("example_on", ["cuda", "cpu"])
def test_a_captured_hf_llama_in_local_mode_on_one_gpu(example_on: str) -> None:
    """A model we did not write, captured and split into 4 stages on 2 local ranks, on the
    GPU: the loss and every gradient equal the same micro-batches run through it unsplit.
    An example made on the CPU for the model on the GPU is captured there."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    ref = transformers.LlamaForCausalLM(cfg).cuda()
    model = transformers.LlamaForCausalLM(cfg).cuda()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 128, (8, 16), device="cuda")

    def loss_fn(out: object, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits[:, :-1]  # type: ignore[attr-defined]
        return nn.functional.cross_entropy(logits.reshape(-1, 128), target[:, 1:].reshape(-1))

    want = reference_step(ref, {"input_ids": ids}, ids, loss_fn, 4)
    pipe = pt.Pipeline(model, "zbv", 4, loss_fn, split_points="auto", local_ranks=2,
                       example_inputs={"input_ids": ids[:2].to(example_on)}, device="cuda")
    got = pipe.step({"input_ids": ids}, ids)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    grads = dict(pipe.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_cuda
def test_generation_on_one_gpu() -> None:
    """Generation on the GPU (2 local ranks, a KV cache per stage, the GPU's own attention
    path): transformers' greedy tokens for a Llama and a Mixtral, in bfloat16 too."""
    pytest.importorskip("transformers")
    from helpers.hf import causal_lm, hf_generate, prompts

    for name in ("llama", "mixtral"):
        for dtype in (torch.float32, torch.bfloat16):
            model = causal_lm(name).to("cuda", dtype)
            batch = prompts()
            gen = pt.Generator(model, rows=2, length=32, prefill=4, window=4, local_ranks=2,
                               device="cuda")
            assert gen.generate(batch, 10) == hf_generate(model, batch, 10), (name, dtype)


@needs_cuda
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_compiled_stages_on_one_gpu(name: str) -> None:
    """compile=True on the GPU (inductor's Triton kernels): the loss and gradients of the
    eager model, within 1e-5 of the largest gradient."""
    if name == "zbv" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("a split backward compiled needs torch >= 2.13")
    ref, model = mlp().cuda(), mlp()
    x, y = (t.cuda() for t in batch(16))
    want = reference_step(ref, x, y, LOSS, 4)
    pipe = pt.Pipeline(model, name, 4, LOSS, local_ranks=2, device="cuda", compile=True,
                       stages_per_rank=2 if name in MULTI else 1)
    got = pipe.step(x, y)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    grads = dict(pipe.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    for n, p in ref.named_parameters():
        assert float((grads[n].grad - p.grad).abs().max()) <= 1e-5 * scale, n


@needs_cuda
def test_asynchronous_schedules_on_one_gpu() -> None:
    """PipeDream-2BW and PipeDream in local mode on the GPU: weights (their versions made and
    kept on the device) against the rules on one process, within 1e-6."""
    import copy

    from pipetrain.testing import Reference2BW, ReferenceStash

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = mlp().cuda()
    data = [tuple(t.cuda() for t in batch(12, seed=t)) for t in range(4)]
    ref = Reference2BW(copy.deepcopy(model), LOSS, 4)
    pipe = pt.Pipeline(model, "pipedream-2bw", 4, LOSS, local_ranks=2, device="cuda")
    mine, theirs = sgd(list(pipe.parameters())), sgd(list(ref.model.parameters()))
    for x, y in data:
        torch.testing.assert_close(pipe.step(x, y).loss, ref.step(x, y), rtol=1e-6, atol=1e-7)
        mine.step()
        theirs.step()
    pipe.drain()
    ref.drain()
    got = dict(pipe.named_parameters())
    for n, q in ref.model.named_parameters():
        torch.testing.assert_close(got[n].grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)

    model = mlp().cuda()
    ref_model = copy.deepcopy(model)
    pipe = pt.Pipeline(model, "pipedream", 4, LOSS, local_ranks=2, device="cuda",
                       optimizer=sgd)
    layers, bounds = list(ref_model), [0, pipe.balance[0], sum(pipe.balance)]
    stash = ReferenceStash([nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])],
                           LOSS, 4, sgd)
    for x, y in data:
        torch.testing.assert_close(pipe.step(x, y).loss, stash.step(x, y), rtol=1e-6, atol=1e-7)
    pipe.drain()
    stash.drain()
    got = dict(pipe.named_parameters())
    for n, q in ref_model.named_parameters():
        assert got[n].is_cuda
        torch.testing.assert_close(got[n], q, rtol=1e-5, atol=1e-7, msg=n)


def _sliced(ctx: pt.RankContext) -> list[str]:
    """Context parallelism under NCCL: cp 2 on 2 GPUs, GPT's loss and gradients as one's."""
    import copy

    import torch.distributed as dist

    from pipetrain.models.gpt import GPTConfig, gpt_layers, lm_loss
    from pipetrain.parallel.context_parallel import ContextParallel

    config = GPTConfig(seq_len=32, d_model=64, n_heads=4, n_layers=2)
    torch.manual_seed(0)
    model = nn.Sequential(*gpt_layers(config)).double().to(ctx.device)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, config.vocab_size, (4, 33), device=ctx.device)
    x, y = ids[:, :-1], ids[:, 1:]
    alone = dist.new_group([ctx.rank])
    with ContextParallel(dist.group.WORLD) as cp:
        pipe = pt.Pipeline(cp.apply(model), "1f1b", 2, lm_loss, group=alone,
                           device=ctx.device)
        got = pipe.step(cp.take(x, 32), cp.take(y, 32))
        want = reference_step(ref, x, y, lm_loss, 2, device=ctx.device)
        assert got.loss is not None
        loss = got.loss.detach().clone()
        dist.all_reduce(loss)
        problems = [] if abs(float(loss) / 2 - float(want)) < 1e-9 else ["loss"]
        refs = dict(ref.named_parameters())
        for n, p in pipe.named_parameters():
            grad = p.grad.detach().clone()
            dist.all_reduce(grad)
            if not torch.allclose(grad / 2, refs[n].grad, rtol=1e-9, atol=1e-12):
                problems.append(n)
        pipe.close()
    return problems


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_context_parallel_under_nccl_on_two_gpus() -> None:
    assert pt.launch(_sliced, 2, backend="nccl", timeout=300) == [[], []]


@needs_cuda
def test_the_sliced_attention_path_on_cuda_kernels() -> None:
    """On one GPU: transformers' Llama and Mistral (a window) through the sliced path's mask
    and CUDA SDPA kernels give the logits of their own attention on packed documents."""
    transformers = pytest.importorskip("transformers")
    from pipetrain.hf.sequence_attention import attend
    from pipetrain.runtime.sequence import Shards

    transformers.logging.set_verbosity_error()
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97, use_cache=False)
    for config in (transformers.LlamaConfig(**common),
                   transformers.MistralConfig(**common, sliding_window=3)):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.cuda().eval()
        ids = torch.randint(0, 97, (2, 12), device="cuda")
        positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1).cuda()
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=positions).logits
            transformers.AttentionInterface.register("pipetrain_cp_cuda_check", attend)
            model.set_attn_implementation("pipetrain_cp_cuda_check")
            with Shards(None, documents=True):
                got = model(input_ids=ids, position_ids=positions).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
