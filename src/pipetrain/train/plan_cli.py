"""``pipetrain plan``: profile the model, calibrate on the ranks, search layouts, write the best.

    $ pipetrain plan --preset small --nproc 4 --memory-limit 64MiB
    $ pipetrain plan --hf llama-local --data notes.txt --nproc 4 --memory-limit 16GiB

1. Profile every layer in this process on one micro-batch of each size the search tries
   (:func:`pipetrain.profile.profile_layers`): the GPT preset's blocks, or the decoder layers
   of ``--hf DIR`` (captured with torch.export and cut where ``pipetrain train --hf`` cuts).
2. Calibrate: train 3 steps of zb-h1, of 1f1b, and of 1f1b recomputed on the ranks (one
   local launch, as ``pipetrain train``); the measured/profiled ratio of each op, the hop
   delay, the step's time outside the schedule, the runtime's cost per action and what
   recomputation adds scale every prediction (:mod:`pipetrain.calibrate`).
3. Search (:func:`pipetrain.planner.search`), print the best candidates, and write the best
   one's predicted timeline (``plan.png``) and a config that ``pipetrain train --config``
   runs as it is (``plan.toml``) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from pipetrain.train.config import TrainConfig

__all__ = ["HELP", "configure", "run"]

HELP = "choose the fastest layout (schedule, micro-batches, balance, recompute) that fits memory"
EXIT_OK, EXIT_NONE_FITS = 0, 3
CALIBRATION_SCHEDULES = ("zb-h1", "1f1b")


def configure(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--memory-limit", required=True, metavar="SIZE",
                        help="bytes each device may hold, e.g. 64MiB or 16GiB")
    parser.add_argument("--preset", default=d.preset, help="GPT preset (default: %(default)s)")
    parser.add_argument("--hf", default=d.hf, metavar="DIR",
                        help="a local Hugging Face save_pretrained directory instead of --preset")
    parser.add_argument("--data", default=d.data, metavar="PATH",
                        help="text the calibration steps train on (default: the stdlib's sources)")
    parser.add_argument("--token-cache", default=d.token_cache, metavar="DIR",
                        help="with --hf: where tokenized corpora are kept (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, metavar="N")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N",
                        help="sequences per step over all replicas (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=d.nproc, metavar="N")
    parser.add_argument("--pp", type=int, metavar="N", help="pipeline ranks (default: nproc/dp)")
    parser.add_argument("--dp", type=int, default=d.dp, metavar="N")
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    parser.add_argument("--schedules", metavar="NAMES",
                        help="comma-separated schedules to consider (default: all)")
    parser.add_argument("--top", type=int, default=8, metavar="N",
                        help="candidates to show (default: %(default)s)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="predict from the profile alone (faster, less accurate)")
    parser.add_argument("--out", type=Path, default=Path("runs/plan"), metavar="DIR",
                        help="where plan.toml and plan.png go (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Plan; exit 3 when no candidate fits the limit (the fastest is still written)."""
    from pipetrain.planner import SCHEDULES, Scale, search
    from pipetrain.train.cli import check
    from pipetrain.train.export_cli import size_bytes
    from pipetrain.train.mesh import layout

    limit = size_bytes(args.memory_limit, "--memory-limit")
    dp, pp = layout(args.nproc, args.dp, args.pp)
    cfg = TrainConfig(preset=args.preset, hf=args.hf, data=args.data,
                      token_cache=args.token_cache, seq_len=args.seq_len,
                      batch_size=args.batch_size, nproc=args.nproc, pp=args.pp, dp=dp,
                      device=args.device, out="", progress=False, sample_tokens=0,
                      eval_batches=1)
    check(cfg)
    rows = _rows_per_replica(cfg, dp)
    schedules = _schedules(args.schedules, SCHEDULES)
    profiles = profile_model(cfg, pp, rows)
    cores = shared_cores(cfg)
    scale = (Scale(cores=cores) if args.no_calibrate
             else calibrate_on_ranks(cfg, pp, rows, profiles, cores))
    scale = dataclasses.replace(scale, foreach=on_cuda(cfg))  # AdamW's kernels there
    ranked = search(profiles, pp, rows, limit, scale, schedules=schedules)
    if not ranked:
        raise ValueError("no layout is possible: the model has fewer layers than stages; "
                         "use fewer pipeline ranks (--pp)")
    best = ranked[0]
    toml_path, png_path = _write(args.out, cfg, best)
    report = {"best": best.to_dict(), "candidates": [c.to_dict() for c in ranked],
              "config": str(toml_path), "png": str(png_path), "memory_limit": limit,
              "scale": dataclasses.asdict(scale)}
    if args.json:
        print(json.dumps(report))
    else:
        _print(ranked[:args.top], limit, cfg, toml_path, png_path)
    return EXIT_OK if best.fits else EXIT_NONE_FITS


def _rows_per_replica(cfg: TrainConfig, dp: int) -> int:
    if cfg.batch_size % dp:
        raise ValueError(f"batch_size={cfg.batch_size} must split into dp={dp} equal replicas")
    return cfg.batch_size // dp


def _schedules(text: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    if text is None:
        return known
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(f"--schedules: unknown {unknown}; choose among {list(known)}")
    return names


# -- 1. profile ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Units:
    """The layers the balance groups into stages, as ``pipetrain train`` cuts the model."""

    layers: list[torch.nn.Module]
    feed: Callable[[torch.Tensor], Any]
    """Token ids -> the first layer's input."""
    loss: Callable[[Any, torch.Tensor], torch.Tensor]


def model_units(cfg: TrainConfig, pp: int) -> Units:
    """The GPT preset's layers, or ``--hf``'s units: its decoder layers (the embedding with the
    first, norm and head with the last) captured with torch.export, materialised from the seed
    (values do not change the times)."""
    if not cfg.hf:
        from pipetrain.gpt import gpt_layers, lm_loss
        from pipetrain.train.source import GPTSource

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            return Units(gpt_layers(GPTSource(cfg).model), lambda ids: ids, lm_loss)
    from pipetrain.hf.model import open_model, split_points
    from pipetrain.layers import packed, trace_stages
    from pipetrain.lazy import NamedInit
    from pipetrain.train.hf_source import causal_lm_loss

    meta = open_model(Path(cfg.hf)).model
    model: torch.nn.Module = NamedInit(meta, cfg.seed).materialize(meta)
    # 2 rows: export specializes a dimension of size 1, and the capture serves every size
    example = {"input_ids": torch.zeros(2, cfg.seq_len, dtype=torch.long)}
    # a balance mode: the units are grouped later, so they may outnumber the stages
    traced = trace_stages(model, split_points(model, pp), example, "time", pp)
    return Units(list(traced.stages), lambda ids: packed(traced, {"input_ids": ids}),
                 causal_lm_loss)


def profile_model(cfg: TrainConfig, pp: int, rows: int) -> list[Any]:
    """The layers profiled on one micro-batch of every size the search tries."""
    from pipetrain.planner import Profiled, microbatch_choices
    from pipetrain.profile import profile_layers

    units = model_units(cfg, pp)
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a CPU run computes
    try:
        for m in microbatch_choices(rows, pp):
            ids = torch.zeros(rows // m, cfg.seq_len, dtype=torch.long)
            x = units.feed(ids)
            costs = profile_layers(units.layers, x, loss_fn=units.loss, sample_target=ids,
                                   repeats=2, reuse=True)
            out.append(Profiled(rows // m, tuple(costs), _input_bytes(units.layers, x)))
    finally:
        torch.set_num_threads(threads)
    return out


def _input_bytes(layers: list[torch.nn.Module], x: torch.Tensor) -> tuple[int, ...]:
    from pipetrain.payload import flatten
    from pipetrain.train.memory import tensor_bytes

    sizes = []
    with torch.no_grad():
        for layer in layers:
            sizes.append(tensor_bytes(flatten(x)[0]))
            x = layer(x)
    return tuple(sizes)


# -- 2. calibrate ----------------------------------------------------------------------------


def on_cuda(cfg: TrainConfig) -> bool:
    """The ranks compute on GPUs (NCCL)."""
    from pipetrain.train.elastic import backend_for

    return backend_for(cfg.device, cfg.nproc) == "nccl"


def shared_cores(cfg: TrainConfig) -> float | None:
    """The cores this machine's ranks share (one thread each), when fewer than the ranks of a
    CPU run; None when each rank has its own device or core."""
    if on_cuda(cfg):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return float(cores) if cores and cores < cfg.nproc else None


def calibrate_on_ranks(cfg: TrainConfig, pp: int, rows: int, profiles: list[Any],
                       cores: float | None = None) -> Any:
    """Measured/profiled ratios from 3 steps of each calibration schedule on the ranks, each
    step p micro-batches of the middle profile's size (fewer than the run's: the ratios and
    the per-action cost do not depend on how many, and the steps are shorter)."""
    from pipetrain.planner import Scale
    from pipetrain.train.elastic import launch_local

    prof = profiles[len(profiles) // 2]
    m = min(rows // prof.rows, pp)  # p micro-batches of the profiled size: a shorter step
    base = dataclasses.replace(cfg, microbatches=m, batch_size=prof.rows * m * cfg.dp,
                               steps=3, balance="params")
    with _stdout_to_stderr():  # the ranks print their config; stdout stays the plan's
        runs = launch_local(base, _calibration_runs)["runs"]
    split, fused, again = (_calibrated(run, cores) for run in runs)
    f, i, w, b = (_ratio(split, prof, "f", ("f",)), _ratio(split, prof, "i", ("i",)),
                  _ratio(split, prof, "w", ("w",)), _ratio(fused, prof, "b", ("i", "w")))
    scale = Scale(f=f, i=i, w=w, b=b, comm=split["comm"],
                  overhead=statistics.mean([split["overhead"], fused["overhead"]]), cores=cores)
    scale = dataclasses.replace(scale, gap=_fitted("gap", [split, fused], prof, scale, 0.05))
    return dataclasses.replace(scale, replay=_fitted("replay", [again], prof, scale, 8.0))


def _fitted(field: str, runs: list[dict[str, Any]], prof: Any, scale: Any,
            most: float) -> float:
    """The value of ``Scale.<field>``, in [0, most], whose predicted steps of ``runs`` add up to
    their measured ones (bisection: the prediction grows with it).

    ``gap``: the spans miss the runtime's work between actions, which the steps include.
    ``replay``: recomputation's cost is not all in the spans (the replay runs before a
    backward waits for its gradient)."""
    from pipetrain.planner import evaluate

    measured = sum(statistics.median(t.makespan for t in run["timelines"]) for run in runs)

    def predicted(value: float) -> float:
        trial = dataclasses.replace(scale, **{field: value}, overhead=0.0)
        return sum(evaluate(prof, run["schedule"], run["balance"], run["recompute"], 0.0,
                            trial).predicted_step_s for run in runs)

    lo, hi = 0.0, most
    if predicted(lo) >= measured:
        return lo
    if predicted(hi) <= measured:
        return hi
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def _calibrated(run: dict[str, Any], cores: float | None) -> dict[str, Any]:
    """A calibration run's costs (work at full speed when the ranks shared ``cores``) and hop."""
    from pipetrain.calibrate import calibrate

    calib = calibrate(run["timelines"], run["schedule"], cores=cores)
    return {**run, "costs": calib.costs.to_dict(), "comm": calib.comm}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _ratio(result: dict[str, Any], prof: Any, op: str, profiled: tuple[str, ...]) -> float:
    """Measured seconds of ``op`` over all stages, over the profiled seconds of the same layers."""
    from pipetrain.partition import stage_bounds

    bounds = stage_bounds(result["balance"])
    want = sum(getattr(c, o) for a, e in bounds for c in prof.layers[a:e] for o in profiled)
    got = sum(result["costs"][op.upper()])
    return got / want if want > 0 else 1.0


def _calibration_runs(cfg: TrainConfig, reporter: Any) -> dict[str, Any]:
    """On every rank, in one launch: :func:`_calibration_run` of ``cfg`` under zb-h1, 1f1b,
    and 1f1b recomputed."""
    variants = [dataclasses.replace(cfg, schedule=name) for name in CALIBRATION_SCHEDULES]
    variants.append(dataclasses.replace(cfg, schedule="1f1b", recompute="always"))
    return {"runs": [_calibration_run(variant) for variant in variants]}


def _calibration_run(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg.steps`` steps; the timelines of those after the first."""
    from pipetrain.train.loop import train_step
    from pipetrain.train.setup import build

    trainer = build(cfg)
    stats = [train_step(trainer, step) for step in range(cfg.steps)][1:]
    overhead = statistics.median(s.seconds - s.timeline.makespan for s in stats)
    return {"timelines": [s.timeline for s in stats], "schedule": trainer.pipe.schedule,
            "overhead": max(0.0, overhead), "balance": list(trainer.pipe.balance),
            "recompute": cfg.recompute}


# -- 3. report ------------------------------------------------------------------------------


def _write(out: Path, cfg: TrainConfig, best: Any) -> tuple[Path, Path]:
    from pipetrain import draw
    from pipetrain.train.cli import config_toml

    out.mkdir(parents=True, exist_ok=True)
    schedule = best.schedule
    if "schedule_text" in best.to_dict():  # a searched schedule: train runs this very one
        schedule = str(out / "plan.schedule.csv")
        Path(schedule).write_text(best.to_dict()["schedule_text"])
    chosen = dataclasses.replace(
        cfg, schedule=schedule, stages_per_rank=best.stages_per_rank,
        microbatches=best.microbatches, balance=",".join(map(str, best.balance)),
        recompute=best.recompute, out="runs/pipetrain", progress=True,
        sample_tokens=TrainConfig.sample_tokens, eval_batches=TrainConfig.eval_batches)
    toml_path, png_path = out / "plan.toml", out / "plan.png"
    toml_path.write_text(config_toml(chosen))
    draw.save_png(best.simulation.timeline, png_path,
                  title=f"plan: {best.schedule} m={best.microbatches} balance "
                        f"{list(best.balance)} recompute {best.recompute} (predicted)")
    return toml_path, png_path


def _print(shown: list[Any], limit: int, cfg: TrainConfig, toml_path: Path,
           png_path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    tokens = cfg.batch_size * cfg.seq_len
    table = Table(title=f"pipetrain plan: {cfg.preset}, memory limit {_mib(limit)} per rank",
                  title_justify="left")
    for name in ("schedule", "v", "m", "balance", "recompute", "step s", "tokens/s",
                 "peak per rank (MiB)", "fits"):
        table.add_column(name, justify="right" if name in ("v", "m", "step s", "tokens/s")
                         else "left")
    for c in shown:
        table.add_row(c.schedule, str(c.stages_per_rank), str(c.microbatches),
                      ",".join(map(str, c.balance)), c.recompute, f"{c.predicted_step_s:.3f}",
                      f"{tokens / c.predicted_step_s:,.0f}",
                      " ".join(f"{b / 2**20:.1f}" for b in c.predicted_peak_bytes),
                      "yes" if c.fits else "NO")
    console = Console()
    console.print(table)
    print(f"best: {toml_path} (pipetrain train --config {toml_path}); timeline {png_path}")
    if not shown[0].fits:
        print("no layout fits: raise --memory-limit, add ranks (--nproc), or shorten "
              "--seq-len / --batch-size", file=sys.stderr)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"
