"""Schedule efficiency on calibrated stages: pipetrain next to torch.distributed.pipelining.

Every layer is a pair of custom autograd functions that sleep for fixed, known times::

    x ──► _InputPath  (forward sleeps F, backward sleeps I) ──► (+) ──► y
    w ──► _WeightPath (forward free,    backward sleeps W)  ──► ─┘

The weight-gradient time hangs off the weight, so a split backward really separates it: I
(gradient w.r.t. the stage input) runs only the input-path sleep and W only the weight-path one.
Sleeps need no CPU, so core count does not matter and only bubbles and runtime overhead show.
Every sleep is logged and checked against the op that ran it (column ``split``).

The first stage's input needs no gradient, so in both libraries its I has nothing to do and its
W runs the whole backward; the first layer's I sleep never runs at all (nothing needs the
gradient of its input), so stage 0's backward is k W sleeps plus k-1 I sleeps for k layers. The
simulator gets those effective per-stage costs. Each library's time inside its ops that is not
sleep (its own per-op work and the layers' autograd bookkeeping) is reported per step for the
busiest rank (``op+``), next to the makespan the simulator predicts.

    python benchmarks/calibrated.py                       # p=4, m=8,16,32, two cost settings
    python benchmarks/calibrated.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gptbench as gb
import torch
import torch.distributed as dist
from bare import BareRunner, spin_sleep
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps

SHARED = gb.TORCH_CLASSES  # the schedules both libraries have
OURS_ONLY = ("zb-h1", "zb-h2")
_LOG: list[tuple[str, int, float, float]] = []  # this process's sleeps: (op, layer, start, end)


# -- calibrated layers ---------------------------------------------------------------------


def _sleep(seconds: float, op: str, layer: int) -> None:
    start = time.time()
    spin_sleep(seconds)  # ends on time; its spin yields the GIL to this process's threads
    _LOG.append((op, layer, start, time.time()))


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, f: float, i: float, layer: int) -> torch.Tensor:
        ctx.cost, ctx.layer = i, layer
        _sleep(f, "F", layer)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _sleep(ctx.cost, "I", ctx.layer)
        return grad, None, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, cost: float, layer: int) -> torch.Tensor:
        ctx.cost, ctx.layer, ctx.shape = cost, layer, w.shape
        return w.sum() * 0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        _sleep(ctx.cost, "W", ctx.layer)
        return torch.ones(ctx.shape) * grad, None, None


class SleepLayer(nn.Module):
    """A layer whose F, I and W take ``f``, ``i`` and ``w`` seconds."""

    def __init__(self, index: int, f: float, i: float, w: float) -> None:
        super().__init__()
        self.index, self.f, self.i, self.w = index, f, i, w
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_InputPath.apply(x, self.f, self.i, self.index)
                + _WeightPath.apply(self.weight, self.w, self.index))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


# -- configuration -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One measured configuration: costs in seconds per layer, schedules to run."""

    label: str
    ranks: int
    microbatches: int
    f: float
    i: float
    w: float
    layers: int
    schedules: tuple[str, ...]
    warmup: int
    steps: int

    def make_layers(self) -> list[nn.Module]:
        return [SleepLayer(j, self.f, self.i, self.w) for j in range(self.layers)]


def stage_costs(case: Case, n_stages: int) -> ps.Costs:
    """Effective per-stage costs: k layers per stage; stage 0's I is empty, its W (and B) runs
    the W sleeps and the I sleeps of all but its first layer."""
    k = case.layers // n_stages
    first = k * case.w + (k - 1) * case.i
    f = (k * case.f,) * n_stages
    i = (0.0,) + (k * case.i,) * (n_stages - 1)
    w = (first,) + (k * case.w,) * (n_stages - 1)
    return ps.Costs(F=f, I=i, W=w, B=(first,) + (k * (case.i + case.w),) * (n_stages - 1))


def ideal(case: Case) -> float:
    """Work of the busiest rank in one step: no bubble, no overhead."""
    return case.microbatches * case.layers / case.ranks * (case.f + case.i + case.w)


# -- per-rank measurement ------------------------------------------------------------------


class _TorchSpans:
    """Wraps a torch PipelineStage's per-micro-batch methods to record when each op runs."""

    def __init__(self, stage: Any) -> None:
        self.spans: list[tuple[str, int, float, float]] = []  # (op, stage, start, end)
        idx = stage.stage_index
        fwd, bwd, wgt = (stage.forward_one_chunk, stage.backward_one_chunk,
                         stage.backward_weight_one_chunk)

        def forward(*a: Any, **k: Any) -> Any:
            return self._timed("F", idx, fwd, a, k)

        def backward(*a: Any, **k: Any) -> Any:
            return self._timed("B" if k.get("full_backward", True) else "I", idx, bwd, a, k)

        def weight(*a: Any, **k: Any) -> Any:
            return self._timed("W", idx, wgt, a, k)

        stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
        stage.backward_weight_one_chunk = weight

    def _timed(self, op: str, idx: int, fn: Callable[..., Any], a: Any, k: Any) -> Any:
        start = time.time()
        try:
            return fn(*a, **k)
        finally:
            self.spans.append((op, idx, start, time.time()))


class _Runner:
    """One library's pipeline for one schedule on this rank: ``step()`` returns op spans."""

    def __init__(self, lib: str, name: str, case: Case, rank: int) -> None:
        self.lib, self.rank, self.case = lib, rank, case
        self.schedule = ps.make_schedule(name, case.ranks, case.microbatches)
        self.k = case.layers // self.schedule.n_stages
        n = case.microbatches * 2
        self.x, self.y = torch.randn(n, 8), torch.randn(n, 8)
        self.order: list[list[str]] | None = None
        if lib == "pipetrain":
            self.pipe = pt.Pipeline(case.make_layers(), schedule=self.schedule, loss_fn=_loss,
                                    timeout=300.0)
        else:
            self._build_torch(name)

    def _build_torch(self, name: str) -> None:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as tps

        layers, sched = self.case.make_layers(), self.schedule
        self.first, self.last = 0 in sched.stages_of(self.rank), \
            sched.n_stages - 1 in sched.stages_of(self.rank)
        stages = [PipelineStage(nn.Sequential(*layers[s * self.k:(s + 1) * self.k]), s,
                                sched.n_stages, torch.device("cpu"))
                  for s in sched.stages_of(self.rank)]
        self.recorders = [_TorchSpans(s) for s in stages]
        cls = getattr(tps, SHARED[name])
        arg = stages[0] if len(stages) == 1 else stages
        self.torch_schedule = cls(arg, self.case.microbatches, loss_fn=_loss)
        self.order = _torch_order(self.torch_schedule, sched.n_ranks)

    def step(self) -> Callable[[], list[tuple[str, int, float, float]]]:
        """One step; returns how to read its op spans (done after the step's time is taken)."""
        _LOG.clear()
        if self.lib == "pipetrain":
            result = self.pipe.step(self.x, self.y)
            return lambda: [(s.action.op.value, s.action.stage, s.start, s.end)
                            for s in result.timeline.of_rank(self.rank)]
        for r in self.recorders:
            r.spans.clear()
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y} if self.last else {}
        self.torch_schedule.step(*args, return_outputs=False, **kwargs)
        return lambda: sorted((s for r in self.recorders for s in r.spans), key=lambda s: s[2])

    def check(self, spans: Sequence[tuple[str, int, float, float]]
              ) -> tuple[int, dict[str, list[float]]]:
        """Sleeps of this step run outside an op allowed to run them; per-op time not slept.

        (The first layer's I sleep never runs: nothing needs its input's gradient.)"""
        allowed = {"F": {"F"}, "I": {"I", "B"}, "W": {"W", "B"}}
        bad = 0
        for op, layer, t0, t1 in _LOG:
            stage = layer // self.k
            ok_ops = {"W", "B"} if op == "I" and stage == 0 else allowed[op]
            if not any(s == stage and o in ok_ops and a - 1e-4 <= t0 and t1 <= b + 1e-4
                       for o, s, a, b in spans):
                bad += 1
        extra: dict[str, list[float]] = {}
        for o, _, a, b in spans:
            slept = sum(t1 - t0 for _, _, t0, t1 in _LOG if a <= t0 and t1 <= b)
            extra.setdefault(o, []).append(b - a - slept)
        return bad, extra


def _torch_order(schedule: Any, n_ranks: int) -> list[list[str]] | None:
    order = getattr(schedule, "pipeline_order", None)
    if order is None:
        order = schedule._get_pipeline_order()  # GPipe and 1F1B: their printable order
    if order is None:
        return None
    out: list[list[str]] = []
    for rank in range(n_ranks):
        acts: list[str] = []
        for a in order.get(rank, []):
            for sub in (a.sub_actions or (a,)) if a is not None else ():
                op = sub.computation_type.value
                if op in ("F", "B", "I", "W"):
                    acts.append(f"{sub.stage_index}{op}{sub.microbatch_index}")
        out.append(acts)
    return out


def _measure(runners: dict[str, Any], case: Case) -> dict[str, Any]:
    """Warm up, then alternate the libraries' steps so both see the same machine noise."""
    out: dict[str, Any] = {lib: {"step": [], "span": [], "misplaced": 0, "extra": {},
                                 "op_extra": []} for lib in runners}
    for n in range(case.warmup + case.steps):
        for lib, runner in runners.items():
            dist.barrier()
            t0 = time.time()
            read_spans = runner.step()
            t1 = time.time()
            spans = read_spans()
            if n >= case.warmup:
                out[lib]["step"].append((t0, t1))
                out[lib]["span"].append((min(s[2] for s in spans), max(s[3] for s in spans)))
                bad, extra = runner.check(spans)
                out[lib]["misplaced"] += bad
                for op, values in extra.items():
                    out[lib]["extra"].setdefault(op, []).extend(values)
                out[lib]["op_extra"].append(sum(sum(v) for v in extra.values()))
    for lib, runner in runners.items():
        out[lib]["order"] = runner.order
    return out


def rank_body(ctx: pt.RankContext, cases: list[Case]) -> list[dict[str, Any]]:
    """Run every case and schedule on this rank; return raw timings."""
    results = []
    for case in cases:
        for name in case.schedules:
            libs = ["pipetrain"] + (["torch"] if name in SHARED else []) + ["bare"]
            runners: dict[str, Any] = {}
            errors = {}
            for lib in libs:
                try:
                    runners[lib] = (_Runner(lib, name, case, ctx.rank) if lib != "bare" else
                                    BareRunner(ps.make_schedule(name, case.ranks,
                                                                case.microbatches),
                                               ctx.rank, case.layers, case.f, case.i, case.w))
                except (ValueError, RuntimeError) as e:  # a schedule refusing (m, p)
                    errors[lib] = f"{type(e).__name__}: {e}"
            dist.barrier()
            raw = _measure(runners, case)
            results.append({"case": case, "schedule": name, "raw": raw, "errors": errors})
    return results


# -- summary -------------------------------------------------------------------------------


def _median_step(per_rank: list[list[tuple[float, float]]]) -> float:
    # A step lasts from the first rank's start to the last rank's end.
    n = len(per_rank[0])
    return statistics.median(max(r[j][1] for r in per_rank) - min(r[j][0] for r in per_rank)
                             for j in range(n))


def _predict(case: Case, name: str, order: list[list[str]] | None) -> tuple[float, str]:
    """Simulated makespan of the library's own action order; pipetrain's where it has none.

    torch's printable order is what its runtime executes for the IR-driven schedules; for
    GPipe and 1F1B it is a separate derivation, and 1F1B's does not validate.
    """
    ours = ps.make_schedule(name, case.ranks, case.microbatches)
    costs = stage_costs(case, ours.n_stages)
    if order is not None:
        try:
            actions = [[ps.Action.parse(a) for a in acts] for acts in order]
            theirs = ps.Schedule.from_lists(name, case.microbatches, ours.placement, actions)
            return ps.simulate(theirs, costs).makespan, "own order"
        except (ValueError, pt.PipelineError):
            pass
    return ps.simulate(ours, costs).makespan, "pipetrain order"


def summarize(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (case, schedule), from every rank's raw timings."""
    rows = []
    for j, first in enumerate(per_rank[0]):
        case, name = first["case"], first["schedule"]
        row: dict[str, Any] = {
            "setting": case.label, "p": case.ranks, "m": case.microbatches,
            "F_ms": case.f * 1e3, "I_ms": case.i * 1e3, "W_ms": case.w * 1e3,
            "layers": case.layers, "schedule": name, "ideal_s": ideal(case),
            "errors": first["errors"],
        }
        for lib in ("pipetrain", "torch", "bare"):
            if lib not in first["raw"]:
                row[lib] = None
                continue
            raws = [r[j]["raw"][lib] for r in per_rank]
            measured = _median_step([r["step"] for r in raws])
            pred, source = _predict(case, name, raws[0]["order"])
            extra: dict[str, list[float]] = {}
            for r in raws:
                for op, values in r["extra"].items():
                    extra.setdefault(op, []).extend(values)
            row[lib] = {
                "measured_s": measured, "span_s": _median_step([r["span"] for r in raws]),
                "predicted_s": pred, "predicted_from": source,
                "efficiency": pred / measured,
                "misplaced_sleeps": sum(r["misplaced"] for r in raws),
                "busiest_op_extra_s": statistics.median(
                    max(r["op_extra"][j] for r in raws) for j in range(len(raws[0]["op_extra"]))),
                "op_overhead_ms": {op: 1e3 * statistics.median(v) for op, v in extra.items()},
            }
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'setting':<14}{'m':>3} {'schedule':<17}{'ideal':>7}{'pt pred':>9}{'pt meas':>9}"
            f"{'pt eff':>8}{'pt op+':>8}{'th pred':>9}{'th meas':>9}{'th eff':>8}{'th op+':>8}"
            f"{'pt/th':>7}{'bare eff':>9} split")
    lines = [head, "-" * len(head)]
    for r in rows:
        pt_, th, bare = r["pipetrain"], r["torch"], r.get("bare")

        def cell(d: dict[str, Any] | None, key: str, fmt: str) -> str:
            v = None if d is None else d[key]
            return "-" if v is None else format(v, fmt)

        ratio = "-" if th is None else f"{th['measured_s'] / pt_['measured_s']:.3f}"
        bad = sum(d["misplaced_sleeps"] for d in (pt_, th) if d is not None)
        lines.append(
            f"{r['setting']:<14}{r['m']:>3} {r['schedule']:<17}{r['ideal_s']:>7.3f}"
            f"{cell(pt_, 'predicted_s', '.3f'):>9}{cell(pt_, 'measured_s', '.3f'):>9}"
            f"{cell(pt_, 'efficiency', '.3f'):>8}{cell(pt_, 'busiest_op_extra_s', '.3f'):>8}"
            f"{cell(th, 'predicted_s', '.3f'):>9}{cell(th, 'measured_s', '.3f'):>9}"
            f"{cell(th, 'efficiency', '.3f'):>8}{cell(th, 'busiest_op_extra_s', '.3f'):>8}"
            f"{ratio:>7}{cell(bare, 'efficiency', '.3f'):>9} {'ok' if bad == 0 else f'{bad} bad'}")
    return "\n".join(lines)


def _cases(args: argparse.Namespace) -> list[Case]:
    settings = [("F=I=W", args.f, args.f, args.f)]
    if args.unequal:
        f, i, w = (float(x) for x in args.unequal.split(","))
        settings.append((f"F={f:g},I={i:g},W={w:g}", f, i, w))
    schedules = tuple(args.schedules.split(",")) if args.schedules else (
        *SHARED, *OURS_ONLY)
    return [Case(label if label != "F=I=W" else f"F=I=W={f:g}", args.p, m, f / 1e3, i / 1e3,
                 w / 1e3, args.layers or 2 * args.p, schedules, args.warmup, args.steps)
            for label, f, i, w in settings for m in args.m]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4, help="ranks (processes)")
    parser.add_argument("--m", type=int, nargs="+", default=[8, 16, 32], help="micro-batches")
    parser.add_argument("--f", type=float, default=10.0, help="F = I = W per layer, ms")
    parser.add_argument("--unequal", default="10,10,5", help="'F,I,W' ms per layer; '' skips")
    parser.add_argument("--layers", type=int, default=0, help="sleep layers (default 2p)")
    parser.add_argument("--schedules", default="", help="comma list (default: all)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", help="write rows and machine description here")
    parser.add_argument("--tiny", action="store_true", help="p=2, m=4, 1 ms, 2 steps (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.p, args.m, args.f, args.unequal, args.steps = 2, [4], 1.0, "", 2
    cases = _cases(args)
    for c in cases:
        if c.layers % (2 * c.ranks):
            parser.error(f"--layers {c.layers} must be a multiple of 2p = {2 * c.ranks}")
    started = time.time()
    per_rank = pt.launch(rank_body, args.p, cases, timeout=3600)
    rows = summarize(per_rank)
    print(format_table(rows))
    print("times in s; pred = simulator makespan for the same per-stage costs; eff = pred / "
          "measured (median step); op+ = time inside ops not slept, summed over the busiest "
          "rank's ops of a step; pt/th = torch step / pipetrain step; bare eff = the same "
          "schedule run by benchmarks/bare.py (sleeps and one-element messages only): the "
          "machine's floor")
    if args.json:
        gb.save_json(args.json, {"rows": rows}, wall_s=time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
