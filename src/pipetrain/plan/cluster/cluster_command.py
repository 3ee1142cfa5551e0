"""``pipetrain plan --cluster GPU``: plan a job for GPUs this machine does not have.

    $ pipetrain plan --cluster H100 --gpus 64 --hf llama-70b/ --seq-len 8192 --global-batch 512
    $ pipetrain plan --cluster A100-80GB --gpus 512 --config-json gpt.json --seq-len 2048 \\
          --global-batch 1536 --tp 8 --pp 2 --json

Nothing is profiled or run: the model's shape (a Hugging Face ``config.json`` is enough), the
GPU's table (:mod:`.hardware`, or ``--hardware FILE.toml``), its measured kernel speeds
(:mod:`.kernels`) and the schedule simulator predict every layout the flags leave open
(:mod:`.cluster_search`, :mod:`.cluster`). Exit 2 for input no layout can take (it says how to
fix it), 3 when no layout fits the memory (the closest is shown, with what would fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal

from pipetrain.plan.cluster.arch import Arch
from pipetrain.plan.cluster.hardware import GPUS, gpu, load_toml, with_overrides
from pipetrain.plan.cluster.job import Job, Layout, Prediction, predict, simulation
from pipetrain.plan.cluster.search import RECOMPUTE, Pins, search
from pipetrain.plan.cluster.trainers import (
    CP_EXCHANGES,
    GRAD_BYTES,
    STATE_BYTES,
    TRAINERS,
    Trainer,
    trainer,
)
from pipetrain.train.config import TrainConfig, config_toml

__all__ = ["configure_cluster", "run_cluster"]

EXIT_BAD_INPUT, EXIT_NONE_FITS = 2, 3


def configure_cluster(parser: argparse.ArgumentParser) -> None:
    """The flags of ``plan --cluster`` that plain ``plan`` does not have."""
    group = parser.add_argument_group("planning for a GPU cluster (--cluster)")
    group.add_argument("--cluster", metavar="GPU",
                       help=f"predict for these GPUs instead of profiling here: "
                            f"{', '.join(GPUS)} (or --hardware FILE.toml)")
    group.add_argument("--gpus", type=int, metavar="N", help="GPUs in all")
    group.add_argument("--gpus-per-node", type=int, metavar="G")
    group.add_argument("--nic-gbps", type=float, metavar="X",
                       help="scale-out bandwidth per GPU, Gbit/s")
    group.add_argument("--hardware", metavar="FILE.toml", help="your own GPU's description")
    group.add_argument("--config-json", metavar="FILE",
                       help="the model's config.json (Hugging Face keys)")
    group.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    group.add_argument("--micro-batch-size", type=int, metavar="b")
    group.add_argument("--cp", type=int, metavar="C", help="context-parallel ranks")
    group.add_argument("--schedule", metavar="NAME")
    group.add_argument("--stages-per-rank", type=int, metavar="V")
    group.add_argument("--recompute", choices=RECOMPUTE)
    group.add_argument("--recompute-layers", type=int, metavar="K",
                       help="of each stage's layers, K recomputed wholly, the rest as "
                            "--recompute says (searched when --recompute is not given)")
    group.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    group.add_argument("--activation-limit", type=float, metavar="N", default=0.0,
                       help="zb-auto: stage-activations a rank may hold (default: pp)")
    stack = parser.add_argument_group(
        "the trainer (--cluster): a preset, each setting overridable by its own flag")
    stack.add_argument("--trainer", choices=TRAINERS, default="pipetrain",
                       help="the stack whose costs to predict (default: %(default)s, what "
                            "pipetrain train runs; docs/planning.md has the table)")
    for flag, what in (("flash-attention", "flash attention (no s x s scores in memory)"),
                       ("attention-dropout", "a dropout over attention's scores (without "
                                             "flash attention)"),
                       ("sequence-parallel", "norms and residuals split by --tp too"),
                       ("distributed-optimizer", "AdamW's states sharded over the dp replicas"),
                       ("overlap-grad-reduce", "gradients reduced under the backward")):
        stack.add_argument(f"--{flag}", action=argparse.BooleanOptionalAction, default=None,
                           dest=f"cluster_{flag.replace('-', '_')}",
                           help=f"{what} (default: the trainer's)")
    stack.add_argument("--cp-exchange", choices=CP_EXCHANGES, default=None,
                       help="how cp ranks attend (default: the trainer's)")
    stack.add_argument("--grad-dtype", choices=tuple(GRAD_BYTES), default=None,
                       help="gradients accumulated and reduced in (default: the trainer's)")
    stack.add_argument("--optimizer-dtype", choices=tuple(STATE_BYTES), default=None,
                       help="AdamW's weights and moments in (default: the trainer's)")


def run_cluster(args: argparse.Namespace) -> int:
    """Plan for ``args.cluster``; the exit code of the module docstring."""
    try:
        job, pins = _job(args)
        found = search(job, pins)
    except ValueError as e:
        print(f"pipetrain plan --cluster: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    best = found[0]
    report = {"best": _row(best, job), "candidates": [_row(p, job) for p in found[:50]],
              **_beside_bf16(job, best),
              "predicted_only": predicted_only(best.layout),
              "trainer": {"preset": args.trainer, **_trainer(args).job_options()},
              "job": {"gpu": job.gpu.name, "gpus": job.gpus, "seq_len": job.seq,
                      "global_batch": job.global_batch, "params": job.arch.params(),
                      "active_params": job.arch.active_params()}}
    if args.json:
        print(json.dumps(report))
    else:
        _print(found[:args.top], job)
        if "bf16" in report:
            print(f"fp8: {report['bf16']['speedup']:.2f}x the step of bf16 on the best layout "
                  f"({report['bf16']['step_s']:.3f} s in bf16, its peak "
                  f"{report['bf16']['peak_bytes_per_gpu'] / 2**30:.1f} GiB)")
        for line in _write(args, job, best):
            print(line)
    if not best.fits:
        limit = (job.memory_limit or job.gpu.hbm_bytes) / 2**30
        print(f"pipetrain plan --cluster: no layout fits {limit:.1f} GiB per GPU; the closest "
              f"needs {best.peak_bytes_per_gpu / 2**30:.1f} GiB ({_fix(best)})", file=sys.stderr)
        return EXIT_NONE_FITS
    return 0


def _beside_bf16(job: Job, best: Prediction) -> dict[str, Any]:
    """Under ``--precision fp8``: the best layout's step and peak in bf16, and fp8's
    speed-up over it (``{"bf16": {...}}``; nothing otherwise)."""
    if job.precision != "fp8":
        return {}
    bf16 = predict(dataclasses.replace(job, precision="bf16"), best.layout)
    return {"bf16": {"step_s": bf16.step_s, "peak_bytes_per_gpu": bf16.peak_bytes_per_gpu,
                     "speedup": bf16.step_s / best.step_s}}


def predicted_only(layout: Layout) -> list[str]:
    """What of ``layout`` pipetrain train does not run yet (predicted, not trainable)."""
    kinds = [f"recompute {layout.recompute}"] if layout.recompute in ("selective", "op") else []
    if layout.recompute_layers:
        kinds.append(f"recompute of {layout.recompute_layers} layers a stage")
    return kinds


def _write(args: argparse.Namespace, job: Job, best: Prediction) -> list[str]:
    """The best layout's predicted timeline (``plan.png``) and, when pipetrain train runs it
    and the model is a preset or a local checkpoint, ``plan.toml`` for ``--config``."""
    from pipetrain.schedules import draw

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lay = best.layout
    sim = simulation(job, lay)
    png = out / "plan.png"
    draw.save_png(sim.timeline, png, title=(
        f"plan --cluster: {job.gpus} x {job.gpu.name}, tp {lay.tp} pp {lay.pp} dp {lay.dp} "
        f"fsdp {lay.fsdp}, {lay.schedule} m={sim.schedule.n_microbatches} (predicted, one "
        "replica's pipeline)"))
    lines = [f"timeline: {png}"]
    missing = predicted_only(lay) + ([] if args.hf or not args.config_json
                                     else ["a model pipetrain can build (--hf or --preset)"])
    if missing:
        return lines + [f"no plan.toml: pipetrain train does not run {', '.join(missing)}"]
    toml = out / "plan.toml"
    toml.write_text(config_toml(TrainConfig(
        preset=args.preset, hf=getattr(args, "hf_spec", args.hf), seq_len=job.seq,
        batch_size=job.global_batch,
        nproc=job.gpus, pp=lay.pp, dp=lay.dp, fsdp=lay.fsdp, tp=lay.tp, ep=lay.ep, cp=lay.cp,
        schedule=lay.schedule, stages_per_rank=lay.stages_per_rank,
        microbatches=lay.microbatches, recompute=lay.recompute, precision="bf16",
        device="cuda")))
    return lines + [f"config: {toml} (torchrun ... -m pipetrain train --config {toml})"]


def _job(args: argparse.Namespace) -> tuple[Job, Pins]:
    for flag in ("gpus", "global_batch"):
        if getattr(args, flag) is None:
            raise ValueError(f"--cluster needs --{flag.replace('_', '-')}")
    card = load_toml(args.hardware) if args.hardware else gpu(args.cluster)
    card = with_overrides(card, args.nic_gbps, args.gpus_per_node)
    limit = 0.0
    if args.memory_limit:
        from pipetrain.train.commands.export_command import size_bytes

        limit = float(size_bytes(args.memory_limit, "--memory-limit"))
    job = Job(_arch(args), card, args.gpus, args.seq_len, args.global_batch,
              precision=args.precision, memory_limit=limit, **_trainer(args).job_options())
    pins = Pins(tp=args.tp, pp=args.pp, dp=args.dp, fsdp=args.fsdp, cp=args.cp, ep=args.ep,
                schedule=args.schedule, stages_per_rank=args.stages_per_rank,
                micro_batch_size=args.micro_batch_size, recompute=args.recompute,
                recompute_layers=args.recompute_layers, activation_limit=args.activation_limit)
    return job, pins


def _trainer(args: argparse.Namespace) -> Trainer:
    """``--trainer`` with the settings its own flags override."""
    names = ("flash_attention", "attention_dropout", "sequence_parallel",
             "distributed_optimizer", "overlap_grad_reduce")
    grad = GRAD_BYTES[args.grad_dtype] if args.grad_dtype else None
    state = STATE_BYTES[args.optimizer_dtype] if args.optimizer_dtype else None
    return trainer(args.trainer, cp_exchange=args.cp_exchange, grad_bytes=grad,
                   state_bytes=state,
                   **{n: getattr(args, f"cluster_{n}") for n in names})


def _arch(args: argparse.Namespace) -> Arch:
    if args.config_json:
        return Arch.from_config(json.loads(Path(args.config_json).read_text()))
    if args.hf:
        return Arch.from_config(json.loads((Path(args.hf) / "config.json").read_text()))
    from pipetrain.models.gpt import PRESETS

    if args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}: one of {', '.join(PRESETS)}")
    c = PRESETS[args.preset]
    return Arch(layers=c.n_layers, hidden=c.d_model, heads=c.n_heads, kv_heads=c.n_heads,
                ffn=c.mlp_ratio * c.d_model, vocab=c.vocab_size, gated=False,
                name=args.preset)


def _row(p: Prediction, job: Job) -> dict[str, Any]:
    d = p.to_dict()
    d["layout"]["microbatches"] = p.layout.microbatches
    return d


def recompute_label(recompute: str, layers: int = 0) -> str:
    """How the table shows a layout's recomputation: ``never``, ..., or ``selective+2`` (2 of
    each stage's layers wholly, the rest selectively)."""
    return recompute + (f"+{layers}" if layers else "")


def _fix(p: Prediction) -> str:
    layout = p.layout
    if layout.recompute != "always":
        return "try --recompute always, a larger --tp or --pp, or more GPUs"
    return "try a larger --tp, --pp or --fsdp, or more GPUs"


_DEGREES = ("tp", "pp", "dp", "fsdp", "cp", "ep")  # a layout's, in the JSON's order

# each column: its header on one line, its header on a narrow terminal, the cells' side
_COLUMNS: tuple[tuple[str, str, Literal["left", "right"]], ...] = (
    ("layout", "layout", "left"), ("schedule", "schedule", "left"), ("v", "v", "right"),
    ("m", "m", "right"), ("b", "b", "right"), ("recompute", "recompute", "left"),
    ("step s", "step s", "right"), ("tokens/s per GPU", "tokens/s\nper GPU", "right"),
    ("MFU", "MFU", "right"), ("peak GiB", "peak\nGiB", "right"), ("fits", "fits", "left"))


def _layout_label(layout: Layout) -> str:
    """``tp2 pp4 dp8``: the degrees above 1, in the JSON's order (``1 GPU`` if none is)."""
    return " ".join(f"{name}{getattr(layout, name)}" for name in _DEGREES
                    if getattr(layout, name) > 1) or "1 GPU"


def _print(shown: list[Prediction], job: Job, console: Any = None) -> None:
    """The ranked layouts as a table: boxed where that fits the terminal's width; narrower
    (80 columns) without the box, the long headers' words stacked and the columns 2, then 1
    space apart, so that every header and cell reads whole (only a layout wraps, at its
    spaces)."""
    from rich import box
    from rich.console import Console

    console = Console() if console is None else console
    title = (f"{job.gpus} x {job.gpu.name}, {job.arch.params() / 1e9:.1f} B parameters, "
             f"{job.seq} tokens x {job.global_batch} sequences per step")
    unboxed = {"box": box.SIMPLE_HEAD, "show_edge": False, "pad_edge": False}
    styles: list[tuple[bool, dict[str, Any]]] = [
        (True, {"title": title, "title_justify": "left"}),
        (False, {**unboxed, "padding": (0, 1), "collapse_padding": True}),  # 2 spaces apart
        (False, {**unboxed, "padding": (0, 0)})]  # 1 space apart
    unbounded = console.options.update_width(10_000)
    for boxed, style in styles:
        table = _table(shown, boxed, style)
        if console.measure(table, options=unbounded).maximum <= console.width:
            break
    if not boxed:
        console.print(title)
    console.print(table)


def _table(shown: list[Prediction], boxed: bool, style: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(**style)
    for wide, narrow, justify in _COLUMNS:
        table.add_column(wide if boxed else narrow, justify=justify,
                         no_wrap=not boxed and wide != "layout")
    for p in shown:
        lay = p.layout
        table.add_row(_layout_label(lay), lay.schedule, str(lay.stages_per_rank),
                      str(lay.microbatches), str(lay.micro_batch_size),
                      recompute_label(lay.recompute, lay.recompute_layers),
                      f"{p.step_s:.3f}", f"{p.tokens_per_s_per_gpu:,.0f}", f"{p.mfu:.3f}",
                      f"{p.peak_bytes_per_gpu / 2**30:.1f}", "yes" if p.fits else "NO")
    return table
