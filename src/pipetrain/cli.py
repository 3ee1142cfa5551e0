"""Command line: list schedules, simulate one, or validate a hand-written schedule file.

Each subcommand is a :class:`Subcommand` (help, parser setup, run) in the table that
:func:`subcommands` returns; a new one (``train``) lives in its own module and adds one
entry there. Exit codes: 0 success, 1 invalid schedule, 2 bad arguments, 3 a simulated
peak above ``--memory-limit``.

    $ pipetrain schedules
    $ pipetrain simulate --schedule 1f1b --ranks 4 --microbatches 8 --png 1f1b.png
    $ pipetrain simulate -s zb-auto -p 4 -m 8 --memory-limit 4 --w-share 0.5
    $ pipetrain validate my_schedule.csv --cost F=1,I=1,W=1
    $ pipetrain verify --hf tiny-llama --schedule zbv --pp 2
    $ pipetrain generate --hf tiny-llama --nproc 2 --prompt "def "
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipetrain.errors import ScheduleError
from pipetrain.plan import plan_command as plan_cli
from pipetrain.schedules import draw
from pipetrain.schedules.generators import REGISTRY, Target, _load_builtin, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulator import DEFAULT_W_SHARE, Costs, Simulation, simulate
from pipetrain.schedules.steady_state import SteadyState, steady_state
from pipetrain.schedules.validate import format_grid, validate
from pipetrain.train.commands import export_command as export_cli
from pipetrain.train.commands import generate_command as generate_cli
from pipetrain.train.commands import train_command as train_cli
from pipetrain.train.commands import verify_command as verify_cli

__all__ = ["Subcommand", "subcommands", "build_parser", "main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE, EXIT_UNFIT = 0, 1, 2, 3


@dataclass(frozen=True)
class Subcommand:
    """One ``pipetrain <name>`` command."""

    help: str
    """One line shown by ``pipetrain --help``."""
    configure: Callable[[argparse.ArgumentParser], None]
    """Adds the command's arguments to its parser."""
    run: Callable[[argparse.Namespace], int]
    """Runs the command and returns its exit code; may raise ScheduleError or ValueError."""


def subcommands() -> dict[str, Subcommand]:
    """The built-in commands, in the order ``--help`` lists them."""
    return {
        "schedules": Subcommand("list the schedule names with their descriptions",
                                lambda p: None, _run_schedules),
        "simulate": Subcommand("generate a schedule, simulate it and draw its timeline",
                               _configure_simulate, _run_simulate),
        "validate": Subcommand("check a hand-written schedule file, then simulate it",
                               _configure_validate, _run_validate),
        "train": Subcommand(train_cli.HELP, train_cli.configure, train_cli.run),
        "export-hf": Subcommand(export_cli.HELP, export_cli.configure, export_cli.run),
        "plan": Subcommand(plan_cli.HELP, plan_cli.configure, plan_cli.run),
        "verify": Subcommand(verify_cli.HELP, verify_cli.configure, verify_cli.run),
        "generate": Subcommand(generate_cli.HELP, generate_cli.configure, generate_cli.run),
    }


def build_parser(commands: Mapping[str, Subcommand] | None = None) -> argparse.ArgumentParser:
    """The ``pipetrain`` parser with one subparser per command (default: :func:`subcommands`)."""
    parser = argparse.ArgumentParser(
        prog="pipetrain",
        description="Pipeline-parallel schedules: list, simulate, validate; train a GPT.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in (commands or subcommands()).items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(child)
        child.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``pipetrain`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit code.

    Example:
        >>> main(["simulate", "-s", "1f1b", "-p", "4", "-m", "8", "--json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error already printed by argparse
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    prog = f"pipetrain {args.command}"
    try:
        _hub(args)
        code: int = args.run(args)
    except BrokenPipeError:  # e.g. `pipetrain simulate ... | head`: the reader left early
        _silence_stdout()
        return EXIT_INVALID
    except ScheduleError as e:  # before ValueError: ScheduleError is also a ValueError
        print(f"{prog}: invalid schedule: {e}", file=sys.stderr)
        return EXIT_INVALID
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ImportError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_INVALID
    return code


def _hub(args: argparse.Namespace) -> None:
    """``--hf ORG/NAME[@REVISION]`` replaced by its local snapshot (:mod:`pipetrain.hf.hub`);
    a plan of a cluster reads only the config."""
    spec = getattr(args, "hf", None)
    if isinstance(spec, str) and spec:
        from pipetrain.hf.hub import CONFIG, local

        args.hf = local(spec, CONFIG if getattr(args, "cluster", None) else None)
        args.hf_spec = spec  # as given, for a plan.toml that runs elsewhere


def _silence_stdout() -> None:
    # Point stdout at devnull so the interpreter's final flush does not fail a second time.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


# ------------------------------------------------------------------------------ schedules


def _run_schedules(args: argparse.Namespace) -> int:
    _load_builtin()
    rows = [(k.name, str(k.default_stages_per_rank), k.description)
            for k in sorted(REGISTRY.values(), key=lambda k: k.name)]
    width = max(len("name"), *(len(name) for name, _, _ in rows))
    print(f"{'name':<{width}}  v  description")
    for name, v, description in rows:
        print(f"{name:<{width}}  {v:>1}  {description}")
    print("\nv: default stages per rank (--stages-per-rank overrides it where the schedule "
          "allows)")
    return EXIT_OK


# ------------------------------------------------------------------------------- simulate


def _configure_simulate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-s", "--schedule", required=True, metavar="NAME",
                        help="schedule name (see `pipetrain schedules`)")
    parser.add_argument("-p", "--ranks", required=True, type=int, metavar="P",
                        help="ranks in the pipeline")
    parser.add_argument("-m", "--microbatches", required=True, type=int, metavar="M",
                        help="micro-batches per step")
    parser.add_argument("-v", "--stages-per-rank", type=int, metavar="V",
                        help="stages held by each rank (default: the schedule's own)")
    _add_run_options(parser)
    parser.add_argument("--grid", action="store_true",
                        help="also print the rank-by-step action grid")


def _configure_validate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE",
                        help="schedule grid: one column per rank, e.g. written by "
                             "Schedule.save")
    _add_run_options(parser)


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", metavar="COSTS",
                        help="per stage per micro-batch, e.g. F=1,B=2 or F=1,I=1,W=1 "
                             "(default F=1,I=1,W=1,B=2)")
    parser.add_argument("--comm", type=float, default=0.0, metavar="T",
                        help="delay of every message between ranks (default 0)")
    parser.add_argument("--w-share", type=float, metavar="X",
                        help="share of an activation kept from I until W, in [0, 1]")
    parser.add_argument("--memory-limit", type=float, metavar="N",
                        help="the most stage-activations a rank may hold (the simulator's "
                             "count at --w-share): zb-auto searches under it; for any "
                             "schedule, exit 3 when a rank's simulated peak is above it")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (the simulation) instead of text")
    parser.add_argument("--png", type=Path, metavar="FILE", help="write a timeline picture")
    parser.add_argument("--trace", type=Path, metavar="FILE",
                        help="write a Chrome/Perfetto trace (JSON)")
    parser.add_argument("--width", type=int, metavar="N",
                        help="characters for the text timeline (default: fit the actions)")


def _run_simulate(args: argparse.Namespace) -> int:
    target = Target(memory_limit=args.memory_limit, costs=_costs(args), comm=args.comm,
                    **_w_share(args))
    schedule = make_schedule(args.schedule, args.ranks, args.microbatches,
                             args.stages_per_rank, target)
    return _report(schedule, args, grid=args.grid)


def _run_validate(args: argparse.Namespace) -> int:
    schedule = Schedule.load(args.file)
    validate(schedule)
    if not args.json:
        print(f"{args.file}: valid schedule {schedule.name!r}\n")
    return _report(schedule, args, grid=False)


# -------------------------------------------------------------------------------- output


def _report(schedule: Schedule, args: argparse.Namespace, *, grid: bool) -> int:
    """Simulate ``schedule`` with the run options, print it and write the requested files.

    An asynchronous schedule is shown as three steps and the drain unrolled
    (:meth:`Schedule.unroll`), under a line of its steady state (:func:`steady_state`)."""
    steady = None
    if schedule.update is not None:
        steady = steady_state(schedule, _costs(args), args.comm)
        schedule = schedule.unroll(3)
    sim = simulate(schedule, _costs(args), args.comm,
                   w_share=_w_share(args).get("w_share", DEFAULT_W_SHARE))
    fit = _fit(sim, args.memory_limit)
    if args.json:
        print(json.dumps({**sim.to_dict(), **fit,
                          **({"steady": steady.to_dict()} if steady else {})}))
    else:
        if steady is not None:
            print(_steady_line(steady))
        print(_summary(sim))
        if fit:
            print(_fit_line(sim, args.memory_limit))
        print()
        print(draw.text_timeline(sim.timeline, args.width))
        if grid:
            print()
            print(format_grid(schedule))
    _write_files(sim, args)
    return EXIT_UNFIT if fit and not fit["fits"] else EXIT_OK


def _steady_line(steady: SteadyState) -> str:
    versions = ", ".join(str(v) for v in steady.peak_versions)
    return (f"asynchronous ({steady.schedule.update}): {steady.period:g} per step in the steady "
            f"state, bubble fraction {steady.bubble_fraction:.3f}, weight versions per rank "
            f"{versions}; below, 3 steps and the drain unrolled")


def _costs(args: argparse.Namespace) -> Costs:
    return Costs.parse(args.cost) if args.cost is not None else Costs()


def _w_share(args: argparse.Namespace) -> dict[str, float]:
    return {} if args.w_share is None else {"w_share": args.w_share}


def _fit(sim: Simulation, limit: float | None) -> dict[str, object]:
    """``{"memory_limit", "fits"}`` for the JSON output, or nothing without a limit."""
    if limit is None:
        return {}
    if not (limit >= 0 and limit != float("inf")):
        raise ValueError(f"--memory-limit must be a finite number >= 0, got {limit!r}")
    return {"memory_limit": limit, "fits": max(sim.peak_activations) <= limit + 1e-9}


def _fit_line(sim: Simulation, limit: float) -> str:
    peak = max(sim.peak_activations)
    rank = sim.peak_activations.index(peak)
    if peak <= limit + 1e-9:
        return f"memory limit    {limit:g} stage-activations: fits (peak {peak:g}, rank {rank})"
    over = [r for r, x in enumerate(sim.peak_activations) if x > limit + 1e-9]
    return (f"memory limit    {limit:g} stage-activations: DOES NOT FIT on ranks {over} "
            f"(peak {peak:g}, rank {rank}); choose a schedule with less memory (v-half, "
            "v-min, zb-auto under this limit) or fewer micro-batches in flight")


def _write_files(sim: Simulation, args: argparse.Namespace) -> None:
    if args.png is not None:
        draw.save_png(sim.timeline, args.png, title=_title(sim.schedule))
        print(f"wrote {args.png}", file=sys.stderr)
    if args.trace is not None:
        draw.save_trace(sim.timeline, args.trace)
        print(f"wrote {args.trace}", file=sys.stderr)


def _title(schedule: Schedule) -> str:
    return (f"{schedule.name}   p={schedule.n_ranks}  m={schedule.n_microbatches}  "
            f"v={_stages_per_rank(schedule)}")


def _stages_per_rank(schedule: Schedule) -> str:
    p, n = schedule.n_ranks, schedule.n_stages
    return str(n // p) if p and n % p == 0 else f"{n}/{p}"


def _summary(sim: Simulation) -> str:
    s = sim.schedule
    lines = [
        f"schedule        {s.name}",
        f"ranks (p)       {s.n_ranks}",
        f"micro-batches   {s.n_microbatches}",
        f"stages          {s.n_stages} ({_stages_per_rank(s)} per rank)",
        f"costs           {sim.costs} per stage per micro-batch; comm {sim.comm:g}",
        f"makespan        {sim.makespan:g}",
        f"bubble          fraction {sim.bubble_fraction:.3f} (idle share of device time), "
        f"rate {sim.bubble_rate:.3f}",
        "",
        *_rank_table(sim),
    ]
    return "\n".join(lines)


def _rank_table(sim: Simulation) -> list[str]:
    header = ("rank", "span", "idle", "peak activations")
    rows = [(str(r), f"{sim.span[r]:g}", f"{sim.idle[r]:g}", f"{sim.peak_activations[r]:g}")
            for r in range(sim.schedule.n_ranks)]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
            for row in (header, *rows)]
