"""Expert parallel: a Hugging Face MoE's experts spread over data-parallel ranks, by its own plan.

On 4 gloo processes, pipelines of 2 ranks whose 2 data-parallel ranks share each layer's
experts (pp 2 x ep 2), the loss and every gradient of one step equal one device's running the
same micro-batches: Mixtral under ZB-H1 with FSDP2 on the other weights (captured with every
size symbolic), Qwen3-MoE (float64) under ZB-V, DeepSeek-V3 and gpt-oss under ZB-H1 (captured
at fixed shapes, as ``pipetrain train`` captures; a split I/W backward each; 1F1B and
interleaved 1F1B run through ``pipetrain train`` below); the experts' all-to-alls (forward
and backward) run in F and I, never in W (a W waits for nothing but its own inputs) except on
the first stage, whose backward is all W (its input, token ids, has no gradient); and
``pipetrain train --ep 2`` gives the losses, gradient norms and saved weights of ``--dp 2``,
holding at most 0.6 of its peak tensor bytes per rank, as the planner predicts (within 20%).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain as pt
from pipetrain.testing import reference_step

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

tf = pytest.importorskip("transformers")

CASES = (("mixtral", "zb-h1", True), ("qwen3_moe", "zbv", False), ("deepseek_v3", "zb-h1", False),
         ("gpt_oss", "zb-h1", False))
"""(model, schedule, FSDP2 on the other weights); 1F1B and interleaved 1F1B (with FSDP2) run
through ``pipetrain train`` below."""
IN_CI = CASES[:1]
"""CI's (its time, CONTRIBUTING.md: tests): Mixtral beside FSDP2; the others in the long tier
(Qwen3-MoE's, DeepSeek-V3's and gpt-oss's stored experts also load in CI:
tests/test_hf_moe_weights.py)."""
MICROBATCHES = 4


def _model(name: str) -> Any:
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    dec = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               vocab_size=64, max_position_embeddings=64, use_cache=False)
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**dec, intermediate_size=32,
                                                      num_local_experts=4, num_experts_per_tok=2))
    if name == "deepseek_v3":  # layer 0 dense; multi-head latent attention, a shared expert
        return tf.DeepseekV3ForCausalLM(tf.DeepseekV3Config(
            **{**dec, "num_key_value_heads": 4}, intermediate_size=64, moe_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
            topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8))
    if name == "gpt_oss":  # biased experts, sliding-window attention
        return tf.GptOssForCausalLM(tf.GptOssConfig(
            **dec, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            sliding_window=4))
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        **dec, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        experts_implementation="batched_mm")).double()


def _loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y.flatten())


def _groups(rank: int, lists: list[list[int]]) -> Any:
    import torch.distributed as dist

    mine = None
    for ranks in lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def _spread(ctx: pt.RankContext, cases: Sequence[tuple[str, str, bool]]) -> list[str]:
    """Every case's loss and gradients against one device's (the expert gradients hold the
    sum of both data-parallel ranks' tokens; the others are averaged here)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from pipetrain.hf.expert_parallel import TracedExpertParallel
    from pipetrain.parallel.parallelize import Composed
    from pipetrain.parallel.sharded import ShardedStages

    ops = _watch_all_to_all()
    r = ctx.rank  # pipeline rank r // 2, data-parallel rank r % 2
    pp_group = _groups(r, [[0, 2], [1, 3]])
    ep_group = _groups(r, [[0, 1], [2, 3]])
    alone = DeviceMesh.from_group(_groups(r, [[i] for i in range(4)]), "cpu")
    ep_mesh = DeviceMesh.from_group(ep_group, "cpu")
    ids = torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    mine = slice(4 * (r % 2), 4 * (r % 2) + 4)
    problems = []
    for name, schedule, fsdp in cases:
        model = _model(name)
        ref = copy.deepcopy(model)
        want = reference_step(ref, {"input_ids": x}, y, _loss, MICROBATCHES)
        spread = TracedExpertParallel(model, ep_mesh, alone)
        sharded = ShardedStages(ep_mesh) if fsdp else None
        if sharded is not None:
            sharded.ignored = spread.params
        case = f"{name} {schedule}" + (" fsdp" if fsdp else "")
        pipe = pt.Pipeline(copy.deepcopy(model), schedule, MICROBATCHES // 2, _loss,
                           split_points=["model.layers.1", "model.layers.2", "model.layers.3"]
                           if schedule == "zbv" else ["model.layers.2"],
                           example_inputs={"input_ids": x[:2]}, group=pp_group, timeout=60,
                           dynamic=name == "mixtral",  # the others as pipetrain train --ep
                           # captures: at fixed shapes
                           parallelize=Composed(spread, sharded) if sharded else spread)
        ops.clear()
        ops.append(pipe.engine.executor)
        got = pipe.step({"input_ids": x[mine]}, y[mine],
                        on_grads_ready=sharded.reduce if sharded else None)
        backward = {"I" if s else "W" for s, _ in ops[1:]} if schedule.startswith("zb") else {"B"}
        if {k for _, k in ops[1:]} != {"F"} | backward:  # stage 0 has no input gradient
            problems.append(f"{case}: the all-to-alls ran in {sorted(set(ops[1:]))}")
        if sharded is not None:
            sharded.finish()
        loss = torch.tensor(float(got.loss if got.loss is not None else "nan"))
        dist.all_reduce(loss, group=ep_group)
        if abs(float(loss) / 2 - float(want)) > 1e-5:
            problems.append(f"{case}: loss {float(loss) / 2} != {float(want)}")
        experts = {id(p) for p in spread.params}
        held = {n.partition(".experts.")[0] for n, _ in pipe.named_parameters()
                if ".experts." in n}  # this rank's MoE layers
        if spread.replaced != len(held) or not held:
            problems.append(f"{case}: {spread.replaced} experts calls replaced, {held} held")
        for n, p in pipe.named_parameters():
            grad = p.grad
            if id(p) in experts:
                if p.to_local().shape[0] * 2 != p.shape[0]:
                    problems.append(f"{case}: {n} holds {p.to_local().shape[0]} experts")
                grad = grad.full_tensor() / 2
            elif isinstance(grad, DTensor):  # FSDP2: the mean over the data-parallel ranks
                grad = grad.full_tensor()
            else:
                grad = grad.clone()
                dist.all_reduce(grad, group=ep_group)
                grad /= 2
            ref_grad = ref.get_parameter(n).grad
            scale = max(float(ref_grad.abs().max()), 1e-3)
            if not (grad - ref_grad).abs().max() <= 1e-5 * scale:
                problems.append(f"{case}: {n}'s gradient differs by "
                                f"{float((grad - ref_grad).abs().max()):.3g}")
    return problems


def _watch_all_to_all() -> list[Any]:
    """Record the stage and kind of action (F, B, I, W) running each all-to-all of the
    experts, its backward too: ``ops[0]`` is the executor to ask, the records follow."""
    import transformers.distributed.expert_parallel as ep

    ops: list[Any] = []
    exchange = ep.all_to_all_single_autograd

    def kind(*_: Any) -> None:
        action = ops[0].current[1]
        ops.append((action.stage, action.op.name))

    def watched(*args: Any, **kwargs: Any) -> torch.Tensor:
        kind()
        out = exchange(*args, **kwargs)
        out.grad_fn.register_prehook(kind)
        return out
    ep.all_to_all_single_autograd = watched
    return ops


def test_pp2_by_ep2_gives_one_devices_loss_and_gradients() -> None:
    results = pt.launch(_spread, 4, IN_CI, timeout=300)
    assert [p for r in results for p in r] == []


@pytest.mark.long  # beside test_pp2_by_ep2_gives_one_devices_loss_and_gradients
def test_pp2_by_ep2_gives_one_devices_loss_and_gradients_on_every_family() -> None:
    results = pt.launch(_spread, 4, CASES[len(IN_CI):], timeout=300)
    assert [p for r in results for p in r] == []


# ------------------------------------------------------------------ pipetrain train --ep

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks"
LR = 1e-3  # benchmarks/moe.py's


def _bench() -> Any:
    """``benchmarks/moe.py`` as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_bench", BENCHMARK / "moe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(root: Path, bench: Any, layout: str, *extra: str, steps: int = 2) -> dict[str, Any]:
    """``benchmarks/moe.py --tiny``'s run of ``layout`` (``pp2 x dp2`` or ``pp2 x ep2``), as
    ``pipetrain train`` in this session (its all-to-alls not timed): a stored Mixtral whose
    experts hold 90% of its weights (8 experts of 256 units on a width of 128, saved by
    transformers with each expert's matrices apart), ``steps`` steps of 1F1B, 2 micro-batches,
    on 4 processes (``extra`` flags after the benchmark's win: a run that resumes the
    layout's). Its summary and step records; every rank read the stored weights."""
    from pipetrain.cli import main

    argv = bench.train_args(root, bench.SIZES["tiny"], layout)
    argv[argv.index("--steps") + 1] = str(steps)
    with pytest.MonkeyPatch.context() as env:
        for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
            env.delenv(key)
        assert main([*argv, *extra]) == 0
    out = Path(argv[argv.index("--out") + 1])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    start = next(s for s in records if s["kind"] == "start")
    assert [r["weights"] for r in start["load"]] == ["stored"] * 4
    summary = json.loads((out / "summary.json").read_text())
    return {**summary, "records": [s for s in records if s["kind"] == "step"]}


# in CI: ep's gradients: test_pp2_by_ep2_gives_one_devices_loss_and_gradients
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_train_ep2_equals_dp2_in_less_memory(tmp_path: Path) -> None:
    """``--dp 2 --ep 2`` against ``--dp 2`` on a pipeline of 2 (1F1B): per step the same
    loss and gradient norm (1e-5) and the same tokens per expert; each rank's measured peak of
    tensor bytes at most 0.6 of the data-parallel run's, a saving the planner predicts per
    pipeline rank within 20%; the ep run's checkpoint resumed at ``--fsdp 2 --ep 2`` under
    interleaved 1F1B gives the uninterrupted ``--dp 2`` run's third step, and ``OUT/hf`` its
    weights (to 2% of the learning rate, the most one step moves a weight: Adam divides a
    gradient by its own size, so rounding in tiny ones shows). The runs are
    ``benchmarks/moe.py --tiny``'s, whose figures it reads from them."""
    bench = _bench()
    bench.save_model(tmp_path, bench.SIZES["tiny"])
    dp = _train(tmp_path, bench, "pp2 x dp2", steps=3)
    ep = _train(tmp_path, bench, "pp2 x ep2")
    assert ep["layout"]["ep"] == 2 and "ep" not in dp["layout"]
    for a, b in zip(dp["records"][:2], ep["records"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
        assert a["experts"] == b["experts"]  # counted in the graph, and by the experts module
        assert a["experts"]["tokens_mean"] == 8 * 32 * 2 / 8  # (token, expert) pairs per expert
    ratios = [e / d for e, d in zip(ep["peak_memory_bytes"], dp["peak_memory_bytes"],
                                    strict=True)]
    assert max(ratios) <= 0.6, ratios
    assert ep["experts"]["imbalance"] >= 1.0 and "step" in ep["experts"]
    predicted = _planned_saving(tmp_path, ep["layout"]["balance"])
    for pp_rank, saved in enumerate(predicted):
        measured = [d - e for d, e in zip(dp["peak_memory_bytes"][2 * pp_rank:][:2],
                                          ep["peak_memory_bytes"][2 * pp_rank:][:2],
                                          strict=True)]
        assert all(abs(saved - m) <= 0.2 * m for m in measured), (predicted, measured)
    # the ep run's checkpoint, resumed under FSDP2 on the other weights (2 stages per rank,
    # interleaved 1F1B): its third step is the uninterrupted --dp 2 run's
    again = _train(tmp_path, bench, "pp2 x ep2", "--dp", "1", "--fsdp", "2", "--schedule",
                   "interleaved-1f1b", steps=3)
    assert again["layout"]["fsdp"] == 2 and again["layout"]["stages_per_rank"] == 2
    a, b = dp["records"][2], again["records"][-1]
    assert b["step"] == 2 and len(again["records"]) == 3  # resumed, not run again
    assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
    want = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pp2_dp2" / "hf").state_dict()
    got = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pp2_ep2" / "hf").state_dict()
    assert want.keys() == got.keys()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 0.02 * LR
    runs = {name: bench.figures(tmp_path / bench._dirname(name), 8 * 32, timed=False)
            for name in bench.LAYOUTS}  # the benchmark reads these runs' figures
    assert all(r["steps_timed"] == 2 and r["tokens_per_s"] > 0 for r in runs.values())


def _planned_saving(root: Path, balance: list[int]) -> list[int]:
    """The planner's predicted peak bytes per pipeline rank of the trained layout (1F1B, 2
    micro-batches of 2 rows, ``balance``) at ``ep`` 1 minus at ``ep`` 2, from its own profile
    of the model (``pipetrain plan``'s, uncalibrated)."""
    from pipetrain.plan.planner import Scale, evaluate
    from pipetrain.plan.shardcost import Sharding
    from pipetrain.plan.unit_profile import model_units, profile_model
    from pipetrain.schedules.generators import make_schedule
    from pipetrain.train.config import TrainConfig

    cfg = TrainConfig(hf=str(root / "moe"), seq_len=32, batch_size=8, microbatches=2)
    prof = profile_model(cfg, model_units(cfg, 2), 1, [2])[0]
    schedule = make_schedule("1f1b", 2, 2)
    peaks = [evaluate(prof, schedule, balance, "never", float("inf"), Scale(),
                      Sharding(dp=2, ep=ep)).predicted_peak_bytes for ep in (1, 2)]
    return [d - e for d, e in zip(*peaks, strict=True)]
