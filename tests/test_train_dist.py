"""The training loop across processes: runs, dp x pp equivalence, clipping, NaN verdicts, resume.

Two launched groups (2 and 4 processes) run many cases each; each case returns a list of
problems, so one failing case reports all the others too.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipetrain as pt
from pipetrain.errors import PipelineError
from pipetrain.models.gpt import gpt_layers, lm_loss
from pipetrain.testing import reference_step
from pipetrain.train.config import TrainConfig
from pipetrain.train.launch import faults
from pipetrain.train.logs.events import NullReporter
from pipetrain.train.loop import run, train_step
from pipetrain.train.mesh import GradReducer
from pipetrain.train.optim import (
    build_optimizer,
    clip_grads_,
    global_grad_norm,
    lr_at,
    no_decay_names,
    set_lr,
)
from pipetrain.train.resume import restore, save
from pipetrain.train.setup import Trainer, build

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

TIED = "0.tokens"


class Steps(NullReporter):
    """Keeps the step records."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def record(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "step":
            self.steps.append(fields)


def _cfg(tmp: str, name: str, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        preset="tiny", data=str(Path(tmp, "corpus.txt")), seq_len=32, batch_size=8,
        microbatches=4, steps=6, warmup=2, lr=3e-3, eval_every=3, eval_batches=1,
        sample_tokens=6, out=str(Path(tmp, name)), timeout=30)
    return TrainConfig(**{**base, **kw})


def _losses(cfg: TrainConfig) -> tuple[list[float], dict[str, Any]]:
    reporter = Steps()
    summary = run(cfg, reporter)
    return [s["loss"] for s in reporter.steps], summary


def _curves(cfg: TrainConfig) -> tuple[list[float], dict[str, Any]]:
    """Losses and gradient norms, alternating (a wrong gradient can hide from AdamW's losses
    for a while: it normalises each element's step; the norm shows it at once)."""
    reporter = Steps()
    summary = run(cfg, reporter)
    return [v for s in reporter.steps for v in (s["loss"], s["grad_norm"])], summary


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.pipe.named_parameters()}


@contextlib.contextmanager
def _faults(plan: str, out: Path) -> Iterator[None]:
    """Faults of ``plan`` fire in this block, once per ``out`` (not once per process)."""
    os.environ[faults.ENV], os.environ[faults.DIR_ENV] = plan, str(out / "faults")
    try:
        yield
    finally:
        del os.environ[faults.ENV], os.environ[faults.DIR_ENV]


# -- two processes ----------------------------------------------------------------------------
def _two(ctx: pt.RankContext, tmp: str) -> list[str]:
    return _cases(ctx, tmp, [_resume_at_pp2, _runs, _resume_bitwise, _clipping, _skip, _abort,
                             _precisions, _overlap, _compiled, _failure_names_the_step])


def _runs(ctx: pt.RankContext, tmp: str) -> list[str]:
    """A tiny GPT trains under 1f1b and zbv: the loss falls; the summary is the same everywhere."""
    problems = []
    for schedule in ("1f1b", "zbv"):
        losses, summary = _losses(_cfg(tmp, f"run-{schedule}", schedule=schedule, steps=8))
        if not losses[-1] < losses[0] - 0.5:
            problems.append(f"{schedule}: the loss did not fall: {losses}")
        if not summary["eval_loss"] < 5.0 or summary["skipped"] or summary["steps"] != 8:
            problems.append(f"{schedule}: summary {summary}")
        if summary["layout"]["stages"] != (4 if schedule == "zbv" else 2):
            problems.append(f"{schedule}: layout {summary['layout']}")
        if not isinstance(summary["sample"], str) or not summary["sample"].startswith("def "):
            problems.append(f"{schedule}: sample {summary['sample']!r}")
        peaks = summary["peak_memory_bytes"]  # fp32 parameters, gradients, two AdamW moments
        if len(peaks) != 2 or sum(peaks) < 16 * summary["params"] or not summary["step_s"] > 0:
            problems.append(f"{schedule}: peaks {peaks}, step_s {summary['step_s']}")
        gathered = [None, None]
        dist.all_gather_object(gathered, summary)
        if gathered[0] != gathered[1]:
            problems.append(f"{schedule}: the ranks return different summaries: {gathered}")
    return problems


def _compiled(ctx: pt.RankContext, tmp: str) -> list[str]:
    """``--compile`` under zbv (inductor, split backward, two processes) trains as the eager
    run does: losses and gradient norms within 1e-5 (relative) for 3 steps."""
    common = dict(schedule="zbv", steps=3, eval_every=0, sample_tokens=0,
                  timeout=120)  # the first F of each stage compiles while its peer waits
    eager, _ = _curves(_cfg(tmp, "eager-zbv", **common))
    compiled, summary = _curves(_cfg(tmp, "compiled-zbv", compile=True, **common))
    worst = max((abs(a - b) / abs(a) for a, b in zip(eager, compiled)), default=0.0)
    if not len(compiled) == len(eager) == 6 or worst > 1e-5:
        return [f"{len(compiled)} and {len(eager)} values, worst relative difference {worst:.2e}:"
                f" compiled {compiled[:4]}..., eager {eager[:4]}..."]
    return [] if summary["steps"] == 3 else [f"summary {summary}"]


def _resume_bitwise(ctx: pt.RankContext, tmp: str) -> list[str]:
    """Three steps, a checkpoint, a new run: the loss curve goes on exactly."""
    full, _ = _losses(_cfg(tmp, "uninterrupted"))
    cfg = _cfg(tmp, "interrupted")
    trainer = build(cfg)
    first = [train_step(trainer, step).loss for step in range(3)]
    save(trainer)
    rest, summary = _losses(cfg)
    problems = []
    if first + rest != full:
        problems.append(f"resumed losses {first} + {rest} != uninterrupted {full}")
    if summary["steps"] != 6 or summary["steps_run"] != 3:
        problems.append(f"summary {summary}")
    return problems


def _pipedream(ctx: pt.RankContext, tmp: str) -> list[str]:
    """--schedule pipedream-2bw: the first step applies nothing (it fills the pipeline), the
    loss falls, and a run stopped at its checkpoint (drained there) and resumed goes on exactly
    as the uninterrupted one: losses and gradient norms."""
    common: dict[str, Any] = dict(schedule="pipedream-2bw", steps=8, checkpoint_every=4,
                                  sample_tokens=0, eval_every=0)
    full, summary = _curves(_cfg(tmp, "2bw-full", **common))
    problems = []
    if not (math.isnan(full[0]) and math.isnan(full[1]) and full[-2] < full[2] - 0.5):
        problems.append(f"2bw: losses and norms {full}")
    if summary["steps"] != 8 or summary["skipped"]:
        problems.append(f"2bw: summary {summary}")
    cfg = _cfg(tmp, "2bw-cut", **common)
    trainer = build(cfg)
    first = [v for step in range(4) for s in [train_step(trainer, step)]
             for v in (s.loss, s.grad_norm)]
    save(trainer)
    del trainer
    rest, summary = _curves(cfg)
    if repr(first + rest) != repr(full):
        problems.append(f"2bw resumed {first} + {rest} != uninterrupted {full}")
    return problems + _pipedream_layouts_and_bf16(tmp, common, full)


def _pipedream_layouts_and_bf16(tmp: str, common: dict[str, Any], full: list[float]
                                ) -> list[str]:
    """A 2BW checkpoint (drained) resumed at another layout, dp = 2 instead of pp = 2: the
    curve goes on within rounding (the replicas' mean sums in another order); bf16 and fp16."""
    problems = []
    cfg = _cfg(tmp, "2bw-layout", **common)
    trainer = build(cfg)
    for step in range(4):
        train_step(trainer, step)
    save(trainer)
    del trainer
    rest, summary = _curves(_cfg(tmp, "2bw-layout", **{**common, "pp": 1, "dp": 2}))
    if summary["layout"]["dp"] != 2 or not all(
            math.isclose(a, b, rel_tol=1e-4) or (math.isnan(a) and math.isnan(b))
            for a, b in zip(rest, full[8:], strict=True)):
        problems.append(f"2bw resumed at dp=2: {rest} != pp=2 {full[8:]}")
    for precision in ("bf16", "fp16"):  # fp16: each update unscaled by the scale that made
        # its gradients, the step before's (an overflow there halves the next step's)
        curves, summary = _curves(_cfg(tmp, f"2bw-{precision}",
                                       **{**common, "precision": precision}))
        losses = curves[0::2]  # steps 0 and 4 fill the pipeline (the second after a checkpoint)
        if not all(math.isfinite(x) != (i in (0, 4)) for i, x in enumerate(losses)) \
                or not 3.0 < summary["eval_loss"] < 6.0:
            problems.append(f"2bw {precision}: {curves}, eval {summary['eval_loss']}")
    return problems


def _clipping(ctx: pt.RankContext, tmp: str) -> list[str]:
    """The global norm over both ranks (tied table once) and the clipped gradients match
    torch.nn.utils.clip_grad_norm_ on the single-device model."""
    cfg = _cfg(tmp, "clip")
    trainer = build(cfg)
    inputs, targets = trainer.batch(0)
    trainer.pipe.step(inputs, targets)
    trainer.reducer.finish()
    norm = global_grad_norm(trainer.counted, trainer.mesh.pp_group, trainer.mesh.comm_device)
    clip_grads_(trainer.params, norm, 0.5)
    torch.manual_seed(cfg.seed)
    reference = nn.Sequential(*gpt_layers(trainer.model))
    reference_step(reference, inputs, targets, lm_loss, cfg.microbatches)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    problems = []
    if not torch.allclose(norm, want, rtol=1e-5) or float(want) < 1.0:
        problems.append(f"global norm {float(norm)} != single-device {float(want)}")
    ref = dict(reference.named_parameters())
    for name, p in trainer.pipe.named_parameters():
        assert p.grad is not None and ref[name].grad is not None
        if not torch.allclose(p.grad, ref[name].grad, rtol=1e-4, atol=1e-7):
            problems.append(f"clipped gradient of {name} differs")
    return problems


def _skip(ctx: pt.RankContext, tmp: str) -> list[str]:
    """A NaN on rank 1's stage at step 1: every rank skips step 1 and only step 1, also when
    every stage recomputes (its layers then run segment by segment, not as one module)."""
    return _skip_with(ctx, tmp, "never") + _skip_with(ctx, tmp, "always")


def _skip_with(ctx: pt.RankContext, tmp: str, recompute: str) -> list[str]:
    trainer = build(_cfg(tmp, f"skip-{recompute}", nonfinite="skip", recompute=recompute))
    train_step(trainer, 0)
    before = _params(trainer)
    with _faults("nan@rank1:step1", Path(tmp, f"skip-{recompute}")):
        skipped = train_step(trainer, 1)
    problems = []
    if not skipped.skipped or not math.isnan(skipped.loss) or trainer.skipped != 1:
        problems.append(f"{recompute}: step 1 not skipped on rank {ctx.rank}: "
                        f"{skipped.fields()}")
    changed = [n for n, p in _params(trainer).items() if not torch.equal(p, before[n])]
    if changed or trainer.step != 2:
        problems.append(f"rank {ctx.rank}: parameters {changed} changed, step {trainer.step}")
    after = train_step(trainer, 2)
    if after.skipped or not math.isfinite(after.loss):
        problems.append(f"{recompute}: step 2 after the skip: {after.fields()}")
    return problems


def _abort(ctx: pt.RankContext, tmp: str) -> list[str]:
    """A NaN on rank 0's stage with nonfinite='abort': every rank raises, naming step and rank
    (with and without recomputing every stage)."""
    problems = []
    for recompute in ("never", "always"):
        trainer = build(_cfg(tmp, f"abort-{recompute}", nonfinite="abort", recompute=recompute))
        try:
            with _faults("nan@rank0:step0", Path(tmp, f"abort-{recompute}")):
                train_step(trainer, 0)
            problems.append(f"{recompute}: rank {ctx.rank} did not raise")
        except PipelineError as e:
            text = str(e)
            wanted = [f"[rank {ctx.rank}] step 0", "rank(s) [0, 1]", "nonfinite='abort'"]
            problems += [f"{recompute}: message lacks {w!r}: {text}" for w in wanted
                         if w not in text]
    return problems


def _precisions(ctx: pt.RankContext, tmp: str) -> list[str]:
    """bf16 and fp16 autocast (fp16 with the dynamic loss scale) train; under bf16,
    recomputing every stage gives bitwise the losses of not recomputing (the recomputation
    runs under the same autocast as the forward)."""
    problems = []
    for precision, recompute in (("bf16", "never"), ("bf16", "always"), ("fp16", "always")):
        cfg = _cfg(tmp, f"p-{precision}-{recompute}", precision=precision, steps=4,
                   recompute=recompute, sample_tokens=0)
        losses, summary = _losses(cfg)
        if not (all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]):
            problems.append(f"{precision}: losses {losses}")
        if not 3.0 < summary["eval_loss"] < 6.0:  # unscaled (fp16 scales the loss by 2**16)
            problems.append(f"{precision}: eval loss {summary['eval_loss']}")
        if (precision, recompute) == ("bf16", "never"):
            plain = losses
        elif precision == "bf16" and losses != plain:
            problems.append(f"bf16 with recomputation: {losses} != without {plain}")
    return problems


def _overlap(ctx: pt.RankContext, tmp: str) -> list[str]:
    """Each stage's dp all-reduce starts from the gradients-ready hook while the step still
    runs, and the result is exactly the mean of the replicas' gradients."""
    torch.manual_seed(0)
    pipe = pt.Pipeline([nn.Linear(8, 8) for _ in range(4)], "1f1b", 4, nn.functional.mse_loss,
                       local_ranks=4)
    g = torch.Generator().manual_seed(ctx.rank)
    inputs, targets = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    reducer = GradReducer({s: st.parameters() for s, st in pipe.stages.items()},
                          dist.group.WORLD, 2)
    started: dict[int, float] = {}

    def hook(stage: int) -> None:
        started[stage] = time.time()
        reducer.start(stage)

    result = pipe.step(inputs, targets, on_grads_ready=hook)
    own = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
    reducer.finish()
    problems = []
    end = max(span.end for span in result.timeline.spans)
    if sorted(started) != [0, 1, 2, 3] or not min(started.values()) < end:
        problems.append(f"hooks at {started}, the step's last action ended at {end}")
    for name, p in pipe.named_parameters():
        want = own[name].clone()
        dist.all_reduce(want)
        if not torch.equal(p.grad, want / 2):
            problems.append(f"{name}: the overlapped mean differs from all_reduce / 2")
    return problems


def _failure_names_the_step(ctx: pt.RankContext, tmp: str) -> list[str]:
    """Resumed at step 2, a step that fails at training step 3 names step 3 on every rank,
    not the resumed pipeline's own count (1). Last: it leaves a failed pipeline behind."""
    cfg = _cfg(tmp, "named", sample_tokens=0)
    trainer = build(cfg)
    for step in range(2):
        train_step(trainer, step)
    save(trainer)
    trainer = build(cfg)
    restore(trainer)
    train_step(trainer, trainer.step)
    try:
        with _faults("shape@rank0:step3", Path(tmp, "named")):
            train_step(trainer, 3)
    except PipelineError as e:
        text = str(e)
        if not re.search(r"\bstep 3\b", text) or re.search(r"\bstep [0-2]\b", text):
            return [f"rank {ctx.rank}: the error does not name training step 3 only: {text}"]
        return []
    return [f"rank {ctx.rank} did not raise"]


# -- four processes ---------------------------------------------------------------------------
def _four(ctx: pt.RankContext, tmp: str) -> tuple[list[str], list[float]]:
    """dp x pp equivalence first: its tied-weight groups are symmetric, while pp=4's are made
    by ranks 0 and 3 only, after which torch names a later subset group differently on
    different ranks (its hash counts the groups each process has made)."""
    problems = _cases(ctx, tmp, [_dp_equivalence])
    full: list[float] = []
    try:
        full = _save_at_pp4(tmp)
    except Exception as e:  # noqa: BLE001  (reported with the others)
        problems.append(f"_save_at_pp4: raised {type(e).__name__}: {e}")
    return problems, full


def _cases(ctx: pt.RankContext, tmp: str, cases: list[Any]) -> list[str]:
    problems: list[str] = []
    for case in cases:
        try:
            problems += [f"{case.__name__}: {p}" for p in case(ctx, tmp)]
        except Exception as e:  # noqa: BLE001  (reported with the others)
            problems.append(f"{case.__name__}: raised {type(e).__name__}: {e}")
    return problems


def _dp_equivalence(ctx: pt.RankContext, tmp: str) -> list[str]:
    """dp=2 x pp=2 (one micro-batch per replica) makes the same step as pp=2 on the whole batch
    (two micro-batches): bitwise, except the tied table, summed in another order (rounding)."""
    cfg = _cfg(tmp, "dp", dp=2, pp=2, batch_size=4, microbatches=1, grad_clip=0.0)
    trainer = build(cfg)
    train_step(trainer, 0)
    torch.manual_seed(cfg.seed)
    layers = gpt_layers(trainer.model)
    reference = pt.Pipeline(layers, "1f1b", 2, lm_loss, local_ranks=2)
    opt = build_optimizer(reference.named_parameters(), no_decay_names(nn.Sequential(*layers)),
                          lr=cfg.lr, weight_decay=cfg.weight_decay)
    set_lr(opt, lr_at(0, peak=cfg.lr, min_lr=cfg.min_lr, warmup=cfg.warmup, steps=cfg.steps))
    reference.step(*trainer.batches.batch(0))
    opt.step()
    ref = dict(reference.named_parameters())
    problems = []
    for name, p in trainer.pipe.named_parameters():
        same = torch.equal(p, ref[name]) if name != TIED else torch.allclose(p, ref[name])
        if not same:
            problems.append(f"rank {ctx.rank}: {name} differs after one step")
    return problems


def _save_at_pp4(tmp: str) -> list[float]:
    """An uninterrupted pp=4 run of 4 steps, and 2 steps of the same run saved at pp=4."""
    full, _ = _losses(_cfg(tmp, "pp4", pp=4, steps=4, sample_tokens=0))
    trainer = build(_cfg(tmp, "pp4-to-pp2", pp=4, steps=4, sample_tokens=0))
    for step in range(2):
        train_step(trainer, step)
    save(trainer)
    return full


def _resume_at_pp2(ctx: pt.RankContext, tmp: str) -> list[str]:
    """Saved at pp=4 (by the four-rank group), resumed at pp=2: the curve goes on."""
    full = [float(x) for x in Path(tmp, "pp4-losses.txt").read_text().split()]
    rest, summary = _losses(_cfg(tmp, "pp4-to-pp2", pp=2, steps=4, sample_tokens=0))
    problems = []
    if summary["steps_run"] != 2 or summary["layout"]["pp"] != 2:
        problems.append(f"summary {summary}")
    if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rest, full[2:], strict=True)):
        problems.append(f"resumed at pp=2: {rest} != pp=4 {full[2:]}")
    return problems


def _corpus_and_launch(fn: Any, nprocs: int, tmp_path: Path) -> list[str]:
    """Write the corpus, run ``fn`` on ``nprocs`` fresh processes; every rank's problems."""
    sources = [Path(textwrap.__file__), Path(argparse.__file__)]
    (tmp_path / "corpus.txt").write_bytes(b"".join(p.read_bytes() for p in sources))
    results = pt.launch(fn, nprocs, str(tmp_path), timeout=300)
    return [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs]


def _fsdp(ctx: pt.RankContext, tmp: str) -> list[str]:
    """pp=2 x fsdp=2 trains with the losses of pp=2 x dp=2 (6 steps, fp32, to rounding) at a
    lower peak per rank, and each run resumes from the other's checkpoint. Under zbv, which
    puts the embedding and its tied head both on rank 0 (FSDP2 shards each apart; the pipeline
    keeps them one weight). In fresh processes: the fsdp mesh (init_device_mesh) must come
    before any other group."""
    common = dict(pp=2, steps=6, sample_tokens=0, eval_every=0, schedule="zbv")
    sharded, summary = _curves(_cfg(tmp, "fsdp", fsdp=2, **common))
    replicated, plain = _curves(_cfg(tmp, "dp", dp=2, **common))
    problems = []
    if not max(summary["peak_memory_bytes"]) < max(plain["peak_memory_bytes"]):
        problems.append(f"peaks {summary['peak_memory_bytes']} !< {plain['peak_memory_bytes']}")
    if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(sharded, replicated, strict=True)):
        problems.append(f"fsdp=2 losses {sharded} != dp=2 {replicated}")
    if summary["layout"].get("fsdp") != 2:
        problems.append(f"layout {summary['layout']}")
    for out, other in (("fsdp", {"dp": 2}), ("dp", {"fsdp": 2})):  # resume at the other one
        more, _ = _curves(_cfg(tmp, out, **{**common, "steps": 8, **other}))
        if len(more) != 4:  # 2 steps: losses and norms
            problems.append(f"{out} resumed with {other}: ran {len(more)} steps, not 2")
        elif out == "dp":
            first = more
        else:
            second = more
    if not problems and not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(first, second)):
        problems.append(f"resumed curves differ: {first} vs {second}")
    return problems


@pytest.mark.long  # beside test_tp_trains_like_fsdp_and_resumes_across_them
def test_fsdp_trains_like_dp_and_resumes_across_them(tmp_path: Path) -> None:
    assert _corpus_and_launch(_fsdp, 4, tmp_path) == []


def _tp(ctx: pt.RankContext, tmp: str) -> list[str]:
    """pp=2 x tp=2 trains with the losses of pp=2 x fsdp=2 (6 steps, fp32, to rounding; that
    one's equal dp=2's, see _fsdp), and each resumes from
    the other's checkpoint (fresh processes, as for _fsdp)."""
    common = dict(pp=2, steps=6, sample_tokens=0, eval_every=0)
    split, summary = _curves(_cfg(tmp, "tp", tp=2, **{**common, "sample_tokens": 5}))
    sharded, other = _curves(_cfg(tmp, "fsdp", fsdp=2, **common))
    problems = []
    if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(split, sharded, strict=True)):
        problems.append(f"tp=2 losses {split} != fsdp=2 {sharded}")
    if summary["layout"].get("tp") != 2:
        problems.append(f"layout {summary['layout']}")
    if not summary["sample"]:  # windows of odd lengths, padded for sequence parallelism
        problems.append(f"no sample: {summary['sample']!r}")
    more = {out: _curves(_cfg(tmp, out, **{**common, "steps": 8, **layout}))[0]
            for out, layout in (("tp", {"fsdp": 2}), ("fsdp", {"tp": 2}))}
    if [len(m) for m in more.values()] != [4, 4]:  # 2 steps: losses and norms
        problems.append(f"resumed across tp and fsdp ran {[len(m) for m in more.values()]}")
    elif not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(*more.values())):
        problems.append(f"resumed curves differ: {more}")
    return problems


def test_tp_trains_like_fsdp_and_resumes_across_them(tmp_path: Path) -> None:
    assert _corpus_and_launch(_tp, 4, tmp_path) == []


def _hsdp(ctx: pt.RankContext, tmp: str) -> list[str]:
    """On 8 fresh processes (as for _fsdp), pp=2 with dp=2 replicas of fsdp=2 shards (HSDP),
    with fsdp=2 shards of tp=2 slices (2-D) and with dp=2 replicas of tp=2 slices train with
    the losses and gradient norms of dp=4, and the first two resume at pp=4 x fsdp=2 as dp=4
    does."""
    common = dict(pp=2, steps=4, sample_tokens=0, eval_every=0, batch_size=16)
    plain, _ = _curves(_cfg(tmp, "dp4", dp=4, **common))
    problems = []
    for out, layout in (("hsdp", {"dp": 2, "fsdp": 2}), ("2d", {"fsdp": 2, "tp": 2}),
                        ("dp-tp", {"dp": 2, "tp": 2})):
        got, summary = _curves(_cfg(tmp, out, **layout, **common))
        if not all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, plain, strict=True)):
            problems.append(f"{layout} losses {got} != dp=4 {plain}")
        if any(summary["layout"].get(k) != v for k, v in layout.items()):
            problems.append(f"layout {summary['layout']}")
    resumed = [_curves(_cfg(tmp, out, **{**common, "pp": 4, "fsdp": 2, "steps": 6}))[0]
               for out in ("hsdp", "dp4", "2d")]
    if [len(r) for r in resumed] != [4, 4, 4]:  # 2 steps: losses and norms
        problems.append(f"resumed at pp=4 x fsdp=2 ran {[len(r) for r in resumed]} steps")
    elif not all(math.isclose(a, b, rel_tol=1e-5) and math.isclose(a, c, rel_tol=1e-5)
                 for a, b, c in zip(*resumed)):
        problems.append(f"resumed curves differ: {resumed}")
    return problems


# in CI: fsdp and tp alone: test_tp_trains_like_fsdp...
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_hsdp_and_fsdp_by_tp_train_like_dp_and_resume_sharded(tmp_path: Path) -> None:
    assert _corpus_and_launch(_hsdp, 8, tmp_path) == []


# -- tests ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """The four-rank group's problems; it leaves a pp=4 checkpoint and that run's losses."""
    tmp = tmp_path_factory.mktemp("train")
    sources = [Path(textwrap.__file__), Path(argparse.__file__)]
    (tmp / "corpus.txt").write_bytes(b"".join(p.read_bytes() for p in sources))
    results = pt.launch(_four, 4, str(tmp), timeout=300)
    (tmp / "pp4-losses.txt").write_text(" ".join(repr(x) for x in results[0][1]))
    return str(tmp), [f"rank {r}: {p}" for r, (probs, _) in enumerate(results) for p in probs]


def test_dp_x_pp_equivalence_and_a_save_at_pp4(four_ranks: tuple[str, list[str]]) -> None:
    assert four_ranks[1] == []


# in CI: pp2 training and resume: test_train_launch.py, test_examples_train_dist.py
@pytest.mark.long  # CI's time (CONTRIBUTING.md: tests)
def test_training_on_two_ranks_and_resuming_at_pp2(four_ranks: tuple[str, list[str]]) -> None:
    results = pt.launch(_two, 2, four_ranks[0], timeout=300)
    assert [f"rank {r}: {p}" for r, probs in enumerate(results) for p in probs] == []


@pytest.mark.long  # beside test_train_launch.py::test_killed_rank_restarts_from_checkpoint_...
def test_pipedream_2bw_trains_resumes_bitwise_and_at_another_layout(tmp_path: Path) -> None:
    assert _corpus_and_launch(_pipedream, 2, tmp_path) == []
