"""Checks: every problem with a training configuration, found before any worker starts.

``pipetrain train`` and ``pipetrain plan`` refuse a configuration here, in the launching
process, with each problem and its fix (exit 2), and every rank checks it again as it builds
(:func:`pipetrain.train.setup.build`). Nothing here builds a model's weights: the launcher
imports neither the training stack (FSDP2) nor the per-rank sources to check its flags; the
source's own checks come from its light :class:`~pipetrain.train.sources.choice.Kind`, and only
``--hf --tp`` opens the model, on ``meta``, to see that its plan splits it.
"""

from __future__ import annotations

from pathlib import Path

from pipetrain.errors import ScheduleError
from pipetrain.schedules.generators import REGISTRY, _load_builtin, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.validate import validate
from pipetrain.train.config import TrainConfig
from pipetrain.train.data.examples import data_problems
from pipetrain.train.mesh import layout
from pipetrain.train.placement import check_order
from pipetrain.train.precision import PRECISIONS
from pipetrain.train.sources.choice import kind_of

__all__ = ["check_config", "run_schedule"]


def run_schedule(cfg: TrainConfig, pp: int) -> Schedule:
    """``cfg.schedule``: a generator's name, or a schedule file (``pipetrain validate``'s
    formats; ``pipetrain plan`` writes one for a searched schedule) run exactly as written.

    Raises:
        ValueError: for integers outside the generator's constraints, or a file that is not a
            valid schedule of ``pp`` ranks, ``cfg.microbatches`` micro-batches and
            ``cfg.stages_per_rank`` stages per rank (when set).
    """
    _load_builtin()
    if cfg.schedule in REGISTRY or not Path(cfg.schedule).is_file():
        return make_schedule(cfg.schedule, pp, cfg.microbatches, cfg.stages_per_rank)
    try:
        schedule = Schedule.load(cfg.schedule)
        validate(schedule)
    except ScheduleError as e:
        raise ValueError(f"--schedule {cfg.schedule}: {e}") from None
    v = schedule.n_stages // schedule.n_ranks
    wanted = {"ranks (--pp)": (schedule.n_ranks, pp),
              "micro-batches (--microbatches)": (schedule.n_microbatches, cfg.microbatches),
              "stages per rank (--stages-per-rank)": (v, cfg.stages_per_rank or v)}
    wrong = [f"{k} {got} where the run has {want}" for k, (got, want) in wanted.items()
             if got != want]
    if wrong:
        raise ValueError(f"--schedule {cfg.schedule} has " + ", ".join(wrong) + "; run it "
                         "with the layout it was written for, or write it again")
    return schedule


def check_config(cfg: TrainConfig, world: int) -> None:
    """Every problem with ``cfg`` for a world of ``world`` ranks, raised at once.

    Raises:
        ValueError: listing each problem and how to fix it.
    """
    problems = []
    try:
        dp, pp = layout(world, cfg.dp, cfg.pp, cfg.fsdp, cfg.tp, cfg.cp)
        run_schedule(cfg, pp)
        dp *= cfg.fsdp  # data-parallel ranks
        problems += _ep_problems(cfg, dp)
    except ValueError as e:
        problems.append(str(e))
        dp = max(cfg.dp, 1) * max(cfg.fsdp, 1)
    problems += kind_of(cfg).problems(cfg)
    try:
        check_order(cfg.mesh_order)
    except ValueError as e:
        problems.append(str(e))
    if cfg.compile and (cfg.recompute != "never" or max(cfg.fsdp, cfg.tp, cfg.ep) > 1):
        problems.append("--compile runs with neither --recompute nor --fsdp, --tp or --ep "
                        "(yet); drop --compile or those")
    if cfg.schedule == "pipedream":
        problems.append("--schedule pipedream updates each stage after every backward, inside "
                        "the pipeline, where train's loop owns the optimizer step: use "
                        "pipedream-2bw, or run pipedream from Python (Pipeline(optimizer=...))")
    if cfg.schedule == "pipedream-2bw" and (cfg.compile or max(cfg.fsdp, cfg.tp, cfg.ep) > 1):
        problems.append("--schedule pipedream-2bw runs without --compile, --fsdp, --tp and "
                        "--ep (yet): its weight versions are whole tensors of one process; "
                        "drop those, or use a synchronous schedule")
    if cfg.precision not in PRECISIONS:
        problems.append(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    if cfg.nonfinite not in ("skip", "abort"):
        problems.append(f"nonfinite must be 'skip' or 'abort', got {cfg.nonfinite!r}")
    if cfg.batch_size % dp or cfg.batch_size // dp < cfg.microbatches:
        ranks = f"dp={dp}" if cfg.fsdp == 1 else f"dp x fsdp = {dp}"
        problems.append(f"batch_size={cfg.batch_size} must split into {ranks} equal "
                        f"batches of at least microbatches={cfg.microbatches} sequences; use a "
                        f"multiple of {dp} that is >= {dp * cfg.microbatches}")
    if cfg.steps < 1 or cfg.seq_len < 1 or cfg.warmup < 0 or cfg.eval_batches < 1:
        problems.append("steps, seq_len and eval_batches must be >= 1 and warmup >= 0 (got "
                        f"{cfg.steps}, {cfg.seq_len}, {cfg.eval_batches}, {cfg.warmup})")
    problems += data_problems(cfg.data, cfg.text_field, cfg.chat)
    problems += _cp_problems(cfg)
    if problems:
        raise ValueError("invalid training configuration:\n" + "\n".join(
            f"  - {p}" for p in problems))


def _ep_problems(cfg: TrainConfig, dp: int) -> list[str]:
    """What keeps ``--ep`` from this layout of ``dp`` data-parallel ranks."""
    if cfg.ep == 1:
        return []
    problems = []
    if dp % cfg.ep:
        problems.append(f"--ep {cfg.ep} must divide the {dp} data-parallel ranks (dp x fsdp) "
                        "holding each stage: the experts are spread over data-parallel "
                        f"ranks; give --ep a divisor of {dp}, or make dp x fsdp a multiple of "
                        f"{cfg.ep}")
    elif cfg.fsdp > 1 and cfg.ep % cfg.fsdp and cfg.fsdp % cfg.ep:
        problems.append(f"--ep {cfg.ep} and --fsdp {cfg.fsdp}: one must divide the other")
    if cfg.tp > 1:
        problems.append("--ep with --tp is not supported yet: use --ep with --dp/--fsdp")
    return problems


def _cp_problems(cfg: TrainConfig) -> list[str]:
    """What keeps ``--cp`` from this run, whatever the model (the model's heads and attention
    are its source kind's to check: :mod:`pipetrain.train.sources.choice`)."""
    if cfg.cp == 1:
        return []
    problems = []
    if cfg.seq_len % cfg.cp:
        problems.append(f"--cp {cfg.cp} cuts each sequence into {cfg.cp} equal slices: "
                        f"--seq-len {cfg.seq_len} does not divide; use a multiple of {cfg.cp}")
    elif cfg.tp > 1 and cfg.sequence_parallel and (cfg.seq_len // cfg.cp) % cfg.tp:
        problems.append(f"--cp {cfg.cp} with --tp {cfg.tp}: each slice of {cfg.seq_len // cfg.cp}"
                        f" tokens must divide by tp for sequence parallelism; use a --seq-len "
                        f"that divides by {cfg.cp * cfg.tp}, or --no-sequence-parallel")
    return problems
