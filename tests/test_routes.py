"""Routes: values go from their producer straight to the stages using them; bitwise training."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import pipetrain as pt
from helpers.lm import lm_batch, lm_loss, skip_lm
from helpers.models import MULTI, SCHEDULES
from pipetrain.runtime.executor import message_plans
from pipetrain.runtime.transport.routes import Ports, direct, linear_routes
from pipetrain.runtime.transport.wire import ACT, GRAD
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.generators import make_schedule
from pipetrain.split.trace import split_model

POINTS4 = ["blocks.2", "blocks.4", "blocks.6"]  # SkipLM (8 blocks) in 4 stages


def _kwargs(n: int = 4) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids, mask, targets = lm_batch(n)
    return {"input_ids": ids, "attention_mask": mask}, targets


# -- derivation -----------------------------------------------------------------------------
def test_chain_links_neighbours_with_whole_payloads() -> None:
    routes = linear_routes(3)
    assert not routes.keyed
    assert routes.ports[0] == Ports((), ((1, None),), ((1, None),), ())
    assert routes.ports[1] == Ports(((0, None),), ((2, None),), ((2, None),), ((0, None),))
    assert routes.ports[2] == Ports(((1, None),), (), (), ((1, None),))


def test_direct_sends_each_value_to_its_users_and_chains_its_gradient_back() -> None:
    made_in = {"a": 0, "b": 1, "c": 2, "inner": 3}
    used_in = {"a": (0, 1, 3, 5), "b": (2,), "c": (5,), "inner": (3,)}
    routes = direct(made_in, used_in, [0, 0, 1, 1, 2, 2], 3)  # parts 0-1, 2-3, 4-5 per stage
    assert routes.pairs() == {
        ("act", 0, 1): ("a", "b"), ("act", 0, 2): ("a",), ("act", 1, 2): ("c",),
        ("grad", 1, 0): ("a", "b"), ("grad", 2, 1): ("a", "c"),  # a: 2 -> 1 -> 0, not 2 -> 0
    }
    assert routes.ports[2].act_in == ((0, ("a",)), (1, ("c",)))
    assert routes.ports[0].grad_in == ((1, ("a", "b")),)


def test_a_traced_skip_skips_the_middle_stages() -> None:
    kwargs, _ = _kwargs()
    split = split_model(skip_lm(), POINTS4, kwargs)
    routes = split.routes([1, 1, 1, 1])
    pairs = routes.pairs()
    out = split.stages[0](split.pack(**kwargs))
    embedded = next(k for k, s in split.made_in.items() if s == 0 and split.used_in[k] == (
        0, 1, 2, 3) and isinstance(out[k], torch.Tensor) and out[k].is_floating_point())
    # ^ the value residual (the others: the mask, and sizes read from the input's shape)
    for dst in (1, 2, 3):
        assert embedded in (pairs[("act", 0, dst)] or ())
    assert all(embedded not in (pairs[("act", s, d)] or ()) for s, d in [(1, 2), (2, 3)])
    # relayed before: the chained payloads carry it through stages 1 and 2
    assert embedded in split.boundaries[1] and embedded in split.boundaries[2]
    # block 1's output (stage 0) reaches block 6 (stage 3) directly, and nothing else
    skip = next(k for k in (pairs[("act", 0, 3)] or ()) if split.used_in[k] == (0, 3)
                and isinstance(out[k], torch.Tensor))
    assert [p for p, keys in pairs.items() if skip in (keys or ())] == [
        ("act", 0, 3), ("grad", 3, 0)]
    assert ("grad", 3, 1) not in pairs and ("grad", 2, 0) not in pairs


def test_grouped_units_route_between_groups_only() -> None:
    kwargs, _ = _kwargs()
    split = split_model(skip_lm(), ["blocks.0", "blocks.2", "blocks.4", "blocks.6"], kwargs)
    grouped = split.routes([2, 1, 2])  # units 0-1 | 2 | 3-4
    assert {(s, d) for kind, s, d in grouped.pairs() if kind == "act"} == {
        (0, 1), (0, 2), (1, 2)}


# -- dataflow and plans -----------------------------------------------------------------------
@pytest.mark.parametrize("name", SCHEDULES)
def test_the_chain_orders_every_route(name: str) -> None:
    """Routes add waits between any two stages; the chain every schedule obeys implies them."""
    for n_ranks in (2, 4):
        schedule = make_schedule(name, n_ranks, 8)
        n = schedule.n_stages
        done = {}
        for t, (rank, i) in enumerate(walk(schedule).order):
            a = schedule.actions[rank][i]
            done[(a.op.value if a.op.value != "I" else "B", a.stage, a.mb)] = t
        for mb in range(8):
            for src in range(n):
                for dst in range(src + 1, n):
                    assert done[("F", src, mb)] < done[("F", dst, mb)]
                    assert done[("B", dst, mb)] < done[("B", src, mb)]


def test_plans_list_the_direct_messages() -> None:
    kwargs, _ = _kwargs()
    routes = split_model(skip_lm(), POINTS4, kwargs).routes([1, 1, 1, 1])
    schedule = make_schedule("1f1b", 4, 4)
    received = {rank: Counter((kind, s, d) for plan in message_plans(
        schedule, rank, True, routes).values() for kind, _, s, d in plan) for rank in range(4)}
    assert received[3] == {(ACT, 0, 3): 4, (ACT, 2, 3): 4}  # stage 0 sends rank 3 directly
    assert received[0] == {(GRAD, 1, 0): 4, (GRAD, 3, 0): 4}
    chained = Counter((kind, s, d) for plan in message_plans(schedule, 3).values()
                      for kind, _, s, d in plan)
    assert chained == {(ACT, 2, 3): 4}


# -- the real Pipeline, local mode ------------------------------------------------------------
def _reference(kwargs: dict[str, torch.Tensor], targets: torch.Tensor, m: int
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ref = skip_lm()
    total = torch.zeros(())
    for i in range(m):
        part = {k: v.tensor_split(m)[i] for k, v in kwargs.items()}
        rows = targets.tensor_split(m)[i]
        loss = lm_loss(ref(**part), rows) * (len(rows) / len(targets))
        loss.backward()  # type: ignore[no-untyped-call]
        total = total + loss.detach()
    return total, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _check(pipe: pt.Pipeline, kwargs: dict[str, Any], targets: torch.Tensor) -> None:
    got = pipe.step(pipe.pack(**kwargs), targets)
    want, grads = _reference(kwargs, targets, pipe.schedule.n_microbatches)
    assert got.loss is not None and torch.equal(got.loss, want)
    mine = {n: p.grad for n, p in pipe.named_parameters()}
    assert sorted(mine) == sorted(grads)
    # the tied weight's two contributions per micro-batch are summed in another order
    torch.testing.assert_close(mine.pop("embed.weight"), grads["embed.weight"])
    assert [n for n, g in mine.items() if g is None or not torch.equal(g, grads[n])] == []


@pytest.mark.parametrize("name", SCHEDULES)
def test_skip_lm_trains_bitwise_like_one_device(name: str) -> None:
    kwargs, targets = _kwargs()
    points = POINTS4 if name in MULTI else ["blocks.3"]
    pipe = pt.Pipeline(skip_lm(), name, 4, lm_loss, local_ranks=2, split_points=points,
                       example_inputs=kwargs)
    assert pipe.routes.keyed
    _check(pipe, kwargs, targets)


@pytest.mark.parametrize("name,recompute", [("1f1b", "always"), ("zbv", "except_last")])
def test_auto_split_groups_units_and_recomputes_bitwise(name: str, recompute: str) -> None:
    kwargs, targets = _kwargs()
    pipe = pt.Pipeline(skip_lm(), name, 2, lm_loss, local_ranks=2, split_points="auto",
                       example_inputs=kwargs, recompute=recompute)
    assert any(n > 1 for n in pipe.balance)  # several traced units in one stage
    _check(pipe, kwargs, targets)


def test_the_middle_stage_never_receives_the_skip() -> None:
    kwargs, targets = _kwargs()
    pipe = pt.Pipeline(skip_lm(), "1f1b", 2, lm_loss, local_ranks=4, split_points=POINTS4,
                       example_inputs=kwargs)
    seen: dict[int, set[str]] = {}
    for s, stage in pipe.stages.items():
        first = stage.module[0]
        first.register_forward_pre_hook(
            lambda _, args, s=s: seen.setdefault(s, set()).update(args[0]))
    _check(pipe, kwargs, targets)
    pairs = pipe.routes.pairs()
    skips = set(pairs[("act", 0, 3)] or ()) - set(pairs[("act", 0, 1)] or ()) - set(
        pairs[("act", 0, 2)] or ())  # block 1's output, used by block 6
    assert skips and not skips & (seen[1] | seen[2])
    assert skips <= seen[3]
