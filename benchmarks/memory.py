"""Memory: each schedule's measured activation memory per rank against the simulator's count.

The model is a stack of identical pre-norm transformer blocks (``pipetrain.models.gpt.Block``) fed
random activations and trained to a random target (mean squared error), so every stage holds
the same layers, as the simulator's memory model assumes. For every schedule of pipetrain and
both ``recompute="never"`` and ``"always"``, on p processes (one thread each):

    measured   the rise of live CPU tensor bytes in the rank's process during one step above
               its level at the step's start (gradients already allocated and zeroed), from
               torch's CPU allocator over every thread (see memprobe.py): activations,
               message buffers and the transient tensors of a backward
    unit       per stage, bytes one micro-batch's F leaves alive (saved tensors and outputs),
               measured alone on the same rank, plus its input when that arrives as a message
    sim        ``ps.simulate(schedule).peak_activations[rank]``, in units
    sim+I      the same with ``i_held``: per stage, the gradients I keeps until W over the
               unit, measured alone (``i_saved``)
    predicted  the simulator's memory rule on its timeline, each F adding its stage's unit
               (never), I adding its ``i_saved`` until W; with recompute F keeps only its
               input, and the replay before B/I adds the unit until B or W ends
    detailed   plus each op's own peak while it runs, and every message a rank sends, held
               from its action's end to the end of the step (the runtime waits for its sends
               there)
    ratio      measured / predicted

    python benchmarks/memory.py                     # p = 2, m = 8, all schedules
    python benchmarks/memory.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gptbench as gb
import memprobe
import torch
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.models.gpt import Block, GPTConfig
from pipetrain.runtime.backward import backward_full, backward_input
from pipetrain.schedules.action import Op
from pipetrain.split.partition import even_balance, stage_bounds

RECOMPUTE = ("never", "always")


@dataclass(frozen=True)
class Setup:
    """The block stack, the batch and the pipeline shape."""

    d_model: int
    heads: int
    seq: int
    batch: int
    microbatches: int
    ranks: int
    blocks: int

    def layers(self, seed: int = 0) -> list[nn.Module]:
        torch.manual_seed(seed)
        cfg = GPTConfig(d_model=self.d_model, n_heads=self.heads, seq_len=self.seq,
                        n_layers=self.blocks)
        return [Block(cfg) for _ in range(self.blocks)]

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        shape = (self.batch, self.seq, self.d_model)
        return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


# -- per-stage unit -------------------------------------------------------------------------

UNIT_KEYS = ("input", "message", "forward", "forward_peak", "i_saved", "b_peak", "i_peak",
             "w_peak")


def stage_units(setup: Setup, schedule: ps.Schedule, rank: int) -> dict[int, dict[str, int]]:
    """Per hosted stage, measured alone on one micro-batch (bytes above the level before):

    input         the stage input, when it arrives as a message (held until B or W)
    message       one message: an activation, or the gradient of one, sent to another rank
    forward       what F leaves alive: saved tensors and outputs
    forward_peak  the most alive during F
    i_saved       what I leaves alive besides the input gradient (gradients kept for W)
    b_peak, i_peak, w_peak   the most alive during B, I and W
    """
    layers = setup.layers(seed=1)
    bounds = stage_bounds(even_balance(len(layers), schedule.n_stages))
    x, y = (t[: setup.batch // setup.microbatches] for t in setup.data())
    out = {}
    for s in schedule.stages_of(rank):
        module = nn.Sequential(*layers[bounds[s][0]:bounds[s][1]])
        target = y if s == schedule.n_stages - 1 else None
        remote = s > 0 and schedule.rank_of(s - 1) != rank
        unit = _measure_stage(module, x, s > 0, target)
        message = x.numel() * x.element_size()
        out[s] = {"input": message if remote else 0, "message": message, **unit}
    return out


def _measure_stage(module: nn.Module, x: torch.Tensor, grad: bool,
                   target: torch.Tensor | None) -> dict[str, int]:
    _forward_backward(module, x, grad, target)  # gradients exist from here on
    leaf = x.detach().requires_grad_(grad)
    with memprobe.Probe() as f:
        y = _forward(module, leaf, target)
    with memprobe.Probe() as b:
        backward_full([y], [torch.ones_like(y)], [leaf])
    leaf = x.detach().requires_grad_(grad)
    y = _forward(module, leaf, target)
    with memprobe.Probe() as i:
        got, work = backward_input([y], [torch.ones_like(y)], [leaf])
    sent = sum(g.numel() * g.element_size() for g in got if g is not None)
    with memprobe.Probe() as w:
        work.run()
    return {"forward": f.end_bytes - f.start_bytes, "forward_peak": f.peak_bytes - f.start_bytes,
            "i_saved": i.end_bytes - i.start_bytes - sent, "b_peak": b.peak_bytes - b.start_bytes,
            "i_peak": i.peak_bytes - i.start_bytes, "w_peak": w.peak_bytes - w.start_bytes}


def _forward(module: nn.Module, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    y: torch.Tensor = module(x)
    return y if target is None else _mse(y, target)


def _forward_backward(module: nn.Module, x: torch.Tensor, grad: bool,
                      target: torch.Tensor | None) -> None:
    y = _forward(module, x.detach().requires_grad_(grad), target)
    y.backward(torch.ones_like(y))


# -- prediction -----------------------------------------------------------------------------


def predicted_bytes(sim: Any, rank: int, units: dict[int, dict[str, int]], recompute: bool,
                    detailed: bool) -> float:
    """The peak over ``rank``'s simulated timeline of bytes alive, by the simulator's rule.

    F adds the stage's unit (input + forward) at its start; B, or W after I, frees it at its
    end; I adds the gradients it keeps for W. With recompute F keeps only the input and B/I
    add the forward bytes (the replay) at their start. ``detailed`` adds what the rule leaves
    out, each measured: an op's own peak while it runs, and the messages sent to other ranks,
    held until the step ends.
    """
    events: list[tuple[float, int, float]] = []  # (time, 0 frees first | 1 allocations, bytes)
    for span in sim.timeline.of_rank(rank):
        u = units[span.action.stage]
        rise, after = _deltas(span.action.op, u, recompute, detailed)
        events += [(span.start, 1, rise), (span.end, 0, after - rise)]
        if detailed and _sends(sim.schedule, span.action, rank):
            events.append((span.end, 1, u["message"]))
    alive = peak = 0.0
    for _, _, delta in sorted(events):
        alive += delta
        peak = max(peak, alive)
    return peak


def _deltas(op: Op, u: dict[str, int], recompute: bool, detailed: bool) -> tuple[int, int]:
    """(most added while ``op`` runs, added when it ends) for one micro-batch of one stage."""
    d = detailed
    x, f, saved = u["input"], u["forward"], u["i_saved"]
    fp, bp, ip, wp = (u[k] * d for k in ("forward_peak", "b_peak", "i_peak", "w_peak"))
    if not recompute:
        return {Op.F: (x + (fp if d else f), x + f), Op.B: (bp, -(x + f)),
                Op.I: (ip, saved), Op.W: (wp, -(x + f + saved))}[op]
    return {Op.F: (x + (fp - f if d else 0), x), Op.B: (f + bp, -x),
            Op.I: (f + ip, f + saved), Op.W: (wp, -(x + f + saved))}[op]


def _sends(schedule: ps.Schedule, action: ps.Action, rank: int) -> bool:
    """Whether ``action`` sends its output (F) or input gradient (B, I) to another rank."""
    s = action.stage
    if action.op is Op.F:
        return s < schedule.n_stages - 1 and schedule.rank_of(s + 1) != rank
    return action.op in (Op.B, Op.I) and s > 0 and schedule.rank_of(s - 1) != rank


def i_held(schedule: ps.Schedule, units: dict[int, dict[str, int]]) -> tuple[float, ...]:
    """Per stage, the gradients I keeps until W in units of the stage's F (``ps.simulate``)."""
    return tuple(max(0, units[s]["i_saved"]) / (units[s]["input"] + units[s]["forward"])
                 for s in range(schedule.n_stages))


# -- measurement ----------------------------------------------------------------------------


def _zero_grads(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.zero_()


def measure(setup: Setup, name: str, recompute: str, rank: int,
            data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """One step's rise of live tensor bytes on this rank (after a warm-up step)."""
    pipe = pt.Pipeline(setup.layers(), name, setup.microbatches, loss_fn=_mse,
                       recompute=recompute, timeout=600.0)
    params = list(pipe.parameters())
    pipe.step(*data)
    _zero_grads(params)
    gc.collect()
    with memprobe.Probe() as probe:
        pipe.step(*data)
    del pipe
    gc.collect()
    return {"measured_bytes": probe.peak_bytes - probe.start_bytes,
            "start_bytes": probe.start_bytes}


def rank_body(ctx: pt.RankContext, setup: Setup, names: Sequence[str]) -> list[dict[str, Any]]:
    memprobe.enable()
    data = setup.data()
    out = []
    for name in names:
        schedule = ps.make_schedule(name, setup.ranks, setup.microbatches)
        units = stage_units(setup, schedule, ctx.rank)
        for recompute in RECOMPUTE:
            out.append({"schedule": name, "recompute": recompute, "rank": ctx.rank,
                        "units": units, **measure(setup, name, recompute, ctx.rank, data)})
    return out


def summarize(setup: Setup, per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for j, first in enumerate(per_rank[0]):
        name, recompute = first["schedule"], first["recompute"]
        schedule = ps.make_schedule(name, setup.ranks, setup.microbatches)
        units: dict[int, dict[str, int]] = {}
        for r in per_rank:
            units.update({int(s): u for s, u in r[j]["units"].items()})
        held = i_held(schedule, units)
        plain, sim = ps.simulate(schedule), ps.simulate(schedule, i_held=held)
        ranks = range(setup.ranks)
        always = recompute == "always"
        pred = [predicted_bytes(sim, r, units, always, detailed=False) for r in ranks]
        model = [predicted_bytes(sim, r, units, always, detailed=True) for r in ranks]
        meas = [per_rank[r][j]["measured_bytes"] for r in ranks]
        rows.append({
            "schedule": name, "recompute": recompute,
            "sim_units": list(plain.peak_activations), "i_held": list(held),
            "sim_i_units": list(sim.peak_activations),
            "unit_bytes": {s: u["forward"] + u["input"] for s, u in units.items()},
            "units": units, "predicted_bytes": pred, "detailed_bytes": model,
            "measured_bytes": meas, "ratio": _ratios(meas, pred),
            "detailed_ratio": _ratios(meas, model)})
    return rows


def _ratios(a: Sequence[float], b: Sequence[float]) -> list[float | None]:
    return [x / y if y else None for x, y in zip(a, b)]


def format_table(rows: list[dict[str, Any]], setup: Setup) -> str:
    head = (f"{'schedule':<17}{'recompute':<10}{'sim':>6}{'sim+I':>10}{'unit MiB':>12}"
            f"{'predicted':>12}"
            f"{'detailed':>12}{'measured':>12}{'meas/pred':>11}{'meas/det':>11}")
    lines = [head, "-" * len(head)]
    schedule_of = {name: ps.make_schedule(name, setup.ranks, setup.microbatches)
                   for name in dict.fromkeys(r["schedule"] for r in rows)}
    for r in rows:
        sched = schedule_of[r["schedule"]]
        unit = [statistics.mean(r["unit_bytes"][s] for s in sched.stages_of(k))
                for k in range(setup.ranks)]
        cells = [_join(r["sim_units"], "{:g}"), _join(r["sim_i_units"], "{:.2f}"),
                 _join(unit, None),
                 *(_join(r[k], None) for k in ("predicted_bytes", "detailed_bytes",
                                               "measured_bytes")),
                 _join(r["ratio"], "{:.2f}"), _join(r["detailed_ratio"], "{:.2f}")]
        lines.append(f"{r['schedule']:<17}{r['recompute']:<10}{cells[0]:>6}{cells[1]:>10}"
                     f"{cells[2]:>12}" + "".join(f" {c:>11}" for c in cells[3:6])
                     + "".join(f" {c:>10}" for c in cells[6:]))
    return "\n".join(lines)


def _join(values: Sequence[float | None], fmt: str | None) -> str:
    """Per-rank values as 'a/b'; MiB with one decimal when ``fmt`` is None."""
    return "/".join("-" if v is None else memprobe.mib(v) if fmt is None else fmt.format(v)
                    for v in values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=2, help="ranks (processes)")
    parser.add_argument("--m", type=int, default=8, help="micro-batches")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--schedules", default=",".join(gb.ALL_SCHEDULES))
    parser.add_argument("--json", help="write rows and machine description here")
    parser.add_argument("--tiny", action="store_true", help="d_model 32, seq 16, 3 schedules")
    args = parser.parse_args(argv)
    if args.tiny:
        args.d_model, args.heads, args.seq, args.batch = 32, 2, 16, 8
        args.schedules = "1f1b,zb-h1,zbv"
    names = args.schedules.split(",")
    setup = Setup(args.d_model, args.heads, args.seq, args.batch, args.m, args.p, 4 * args.p)
    if args.batch % args.m:
        parser.error(f"--batch {args.batch} must be a multiple of --m {args.m}")
    started = time.time()
    rows = summarize(setup, pt.launch(rank_body, args.p, setup, names, timeout=3600))
    print(f"{setup.blocks} blocks (d_model {args.d_model}, seq {args.seq}), batch {args.batch},"
          f" m = {args.m}, p = {args.p}; per-rank values separated by '/', units per stage")
    print(format_table(rows, setup))
    print("MiB; sim: simulator's peak activations (units); sim+I: the same with the "
          "gradients I keeps until W (i_held, measured per stage); unit: bytes of one "
          "micro-batch's F per stage (input + forward), mean over the rank's stages; "
          "predicted: the simulator's memory rule with those units and i_held; detailed: plus "
          "each op's own peak and the sends held until the step ends; measured: rise of live "
          "CPU tensor bytes during a step (torch allocator, all threads)")
    if args.json:
        gb.save_json(args.json, {"rows": rows}, wall_s=time.time() - started,
                     setup=setup.__dict__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
