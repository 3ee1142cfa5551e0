"""Shared capture on 2 processes (gloo): rank 0 exports, rank 1 loads its program (no weights
in it) and builds the same graph on its own model's tensors; a rank whose model or example
differs, a rank 0 that captured before, an export that fails and a rank 0 that never comes each
end without a hang."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError, PipelineError

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")


def _shared(name: str, example: dict[str, Any] | None = None) -> tuple[Any, nn.Module]:
    import test_zoo as zoo
    from pipetrain.split.shared_capture import capture_shared

    arch = zoo.BY_NAME[name]
    model = zoo.build(arch)
    inputs, _ = zoo.batch(arch)
    example = example or {k: v[:2] for k, v in inputs.items()}
    return capture_shared(model, example, dist.group.WORLD), model


def _cases(ctx: pt.RankContext) -> list[str]:
    from pipetrain.split.capture import RECALL
    from pipetrain.split.shared_capture import _payload

    torch.set_num_threads(1)
    problems = []
    for name in ("llama", "t5"):  # decoder-only; encoder-decoder (its own loss from labels)
        RECALL.clear()
        captured, model = _shared(name)
        digest = [None, None]
        dist.all_gather_object(digest, str(captured.graph))
        if digest[0] != digest[1]:
            problems.append(f"{name}: the ranks' graphs differ")
        if (captured.seconds == 0.0) != (ctx.rank == 1):  # loaded on rank 1, exported on 0
            problems.append(f"{name}: rank {ctx.rank} export took {captured.seconds} s")
        own = {id(t) for t in (*model.parameters(), *model.buffers())}
        foreign = [t for t, v in captured.attrs.items() if isinstance(v, nn.Parameter)
                   and id(v) not in own]
        if foreign:
            problems.append(f"{name}: {foreign[:3]} are not this rank's own parameters")
    # rank 0's payload holds the graph, not the weights
    import test_zoo as zoo
    from pipetrain.split.capture import _bind, export, from_program

    model = zoo.build(zoo.BY_NAME["llama"])
    example = {k: v[:2] for k, v in zoo.batch(zoo.BY_NAME["llama"])[0].items()}
    import inspect

    bound = _bind(inspect.signature(model.forward), example)
    program, _ = export(model, bound)
    payload = _payload(program, model, from_program(program, model, inspect.signature(
        model.forward), bound, 0.0), "")
    size = int.from_bytes(payload[:8], "little")
    loaded = torch.export.load(io.BytesIO(payload[8 + size:]))
    if not loaded.state_dict or not all(t.is_meta for t in loaded.state_dict.values()):
        problems.append("the shared program carries weights")
    if not all(not p.is_meta for p in program.state_dict.values()):
        problems.append("saving left meta tensors in rank 0's own program")
    return problems + _eval_capture(ctx) + _across(ctx) + _fallbacks(ctx)


def _across(ctx: pt.RankContext) -> list[str]:
    """Inside ``across(world)`` (pipetrain train's replicas), a pipeline group of one rank
    each still shares: rank 1 loads rank 0's export."""
    import test_zoo as zoo
    from pipetrain.split.capture import RECALL
    from pipetrain.split.shared_capture import across, capture_shared

    RECALL.clear()
    alone = [dist.new_group([0]), dist.new_group([1])][ctx.rank]
    arch = zoo.BY_NAME["gpt2"]
    example = {k: v[:2] for k, v in zoo.batch(arch)[0].items()}
    with across(dist.group.WORLD):
        captured = capture_shared(zoo.build(arch), example, alone)
    if (captured.seconds == 0.0) != (ctx.rank == 1):
        return [f"across: rank {ctx.rank} took {captured.seconds} s"]
    return []


def _eval_capture(ctx: pt.RankContext) -> list[str]:
    """A GPT-2 with dropout: its first eval step captures it in eval mode, shared too (rank 1
    loads it), and evaluates as the model in eval mode on one process."""
    import copy

    import transformers as tf

    from helpers.hf import batch, lm_loss
    from pipetrain.split.capture import RECALL

    RECALL.clear()
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False)
    model = tf.GPT2LMHeadModel(cfg).double()
    ref = copy.deepcopy(model).eval()
    inputs, targets = batch("gpt2", rows=8, seq=10)
    pipe = pt.Pipeline(model, "1f1b", 4, lm_loss, split_points=["transformer.h.1"],
                       example_inputs=inputs, timeout=30)
    loaded: list[float] = []
    export = torch.export.export  # rank 1 exports nothing: it loads the eval capture too

    def counted(*args: Any, **kwargs: Any) -> Any:
        loaded.append(1.0)
        return export(*args, **kwargs)
    torch.export.export = counted
    try:
        got = pipe.eval_step(pipe.pack(**inputs), targets).loss
    finally:
        torch.export.export = export
    with torch.no_grad():
        want = lm_loss(ref(**inputs), targets)
    problems = [] if pipe.engine.evaluator is not None else ["no eval graph was made"]
    if ctx.rank == 1 and (loaded or got is None
                          or not torch.allclose(got, want, rtol=1e-10, atol=0)):
        problems.append(f"eval: {got} != {want}, own exports {len(loaded)}")
    return problems


def _fallbacks(ctx: pt.RankContext) -> list[str]:
    """Each rank ends with a capture of its own model when sharing cannot serve it."""
    import test_zoo as zoo
    from pipetrain.split.capture import RECALL

    problems = []
    RECALL.clear()  # rank 1's example is longer: its key is not rank 0's
    inputs = {k: v[:2] for k, v in zoo.batch(zoo.BY_NAME["gpt2"])[0].items()}
    if ctx.rank == 1:
        inputs = {k: torch.cat([v, v], 1) for k, v in inputs.items()}
    captured, _ = _shared("gpt2", inputs)
    if captured.seconds == 0.0:
        problems.append("another example: loaded rank 0's capture")
    RECALL.clear()  # rank 0 captured before, on its own; rank 1 did not: rank 1 exports
    bert = zoo.BY_NAME["bert"]
    if ctx.rank == 0:
        from pipetrain.split.capture import capture

        capture(zoo.build(bert), {k: v[:2] for k, v in zoo.batch(bert)[0].items()})
    captured, _ = _shared("bert")
    if (captured.seconds == 0.0) != (ctx.rank == 0):  # rank 0's recalled, rank 1's exported
        problems.append(f"recalled on rank 0 only: rank {ctx.rank} took {captured.seconds} s")
    try:  # an export that fails fails on every rank
        from pipetrain.split.shared_capture import capture_shared

        capture_shared(_Branchy(), (torch.randn(2, 4),), dist.group.WORLD)
        problems.append("a model export cannot capture was captured")
    except PartitionError:
        pass
    if ctx.rank == 1:  # (last: the ranks' counts of shared captures part here)
        from pipetrain.split import shared_capture

        shared_capture.START_S = 1.0  # a rank 0 that never builds it: an error, not a hang
        try:
            _shared("vit")
            problems.append("waited for a rank 0 that never came")
        except PipelineError as e:
            if "did not start exporting the model within 1 s" not in str(e):
                problems.append(f"no rank 0: {e}")
    return problems


class _Branchy(nn.Module):
    """Python control flow on a tensor's value: torch.export cannot capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if float(x.sum()) > 0 else x - 1


# in CI: the shared capture's own path (rank 0 exports, the others load) in every multi-process
# run of a transformers model, e.g. test_hf_dist.py::test_hf_models_and_a_cnn_on_two_ranks; its
# fallbacks here only
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_rank_1_loads_rank_0s_capture_and_falls_back_where_it_cannot() -> None:
    assert [f"rank {r}: {p}" for r, ps in enumerate(pt.launch(_cases, 2, timeout=300))
            for p in ps] == []

