"""Rank placement without processes: both mesh orders' formulas, every rank's coordinates and
the pp, dp, fsdp and tp groups at several layouts, the refusals, and the printed rank map."""

from __future__ import annotations

import itertools

import pytest

from pipetrain.train.checks import check_config
from pipetrain.train.config import TrainConfig
from pipetrain.train.logs.report import describe_layout
from pipetrain.train.placement import MESH_ORDERS, Coords, Placement, format_rank_map

LAYOUTS = [(2, 1, 1, 1), (2, 2, 1, 1), (2, 1, 8, 1), (2, 2, 4, 1), (4, 2, 1, 2),
           (2, 2, 2, 2), (3, 1, 2, 2), (1, 4, 1, 1), (4, 1, 1, 1), (2, 1, 1, 4)]
"""(pp, dp, fsdp, tp)."""


def _expected_rank(order: str, pp: int, dp: int, fsdp: int, tp: int, c: Coords) -> int:
    """The formulas as written in docs/cluster.md."""
    if order == "pp-outer":
        return ((c.pp * dp + c.replica) * fsdp + c.shard) * tp + c.tp
    return ((c.replica * fsdp + c.shard) * pp + c.pp) * tp + c.tp


def _every_coords(pp: int, dp: int, fsdp: int, tp: int) -> list[Coords]:
    return [Coords(*c) for c in itertools.product(range(pp), range(dp), range(fsdp), range(tp))]


@pytest.mark.parametrize("order", MESH_ORDERS)
@pytest.mark.parametrize(("pp", "dp", "fsdp", "tp"), LAYOUTS)
def test_every_rank_has_the_coordinates_of_the_formula(order: str, pp: int, dp: int,
                                                       fsdp: int, tp: int) -> None:
    place = Placement(pp, dp, fsdp, tp, order)
    at = {_expected_rank(order, pp, dp, fsdp, tp, c): c for c in _every_coords(pp, dp, fsdp, tp)}
    assert sorted(at) == list(range(pp * dp * fsdp * tp)) == list(range(place.world))
    for rank, c in at.items():
        assert place.coords(rank) == c
        assert place.rank(c.pp, c.replica, c.shard, c.tp) == rank


def _grouped(place: Placement, same: tuple[str, ...]) -> list[list[int]]:
    """The ranks that agree on the coordinates ``same``, found by brute force."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(place.world):
        c = place.coords(r)
        groups.setdefault(tuple(getattr(c, k) for k in same), []).append(r)
    return sorted(groups.values())


@pytest.mark.parametrize("order", MESH_ORDERS)
@pytest.mark.parametrize(("pp", "dp", "fsdp", "tp"), LAYOUTS)
def test_groups_are_the_ranks_that_share_the_other_coordinates(order: str, pp: int, dp: int,
                                                               fsdp: int, tp: int) -> None:
    place = Placement(pp, dp, fsdp, tp, order)
    pipelines = place.groups("pp")
    assert sorted(pipelines) == _grouped(place, ("replica", "shard", "tp"))
    for group in pipelines:  # a pipeline's ranks ascend with the pipeline rank (group rank)
        assert [place.coords(r).pp for r in group] == list(range(pp))
    data = place.groups("dp_replicate", "dp_shard")
    assert sorted(data) == _grouped(place, ("pp", "tp"))
    for group in data:  # group rank = replica * fsdp + shard: the rows each rank trains on
        assert [place.coords(r).replica * fsdp + place.coords(r).shard for r in group] == \
            list(range(dp * fsdp))
    assert sorted(place.groups("dp_shard")) == _grouped(place, ("pp", "replica", "tp"))
    assert sorted(place.groups("tp")) == _grouped(place, ("pp", "replica", "shard"))
    for group in place.groups("tp"):  # tp innermost in both orders: consecutive ranks
        assert group == list(range(group[0], group[0] + tp))


def test_pp_outer_keeps_the_shards_on_a_node_and_dp_outer_the_pipeline() -> None:
    """2 nodes x 8 ranks (node = rank // 8), the issue's --pp 2 --fsdp 8 and the old recipe's
    --dp 2 --fsdp 4 --pp 2."""
    def nodes(group: list[int]) -> set[int]:
        return {r // 8 for r in group}

    outer = Placement(pp=2, fsdp=8)
    assert outer.groups("dp_shard") == [list(range(8)), list(range(8, 16))]
    assert all(nodes(g) == {0, 1} for g in outer.groups("pp"))
    assert all(len(nodes(g)) == 1 for g in outer.groups("dp_shard"))
    old = Placement(pp=2, fsdp=8, order="dp-outer")  # the issue: shards span both nodes
    assert old.groups("pp")[0] == [0, 1] and old.groups("dp_shard")[0] == list(range(0, 16, 2))
    assert all(nodes(g) == {0, 1} for g in old.groups("dp_shard"))
    hsdp = Placement(pp=2, dp=2, fsdp=4)  # stage 0 on node 0, stage 1 on node 1
    assert all(nodes(g) == {0, 1} for g in hsdp.groups("pp"))
    assert all(len(nodes(g)) == 1 for g in hsdp.groups("dp_replicate", "dp_shard"))
    whole = Placement(pp=2, dp=2, fsdp=4, order="dp-outer")  # a replica per node
    assert all(len(nodes(g)) == 1 for g in whole.groups("pp"))
    assert all(nodes(g) == {0, 1} for g in whole.groups("dp_replicate"))


@pytest.mark.parametrize(("pp", "dp", "fsdp", "tp"), LAYOUTS)
def test_the_orders_differ_exactly_where_pipeline_and_data_both_exceed_one(
        pp: int, dp: int, fsdp: int, tp: int) -> None:
    a, b = (Placement(pp, dp, fsdp, tp, order) for order in MESH_ORDERS)
    same = all(a.coords(r) == b.coords(r) for r in range(a.world))
    assert same == (not a.matters) and a.matters == (pp > 1 and dp * fsdp > 1)


def test_refusals_say_what_to_pass() -> None:
    with pytest.raises(ValueError, match="pass --mesh-order pp-outer .* or dp-outer"):
        Placement(2, order="pp-inner")
    with pytest.raises(ValueError, match="must be >= 1"):
        Placement(0)
    with pytest.raises(ValueError, match="rank 4 is outside this mesh of 4 ranks"):
        Placement(2, 2).coords(4)
    with pytest.raises(ValueError, match="dp_shard coordinate 1 is outside 0..0"):
        Placement(2, 2).rank(0, 0, 1)
    with pytest.raises(ValueError, match=r"mesh order must be one of pp-outer, dp-outer"):
        check_config(TrainConfig(mesh_order="outer"), 2)


def _ranks(place: Placement, per_node: int, host: str = "h") -> list[dict[str, object]]:
    return [{"rank": r, "node": r // per_node, "host": f"{host}{r // per_node}",
             "local_rank": r % per_node, "pp": c.pp, "dp": c.replica, "shard": c.shard,
             "tp": c.tp} for r, c in ((r, place.coords(r)) for r in range(place.world))]


def test_the_rank_map_is_a_line_per_node() -> None:
    lines = format_rank_map(_ranks(Placement(pp=2, fsdp=2), 2), "pp-outer")
    assert lines == [
        "ranks by node (r global rank, L local rank, pp pipeline rank, s fsdp shard; "
        "--mesh-order pp-outer):",
        "  node 0 (h0): r0 L0 pp0 s0 | r1 L1 pp0 s1",
        "  node 1 (h1): r2 L0 pp1 s0 | r3 L1 pp1 s1"]
    every = format_rank_map(_ranks(Placement(pp=2, dp=2, fsdp=2, tp=2), 8))
    assert every[1].startswith("  node 0 (h0): r0 L0 pp0 dp0 s0 t0 | r1 L1 pp0 dp0 s0 t1 |")
    big = format_rank_map(_ranks(Placement(pp=4, fsdp=8), 16))  # 32 ranks: 2 lines + head
    assert len(big) == 3 and big[2].count("|") == 15 and format_rank_map([]) == []


def test_the_layout_names_the_order_where_it_matters() -> None:
    assert describe_layout({"world": 4, "dp": 1, "fsdp": 2, "pp": 2,
                            "mesh_order": "dp-outer"}) == "4 ranks (dp 1 x fsdp 2 x pp 2, dp-outer)"


def test_expert_parallel_layouts_are_checked_before_launch() -> None:
    with pytest.raises(ValueError, match=r"--ep 2 spreads .* the built-in GPT has none"):
        check_config(TrainConfig(ep=2, dp=2, batch_size=8, microbatches=2), 4)
    with pytest.raises(ValueError, match=r"--ep 3 must divide the 4 data-parallel ranks .* "
                                         r"give --ep a divisor of 4"):
        check_config(TrainConfig(hf="x", ep=3, dp=4, pp=1, batch_size=8, microbatches=2), 4)
    with pytest.raises(ValueError, match=r"--ep 4 and --fsdp 3: one must divide the other"):
        check_config(TrainConfig(hf="x", ep=4, fsdp=3, dp=4, pp=1, batch_size=24,
                                 microbatches=2), 12)
    with pytest.raises(ValueError, match=r"--ep with --tp is not supported yet"):
        check_config(TrainConfig(hf="x", ep=2, dp=2, tp=2, pp=1, batch_size=8,
                                 microbatches=2), 4)
