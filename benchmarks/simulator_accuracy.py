"""Simulator accuracy: predict each schedule's step time from profiled and from calibrated
costs, then run it.

On p = 2 processes (one thread each) training pipetrain's GPT (``small`` preset by default):

    1. calibrate  once, before everything else: a run of one schedule that has F, B, I and W
                  (``--calibrate``, DualPipeV by default): one warm-up step, then the
                  timelines of ``--calibration-steps`` steps give ``ps.calibrate``'s costs per
                  stage and op and its message delay; every rank also profiles every layer
                  alone (``profile_layers``), whose times only split a calibrated stage among
                  its layers when another schedule cuts the model elsewhere (``regroup``)
    2. profile    right before each schedule's run, every rank times F, I and W of its own
                  stages on one micro-batch at the same time (so both cores are busy, as in a
                  step) with ``profile_layers`` (each stage as one layer; stage 0 gets the
                  real token ids, the last stage the real loss), and the fused B
                  (``backward_full``) next to it; ``comm`` is half the round trip of one
                  activation-sized tensor between the two ranks, idle
    3. predict    ``ps.simulate(schedule, costs, comm).makespan``, from the profile
                  (``predicted``) and from the calibration (``calibrated``)
    4. run        the schedule: median over steps of first rank's start to last rank's end

The calibration run is not one of the measured runs: every schedule, the calibration's own
included, is predicted from steps it did not run in.

Beside predicted / measured the script reports where a miss comes from: ``span`` is the
measured time from the first action's start to the last one's end (the rest of a step is the
runtime's step start and end), ``ops`` is each op's mean time inside the run over its
profiled time, ``replay`` is the simulator's makespan when each action takes as long as it did
in the run and each message the mean ``hop`` measured in the run (both medians over steps).

    python benchmarks/simulator_accuracy.py                       # all schedules, 2 minutes
    python benchmarks/simulator_accuracy.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gptbench as gb
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.models.gpt import lm_loss
from pipetrain.runtime import microbatch
from pipetrain.runtime.backward import backward_full
from pipetrain.schedules import calibration as pt_calibrate
from pipetrain.schedules.calibration import regroup
from pipetrain.schedules.dataflow import walk
from pipetrain.schedules.timeline import Span, Timeline
from pipetrain.split.partition import stage_bounds
from pipetrain.split.profile import profile_layers

Batch = tuple[torch.Tensor, torch.Tensor]
OPS = ("F", "B", "I", "W")


# -- profiling ------------------------------------------------------------------------------


def _stage_inputs(layers: Sequence[nn.Module], bounds: Sequence[tuple[int, int]],
                  x: torch.Tensor) -> list[torch.Tensor]:
    """Each stage's input for the micro-batch ``x``; activations need a gradient, as in a run."""
    inputs = []
    with torch.no_grad():
        for lo, hi in bounds:
            inputs.append(x.detach().requires_grad_(x.is_floating_point()))
            for layer in layers[lo:hi]:
                x = layer(x)
    return inputs


def _fused_backward(module: nn.Module, x: torch.Tensor, target: torch.Tensor | None,
                    repeats: int) -> float:
    """Median seconds of ``backward_full`` after a fresh forward (one warm-up first)."""
    times = []
    for _ in range(repeats + 1):
        leaf = x.detach().requires_grad_(x.is_floating_point())
        out = module(leaf)
        root = out if target is None else lm_loss(out, target)
        t0 = time.perf_counter()
        backward_full([root], [torch.ones_like(root)], [leaf])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def profile_stages(work: gb.Workload, balance: Sequence[int], stages: Sequence[int], data: Batch,
                   repeats: int) -> dict[int, dict[str, float]]:
    """Seconds of F, B, I, W per micro-batch of ``stages`` (other ranks profile theirs)."""
    layers = work.layers()
    bounds = stage_bounds(balance)
    x, y = (microbatch.split(t, work.microbatches)[0] for t in data)
    inputs = _stage_inputs(layers, bounds, x)
    out = {}
    dist.barrier()
    for s in stages:
        module = nn.Sequential(*layers[bounds[s][0]:bounds[s][1]])
        last = s == len(balance) - 1
        cost = profile_layers([module], inputs[s], loss_fn=lm_loss if last else None,
                              sample_target=y if last else None, repeats=repeats)[0]
        b = _fused_backward(module, inputs[s], y if last else None, repeats)
        out[s] = {"F": cost.f, "B": b, "I": cost.i, "W": cost.w}
    dist.barrier()
    return out


def comm_delay(work: gb.Workload, rank: int, repeats: int = 20) -> float:
    """Half the median round trip of one activation message between ranks 0 and 1."""
    n = work.batch // work.microbatches * work.config.seq_len * work.config.d_model
    buf = torch.zeros(n)
    times = []
    for _ in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times[2:])


# -- running --------------------------------------------------------------------------------


def run_schedule(work: gb.Workload, name: str, data: Batch, warmup: int,
                 steps: int) -> dict[str, Any]:
    """Step walls on this rank, and every rank's action spans (relative to the step start)."""
    layers = work.layers()
    balance = gb.split(layers, work.schedule(name))
    runner = gb.PipetrainRunner(work, name, layers, balance)
    walls, spans = [], []
    for n in range(warmup + steps):
        gb.clear_grads(runner.params)
        dist.barrier()
        t0 = time.time()
        runner.step(*data)
        t1 = time.time()
        if n >= warmup:
            assert runner.last_result is not None
            walls.append((t0, t1))
            spans.append([(str(s.action), s.rank, s.start, s.end)
                          for s in runner.last_result.timeline.spans])
    return {"schedule": name, "balance": balance, "walls": walls, "spans": spans}


def profile_model(work: gb.Workload, data: Batch, repeats: int) -> dict[str, list[float]]:
    """Seconds of each op per layer of the whole model on one micro-batch, profiled alone."""
    x, y = (microbatch.split(t, work.microbatches)[0] for t in data)
    dist.barrier()
    costs = profile_layers(work.layers(), x, loss_fn=lm_loss, sample_target=y, repeats=repeats)
    dist.barrier()
    return {"F": [c.f for c in costs], "B": [c.b for c in costs], "I": [c.i for c in costs],
            "W": [c.w for c in costs]}


def rank_body(ctx: pt.RankContext, work: gb.Workload, names: Sequence[str], data: Batch,
              warmup: int, steps: int, repeats: int, calibration: tuple[str, int],
              ) -> list[dict[str, Any]]:
    """The calibration first; then per schedule: profile its stages and the comm right before
    running it, so that the profile and the run see the machine in the same state."""
    out = [{"layers": profile_model(work, data, repeats),
            **run_schedule(work, calibration[0], data, 1, calibration[1])}]
    for name in names:
        sched = work.schedule(name)
        balance = gb.split(work.layers(), sched)
        costs = profile_stages(work, balance, sched.stages_of(ctx.rank), data, repeats)
        comm = comm_delay(work, ctx.rank)
        out.append({"costs": costs, "comm_s": comm,
                    **run_schedule(work, name, data, warmup, steps)})
    return out


# -- summary --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibrated:
    """Costs and message delay from the calibration run, and what moves them to a split."""

    name: str
    calibration: pt_calibrate.Calibration
    balance: list[int]
    layer_weights: dict[str, list[float]]

    def costs(self, balance: Sequence[int]) -> ps.Costs:
        return regroup(self.calibration.costs, self.balance, balance, weights=self.layer_weights)


def calibrated(work: gb.Workload, run: dict[str, Any]) -> Calibrated:
    """The calibration run's costs per stage and op and its median hop (``ps.calibrate``)."""
    sched = work.schedule(run["schedule"])
    steps = [Timeline(sched.n_ranks, tuple(Span(rank, ps.Action.parse(a), start, end)
                                           for a, rank, start, end in step), "s")
             for step in run["spans"]]
    return Calibrated(run["schedule"], ps.calibrate(steps, sched), run["balance"], run["layers"])


def _costs(per_stage: dict[int, dict[str, float]], n_stages: int) -> ps.Costs:
    return ps.Costs(**{op: tuple(per_stage[s][op] for s in range(n_stages)) for op in OPS})


def _run_op_times(spans: list[list[tuple[str, int, float, float]]],
                  n_stages: int) -> dict[int, dict[str, float]]:
    """Mean duration of each (stage, op) over all its actions in all measured steps."""
    got: dict[tuple[int, str], list[float]] = {}
    for step in spans:
        for text, _, start, end in step:
            a = ps.Action.parse(text)
            got.setdefault((a.stage, a.op.value), []).append(end - start)
    return {s: {op: statistics.mean(got.get((s, op), [0.0])) for op in OPS}
            for s in range(n_stages)}


SpanRow = tuple[str, int, float, float]  # (action, rank, start, end)


def _waits(spans: list[list[SpanRow]], sched: ps.Schedule) -> tuple[list[float], list[float]]:
    """Two kinds of time between actions in a run:

    gap  idle before an action that needs no message (W, F of stage 0, B/I of the last
         stage) after the previous action of its rank: the runtime's own time
    hop  from the end of the action that sends a message to the start of the action on
         another rank that receives it, when that rank was already idle at the send
    """
    gaps, hops = [], []
    for step in spans:
        end = {row[0]: row[3] for row in step}
        for rank in range(sched.n_ranks):
            mine = sorted((row for row in step if row[1] == rank), key=lambda row: row[2])
            for prev, cur in zip(mine, mine[1:]):
                source = _source(ps.Action.parse(cur[0]), sched.n_stages - 1, end)
                if source is None:
                    gaps.append(cur[2] - prev[3])
                elif (sched.rank_of(ps.Action.parse(source).stage) != rank
                      and end[source] > prev[3]):  # the message was sent after this rank idled
                    hops.append(cur[2] - end[source])
    return gaps, hops


def _source(a: ps.Action, last: int, done: dict[str, float]) -> str | None:
    """The action whose message ``a`` consumes; None for W, F of stage 0, B/I of the last."""
    if a.op.value == "F" and a.stage > 0:
        return f"{a.stage - 1}F{a.mb}"
    if a.op.value in "BI" and a.stage < last:
        return next(c for c in (f"{a.stage + 1}B{a.mb}", f"{a.stage + 1}I{a.mb}") if c in done)
    return None


def _replay(step: list[SpanRow], sched: ps.Schedule, hop: float) -> float:
    """The simulator's makespan when every action takes exactly as long as it did in ``step``."""
    took = {row[0]: row[3] - row[2] for row in step}
    result = walk(sched, lambda rank, a: took[str(a)], hop)
    return max(result.end.values()) - min(result.start.values())


def summarize_one(work: gb.Workload, costs: dict[int, dict[str, float]], comm: float,
                  runs: list[list[SpanRow]], walls: list[list[tuple[float, float]]],
                  balance: list[int], name: str, calib: Calibrated) -> dict[str, Any]:
    """Predictions, measurement and the diagnosis of one schedule."""
    sched = work.schedule(name)
    n = sched.n_stages
    predicted = ps.simulate(sched, _costs(costs, n), comm).makespan
    calibrated_costs = calib.costs(balance)
    from_calibration = ps.simulate(sched, calibrated_costs, calib.calibration.comm).makespan
    measured = gb.median_step(walls)
    span = statistics.median(max(r[3] for r in st) - min(r[2] for r in st) for st in runs)
    in_run = _run_op_times(runs, n)
    used = [op for op in OPS if any(a.op.value == op for acts in sched.actions for a in acts)]
    ops = {op: sum(in_run[s][op] for s in range(n)) / sum(costs[s][op] for s in range(n))
           for op in used}
    gaps, hops = _waits(runs, sched)
    hop = max(0.0, statistics.mean(hops)) if hops else comm  # < 0: senders preempted
    replay = statistics.median(_replay(step, sched, hop) for step in runs)
    with_hop = ps.simulate(sched, _costs(costs, n), hop).makespan
    return {"schedule": name, "balance": balance, "predicted_s": predicted,
            "measured_s": measured, "ratio": predicted / measured,
            "calibrated_s": from_calibration, "calibrated_ratio": from_calibration / measured,
            "calibrated_costs": calibrated_costs.to_dict(), "span_s": span,
            "replay_s": replay, "predicted_at_hop_s": with_hop, "op_ratio": ops,
            "comm_s": comm, "hop_s": hop,
            "gap_s": statistics.median(gaps) if gaps else 0.0,
            "actions_per_rank": max(len(a) for a in sched.actions),
            "costs": {str(s): c for s, c in costs.items()},
            "run_op_s": {str(s): c for s, c in in_run.items()}}


def summarize(work: gb.Workload, per_rank: list[list[dict[str, Any]]],
              ) -> tuple[Calibrated, list[dict[str, Any]]]:
    calib = calibrated(work, per_rank[0][0])
    rows = []
    for j, run in enumerate(per_rank[0]):
        if j == 0:  # the calibration run
            continue
        costs = {int(s): c for r in per_rank for s, c in r[j]["costs"].items()}
        comm = statistics.median(r[j]["comm_s"] for r in per_rank)
        walls = [r[j]["walls"] for r in per_rank]
        # every rank's timeline holds every rank's spans: rank 0's suffice
        rows.append(summarize_one(work, costs, comm, run["spans"], walls, run["balance"],
                                  run["schedule"], calib))
    return calib, rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<17}{'measured':>9}{'profiled':>9}{'ratio':>7}{'calibrated':>11}"
            f"{'ratio':>7}{'at hop':>8}{'span':>7}{'replay':>8}{'hop ms':>7}"
            "  in-run / profiled op time")
    lines = [head, "-" * len(head)]
    for r in rows:
        ops = " ".join(f"{op} {v:.2f}" for op, v in r["op_ratio"].items())
        lines.append(f"{r['schedule']:<17}{r['measured_s']:>9.3f}{r['predicted_s']:>9.3f}"
                     f"{r['ratio']:>7.3f}{r['calibrated_s']:>11.3f}{r['calibrated_ratio']:>7.3f}"
                     f"{r['predicted_at_hop_s'] / r['measured_s']:>8.3f}"
                     f"{r['span_s']:>7.3f}{r['replay_s'] / r['span_s']:>8.3f}"
                     f"{r['hop_s'] * 1e3:>7.2f}  {ops}")
    return "\n".join(lines)


def _within(rows: list[dict[str, Any]], key: str) -> str:
    near = [r["schedule"] for r in rows if abs(r[key] - 1) <= 0.05]
    missed = [r["schedule"] for r in rows if r["schedule"] not in near]
    return f"{len(near)} of {len(rows)}" + (f" (missed: {', '.join(missed)})" if missed else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small",
                        help="GPT preset (pipetrain.models.gpt.PRESETS)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--m", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--schedules", default=",".join(gb.ALL_SCHEDULES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="profiling runs per op (median)")
    parser.add_argument("--calibrate", default="dualpipev",
                        help="the schedule whose steps calibrate the costs (F, B, I and W)")
    parser.add_argument("--calibration-steps", type=int, default=3,
                        help="steps of the calibration run read (after one warm-up step)")
    parser.add_argument("--json", help="write rows and machine description here")
    parser.add_argument("--tiny", action="store_true", help="tiny preset, 3 schedules (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.preset, args.batch, args.m, args.steps, args.repeats = "tiny", 4, 4, 2, 2
        args.schedules, args.calibration_steps = "1f1b,zb-h1,zbv", 1
    names = args.schedules.split(",")
    work = gb.Workload(args.preset, args.batch, args.m)
    started = time.time()
    per_rank = pt.launch(rank_body, work.ranks, work, names, work.data(), args.warmup,
                         args.steps, args.repeats, (args.calibrate, args.calibration_steps),
                         timeout=3600)
    calib, rows = summarize(work, per_rank)
    comms = [r["comm_s"] * 1e3 for r in rows]
    print(f"GPT {args.preset}, batch {args.batch} x {work.config.seq_len} tokens, m = {args.m},"
          f" p = {work.ranks} (1 thread each); comm {min(comms):.2f}-{max(comms):.2f} ms per hop"
          f" idle; calibrated on {args.calibration_steps} steps of {calib.name}: hop "
          f"{calib.calibration.comm * 1e3:.2f} ms (median of {calib.calibration.hops})")
    print(format_table(rows))
    print("s; measured: median step; profiled: the simulator with the per-stage costs profiled "
          "alone and the idle comm; calibrated: the simulator with the calibration run's costs "
          "and hop; ratio: prediction / measured; at hop: the profiled prediction with the run's "
          "mean hop as comm, over measured; span: first action start to last action end; "
          "replay: simulator fed each action's time in the run and the mean hop, over span; "
          "hop: mean time from the end of a message's sending action to the start of its "
          "receiving action on a rank idle since before the send")
    print(f"within 5% of measured: profiled {_within(rows, 'ratio')}; calibrated "
          f"{_within(rows, 'calibrated_ratio')}")
    if args.json:
        calibration = {"schedule": calib.name, "steps": args.calibration_steps,
                       "balance": calib.balance, "comm_s": calib.calibration.comm,
                       "hops": calib.calibration.hops,
                       "costs": calib.calibration.costs.to_dict()}
        gb.save_json(args.json, {"rows": rows}, wall_s=time.time() - started,
                     preset=args.preset, batch=args.batch, microbatches=args.m,
                     calibration=calibration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
