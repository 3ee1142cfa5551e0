"""``pipetrain plan --module SPEC``: plan a user's own module, write its Pipeline arguments.

    $ pipetrain plan --module train.py:build --pp 4 --memory-limit 16GiB

``SPEC`` is ``path/to/file.py:function`` or ``package.module:function``. The function takes
no arguments and returns a dict (the contract, :data:`REQUIRED` and :data:`OPTIONAL`)::

    def build():
        model = MyModel()
        return {"model": model,                  # an nn.Module, or a list of layers
                "example_inputs": batch,         # one whole step's inputs, as forward takes
                "loss_fn": loss_fn,              # loss_fn(output, target) -> scalar
                "target": targets}               # that step's targets
                # optional: "split_dim": 1 (the batch dimension; default 0)

:func:`pipetrain.plan.module_plan.plan_module` profiles it in this process and predicts every layout
of ``--pp`` pipeline ranks (default ``--nproc``; one process each) from the profile alone, as
``--no-calibrate`` does; ``--seq-len``, ``--batch-size``, ``--data`` and ``--device`` do not
apply (the function's batch and model decide). It prints the best candidates and writes under
``--out``: ``plan.toml`` (the best layout's ``pt.Pipeline`` keyword arguments, which
:func:`read_plan` loads), ``plan.schedule.csv`` for a searched (zb-auto) schedule, and the
predicted timeline ``plan.png``. Exit 3 when no layout fits ``--memory-limit``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import itertools
import json
import sys
from collections.abc import Mapping
from difflib import get_close_matches
from pathlib import Path
from types import ModuleType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["REQUIRED", "OPTIONAL", "run_module", "load_spec", "read_plan"]

REQUIRED = ("model", "example_inputs", "loss_fn", "target")
OPTIONAL = ("split_dim",)
EXIT_OK, EXIT_NONE_FITS = 0, 3
_LOADED = itertools.count()


def run_module(args: argparse.Namespace) -> int:
    """Plan ``args.module``; exit 3 when no candidate fits (the fastest is still written)."""
    from pipetrain.plan.limit import memory_limit
    from pipetrain.plan.module_plan import plan_module
    from pipetrain.plan.planner import SCHEDULES

    others = [f"--{flag.replace('_', '-')}" for flag in ("hf", "dp", "fsdp", "tp",
                                                         "fsdp_reshard")
              if getattr(args, flag) not in (None, "", 1)]
    if others:
        raise ValueError(f"--module plans pipeline ranks only (--pp, default --nproc); drop "
                         f"{' '.join(others)}")
    ranks = args.nproc if args.pp is None else args.pp
    limit, chosen = memory_limit(args.memory_limit, args.device, ranks)
    if chosen:
        print(f"pipetrain plan: {chosen}", file=sys.stderr, flush=True)
    schedules = SCHEDULES if args.schedules is None else tuple(
        n.strip() for n in args.schedules.split(",") if n.strip())
    given = load_spec(args.module)
    plans = plan_module(given["model"], given["example_inputs"], given["loss_fn"],
                        given["target"], ranks, limit, schedules=schedules,
                        split_dim=given.get("split_dim", 0))
    best = plans[0]
    toml_path, png_path = write_plan(args.out, args.module, best, limit)
    if args.json:
        print(json.dumps({"best": best.to_dict(), "candidates": [p.to_dict() for p in plans],
                          "config": str(toml_path), "png": str(png_path),
                          "memory_limit": limit, "module": args.module, "ranks": ranks}))
    else:
        _print(plans[:args.top], limit, args.module, toml_path, png_path)
    return EXIT_OK if best.fits else EXIT_NONE_FITS


def load_spec(spec: str) -> dict[str, Any]:
    """Call ``spec``'s function (``path/to/file.py:function`` or ``package.module:function``)
    and check what it returns against the contract (the module docstring).

    Raises:
        ValueError: for a malformed spec, a missing file, module or function, or a result
            that is not a dict with the required keys (the message says what to give).
    """
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"--module {spec!r}: give path/to/file.py:function or "
                         "package.module:function")
    module = _load(spec, where)
    fn = getattr(module, name, None)
    if not callable(fn):
        near = get_close_matches(name, [n for n in dir(module) if not n.startswith("_")])
        raise ValueError(f"--module {spec!r}: {where} has no function {name!r}"
                         + (f"; did you mean {near[0]!r}?" if near else ""))
    got = fn()
    if not isinstance(got, Mapping):
        raise ValueError(f"--module {spec!r}: {name}() returned {type(got).__name__}; return a "
                         f"dict with the keys {list(REQUIRED)} (optional: {list(OPTIONAL)})")
    missing = [k for k in REQUIRED if k not in got]
    unknown = [k for k in got if k not in REQUIRED + OPTIONAL]
    if missing or unknown:
        raise ValueError(f"--module {spec!r}: {name}() returned the keys {list(got)}; "
                         f"missing {missing}, unknown {unknown}: give exactly {list(REQUIRED)} "
                         f"(optional: {list(OPTIONAL)})")
    return dict(got)


def _load(spec: str, where: str) -> ModuleType:
    """The file ``where`` run as a module (its folder importable while it loads), or the
    importable module named ``where``."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"--module {spec!r}: no file {where} (from {Path.cwd()})")
        found = importlib.util.spec_from_file_location(
            f"_pipetrain_module_{next(_LOADED)}_{path.stem}", path)
        if found is None or found.loader is None:
            raise ValueError(f"--module {spec!r}: {where} cannot be loaded as Python")
        module = importlib.util.module_from_spec(found)
        sys.modules[found.name] = module  # dataclasses and pickling look themselves up
        sys.path.insert(0, str(path.parent))
        try:
            found.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.parent))
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where == e.name or where.startswith(e.name + ".")):
            raise ValueError(f"--module {spec!r}: no module {e.name!r} on the path; give a "
                             "file (path/to/file.py:function) or install the package") from e
        raise


def write_plan(out: Path, spec: str, best: Any, limit: int) -> tuple[Path, Path]:
    """``plan.toml`` (and ``plan.schedule.csv`` for a searched schedule) and ``plan.png``
    of ``best`` (a :class:`~pipetrain.plan.module_plan.ModulePlan`) under ``out``."""
    from pipetrain.schedules import draw

    out.mkdir(parents=True, exist_ok=True)
    kwargs = best.pipeline_kwargs()
    kwargs.pop("example_inputs", None)  # the step's batch: the caller's to give
    if best.searched:
        (out / "plan.schedule.csv").write_text(kwargs.pop("schedule").to_text())
        kwargs["schedule_file"] = "plan.schedule.csv"
    lines = ["# pipetrain plan --module: the best layout's keyword arguments of pt.Pipeline",
             "#   kwargs = pipetrain.plan.read_plan(PATH"
             + (", example_inputs=batch)" if "split_points" in kwargs else ")"),
             "#   pipe = pt.Pipeline(model, **kwargs, loss_fn=loss_fn)",
             f"module = {_toml(spec)}", "", "[pipeline]"]
    lines += [f"{k} = {_toml(v)}" for k, v in kwargs.items()]
    lines += ["", "[predicted]", f"step_s = {best.predicted_step_s!r}",
              f"peak_bytes = {_toml(list(best.predicted_peak_bytes))}",
              f"fits = {_toml(best.fits)}", f"memory_limit = {limit}"]
    toml_path, png_path = out / "plan.toml", out / "plan.png"
    toml_path.write_text("\n".join(lines) + "\n")
    draw.save_png(best.candidate.simulation.timeline, png_path,
                  title=f"plan: {best.schedule} m={best.microbatches} balance "
                        f"{list(best.balance)} recompute {best.recompute} (predicted)")
    return toml_path, png_path


def read_plan(path: str | Path, example_inputs: Any = None) -> dict[str, Any]:
    """The ``pt.Pipeline`` keyword arguments that ``pipetrain plan --module`` wrote to
    ``path`` (its ``[pipeline]`` table; a ``schedule_file`` beside it loaded as the
    :class:`~pipetrain.schedules.schedule.Schedule`). A captured model's plan holds
    ``split_points = "auto"``, which needs ``example_inputs``: the batch the plan was made
    with, as ``forward`` takes it (a tensor is given as the one positional argument).

    Raises:
        ValueError: for a file that is not TOML or has no ``[pipeline]`` table, or a missing
            schedule file.
    """
    from pipetrain.schedules.schedule import Schedule

    path = Path(path)
    try:
        table = tomllib.loads(path.read_text()).get("pipeline")
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    if not isinstance(table, dict):
        raise ValueError(f"{path} has no [pipeline] table: read a plan.toml that "
                         "`pipetrain plan --module` wrote")
    kwargs = dict(table)
    if "schedule_file" in kwargs:
        schedule = path.parent / kwargs.pop("schedule_file")
        if not schedule.is_file():
            raise ValueError(f"{path} names the schedule file {schedule}, which is missing: "
                             "keep plan.schedule.csv beside plan.toml, or plan again")
        kwargs["schedule"] = Schedule.load(schedule)
    if example_inputs is not None and "split_points" in kwargs:
        kwargs["example_inputs"] = (example_inputs if isinstance(example_inputs, (tuple, dict))
                                    else (example_inputs,))
    return kwargs


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: the same escapes
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _print(shown: list[Any], limit: int, spec: str, toml_path: Path, png_path: Path) -> None:
    from pipetrain.plan.table import print_candidates

    print_candidates(shown, f"pipetrain plan: {spec}, memory limit {_size(limit)} per rank",
                     lambda p: f"pp{len(p.predicted_peak_bytes)}", step_digits=4,
                     caption="predicted from the profile alone (no calibration on the ranks)")
    print(f"best: {toml_path} (pipetrain.plan.read_plan gives pt.Pipeline its arguments); "
          f"timeline {png_path}")
    if not shown[0].fits:
        print("no layout fits: raise --memory-limit, add ranks (--pp), or give a smaller "
              "batch", file=sys.stderr)


def _size(n: float) -> str:
    """``3 MiB``, ``1.5 GiB``, ``1 TiB``: bytes in the largest binary unit they reach."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n:.0f} B"
