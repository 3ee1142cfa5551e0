"""``pipetrain plan``: profile the model, calibrate on the ranks, search layouts, write the best.

    $ pipetrain plan --preset small --nproc 4 --memory-limit 64MiB
    $ pipetrain plan --hf llama-local --data notes.txt --nproc 4 --memory-limit 16GiB
    $ pipetrain plan --module train.py:build --pp 4 --memory-limit 1TiB   # module_command.py

0. Layouts: every ``pp x dp x fsdp x tp = nproc`` (pp at least 2; FSDP under each reshard)
   that the flags given pin and ``pipetrain train`` accepts (:func:`candidate_layouts`).
1. Profile every layer in this process on one micro-batch of each size the search tries
   (:mod:`pipetrain.plan.unit_profile`): the GPT preset's blocks, or the decoder layers of
   ``--hf DIR``, under tensor parallelism one rank's share of each.
2. Calibrate: train 3 steps of zb-h1, of 1f1b, and of 1f1b recomputed on the ranks (one
   local launch, as ``pipetrain train``, at the fewest pipeline ranks searched, the rest
   replicas); the measured/profiled ratio of each op, the hop delay, the step's time outside
   the schedule, the runtime's cost per action and what recomputation adds scale every
   prediction (:mod:`pipetrain.schedules.calibration`); then time all-reduce, all-gather and
   reduce-scatter over groups of each size the layouts use (:mod:`pipetrain.plan.shardcost`).
3. Search (:func:`pipetrain.plan.planner.search`) each layout, print the best candidates, and
   write the best
   one's predicted timeline (``plan.png``) and a config that ``pipetrain train --config``
   runs as it is (``plan.toml``) under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from pipetrain.parallel import RESHARD
from pipetrain.plan.unit_profile import profile_layouts
from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.choice import kind_of

__all__ = ["HELP", "configure", "run"]

HELP = ("choose the fastest layout (pp x dp x fsdp x tp, schedule, micro-batches, balance, "
        "recompute) that fits memory")
EXIT_OK, EXIT_NONE_FITS = 0, 3


def configure(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--memory-limit", metavar="SIZE",
                        help="bytes each device may hold, e.g. 64MiB or 16GiB (default: the "
                             "GPU's total memory; on CPU the available RAM / the local ranks)")
    parser.add_argument("--preset", default=d.preset, help="GPT preset (default: %(default)s)")
    parser.add_argument("--hf", default=d.hf, metavar="DIR|ORG/NAME",
                        help="a local Hugging Face save_pretrained directory, or a Hub id "
                             "ORG/NAME[@REVISION], instead of --preset")
    parser.add_argument("--module", metavar="SPEC", help="your own model instead: "
                        "path/to/file.py:function or package.module:function returning a dict "
                        "of model, example_inputs, loss_fn, target (pipetrain.plan.module_command)")
    parser.add_argument("--data", default=d.data, metavar="PATH",
                        help="text the calibration steps train on (default: the stdlib's sources)")
    parser.add_argument("--token-cache", default=d.token_cache, metavar="DIR",
                        help="with --hf: where tokenized corpora are kept (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=d.seq_len, metavar="N")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, metavar="N",
                        help="sequences per step over all replicas (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=d.nproc, metavar="N")
    parser.add_argument("--pp", type=int, metavar="N",
                        help="pipeline ranks (default: search, at least 2)")
    parser.add_argument("--dp", type=int, metavar="N", help="data-parallel replicas "
                        "(default: search, with --fsdp and --tp, what nproc/pp leaves)")
    parser.add_argument("--fsdp", type=int, metavar="N", help="FSDP shards (default: search)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="tensor-parallel ranks (default: search; not with --hf)")
    parser.add_argument("--ep", type=int, metavar="N", help="expert-parallel ranks, of the "
                        "data-parallel ones (default: search, for an --hf mixture of experts)")
    parser.add_argument("--fsdp-reshard", choices=RESHARD, metavar="WHEN",
                        help="FSDP's reshard: step, layer or part (default: search)")
    parser.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    parser.add_argument("--schedules", metavar="NAMES",
                        help="comma-separated schedules to consider (default: all)")
    parser.add_argument("--allow-async", action="store_true",
                        help="consider pipedream-2bw too, whose update uses the gradient of the "
                        "step before (never chosen without this)")
    parser.add_argument("--top", type=int, default=8, metavar="N",
                        help="candidates to show (default: %(default)s)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="predict from the profile alone (faster, less accurate)")
    parser.add_argument("--out", type=Path, default=Path("runs/plan"), metavar="DIR",
                        help="where plan.toml and plan.png go (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    from pipetrain.plan.cluster.cluster_command import configure_cluster

    configure_cluster(parser)


def run(args: argparse.Namespace) -> int:
    """Plan; exit 3 when no candidate fits the limit (the fastest is still written)."""
    if args.cluster or args.hardware:
        from pipetrain.plan.cluster.cluster_command import run_cluster

        return run_cluster(args)
    if args.module:
        from pipetrain.plan.module_command import run_module

        return run_module(args)
    from pipetrain.plan.limit import memory_limit
    from pipetrain.plan.measured import calibrate_on_ranks, on_cuda, shared_cores
    from pipetrain.plan.planner import ASYNCHRONOUS, SCHEDULES, Scale, ranked, search
    from pipetrain.plan.shardcost import Collectives
    from pipetrain.train.commands.train_command import check

    limit, chosen = memory_limit(args.memory_limit, args.device, args.nproc)
    if chosen:
        print(f"pipetrain plan: {chosen}", file=sys.stderr, flush=True)
    cfg = TrainConfig(preset=args.preset, hf=args.hf, data=args.data,
                      token_cache=args.token_cache, seq_len=args.seq_len,
                      batch_size=args.batch_size, nproc=args.nproc, device=args.device, out="",
                      progress=False, sample_tokens=0, eval_batches=1)
    check(cfg, training=False)
    layouts = candidate_layouts(cfg, args.pp, args.dp, args.fsdp, args.tp, args.fsdp_reshard,
                                args.ep)
    schedules = _schedules(args.schedules, SCHEDULES, ASYNCHRONOUS if args.allow_async else ())
    calib = _calibration_layout(layouts, cfg.nproc)
    profiles = profile_layouts(cfg, [*layouts, calib])
    cores = shared_cores(cfg)
    scale, collectives = ((Scale(cores=cores), Collectives.default()) if args.no_calibrate
                          else calibrate_on_ranks(cfg, calib, profiles, cores, layouts))
    scale = dataclasses.replace(scale, foreach=on_cuda(cfg))  # AdamW's kernels there
    found = []
    for pp, sharding in layouts:
        found += search(profiles[pp, sharding.tp], pp, cfg.batch_size // sharding.data, limit,
                        scale, schedules=schedules, sharding=sharding,
                        collectives=collectives)
    candidates = ranked(found)
    if not candidates:
        raise ValueError("no layout is possible: the model has fewer layers than stages; "
                         "use fewer pipeline ranks (--pp)")
    best = candidates[0]
    toml_path, png_path = _write(args.out, cfg, best)
    report = {"best": best.to_dict(), "candidates": [c.to_dict() for c in candidates],
              "config": str(toml_path), "png": str(png_path), "memory_limit": limit,
              "scale": dataclasses.asdict(scale), "collectives": collectives.fitted}
    if args.json:
        print(json.dumps(report))
    else:
        _print(candidates[:args.top], limit, cfg, toml_path, png_path)
    return EXIT_OK if best.fits else EXIT_NONE_FITS


Layout = tuple[int, Any]
"""(pipeline ranks, :class:`pipetrain.plan.shardcost.Sharding` of each)."""


def candidate_layouts(cfg: TrainConfig, pp: int | None, dp: int | None, fsdp: int | None,
                      tp: int | None, reshard: str | None, ep: int | None = 1) -> list[Layout]:
    """Every ``pp x dp x fsdp x tp = nproc`` the flags given allow and ``pipetrain train``
    accepts for ``cfg`` (pp at least 2 unless given; with ``--hf``, tp only for a model that
    declares a plan whose heads split, and whose weights are stored), each at every ``ep``
    that fits (``ep=None``: search; :func:`pipetrain.plan.experts.ep_choices`).

    Raises:
        ValueError: when none does, saying why (the first of them's reason).
    """
    from pipetrain.plan.experts import ep_choices
    from pipetrain.plan.shardcost import Sharding
    from pipetrain.train.checks import check_config
    from pipetrain.train.mesh import layout

    n, out, why = cfg.nproc, [], None
    moe = kind_of(cfg).meta_model(cfg) if ep != 1 else None
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    for p, d, s, t in itertools.product(divisors, repeat=4):
        if p * d * s * t != n or (pp is None and p < 2 and n > 1) or any(
                given is not None and given != v for given, v in
                ((pp, p), (dp, d), (fsdp, s), (tp, t))):
            continue
        trial = dataclasses.replace(cfg, pp=p, dp=d, fsdp=s, tp=t, microbatches=1,
                                    sequence_parallel=bool(cfg.seq_len % t == 0))
        try:
            check_config(trial, n)
        except ValueError as e:
            why = why or e
            continue
        for when in (RESHARD if s > 1 and reshard is None else (reshard or "part",)):
            out += [(p, Sharding(d, s, t, when, e)) for e in ep_choices(moe, d * s, s, t, ep)]
    if not out:
        if why is None:
            layout(n, dp or 1, pp, fsdp or 1, tp or 1)  # raises, naming the mismatch
        raise ValueError(f"no layout of {n} processes is possible with these flags: {why}")
    return out


def _calibration_layout(layouts: list[Layout], nproc: int) -> Layout:
    """What the calibration trains: the fewest pipeline ranks searched, replicated."""
    from pipetrain.plan.shardcost import Sharding

    pp = min(p for p, _ in layouts)
    return pp, Sharding(dp=nproc // pp)


def _schedules(text: str | None, known: tuple[str, ...],
               allowed: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The schedules to search: ``known``, and the asynchronous ones ``allowed``."""
    known = known + allowed
    if text is None:
        return known
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown and not allowed and any(n.startswith("pipedream") for n in unknown):
        raise ValueError(f"--schedules: {unknown} update with the gradient of the step before "
                         "(asynchronous); pass --allow-async to consider them")
    if unknown or not names:
        raise ValueError(f"--schedules: unknown {unknown}; choose among {list(known)}")
    return names


# -- 2. report ------------------------------------------------------------------------------


def _write(out: Path, cfg: TrainConfig, best: Any) -> tuple[Path, Path]:
    from pipetrain.schedules import draw
    from pipetrain.train.commands.finetune import fine_tuning_defaults
    from pipetrain.train.config import config_toml

    out.mkdir(parents=True, exist_ok=True)
    schedule = best.schedule
    if "schedule_text" in best.to_dict():  # a searched schedule: train runs this very one
        schedule = str(out / "plan.schedule.csv")
        Path(schedule).write_text(best.to_dict()["schedule_text"])
    chosen = dataclasses.replace(
        cfg, schedule=schedule, stages_per_rank=best.stages_per_rank,
        microbatches=best.microbatches, balance=",".join(map(str, best.balance)),
        recompute=best.recompute, out="runs/pipetrain", progress=True,
        sample_tokens=TrainConfig.sample_tokens, eval_batches=TrainConfig.eval_batches,
        pp=best.simulation.schedule.n_ranks, dp=best.sharding.dp, fsdp=best.sharding.fsdp,
        tp=best.sharding.tp, fsdp_reshard=best.sharding.reshard, ep=best.sharding.ep,
        sequence_parallel=cfg.seq_len % best.sharding.tp == 0)
    toml_path, png_path = out / "plan.toml", out / "plan.png"
    # with --hf weights, train picks the fine-tuning optimiser settings itself (not lr=1e-2)
    toml_path.write_text(config_toml(chosen, left_out=fine_tuning_defaults({"hf": cfg.hf})))
    draw.save_png(best.simulation.timeline, png_path,
                  title=f"plan: {_layout(best)}, {best.schedule} m={best.microbatches} balance "
                        f"{list(best.balance)} recompute {best.recompute} (predicted)")
    return toml_path, png_path


def _print(shown: list[Any], limit: int, cfg: TrainConfig, toml_path: Path,
           png_path: Path) -> None:
    from pipetrain.plan.table import print_candidates

    print_candidates(shown, f"pipetrain plan: {kind_of(cfg).label(cfg)}, memory limit "
                     f"{_mib(limit)} per rank", _layout, tokens=cfg.batch_size * cfg.seq_len)
    print(f"best: {toml_path} (pipetrain train --config {toml_path}); timeline {png_path}")
    if not shown[0].fits:
        print("no layout fits: raise --memory-limit, add ranks (--nproc), or shorten "
              "--seq-len / --batch-size", file=sys.stderr)


def _layout(c: Any) -> str:
    """``pp2``, ``pp2 fsdp2 part``, ``pp2 tp2``."""
    sharded = c.sharding.label()
    return f"pp{c.simulation.schedule.n_ranks}" + ("" if sharded == "-" else f" {sharded}")


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"
