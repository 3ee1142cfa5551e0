"""Train command: ``pipetrain train``, its flags generated from TrainConfig, and ``--config``.

Every field of :class:`~pipetrain.train.config.TrainConfig` is a flag (``seq_len`` →
``--seq-len``, booleans as ``--progress`` / ``--no-progress``) with the field's docstring as
help, and a key of the TOML file given by ``--config``. Flags on the command line override
the file; the file overrides the defaults (for ``--hf`` with stored weights, the fine-tuning
ones of :mod:`pipetrain.train.commands.finetune`). Outside torchrun the command starts ``--nproc``
local processes (:func:`pipetrain.train.launch.elastic.launch_local`); under torchrun it is one of
them (:func:`pipetrain.train.launch.elastic.worker`).

    $ pipetrain train --nproc 2 --schedule zbv --steps 200
    $ pipetrain train --config run.toml --steps 50
    $ torchrun --nproc-per-node 4 -m pipetrain train --pp 2 --dp 2

With ``--verify`` (and ``--hf``) the model is first checked against one process at a small
width under the run's pipeline layout (:func:`pipetrain.train.commands.verify_hf.before_training`).

Exit codes: 0 the run finished, 1 it failed on some rank (or ``--verify`` found a difference:
nothing was started), 2 bad arguments or config.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.choice import kind_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["HELP", "configure", "run", "resolve", "resolved", "load_toml", "field_docs",
           "FT_RESTARTS"]

HELP = ("train a pipelined GPT, or a local Hugging Face checkpoint with --hf (local processes, "
        "or one worker under torchrun)")
"""The command's line in ``pipetrain --help``."""
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_METAVARS: dict[type, str] = {int: "N", float: "X", str: "TEXT"}


# ------------------------------------------------------------------------------ the fields


def field_docs() -> dict[str, str]:
    """Each TrainConfig field's attribute docstring (the string literal after it), by name."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = _plain(" ".join(after.value.value.split()))
    return docs


def _plain(text: str) -> str:
    """Docstring markup as plain text: ``x`` and :data:`a.b` become x and a.b."""
    return re.sub(r"(?::\w+:)?`{1,2}([^`]+)`{1,2}", r"\1", text)


def _field_type(name: str) -> tuple[type, bool]:
    """The field's base type (int, float, str, bool) and whether it may be None."""
    hint = typing.get_type_hints(TrainConfig)[name]
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        base = [a for a in args if a is not type(None)]
        if len(base) != 1:
            raise TypeError(f"TrainConfig.{name}: unsupported type {hint}")
        return base[0], type(None) in args
    return hint, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------------------------- parser


def configure(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per TrainConfig field to ``parser``.

    Flags default to "not given" (absent from the parsed namespace), so that
    :func:`resolve` can tell a flag given on the command line from the file's value.
    """
    parser.add_argument("--config", type=Path, metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file of settings (keys as the flags, with _ or -); "
                             "flags given on the command line override it")
    from pipetrain.train.commands.finetune import SHOWN

    docs = field_docs()
    for f in dataclasses.fields(TrainConfig):
        base, optional = _field_type(f.name)
        shown = repr(f.default) if isinstance(f.default, str) else f.default
        tuned = f"; {SHOWN[f.name]} when --hf has weights" if f.name in SHOWN else ""
        help_text = f"{docs.get(f.name, '')} (default: {shown}{tuned})".replace("%", "%%")
        if base is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(_flag(f.name), type=base, default=argparse.SUPPRESS,
                                metavar=_METAVARS.get(base, "VALUE"), help=help_text)


def resolve(args: argparse.Namespace) -> TrainConfig:
    """The run's config: defaults, then the ``--config`` file, then the flags given.

    The defaults are TrainConfig's, except that with ``--hf DIR`` holding weights the
    optimiser settings given neither in the file nor as flags take the fine-tuning defaults
    (:func:`pipetrain.train.commands.finetune.fine_tuning_defaults`); :func:`resolved` also
    says which.

    Raises:
        ValueError: the file is not valid TOML, has an unknown key or a value of the wrong
            type, or a setting is out of range.
        OSError: the file cannot be read.
    """
    return resolved(args)[0]


FT_RESTARTS = 3
"""``--max-restarts`` under ``--ft`` when not given: a failed replica comes back this many
times (each loading a healthy replica's state); ``--max-restarts 0`` lets it go."""


def resolved(args: argparse.Namespace, env: typing.Mapping[str, str] | None = None
             ) -> tuple[TrainConfig, tuple[str, ...], str]:
    """:func:`resolve`'s config, the settings that took the fine-tuning defaults (empty for a
    preset, or ``--hf`` without weights), and the line that says what was inferred (empty when
    nothing the user sees was). Inferred: the layout's one open degree from the world
    (``env``'s torchrun ``WORLD_SIZE``, else ``--nproc``; :mod:`pipetrain.train.degrees`), and
    ``--max-restarts`` under ``--ft`` (:data:`FT_RESTARTS`).

    The flags default to "not given" (argparse.SUPPRESS), so what the file and the command
    line set is exactly the namespace's fields and the file's keys: only the others can take
    a default.
    """
    from pipetrain.train.commands.finetune import fine_tuning_defaults

    given = load_toml(args.config) if getattr(args, "config", None) else {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given.update({k: v for k, v in vars(args).items() if k in names})
    if given.get("hf"):  # a Hub id from the --config file (the flag's is resolved already)
        from pipetrain.hf.hub import local

        given["hf"] = local(str(given["hf"]))
    tuned = fine_tuning_defaults(given)
    if given.get("ft") and "max_restarts" not in given:
        given["max_restarts"] = FT_RESTARTS
    world = _world(given, os.environ if env is None else env)
    inferred = _open_degree(given, world)
    cfg = TrainConfig(**{**tuned, **given, **inferred})
    check(cfg)
    from pipetrain.train.degrees import said

    shown = inferred and max(inferred.values()) > 1  # a 1 changes nothing the user sees
    return cfg, tuple(tuned), said(inferred, world, given) if shown else ""


def _world(given: dict[str, Any], env: typing.Mapping[str, str]) -> int:
    """The job's ranks: torchrun's world (times ``--dp`` for one ``--ft`` replica's), else
    ``--nproc``."""
    from pipetrain.train.launch.elastic import under_torchrun

    if not under_torchrun(dict(env)):
        return int(given.get("nproc", TrainConfig.nproc))
    world = int(env["WORLD_SIZE"])
    return world * int(given.get("dp", 1)) if given.get("ft_replica_id") is not None else world


def _open_degree(given: dict[str, Any], world: int) -> dict[str, int]:
    """The layout's open degree (:func:`pipetrain.train.degrees.open_degree`); one ``--ft``
    replica's world (``--ft-replica-id``) needs ``--dp`` given."""
    from pipetrain.train.degrees import open_degree

    if given.get("ft") and given.get("ft_replica_id") is not None and "dp" not in given:
        raise ValueError("--ft-replica-id R: this world is one replica, so --dp (how many "
                         "replicas) cannot be inferred from it; give --dp")
    return open_degree(given, world)


def load_toml(path: Path) -> dict[str, Any]:
    """The settings of a TOML file, checked against TrainConfig's fields and types.

    Raises:
        ValueError: invalid TOML, an unknown key (naming the valid ones), a value of the wrong
            type.
        OSError: the file cannot be read.

    Example:
        >>> load_toml(Path("run.toml"))  # doctest: +SKIP
        {'schedule': 'zbv', 'steps': 50}
    """
    try:
        raw = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    valid = [f.name for f in dataclasses.fields(TrainConfig)]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}; valid keys: "
                             f"{', '.join(valid)}")
        values[name] = _checked(path, key, name, value)
    return values


def _checked(path: Path, key: str, name: str, value: Any) -> Any:
    base, optional = _field_type(name)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, base) and (base is bool or not isinstance(value, bool))
    if not ok:
        wanted = {int: "an integer", float: "a number", str: "a string",
                  bool: "true or false"}.get(base, base.__name__)
        none = " (leave the key out for the default)" if optional else ""
        raise ValueError(f"{path}: {key} must be {wanted}{none}, got {value!r}")
    return value


def check(cfg: TrainConfig, *, training: bool = True) -> None:
    """Reject settings that cannot start a run, before any process is started (``training``:
    also what a training run needs of its data; ``verify`` and ``plan`` lay a run out only).

    Raises:
        ValueError: naming the setting, its value and what to use instead.
    """
    from pipetrain.schedules.generators import REGISTRY, _load_builtin

    _load_builtin()
    kind = kind_of(cfg)
    for problem in kind.problems(cfg) + (kind.data_problems(cfg) if training else []):
        raise ValueError(problem)  # the first one, before any other flag
    if cfg.schedule not in REGISTRY and not Path(cfg.schedule).is_file():
        raise ValueError(f"unknown schedule {cfg.schedule!r}; choose one of "
                         f"{sorted(REGISTRY)}, or give a schedule file")
    if cfg.save_hf_every < 0:
        raise ValueError(f"--save-hf-every must be 0 or more, got {cfg.save_hf_every}")
    _check_lora(cfg)
    _check_ft(cfg)
    if cfg.pack:
        from pipetrain.train.data.records import is_dataset

        if not is_dataset(cfg.data):
            raise ValueError("--pack packs the examples of a data set: give --data as a .jsonl, "
                             ".json, .parquet or .csv file or a save_to_disk directory, and "
                             "--hf")
    if cfg.log:
        from pipetrain.train.logs.sinks import missing

        if not cfg.out:
            raise ValueError(f"--log {cfg.log}: the sinks write under --out; give one")
        for problem in missing(cfg.log):  # parse() raises for an unknown name first
            raise ValueError(problem)
    from pipetrain.parallel import RESHARD

    if cfg.fsdp_reshard not in RESHARD:
        raise ValueError(f"--fsdp-reshard must be one of {', '.join(RESHARD)}, "
                         f"got {cfg.fsdp_reshard!r}")
    for name in ("nproc", "steps", "seq_len", "batch_size", "microbatches", "dp", "fsdp",
                 "tp", "ep", "cp"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(cfg, name)}")
    if cfg.pp is not None and cfg.pp < 1:
        raise ValueError(f"--pp must be at least 1 (or left out), got {cfg.pp}")
    if cfg.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {cfg.max_restarts}")
    if not cfg.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {cfg.timeout}")


# ------------------------------------------------------------------------------------- run


def _check_lora(cfg: TrainConfig) -> None:
    if cfg.lora_r < 0:
        raise ValueError(f"--lora-r must be 0 (train every weight) or a rank >= 1, got "
                         f"{cfg.lora_r}")
    if not cfg.lora_r:
        if cfg.merge:
            raise ValueError("--merge merges a LoRA adapter: give --lora-r too")
        return
    if not 0.0 <= cfg.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_alpha < 0:
        raise ValueError(f"--lora-alpha must be positive (0: 2 x --lora-r), got "
                         f"{cfg.lora_alpha}")
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ValueError("--lora-r needs peft: pip install peft")


def _check_ft(cfg: TrainConfig) -> None:
    from pipetrain.train.launch.elastic import under_torchrun

    if not cfg.ft:
        if cfg.ft_replica_id is not None or cfg.ft_lighthouse:
            raise ValueError("--ft-replica-id and --ft-lighthouse belong to a run with --ft")
        return
    from pipetrain.train.launch.replicas import lighthouse_url, require_torchft

    require_torchft()
    if cfg.dp < 2:
        raise ValueError(f"--ft keeps --dp replicas going when one fails, and --dp is {cfg.dp}:"
                         " give --dp 2 or more (a single pipeline recovers from a failure by "
                         "its checkpoints: drop --ft, use --max-restarts)")
    if not 1 <= cfg.ft_min_replicas <= cfg.dp:
        raise ValueError(f"--ft-min-replicas must be between 1 and --dp {cfg.dp}, got "
                         f"{cfg.ft_min_replicas}")
    if cfg.schedule == "pipedream-2bw" or cfg.ep > 1:
        raise ValueError("--ft runs synchronous schedules without --ep (yet): drop "
                         f"{'--schedule pipedream-2bw' if cfg.ep == 1 else '--ep'} or --ft")
    if cfg.ft_replica_id is None:
        if under_torchrun():
            raise ValueError("--ft under torchrun runs one torchrun per replica: give each "
                             "--ft-replica-id R (0 .. dp-1) and --ft-lighthouse HOST:PORT")
        return
    if not 0 <= cfg.ft_replica_id < cfg.dp:
        raise ValueError(f"--ft-replica-id must be between 0 and --dp - 1 = {cfg.dp - 1}, got "
                         f"{cfg.ft_replica_id}")
    if not cfg.ft_lighthouse:
        raise ValueError("--ft-replica-id needs --ft-lighthouse HOST:PORT, the Lighthouse "
                         "every replica reports to")
    lighthouse_url(cfg.ft_lighthouse)


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain train``: launch local workers, or be one under torchrun.

    Raises:
        ValueError, OSError: bad flags or config file (the command line turns them into exit 2).
    """
    cfg, tuned, inferred = resolved(args)
    from pipetrain.train.checks import check_config
    from pipetrain.train.launch import elastic

    if inferred and os.environ.get("RANK", "0") == "0":
        print(f"pipetrain train: {inferred}", flush=True)

    # what the workers would refuse, refused before any starts (exit 2)
    world = int(os.environ["WORLD_SIZE"]) if elastic.under_torchrun() else cfg.nproc
    one_replica = cfg.ft and cfg.ft_replica_id is not None  # --ft: the world is one replica
    check_config(cfg, world * (cfg.dp if one_replica else 1))
    if one_replica:  # an unreachable Lighthouse is bad input: exit 2 within --timeout
        from pipetrain.train.launch.replicas import lighthouse_url, reach

        reach(lighthouse_url(cfg.ft_lighthouse), cfg.timeout)
    if cfg.verify and not _verified(cfg):
        return EXIT_FAILED
    if cfg.pack:  # a model that lets packed examples see each other is refused here
        from pipetrain.hf.model import open_model
        from pipetrain.train.data.packing import check_model

        check_model(open_model(cfg.hf).config, cfg.hf)
    if cfg.cp > 1:  # a model whose attention the slices would get wrong is refused here
        from pipetrain.train.commands.verify_hf import shrink

        for problem in kind_of(cfg).slicing_problems(cfg, shrink):
            raise ValueError(problem)
    if elastic.under_torchrun():
        elastic.worker(cfg, tuned=tuned)  # exits 1 itself on failure, naming the rank
        return EXIT_OK
    try:
        if cfg.ft and cfg.ft_replica_id is None:  # a Lighthouse and an agent per replica
            from pipetrain.train.launch.replica_launch import launch_replicas

            launch_replicas(cfg)
        else:
            elastic.launch_local(cfg, tuned=tuned)
    except elastic.JobFailed as e:
        print(f"pipetrain train: {e}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _verified(cfg: TrainConfig) -> bool:
    """``--verify``: check the run's model and layout at a small width before starting any
    worker (:func:`pipetrain.train.commands.verify_hf.before_training`); print the table (on global
    rank 0 under torchrun, where every worker checks) and say whether it passed."""
    import os

    from pipetrain.errors import PipelineError
    from pipetrain.train.commands import verify_hf

    shown = os.environ.get("RANK", "0") == "0"
    try:
        result = verify_hf.before_training(cfg, _say if shown else None)
    except PipelineError as e:
        print(f"pipetrain train: --verify failed, not training: the pipelined step failed "
              f"where one process did not: {e}", file=sys.stderr, flush=True)
        return False
    if shown:
        print(result.table() + "\n", flush=True)
    if not result.passed:
        print(f"pipetrain train: --verify failed, not training: "
              f"{result.verdict().removeprefix('FAIL: ')}; see the table above",
              file=sys.stderr, flush=True)
    return result.passed


def _say(line: str) -> None:
    print(line.replace("pipetrain verify", "pipetrain train --verify", 1), flush=True)
