"""Drawing: text timeline, PNG and Chrome trace of simulated and measured timelines."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from pipetrain.schedules import make_schedule
from pipetrain.schedules.action import Action
from pipetrain.schedules.draw import chrome_trace, save_png, save_trace, text_timeline
from pipetrain.schedules.simulator import Costs, simulate
from pipetrain.schedules.timeline import Span, Timeline


def sim_timeline(name: str = "1f1b", p: int = 2, m: int = 3, costs: str = "F=1,B=1") -> Timeline:
    return simulate(make_schedule(name, p, m), Costs.parse(costs)).timeline


def measured() -> Timeline:
    # Seconds from an arbitrary clock (perf_counter-like), unequal durations.
    t0 = 5000.25
    spans = [(0, "0F0", 0.000, 0.010), (0, "0F1", 0.010, 0.021), (1, "1F0", 0.011, 0.020),
             (1, "1B0", 0.020, 0.041), (0, "0B0", 0.042, 0.060), (1, "1F1", 0.041, 0.052),
             (1, "1B1", 0.052, 0.070), (0, "0B1", 0.071, 0.090)]
    return Timeline(2, tuple(Span(r, Action.parse(a), t0 + s, t0 + e) for r, a, s, e in spans),
                    unit="s")


def test_text_equal_costs_one_column_per_action() -> None:
    text = text_timeline(sim_timeline())
    lines = text.splitlines()
    assert lines[0] == "rank 0 |0F0 0F1 ... 0B0 0F2 0B1 ... 0B2|"
    assert lines[1] == "rank 1 |... 1F0 1B0 1F1 1B1 1F2 1B2 ...|"
    assert lines[2].startswith("legend: <stage><op><mb>; F forward, B backward; . idle")
    assert "one column = 1 unit" in lines[2]


def test_text_proportional_when_costs_differ() -> None:
    lines = text_timeline(sim_timeline(costs="F=1,B=2")).splitlines()
    # 4 characters per unit: "0F0 " is one unit, "0B0     " two; rank 1 starts idle.
    assert lines[0].startswith("rank 0 |0F0 0F1 ........0B0     0F2 ")
    assert lines[1].startswith("rank 1 |....1F0 1B0     1F1 ")
    assert len({len(line) for line in lines[:2]}) == 1
    assert "one character = 0.25 units" in lines[2]


def test_text_narrow_width_uses_short_forms() -> None:
    lines = text_timeline(sim_timeline("1f1b", 4, 8), width=30).splitlines()
    assert lines[3] == "rank 3 |...FBFBFBFBFBFBFBFB...|"  # 22 slots, one letter each
    lines = text_timeline(sim_timeline("1f1b", 4, 8, "F=1,B=2"), width=40).splitlines()
    assert all(len(line) == len("rank 0 |") + 40 + 1 for line in lines[:4])
    for line in lines[:4]:  # every action still shows as its op letter, drawn out with "-"
        body = line[len("rank 0 |"):-1]
        assert set(body) <= set("FB-.") and body.count("F") == body.count("B") == 8


def test_text_marks_a_ranks_second_stage_in_short_forms() -> None:
    tl = sim_timeline("interleaved-1f1b", 4, 8, "F=1,B=2")
    text = text_timeline(tl, width=100)
    assert "f" in text and "lower case: the rank's later stage" in text


def test_text_measured_seconds_with_offset() -> None:
    text = text_timeline(measured())
    assert text.splitlines()[0].startswith("rank 0 |0F0 ")
    assert "1B0" in text and "makespan 0.09 s" in text


def test_text_empty_and_bad_width() -> None:
    assert "empty" in text_timeline(Timeline(2, ()))
    with pytest.raises(ValueError, match="width"):
        text_timeline(sim_timeline(), width=0)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("timeline", [sim_timeline("zbv", 4, 8, "F=1,I=1,W=1"), measured()],
                         ids=["zbv", "measured"])
def test_png_is_written(tmp_path: Path, timeline: Timeline) -> None:
    out = tmp_path / "t.png"
    save_png(timeline, out, title="test")
    width, height = png_size(out)
    assert 800 <= width <= 3000 and 300 <= height <= 2000
    assert out.stat().st_size > 10_000


def test_trace_structure() -> None:
    tl = sim_timeline()
    trace = chrome_trace(tl)
    events = trace["traceEvents"]
    assert isinstance(events, list)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(tl.spans) == 12
    first = next(e for e in spans if e["name"] == "1F0")
    assert first["pid"] == 1
    assert first["args"] == {"stage": 1, "mb": 0, "op": "F"}
    # abstract units: 1 unit = 1 ms = 1000 us
    assert (first["ts"], first["dur"]) == (1000.0, 1000.0)
    assert "1 ms" in str(trace["otherData"])
    json.dumps(trace)


@pytest.mark.parametrize(("unit", "us"), [("s", 1e6), ("ms", 1e3), ("us", 1.0)])
def test_trace_unit_conversion(unit: str, us: float) -> None:
    tl = Timeline(1, (Span(0, Action.parse("0F0"), 10.0, 12.0),
                      Span(0, Action.parse("0B0"), 12.5, 13.0)), unit=unit)
    spans = [e for e in chrome_trace(tl)["traceEvents"] if e["ph"] == "X"]
    assert [(e["ts"], e["dur"]) for e in spans] == [(0.0, 2 * us), (2.5 * us, 0.5 * us)]


def test_save_trace(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    save_trace(measured(), out)
    loaded = json.loads(out.read_text())
    spans = [e for e in loaded["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) == 0.0
    assert spans[0]["dur"] == pytest.approx(10_000.0)
