"""Shard cost: the sharded state's bytes, the gathered weights, and the collectives' seconds of
dp, FSDP, tensor and expert parallel; and the share of a layer one tensor-parallel rank
computes."""

from __future__ import annotations

import pytest
import torch

from pipetrain.models.gpt import PRESETS, gpt_layers
from pipetrain.parallel.sharded import unit_bytes
from pipetrain.parallel.tensor_parallel import gpt_plan, local_layer, traffic
from pipetrain.plan.shardcost import (
    Collectives,
    LayerComm,
    Sharding,
    action_seconds,
    gathered_bytes,
    reduction_seconds,
    state_bytes,
    step_temporaries,
)
from pipetrain.split.profile import LayerCost

MIB = 2**20
LAYER = LayerCost(1e-3, 1e-3, 1e-3, param_bytes=12 * MIB, activation_bytes=MIB,
                  frozen_bytes=0, largest_grad_bytes=4 * MIB)
COMM = LayerComm(units=(3 * MIB, MIB, 4 * MIB, 4 * MIB, 0), tp_f=(MIB, MIB), tp_i=(MIB, MIB))
FLAT = Collectives({f"{k}/2": (1e-3, 1e-9) for k in ("all_reduce", "all_gather",
                                                      "reduce_scatter")})


def test_without_fsdp_the_state_is_four_times_the_trainable_bytes_plus_the_frozen() -> None:
    frozen = LayerCost(0, 0, 0, param_bytes=3 * MIB, activation_bytes=0, frozen_bytes=MIB)
    assert state_bytes([LAYER, frozen], [COMM, COMM], Sharding(dp=2)) == 4 * 14 * MIB + MIB


@pytest.mark.parametrize(("reshard", "gathered"), [("step", 24), ("layer", 12), ("part", 4)])
def test_fsdp_shards_weights_and_moments_keeps_whole_gradients_and_gathers_by_reshard(
        reshard: str, gathered: int) -> None:
    two = [LAYER, LAYER]
    assert gathered_bytes(two, [COMM, COMM], reshard) == gathered * MIB
    # 24 MiB trainable: 3 x 24 / 2 of shards, 24 of whole gradients, and what is gathered
    assert state_bytes(two, [COMM, COMM], Sharding(fsdp=2, reshard=reshard)) == \
        (36 + 24 + gathered) * MIB
    assert step_temporaries(two, Sharding(fsdp=2), foreach=False) == 4 * MIB  # 2 x 4 / 2
    assert step_temporaries(two, Sharding(fsdp=2), foreach=True) == 12 * MIB


def test_each_op_pays_its_collectives() -> None:
    ar = FLAT.seconds("all_reduce", 2, MIB)
    ag = [FLAT.seconds("all_gather", 2, u) for u in COMM.units if u]
    tp = Sharding(tp=2)
    assert action_seconds("F", [COMM], tp, FLAT) == pytest.approx(2 * ar)
    assert action_seconds("I", [COMM], tp, FLAT) == pytest.approx(2 * ar)
    assert action_seconds("W", [COMM], tp, FLAT) == 0.0
    assert action_seconds("F", [COMM], tp, FLAT, tp_scale=3.0) == pytest.approx(6 * ar)
    part, layer = Sharding(fsdp=2, reshard="part"), Sharding(fsdp=2, reshard="layer")
    for op in "FIWB":  # every action gathers what it computes
        assert action_seconds(op, [COMM], part, FLAT) == pytest.approx(sum(ag))
        assert action_seconds(op, [COMM], layer, FLAT) == pytest.approx(
            FLAT.seconds("all_gather", 2, 12 * MIB))
    assert action_seconds("F", [COMM], Sharding(fsdp=2, reshard="step"), FLAT) == 0.0


def test_the_step_reduces_over_dp_or_reduce_scatters_over_fsdp() -> None:
    assert reduction_seconds([LAYER], [COMM], Sharding(), FLAT) == 0.0
    assert reduction_seconds([LAYER], [COMM], Sharding(dp=2), FLAT) == pytest.approx(
        FLAT.seconds("all_reduce", 2, 12 * MIB))
    rs = sum(FLAT.seconds("reduce_scatter", 2, u) for u in COMM.units if u)
    assert reduction_seconds([LAYER], [COMM], Sharding(fsdp=2), FLAT) == pytest.approx(rs)
    hsdp = reduction_seconds([LAYER], [COMM], Sharding(dp=2, fsdp=2), FLAT)
    assert hsdp == pytest.approx(rs + sum(FLAT.seconds("all_reduce", 2, u / 2)
                                          for u in COMM.units if u))
    # reshard "step": one unit per layer, gathered once a step
    step = reduction_seconds([LAYER], [COMM], Sharding(fsdp=2, reshard="step"), FLAT)
    assert step == pytest.approx(FLAT.seconds("reduce_scatter", 2, 12 * MIB)
                                 + FLAT.seconds("all_gather", 2, 12 * MIB))


def test_collectives_fall_back_to_the_default_and_cost_nothing_alone() -> None:
    guess = Collectives.default()
    assert guess.seconds("all_reduce", 1, MIB) == 0.0 and guess.seconds("all_gather", 4, 0) == 0
    # a ring all-reduce moves twice an all-gather's bytes
    assert guess.seconds("all_reduce", 2, 1e9) > 1.9 * guess.seconds("all_gather", 2, 1e9) > 0
    assert FLAT.seconds("all_gather", 2, 1e6) == pytest.approx(2e-3)
    assert FLAT.seconds("all_gather", 4, 1e6) == guess.seconds("all_gather", 4, 1e6)


def test_sharding_names_itself() -> None:
    assert Sharding().label() == "-" and Sharding(dp=2).label() == "dp2"
    assert Sharding(dp=2, fsdp=2, reshard="layer").label() == "dp2 fsdp2 layer"
    assert Sharding(tp=2).replicas == 2 and Sharding(tp=2).data == 1
    assert Sharding(dp=2, fsdp=2).to_dict() == {"dp": 2, "fsdp": 2, "tp": 1,
                                                "fsdp_reshard": "part", "ep": 1}


def test_a_tensor_parallel_rank_computes_its_share_of_a_gpt_block() -> None:
    torch.manual_seed(0)
    embedding, block, *_ = gpt_layers(PRESETS["tiny"])
    plan = gpt_plan(False)
    local = local_layer(block, plan, 2)
    d = 64
    assert local is not block and local_layer(embedding, plan, 2) is embedding
    assert tuple(local.attn.qkv.weight.shape) == (3 * d // 2, d)
    assert tuple(local.attn.proj.weight.shape) == (d, d // 2)
    assert tuple(local.mlp[0].weight.shape) == (2 * d, d)
    assert tuple(local.mlp[2].weight.shape) == (d, 2 * d)
    # each of q, k, v keeps its first half of the rows: this rank's heads
    q_rows = block.attn.qkv.weight[:d // 2]
    k_rows = block.attn.qkv.weight[d:d + d // 2]
    assert torch.equal(local.attn.qkv.weight[:d // 2], q_rows)
    assert torch.equal(local.attn.qkv.weight[d // 2:d], k_rows)
    x = torch.randn(2, 8, d)
    assert local(x).shape == x.shape
    f, i = traffic(local, plan, x)
    assert f == (2 * 8 * d * 4,) * 2 and i == (2 * 8 * d * 4,) * 2  # proj, mlp.2; qkv, mlp.0
    whole = sum(p.numel() for p in block.parameters()) * 4
    assert sum(unit_bytes(block)) == whole and len(unit_bytes(block)) == 5  # 4 matrices + rest
    halved = sum(unit_bytes(local))
    assert whole / 2 < halved < whole * 0.55  # the norms and row-wise biases stay whole


def test_a_split_that_does_not_divide_is_refused() -> None:
    _, block, *_ = gpt_layers(PRESETS["tiny"])
    with pytest.raises(ValueError, match="does not split into 3 x 5"):
        local_layer(block, gpt_plan(False), 5)


# ------------------------------------------------------------------ expert parallel

MOE = LayerComm(units=(12 * MIB,), experts=8 * MIB, a2a=MIB)
A2A = Collectives({"all_to_all/2": (1e-3, 1e-9), "all_reduce/2": (1e-3, 1e-9)})


def test_expert_parallel_spreads_the_experts_state_and_nothing_else() -> None:
    dense = 4 * 4 * MIB  # weights, gradients and AdamW's two moments of the 4 MiB not experts
    assert state_bytes([LAYER], [MOE], Sharding(dp=2)) == dense + 4 * 8 * MIB
    assert state_bytes([LAYER], [MOE], Sharding(dp=2, ep=2)) == dense + 4 * 4 * MIB
    # FSDP shards the rest; the experts are spread over ep, not sharded again
    sharded = state_bytes([LAYER], [MOE], Sharding(fsdp=2, ep=2, reshard="layer"))
    assert sharded == 3 * 4 * MIB / 2 + 4 * MIB + 12 * MIB + 4 * 8 * MIB / 2
    # AdamW's temporaries: the largest gradient, an expert matrix, spread too
    assert step_temporaries([LAYER], Sharding(dp=2, ep=2), False, [MOE]) == 2 * 2 * MIB


def test_expert_parallel_pays_two_all_to_alls_per_moe_layer_in_f_i_and_b_only() -> None:
    one = 1e-3 + MIB * 1e-9
    for op in "FIB":
        assert action_seconds(op, [MOE, COMM], Sharding(dp=2, ep=2), A2A) == \
            pytest.approx(2 * one)
    assert action_seconds("W", [MOE], Sharding(dp=2, ep=2), A2A) == 0
    assert action_seconds("F", [MOE], Sharding(dp=2), A2A) == 0  # no ep: no all-to-all


def test_experts_gradients_reduce_over_the_ranks_holding_the_same_experts() -> None:
    # dp 2 = ep 2: each expert is held once, only the 4 MiB of other weights are all-reduced
    spread = reduction_seconds([LAYER], [MOE], Sharding(dp=2, ep=2), A2A)
    assert spread == pytest.approx(1e-3 + 4 * MIB * 1e-9)
    assert reduction_seconds([LAYER], [MOE], Sharding(dp=2), A2A) == \
        pytest.approx(1e-3 + 12 * MIB * 1e-9)
    assert Sharding(dp=2, ep=2).label() == "dp2 ep2"
