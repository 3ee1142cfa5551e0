"""V-shape generators (zbv, dualpipev): validity, published bubble and memory, errors."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.dataflow import needs, produces, walk
from pipetrain.schedules.generators.dualpipev import dualpipev
from pipetrain.schedules.generators.vshape import zbv
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import Costs, simulate
from pipetrain.schedules.validate import validate

W_SHARES = (0.0, 0.5, 1.0)
Duration = Callable[[int, Action], float]


def _costs(f: float = 1.0, i: float = 1.0, w: float = 1.0) -> dict[Op, float]:
    return {Op.F: f, Op.I: i, Op.W: w, Op.B: i + w}


def _duration(costs: dict[Op, float]) -> Duration:
    return lambda rank, action: costs[action.op]


def _m_grid(p: int) -> list[int]:
    return sorted({1, 2, 3, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2} - {0})


def _peaks(schedule: Schedule, w_share: float) -> list[float]:
    # Stage-activations alive per rank: F +1, B -1, I -(1 - w_share), W -w_share.
    result = walk(schedule, duration=_duration(_costs()))
    freed = {Op.F: -1.0, Op.B: 1.0, Op.I: 1.0 - w_share, Op.W: w_share}
    peaks = []
    for rank, acts in enumerate(schedule.actions):
        steps = sorted(range(len(acts)), key=lambda k: result.start[rank, k])
        alive = peak = 0.0
        for k in steps:
            alive -= freed[acts[k].op]
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def _spans_and_busy(schedule: Schedule, costs: dict[Op, float]) -> tuple[list[float], float]:
    result = walk(schedule, duration=_duration(costs))
    assert result.complete
    spans = []
    for rank, acts in enumerate(schedule.actions):
        keys = [(rank, k) for k in range(len(acts))]
        spans.append(max(result.end[k] for k in keys) - min(result.start[k] for k in keys))
    busy = sum(costs[a.op] for a in schedule.actions[0])
    return spans, busy


def _fused_idle(schedule: Schedule, costs: dict[Op, float]) -> list[float]:
    # Makespan minus busy time per rank when every "F then B" pair runs as one F&B block that
    # starts once both halves' inputs have arrived (DualPipe's overlapped pair).
    blocks = [_pairs(acts) for acts in schedule.actions]
    ready: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * schedule.n_ranks, [0.0] * schedule.n_ranks
    while any(pos[r] < len(blocks[r]) for r in range(schedule.n_ranks)):
        moved = False
        for rank, rank_blocks in enumerate(blocks):
            while pos[rank] < len(rank_blocks):
                block = rank_blocks[pos[rank]]
                own = {produces(a) for a in block}
                deps = [d for a in block for d in needs(a, schedule.n_stages) if d not in own]
                if any(d not in ready for d in deps):
                    break
                free[rank] = max([free[rank]] + [ready[d] for d in deps])
                free[rank] += sum(costs[a.op] for a in block)
                ready.update((produces(a), free[rank]) for a in block)
                pos[rank], moved = pos[rank] + 1, True
        assert moved, "fused walk deadlocked"
    busy = [sum(costs[a.op] for a in acts) for acts in schedule.actions]
    return [max(free) - b for b in busy]


def _pairs(acts: tuple[Action, ...]) -> list[list[Action]]:
    out: list[list[Action]] = []
    for a in acts:
        if a.op is Op.B and out and len(out[-1]) == 1 and out[-1][0].op is Op.F:
            out[-1].append(a)
        else:
            out.append([a])
    return out


# -- validity ------------------------------------------------------------------------------


def _check_valid(s: Schedule, p: int, m: int) -> None:
    assert s.n_ranks == p and s.n_stages == 2 * p and s.n_microbatches == m
    assert all(s.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
    seen: Counter[tuple[int, int, Op]] = Counter()
    for rank, acts in enumerate(s.actions):
        for a in acts:
            assert s.rank_of(a.stage) == rank and 0 <= a.mb < m
            seen[a.stage, a.mb, a.op] += 1
    for stage in range(2 * p):
        for mb in range(m):
            ops = {op: seen[stage, mb, op] for op in Op}
            assert ops in ({Op.F: 1, Op.B: 1, Op.I: 0, Op.W: 0},
                           {Op.F: 1, Op.B: 0, Op.I: 1, Op.W: 1}), (stage, mb, ops)
    for stage in range(2 * p):
        acts = s.actions[s.rank_of(stage)]
        for kinds in ({Op.F}, {Op.B, Op.I}, {Op.W}):
            mbs = [a.mb for a in acts if a.stage == stage and a.op in kinds]
            assert mbs == sorted(mbs), (stage, kinds, mbs)
    assert walk(s).complete


@pytest.mark.parametrize("build", [zbv, dualpipev])
@pytest.mark.parametrize("p", range(1, 9))
def test_valid_over_grid(build: Callable[[int, int, int], Schedule], p: int) -> None:
    for m in _m_grid(p):
        _check_valid(build(p, m, 2), p, m)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_registered_with_two_stages_per_rank(name: str) -> None:
    s = make_schedule(name, 4, 8)
    assert s.name == name and s.n_stages == 8
    assert s.placement == (0, 1, 2, 3, 3, 2, 1, 0)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_validator_accepts(name: str) -> None:
    for p in (1, 2, 5):
        for m in _m_grid(p):
            validate(make_schedule(name, p, m))


def test_zbv_ops_are_f_i_w_only() -> None:
    s = zbv(4, 9, 2)
    assert {a.op for acts in s.actions for a in acts} == {Op.F, Op.I, Op.W}


def test_zbv_small_case_by_hand() -> None:
    s = zbv(2, 3, 2)
    assert [" ".join(map(str, acts)) for acts in s.actions] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ]


def test_dualpipev_small_case_by_hand() -> None:
    # Warm-up nF0, n(F0 F1), n(I1 W1 F1); steady F&B pairs; cool-down B's, then I's and W's.
    s = dualpipev(2, 4, 2)
    assert [" ".join(map(str, acts)) for acts in s.actions] == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3",
    ]


# -- ZB-V: zero bubble and 2p activations ---------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
def test_zbv_zero_bubble_from_2p_minus_1(p: int) -> None:
    costs = _costs()
    for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 2):
        spans, busy = _spans_and_busy(zbv(p, m, 2), costs)
        assert busy == m * 2 * 3
        assert (max(spans) - busy) / max(spans) == 0.0, (p, m, spans)


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_bubble_below_2p_minus_1(p: int) -> None:
    # 2p-1 is the smallest m with zero bubble; fewer micro-batches still run, with idle time.
    for m in range(1, 2 * p - 1):
        spans, busy = _spans_and_busy(zbv(p, m, 2), _costs())
        assert max(spans) - busy == 2 * (2 * p - 1 - m) > 0


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("w_share", W_SHARES)
def test_zbv_peak_2p(p: int, w_share: float) -> None:
    for m in _m_grid(p):
        peaks = _peaks(zbv(p, m, 2), w_share)
        assert max(peaks) <= 2 * p
        if m >= 2 * p - 1:
            assert peaks == [2 * p] * p, (m, peaks)


# -- DualPipeV: published bubble and S+1 activations ----------------------------------------

# F <= I and W <= I, as in the DualPipe paper's setting; the formula is exact there.
COST_GRID = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 0.5), (1, 3, 2), (1, 2, 2), (0.5, 1, 1)]


@pytest.mark.parametrize("f, i, w", COST_GRID)
def test_dualpipev_bubble_with_fused_pairs(f: float, i: float, w: float) -> None:
    costs = _costs(f, i, w)
    for p in range(1, 9):
        published = (p - 1) * ((f + costs[Op.B]) + costs[Op.B] - 3 * w)  # (S/2-1)(F&B+B-3W)
        for m in (2 * p, 2 * p + 1, 3 * p + 2):
            idle = _fused_idle(dualpipev(p, m, 2), costs)
            assert idle == pytest.approx([published] * p), (p, m)


@pytest.mark.parametrize("f, i, w", COST_GRID)
def test_dualpipev_bubble_with_separate_actions(f: float, i: float, w: float) -> None:
    costs = _costs(f, i, w)
    for p in range(1, 9):
        published = (p - 1) * (f + 2 * costs[Op.B] - 3 * w)
        for m in (2 * p, 2 * p + 1, 3 * p + 2):
            s = dualpipev(p, m, 2)
            result = walk(s, duration=_duration(costs))
            makespan = max(result.end.values())
            _, busy = _spans_and_busy(s, costs)
            assert makespan - busy <= published + 1e-9, (p, m)


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("w_share", W_SHARES)
def test_dualpipev_peak_s_plus_1(p: int, w_share: float) -> None:
    for m in _m_grid(p):
        peaks = _peaks(dualpipev(p, m, 2), w_share)
        assert max(peaks) <= 2 * p + 1
        if m >= 2 * p:
            assert peaks == [2 * p + 1] * p, (m, peaks)


# -- the simulator agrees ------------------------------------------------------------------


@pytest.mark.parametrize("w_share", W_SHARES)
def test_simulate_agrees(w_share: float) -> None:
    for p in (1, 2, 3, 4, 8):
        for m in (2 * p, 3 * p + 1):
            z = simulate(zbv(p, m, 2), Costs(F=1, I=1, W=1), w_share=w_share)
            assert z.bubble_rate == 0.0 and z.peak_activations == (2 * p,) * p
            d = simulate(dualpipev(p, m, 2), Costs(F=1, I=1, W=1), w_share=w_share)
            assert max(d.idle) <= (p - 1) * (1 + 2 + 2 - 3)
            assert d.peak_activations == (2 * p + 1,) * p


# -- constraint errors ---------------------------------------------------------------------


@pytest.mark.parametrize("build", [zbv, dualpipev])
@pytest.mark.parametrize("v", [1, 3, 4])
def test_rejects_other_stages_per_rank(build: Callable[[int, int, int], Schedule],
                                       v: int) -> None:
    with pytest.raises(ValueError, match=rf"stages_per_rank=2\), got stages_per_rank={v}"):
        build(4, 8, v)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_rejects_other_stages_per_rank_via_registry(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} places two stages per rank"):
        make_schedule(name, 4, 8, stages_per_rank=1)


@pytest.mark.parametrize("build", [zbv, dualpipev])
def test_rejects_empty_counts(build: Callable[[int, int, int], Schedule]) -> None:
    with pytest.raises(ValueError, match="at least 1 rank and 1 micro-batch, got n_ranks=0"):
        build(0, 4, 2)
    with pytest.raises(ValueError, match="n_microbatches=0"):
        build(2, 0, 2)
