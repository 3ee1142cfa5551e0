"""Training loop: the steps of a ``pipetrain train`` run on one rank, and its summary.

One step, on every rank of the dp x pp mesh, in this order (every collective is called by
every rank in the same sequence, because every branch depends only on values all ranks share)::

    [1] faults.at_step                   injected kill / raise / hang / NaN / shape (tests,
                                         soak)
    [2] pipe.step under autocast         F/B/I/W of this replica's rows, as scheduled
    [3] dp all-reduce of gradients       mean over the replicas (sum, then / dp); a stage's
                                         starts when the step reports its gradients final,
                                         overlapping the cool-down (with --fsdp: FSDP2's
                                         reduce-scatter, pipetrain.parallel.sharded)
    [4] unscale (fp16)                   gradients of the true loss
    [5] verdict over the world           OK / overflow / non-finite: all go, skip or stop
    [6] global norm over the pp group    clip every rank's gradients by the same factor
                                         (and over the shards' slices, with --fsdp)
    [7] AdamW step at lr_at(step)        then zero the gradients

Under the asynchronous ``pipedream-2bw`` the gradients [2] leaves are the previous step's
(W(t+1) = W(t) - lr * grad f(W(t-1))): [3]-[7] apply those, the step's record carries the
loss and gradient norm of the batch they come from (the previous one), and the first step,
which fills the pipeline, applies none (its record has NaN there). Before a checkpoint and at
the end the pipeline is drained and the step's own batch applied as well (at the same learning
rate; the record keeps the first update's figures and adds the second's as ``drained``), so
that a checkpoint holds no micro-batch in flight and a resumed run goes on exactly as one that
was not stopped.

Eval losses, checkpoints and the one timeline picture come between steps; generated text and
the summary at the end. :func:`run` returns the same summary on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from pipetrain.runtime.dtensors import whole
from pipetrain.schedules.timeline import Timeline
from pipetrain.train.config import TrainConfig
from pipetrain.train.launch import faults
from pipetrain.train.launch.replicas import Turnout, changes
from pipetrain.train.logs.events import Reporter
from pipetrain.train.memory import MemoryMeter
from pipetrain.train.nonfinite import NONFINITE, OVERFLOW, decide, finding
from pipetrain.train.optim import clip_grads_, grad_square_sum, lr_at, set_lr
from pipetrain.train.precision import autocast
from pipetrain.train.resume import load_peer_state, peer_state, restore, save
from pipetrain.train.sample import cache_length, evaluate, prompt_ids, sample
from pipetrain.train.setup import Trainer, build
from pipetrain.train.timing import predict

__all__ = ["run", "train_step", "evaluate", "sample", "StepStats"]


@dataclass(frozen=True)
class StepStats:
    """What one step reports (the ``step`` record) plus its measured timeline."""

    step: int
    loss: float
    """Mean over the replicas; NaN when the loss was non-finite."""
    lr: float
    grad_norm: float
    """Global norm before clipping; NaN for a skipped step."""
    tokens_per_s: float
    bubble: float
    skipped: bool
    seconds: float
    timeline: Timeline
    experts: dict[str, Any] | None = None
    """A mixture of experts' load this step (:func:`pipetrain.hf.expert_load.summarize`)."""
    drained: dict[str, Any] | None = None
    """``pipedream-2bw``, a step that drained after its update: the second update's (its own
    batch's) loss, grad_norm and skipped; ``skipped`` above is then either's."""
    replicas: Turnout | None = None
    """``--ft``: the replicas that took part (and any that loaded another's state)."""

    def fields(self) -> dict[str, Any]:
        return {"step": self.step, "loss": self.loss, "lr": self.lr,
                "grad_norm": self.grad_norm, "tokens_per_s": self.tokens_per_s,
                "bubble": self.bubble, "skipped": self.skipped,
                **({"experts": self.experts} if self.experts is not None else {}),
                **({"drained": self.drained} if self.drained is not None else {}),
                **({"replicas": len(self.replicas.members)} if self.replicas is not None
                   else {})}


@dataclass
class Tally:
    """What the summary needs from this run's steps (only the last two steps' timelines are
    kept: the last is pictured, the one before gives the simulator its costs)."""

    steps: int = 0
    final_loss: float = math.nan
    """The loss of the last step not skipped."""
    bubble_sum: float = 0.0
    bubble_steps: int = 0
    last: StepStats | None = None
    before_last: StepStats | None = None
    seconds: list[float] = dataclasses.field(default_factory=list)
    experts: dict[str, Any] | None = None
    """The step whose experts were least evenly loaded: its load, and the step."""

    def add(self, stats: StepStats) -> None:
        self.seconds.append(stats.seconds)
        load = stats.experts
        if load is not None and (self.experts is None
                                 or load["imbalance"] > self.experts["imbalance"]):
            self.experts = {**load, "step": stats.step}
        if self.steps > 0:  # the first step also pays for warming up
            self.bubble_sum += stats.bubble
            self.bubble_steps += 1
        self.steps += 1
        if not stats.skipped:
            self.final_loss = stats.loss
        self.before_last, self.last = self.last, stats

    @property
    def bubble(self) -> float:
        if self.bubble_steps:
            return self.bubble_sum / self.bubble_steps
        return self.last.bubble if self.last is not None else math.nan

    @property
    def step_s(self) -> float:
        """The median seconds per step, the first (warm-up) step left out when others ran."""
        kept = self.seconds[1:] or self.seconds
        return statistics.median(kept) if kept else math.nan


def run(cfg: TrainConfig, reporter: Reporter) -> dict[str, Any]:
    """Train as ``cfg`` says; call in every process of an initialised torch.distributed job.

    The world must hold ``cfg.dp x cfg.pp`` ranks. With ``cfg.resume`` the run continues from
    the newest checkpoint under ``cfg.out``; it saves every ``cfg.checkpoint_every`` steps and
    at the end. The reporter receives ``start``, ``step``, ``eval``, ``checkpoint``,
    ``sample`` and ``end`` records and one timeline; ``run`` does not close it.

    Returns:
        The summary, equal on every rank: final_loss (mean over the replicas, last step not
        skipped), eval_loss, tokens_per_s (all replicas, this invocation), bubble (mean
        measured, first step left out), steps (done in all), steps_run (by this invocation),
        skipped, params, layout, sample (None without sample_tokens), seconds, step_s (the
        median seconds per step after the first, the slowest rank's), peak_memory_bytes (per
        global rank, the most bytes of tensors it held while training: see
        :mod:`pipetrain.train.memory`), checkpoint (the newest saved or resumed from; None
        without ``out``).

    Raises:
        ValueError: for a configuration that does not fit the world (all problems listed).
        PipelineError: when a step fails, or a non-finite step with ``nonfinite='abort'``.

    Example::

        summary = run(TrainConfig(preset="tiny", steps=50), NullReporter())
    """
    trainer = build(cfg, progress=cfg.progress)
    try:
        return _run(trainer, reporter)
    finally:
        if trainer.sequence is not None:  # --cp: the tag of its group, for the next run
            trainer.sequence.close()


def _run(trainer: Trainer, reporter: Reporter) -> dict[str, Any]:
    """:func:`run` on the rank's built ``trainer``."""
    cfg = trainer.cfg
    resumed = restore(trainer)
    if trainer.replicas is not None:  # --ft: what a recovering replica loads from this one
        trainer.replicas.serve(lambda: peer_state(trainer),
                               lambda state: load_peer_state(trainer, state), trainer.step)
    reporter.record("start", {**_start_fields(trainer),
                              "resumed_from": None if resumed is None else str(resumed)})
    if trainer.data:  # a data set of examples: what is trained on, and how it is laid out
        reporter.record("data", trainer.data)
    tally = Tally()
    saved = resumed
    meter = MemoryMeter(trainer.mesh.device, cfg.steps - trainer.step,
                        measure=not trainer.pipe.asynchronous, verbose=cfg.verbose)
    clock = time.perf_counter()
    members = tuple(range(cfg.dp)) if cfg.ft else ()
    while trainer.step < cfg.steps:
        with meter.step(lambda: _held(trainer)):
            stats = train_step(trainer, trainer.step)
        if stats is None:  # --ft: a replica failed during the step, which runs again
            continue
        if stats.replicas is not None:  # --ft: who left or joined at this step
            for kind, fields in changes(members, stats.replicas, stats.step):
                reporter.record(kind, fields)
            members = stats.replicas.members
        tally.add(stats)
        reporter.record("step", stats.fields())
        step = stats.step
        if _due(cfg.eval_every, trainer.step, cfg.steps):
            reporter.record("eval", {"step": step, "eval_loss": evaluate(trainer)})
        if _due(cfg.checkpoint_every, trainer.step, cfg.steps):
            saved = _checkpoint(trainer, reporter) or saved
        if _due(cfg.save_hf_every, trainer.step, cfg.steps):
            _save_hf(trainer, reporter)
    elapsed = trainer.mesh.world_max(time.perf_counter() - clock)
    if tally.steps:  # the end of a run that trained is always saved
        saved = _checkpoint(trainer, reporter) or saved
    _save_hf(trainer, reporter)
    final_eval = evaluate(trainer)
    reporter.record("eval", {"step": trainer.step - 1, "eval_loss": final_eval})
    last = tally.last
    if last is not None and not trainer.pipe.asynchronous:  # (an asynchronous step's timeline
        # holds this rank's actions only) predicted from the step before: costs it was not
        # measured on
        basis = tally.before_last or last
        reporter.timeline(last.step, last.timeline,
                          predict(basis.timeline, trainer.pipe.schedule), basis.step)
    text = sample(trainer)
    if text is not None:
        cached = cache_length(trainer, prompt_ids(trainer)) is not None
        reporter.record("sample", {"text": text, "kv_cache": cached})
    summary = {**_summary(trainer, tally, elapsed, final_eval, text),
               "peak_memory_bytes": _every_rank_value(meter.peak_bytes),
               "checkpoint": None if saved is None else str(saved), **_replicas_end(trainer)}
    reporter.record("end", summary)
    if trainer.replicas is not None:
        trainer.replicas.close()
    return summary


def _replicas_end(trainer: Trainer) -> dict[str, Any]:
    """``--ft``: this replica's id, and whether every replica ends with the same weights
    and optimizer state, bitwise (compared over torchft's process group)."""
    replicas = trainer.replicas
    if replicas is None:
        return {}
    tensors = cast(dict[str, torch.Tensor], peer_state(trainer)["tensors"])
    held = [v for k, v in sorted(tensors.items()) if not k.startswith("rng/")]
    same = replicas.same_everywhere(held)
    everywhere = trainer.mesh.world_max(0.0 if same else 1.0) == 0.0  # every rank agrees
    return {"replica": replicas.replica, "replicas_bitwise_equal": everywhere}


def _due(every: int, done: int, steps: int) -> bool:
    """After ``done`` steps: is an every-``every`` event due (the end has its own)?"""
    return every > 0 and done % every == 0 and done < steps


def _checkpoint(trainer: Trainer, reporter: Reporter) -> Path | None:
    """Save (when the run has an ``out``); return the committed directory."""
    path = save(trainer)
    if path is not None:
        reporter.record("checkpoint", {"step": trainer.step, "path": str(path)})
    return path


def _save_hf(trainer: Trainer, reporter: Reporter) -> None:
    """Write ``<out>/hf`` (``--hf`` runs with an ``out``): the first replica's ranks, each its
    own shard (FSDP2 shards, tensor- and expert-parallel ranks first gather their weights
    whole, the first of them writes)."""
    source, mesh = trainer.source, trainer.mesh
    if not source.exports or not trainer.cfg.out or mesh.dp_rank >= max(mesh.fsdp, mesh.ep):
        return
    if mesh.cp_rank and mesh.fsdp == 1:  # (with FSDP2 the cp ranks hold shards too)
        return
    state = {k: whole(v) for k, v in trainer.pipe.state_dict().items()}  # over the shards
    if mesh.dp_rank != 0 or mesh.tp_rank != 0 or mesh.cp_rank != 0:
        return
    path = source.save(Path(trainer.cfg.out) / "hf", state, mesh.pp_group)
    if path is not None:
        reporter.record("hf", {"step": trainer.step, "path": str(path)})


def train_step(trainer: Trainer, step: int) -> StepStats | None:
    """Run step ``step`` (the markers refer to the module docstring's diagram); None when,
    under ``--ft``, a replica failed during it and it was not committed (run it again: with
    a peer's state loaded, ``trainer.step`` may then be another)."""
    cfg, mesh, pipe = trainer.cfg, trainer.mesh, trainer.pipe
    start = time.perf_counter()
    if trainer.replicas is not None:  # --ft [0]: who takes part; a replica behind loads
        trainer.replicas.start()      # a healthy one's state (and step) here
        step = trainer.step
    fault = faults.at_step(step, trainer.job_rank)  # [1]
    trainer.injector.armed = fault == "nan"
    lr = lr_at(step, peak=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, steps=cfg.steps)
    set_lr(trainer.optimizer, lr)
    inputs, targets = trainer.batch(step)
    used = trainer.scale.value  # the loss scale of this step's forwards (fp16)
    try:
        with autocast(cfg.precision, mesh.device), faults.wrong_shape(pipe, fault == "shape"), \
                _counting(trainer.expert_load):  # tokens per expert, F only
            result = pipe.step(trainer.feed(inputs), targets, step=step,  # [2] errors name it
                               on_grads_ready=trainer.on_grads_ready)  # [3]
    finally:
        trainer.injector.armed = False
    asynchronous = pipe.asynchronous  # the gradients are the step before's
    loss, grad_norm, skipped = math.nan, math.nan, False
    updated = result.gave_grads  # not an asynchronous schedule's first, filling step
    if not asynchronous:
        done = _update(trainer, step, result.loss, used)
        if done is None:  # --ft: not committed
            return None
        loss, grad_norm, skipped = done
    elif updated:  # the step before's batch
        loss, grad_norm, skipped = _applied(_update(trainer, step, result.previous_loss,
                                                    trainer.last_scale))
    trainer.last_scale = used
    drained: dict[str, Any] | None = None
    if asynchronous and _drain_due(trainer, step):  # the step's own batch too
        last = _applied(_update(trainer, step, pipe.drain(
            step=step, on_grads_ready=trainer.on_grads_ready).previous_loss, used))
        if updated:  # the record keeps the first update's figures, the drain's apart
            drained = {"loss": mesh.dp_mean(last[0]), "grad_norm": last[1], "skipped": last[2]}
        else:
            loss, grad_norm, skipped = last
    trainer.step = step + 1
    seconds = time.perf_counter() - start
    said = None if trainer.replicas is None else trainer.replicas.said
    return StepStats(step, mesh.dp_mean(loss) if said is None else said.loss, lr, grad_norm,
                     cfg.batch_size * cfg.seq_len / seconds, result.bubble_fraction,
                     skipped or bool(drained and drained["skipped"]), seconds, result.timeline,
                     _expert_load(trainer), drained, said)


def _update(trainer: Trainer, step: int, scaled: torch.Tensor | None, value: float
            ) -> tuple[float, float, bool] | None:
    """[3]-[7] on the gradients in ``.grad``: their batch's loss (``scaled``, None where this
    rank has none, by the loss scale ``value``, which made the gradients), the norm before
    clipping (NaN when skipped) and whether it was skipped; None when ``--ft``'s step was
    not committed (nothing changed, the gradients are dropped)."""
    cfg, mesh, replicas = trainer.cfg, trainer.mesh, trainer.replicas
    trainer.finish_grads()  # [3]
    if replicas is not None:  # [3'] over the replicas that take part
        replicas.average_([_grad(p) for p in trainer.params])
    trainer.scale.unscale_(trainer.params, value)  # [4]
    loss = trainer.scale.unscale_loss(float(scaled if scaled is not None else "nan"), value)
    if replicas is not None:
        loss = replicas.turnout(mesh.dp_mean(loss)).loss  # [3"] over the shards, then the
        # replicas: every rank of every replica comes to the same verdict
        if not replicas.commit():  # [5']
            trainer.optimizer.zero_grad(set_to_none=True)
            return None
    square_sum = grad_square_sum(trainer.counted, mesh.comm_device) + mesh.tp_sum_(
        grad_square_sum(trainer.split, mesh.comm_device))
    experts = mesh.ep_sum_(grad_square_sum(trainer.experts, mesh.comm_device))
    verdict = decide(finding(loss, float(square_sum + experts), trainer.scale.enabled),  # [5]
                     mesh.rank, mesh.world, mesh.comm_device)
    grad_norm = math.nan
    if verdict.skip:
        if verdict.level == NONFINITE and cfg.nonfinite == "abort":
            raise verdict.error(mesh.rank, step)
        trainer.skipped += 1
    else:
        norm = mesh.pp_sum_(mesh.shard_sum_(square_sum) + experts).sqrt()  # [6]
        grad_norm = float(norm)
        clip_grads_(trainer.params, norm, cfg.grad_clip)
        trainer.optimizer.step()  # [7]
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scale.update(overflow=verdict.level == OVERFLOW)
    return loss, grad_norm, verdict.skip


def _applied(done: tuple[float, float, bool] | None) -> tuple[float, float, bool]:
    """An asynchronous schedule's update, always applied (--ft refuses those schedules)."""
    if done is None:
        raise RuntimeError("an asynchronous schedule's update was not committed: --ft runs "
                           "synchronous schedules only")
    return done


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    """``p``'s gradient, zeros where it has none (every replica averages the same list)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _drain_due(trainer: Trainer, step: int) -> bool:
    """An asynchronous schedule drains before a checkpoint and after the last step."""
    cfg, done = trainer.cfg, step + 1
    return done == cfg.steps or bool(cfg.out) and _due(cfg.checkpoint_every, done, cfg.steps)


def _counting(load: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if load is None else load.counting()


def _expert_load(trainer: Trainer) -> dict[str, Any] | None:
    """The step's tokens per expert over the whole job: every rank adds its layers' counts
    of its rows (a tensor-parallel group's ranks count the same rows once)."""
    if trainer.expert_load is None:
        return None
    from pipetrain.hf.expert_load import summarize
    from pipetrain.runtime.failure import job_failure

    mesh = trainer.mesh
    counts = trainer.expert_load.take().to(mesh.comm_device)
    if torch.distributed.is_initialized():
        job_failure.all_reduce(counts, "the experts' token counts")
    return summarize(counts // mesh.tp)


def _start_fields(trainer: Trainer) -> dict[str, Any]:
    return {"config": dataclasses.asdict(trainer.cfg), "world": _job_world(trainer),
            "degrees": _degrees(trainer), "layout": trainer.layout(), "ranks": trainer.ranks,
            "balance": list(trainer.pipe.balance),
            "params": _n_params(trainer), "start_step": trainer.step,
            "run_id": _run_id(), **({"load": _every_rank(trainer.loaded)} if trainer.loaded
                                     else {})}


def _job_world(trainer: Trainer) -> int:
    """The job's ranks: every replica's under ``--ft``, where this world is one of them."""
    return trainer.mesh.world * (trainer.cfg.dp if trainer.replicas is not None else 1)


def _degrees(trainer: Trainer) -> dict[str, int]:
    """Every degree of the layout, 1s included: ``pp``, ``dp`` (replicas), ``fsdp``,
    ``cp``, ``tp``, ``ep``; their product (``ep`` aside, a part of ``dp x fsdp``) is the
    start's ``world``."""
    mesh = trainer.mesh
    replicas = trainer.cfg.dp if trainer.replicas is not None else mesh.dp // mesh.fsdp
    return {"pp": mesh.pp, "dp": replicas, "fsdp": mesh.fsdp, "cp": mesh.cp, "tp": mesh.tp,
            "ep": mesh.ep}


def _every_rank(value: dict[str, Any]) -> list[dict[str, Any]]:
    """``value`` of every rank, by global rank (a small all-gather at the start)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _every_rank_value(value: int | None) -> list[int | None]:
    return [x["value"] for x in _every_rank({"value": value})]


def _held(trainer: Trainer) -> list[torch.Tensor]:
    """What the rank holds between steps: parameters, buffers, gradients, optimizer state."""
    pipe = trainer.pipe
    held: list[torch.Tensor] = [p for _, p in pipe.named_parameters()]
    held += [b for _, b in pipe.named_buffers()]
    held += [p.grad for p in held if isinstance(p, torch.nn.Parameter) and p.grad is not None]
    for state in trainer.optimizer.state.values():
        held += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return held


def _n_params(trainer: Trainer) -> int:
    return trainer.source.n_params


def _run_id() -> str | None:
    """The job's id, the same across its restarts (torchrun's default ``none`` is no id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    return None if run_id in (None, "", "none") else run_id


def _summary(trainer: Trainer, tally: Tally, elapsed: float, final_eval: float,
             text: str | None) -> dict[str, Any]:
    cfg = trainer.cfg
    tokens = tally.steps * cfg.batch_size * cfg.seq_len
    return {
        "final_loss": tally.final_loss, "eval_loss": final_eval,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "bubble": trainer.mesh.dp_mean(tally.bubble), "steps": trainer.step,
        "steps_run": tally.steps, "skipped": trainer.skipped,
        "params": _n_params(trainer), "layout": trainer.layout(), "sample": text,
        "seconds": elapsed, "step_s": trainer.mesh.world_max(tally.step_s),
        **({"experts": tally.experts} if tally.experts is not None else {}),
    }
