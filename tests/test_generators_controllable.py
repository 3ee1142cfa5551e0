"""Controllable-memory V generators (v-half, v-min): validity, published memory, bubble, errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import needs
from pipetrain.schedules.generators.controllable import (
    _block_order,
    _v_half_block,
    _v_min_block,
    v_half,
    v_min,
)
from pipetrain.schedules.generators.vshape import zbv
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, Simulation, simulate
from pipetrain.schedules.validate import validate
from test_generators_v import _check_valid as check_v_valid

Build = Callable[[int, int, int], Schedule]
BUILDS: dict[str, Build] = {"v-half": v_half, "v-min": v_min}
UNIT = Costs(F=1, I=1, W=1)
W_SHARES = (0.0, 0.5, 1.0)


def _m_grid(p: int) -> list[int]:
    return sorted({1, 2, 3, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2} - {0})


def _cap(name: str, p: int) -> int:
    # Published activation memory in micro-batches of a rank's share, times 2 stages per rank.
    return 2 * ((p + 2) // 2) if name == "v-half" else 2 * ((p + 4) // 3)


def _bubble(name: str, p: int) -> int:
    """Measured idle on the longest rank (span - 6m) at F = I = W = 1, comm 0, m large enough."""
    if p == 1:
        return 0
    if name == "v-half":
        return 1 if p == 2 else (3 * p - 4 if p % 2 else 3 * p - 7)
    return 4 * p - 5 if p % 3 == 1 else 4 * p - 7


def _m_steady(name: str, p: int) -> int:
    """The smallest m from which the bubble is exactly ``_bubble``."""
    return (p + 3) // 2 if name == "v-half" else (p + 7) // 3


def _idle(sim: Simulation) -> float:
    return max(sim.span) - 6 * sim.schedule.n_microbatches


# -- validity ------------------------------------------------------------------------------


def _check_valid(s: Schedule, p: int, m: int) -> None:
    validate(s)
    check_v_valid(s, p, m)  # V placement, every op once per (stage, mb), each op in mb order
    assert {a.op for acts in s.actions for a in acts} == {Op.F, Op.I, Op.W}  # split only


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("p", range(1, 9))
def test_valid_over_grid(name: str, p: int) -> None:
    for m in _m_grid(p):
        _check_valid(BUILDS[name](p, m, 2), p, m)


@pytest.mark.parametrize("name", BUILDS)
def test_registered_with_v_placement_and_round_trip(name: str) -> None:
    s = make_schedule(name, 4, 8)
    assert s.name == name and s.n_stages == 8
    assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    assert s.split_backward
    back = Schedule.from_text(s.to_text())
    assert back == s


def test_small_cases_by_hand() -> None:
    assert [" ".join(map(str, acts)) for acts in v_half(2, 3).actions] == [
        "0F0 0F1 3F0 3I0 3F1 3W0 0F2 0I0 3I1 0W0 3F2 3W1 0I1 3I2 0W1 3W2 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 1I0 2W0 1F2 1W0 2F2 2I1 1I1 2W1 1W1 2I2 1I2 2W2 1W2",
    ]
    assert [" ".join(map(str, acts)) for acts in v_min(2, 3).actions] == [
        "0F0 0F1 3F0 3I0 3W0 3F1 0I0 3I1 0F2 0W0 0I1 3W1 3F2 3I2 0W1 3W2 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 1I0 2W0 1W0 2I1 1I1 1F2 2F2 2W1 1W1 2I2 1I2 2W2 1W2",
    ]


@pytest.mark.parametrize("name, block", [("v-half", _v_half_block), ("v-min", _v_min_block)])
def test_building_block_repeats_without_collisions(
        name: str, block: Callable[[int, int], tuple[tuple[Action, int], ...]]) -> None:
    # What the squeeze's no-deadlock argument rests on: the four passes of a rank sit on four
    # residues mod 6, every input comes from a strictly earlier slot, and the block order with
    # each W right after its I never needs more than the memory cap.
    for p in range(1, 33):
        slot = {(a.stage, a.op): s for r in range(p) for a, s in block(p, r)}
        for r in range(p):
            assert len({s % 6 for a, s in block(p, r)}) == 4, (p, r)
        for (stage, op), s in slot.items():
            for kind, dep_stage, _ in needs(Action(stage, op, 0), 2 * p):
                dep_op = Op.F if kind == "F" else Op.I
                assert slot[dep_stage, dep_op] < s, (p, stage, op)
        for r in range(p):
            alive = peak = 0
            for a in _block_order(block, p, r, 3 * p):
                alive += 1 if a.op is Op.F else -1
                peak = max(peak, alive)
            assert peak <= _cap(name, p), (p, r)


# -- published memory: (p+2)//2 and (p+4)//3 micro-batches of a rank's share ---------------


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("p", range(1, 11))
def test_peak_is_the_published_memory(name: str, p: int) -> None:
    cap = _cap(name, p)
    for m in (p, 2 * p, 2 * p + 1, 3 * p, 4 * p):
        peaks = simulate(BUILDS[name](p, m, 2), UNIT).peak_activations  # w_share = 1.0
        assert max(peaks) == cap, (m, peaks)


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("w_share", W_SHARES)
def test_peak_never_above_published_memory(name: str, w_share: float) -> None:
    for p in range(1, 9):
        for m in _m_grid(p):
            sim = simulate(BUILDS[name](p, m, 2), UNIT, w_share=w_share)
            assert max(sim.peak_activations) <= _cap(name, p), (p, m)


def test_published_memory_table() -> None:
    # Stage-activation units per rank; 1F1B and ZB-V hold 2p.
    table = {4: (6, 4), 6: (8, 6), 8: (10, 8), 12: (14, 10), 16: (18, 12)}
    for p, (half, vmin) in table.items():
        assert max(simulate(v_half(p, 2 * p), UNIT).peak_activations) == half
        assert max(simulate(v_min(p, 2 * p), UNIT).peak_activations) == vmin


# -- bubble: half and two thirds of 1F1B's ------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("p", range(1, 11))
def test_bubble_exact(name: str, p: int) -> None:
    m0 = _m_steady(name, p)
    for m in sorted({m0, m0 + 1, p + 1, 2 * p, 3 * p + 1, 4 * p}):
        sim = simulate(BUILDS[name](p, m, 2), UNIT)
        assert _idle(sim) == _bubble(name, p), m


def test_bubble_table() -> None:
    # Idle units on the longest rank at F = I = W = 1; 1F1B on the same work idles 6(p-1).
    table = {4: (5, 11, 18), 6: (11, 17, 30), 8: (17, 25, 42), 9: (23, 29, 48)}
    for p, (half, vmin, one_f_one_b) in table.items():
        for m in (2 * p, 4 * p):
            assert _idle(simulate(v_half(p, m), UNIT)) == half
            assert _idle(simulate(v_min(p, m), UNIT)) == vmin
            base = simulate(make_schedule("1f1b", p, m), Costs(F=2, B=4))  # 6 units per mb
            assert _idle(base) == one_f_one_b == 6 * (p - 1)


@pytest.mark.parametrize("p", range(3, 13))
def test_bubble_ratio_to_1f1b(p: int) -> None:
    one_f_one_b = 6 * (p - 1)
    # V-Half: 3(p-1) - 1 for odd p, 3(p-1) - 4 for even p.
    assert one_f_one_b // 2 - _bubble("v-half", p) == (1 if p % 2 else 4)
    # V-Min: 4(p-1) - 1 when p = 3k+1, else 4(p-1) - 3.
    assert 2 * one_f_one_b // 3 - _bubble("v-min", p) == (1 if p % 3 == 1 else 3)


@pytest.mark.parametrize("p", [4, 8])
def test_v_half_beats_1f1b_when_i_costs_twice_f(p: int) -> None:
    # Built at F = I = W, the order stays on the building block in the steady state, so it
    # still beats 1F1B (same work per rank: F = 2, B = 6) when I = 2F = 2W.
    m = 4 * p
    half = simulate(v_half(p, m), Costs(F=1, I=2, W=1))
    base = simulate(make_schedule("1f1b", p, m), Costs(F=2, B=6))
    assert max(half.peak_activations) == _cap("v-half", p)
    assert half.bubble_rate < base.bubble_rate


# -- against ZB-V: less memory, more bubble -------------------------------------------------


@pytest.mark.parametrize("p", range(2, 9))
def test_less_memory_more_bubble_than_zbv(p: int) -> None:
    for m in (2 * p, 3 * p + 1):
        z = simulate(zbv(p, m, 2), UNIT)
        h, n = simulate(v_half(p, m), UNIT), simulate(v_min(p, m), UNIT)
        assert _idle(z) == 0 < _idle(h) <= _idle(n)
        assert max(n.peak_activations) <= max(h.peak_activations) <= max(z.peak_activations)
        if p >= 3:  # for p <= 2 all three hold 2p
            assert max(h.peak_activations) < max(z.peak_activations) == 2 * p
        if p == 4 or p >= 6:  # at p = 3 both memory and bubble tie; at p = 5 memory ties
            assert max(n.peak_activations) < max(h.peak_activations)
            assert _idle(h) < _idle(n)


# -- constraint errors ---------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("v", [1, 3, 4])
def test_rejects_other_stages_per_rank(name: str, v: int) -> None:
    with pytest.raises(ValueError, match=rf"{name} places two stages per rank as a V "
                                         rf"\(stages_per_rank=2\), got stages_per_rank={v}"):
        BUILDS[name](4, 8, v)
    with pytest.raises(ValueError, match=f"{name} places two stages per rank"):
        make_schedule(name, 4, 8, stages_per_rank=v)


@pytest.mark.parametrize("name", BUILDS)
def test_rejects_empty_counts(name: str) -> None:
    with pytest.raises(ValueError, match="at least 1 rank and 1 micro-batch, got n_ranks=0"):
        BUILDS[name](0, 4, 2)
    with pytest.raises(ValueError, match="n_ranks=-1"):
        BUILDS[name](-1, 4, 2)
    with pytest.raises(ValueError, match="n_microbatches=0"):
        BUILDS[name](2, 0, 2)
    with pytest.raises(ValueError, match="n_microbatches must be a positive integer"):
        make_schedule(name, 2, 0)
