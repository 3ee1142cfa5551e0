"""MoE: a mixture of experts trained with its experts spread (pp 2 x ep 2) against replicated.

``pipetrain train --hf`` trains a Mixtral built from its config (random weights, float32, the
experts most of its weights) on 4 gloo processes, a pipeline of 2 ranks each held by 2
data-parallel ranks, twice on the same data, seed and steps: with ``--ep 2`` (each rank of a
data-parallel pair holds half of each layer's experts; tokens travel to them and back by
all-to-all) and without (each rank holds all of its stages' experts). From each run's
``summary.json`` and ``log.jsonl``, the first step left out as warm-up:

    tokens/s      tokens per step x steps / their seconds (rank 0's clock)
    step s        the median seconds per step, the slowest rank's (``step_s``)
    peak          each rank's peak of tensor bytes (``peak_memory_bytes``), and ep/dp's ratio
    all-to-all    for the ep run, each rank's seconds inside the experts' all-to-alls per
                  step, forward (the split sizes and the tokens, to the experts and back, each
                  waited on) and backward (the two token exchanges' own all-to-alls), and
                  their share of the step; waiting for the peer to arrive counts in it

The all-to-alls are timed by this module, imported by every worker before it trains (the
forkserver that starts the workers preloads it): it wraps transformers' ``all_to_all_single``
and ``all_to_all_single_autograd`` (a prehook and a hook on the backward node time its
all-to-all) and pipetrain's ``train_step``, and after each step writes the rank's seconds to
``OUT/all_to_all/rank<r>.json``. Nothing under ``src/`` changes.

With ``--plan`` (the default at full size) ``pipetrain plan``, calibrated on the same ranks,
predicts the same pipeline afterwards, and its predictions are printed beside the measured
figures: each layout's peak bytes per pipeline rank, and the ep run's seconds per step in the
all-to-alls (:func:`predictions`).

    python benchmarks/moe.py --json moe.json       # docs/benchmarks.md section 10
    python benchmarks/moe.py --tiny --json out.json  # tests/test_expert_parallel_dist.py's run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

TIMERS_ENV = "MOE_BENCH_TIMERS"
"""Set (to 1) in the training process: importing this module then installs the timers."""

MIB = 2**20
LAYOUTS: dict[str, list[str]] = {"pp2 x dp2": ["--dp", "2"],
                                 "pp2 x ep2": ["--dp", "2", "--ep", "2"]}
SIZES: dict[str, dict[str, int]] = {  # the model, then the run
    "full": dict(layers=4, hidden=256, intermediate=512, experts=8, top_k=2, heads=4, kv=2,
                 seq_len=128, batch=16, microbatches=4, steps=10),
    "tiny": dict(layers=4, hidden=128, intermediate=256, experts=8, top_k=2, heads=4, kv=2,
                 seq_len=32, batch=8, microbatches=2, steps=2, stored=1),
}
"""``stored``: the model saved with its weights (each expert's matrices apart, as transformers
saves them), so the runs read and fuse them; else config only, initialised from --seed.
The tiny size is tests/test_expert_parallel_dist.py's run (experts 90% of the weights)."""
VOCAB = 300

# ------------------------------------------------------------------------ in every worker

_SPENT: dict[str, float] = {"forward_s": 0.0, "backward_s": 0.0, "calls": 0, "rows": 0}
_STEPS: list[dict[str, float]] = []


def install_timers() -> None:
    """Wrap the experts' all-to-alls (transformers) and the training step (pipetrain)."""
    import transformers.distributed.expert_parallel as ep

    import pipetrain.train.loop as loop

    ep.all_to_all_single = _timed_sizes(ep.all_to_all_single)
    ep.all_to_all_single_autograd = _timed_tokens(ep.all_to_all_single_autograd)
    loop.train_step = _recorded(loop.train_step)


def _timed_sizes(exchange: Callable[..., Any]) -> Callable[..., Any]:
    """The split sizes' all-to-all (synchronous), its seconds counted as forward."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = exchange(*args, **kwargs)
        _SPENT["forward_s"] += time.perf_counter() - start
        return out
    return timed


def _timed_tokens(exchange: Callable[..., Any]) -> Callable[..., Any]:
    """The tokens' all-to-all: forward waited on inside the timing (the caller would wait at
    its first use anyway); its backward node timed by hooks."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = exchange(*args, **kwargs)
        if isinstance(out, AsyncCollectiveTensor):
            out.trigger_wait()
        _SPENT["forward_s"] += time.perf_counter() - start
        _SPENT["calls"] += 1
        if sys._getframe(1).f_code.co_name == "_dispatch_tokens":  # rows for this rank's experts
            _SPENT["rows"] += out.shape[0]
        node = _exchange_node(out.grad_fn)
        if node is not None:
            _time_backward(node)
        return out
    return timed


def _exchange_node(node: Any) -> Any:
    """The all-to-all's own backward node: ``node`` or, under the async wrapper's identity
    node, the one below it; None without autograd."""
    if node is None or "all_to_all" in node.name():
        return node
    below = [n for n, _ in node.next_functions if n is not None and "all_to_all" in n.name()]
    return below[0] if below else None


def _time_backward(node: Any) -> None:
    """Add the seconds ``node`` (an all-to-all's backward, which waits for it) takes."""
    started: list[float] = []

    def before(*_: Any) -> None:
        started.append(time.perf_counter())

    def after(*_: Any) -> None:
        _SPENT["backward_s"] += time.perf_counter() - started.pop()
    node.register_prehook(before)
    node.register_hook(after)


def _recorded(train_step: Callable[..., Any]) -> Callable[..., Any]:
    """``train_step`` that counts only its own all-to-alls and writes them after each step."""
    def recorded(trainer: Any, step: int) -> Any:
        _SPENT.update(forward_s=0.0, backward_s=0.0, calls=0, rows=0)
        stats = train_step(trainer, step)
        _STEPS.append({"step": step, "seconds": stats.seconds, **_SPENT})
        if trainer.cfg.out:
            path = Path(trainer.cfg.out) / "all_to_all" / f"rank{trainer.mesh.rank}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_STEPS))
        return stats
    return recorded


def train_all(root: str, size: dict[str, int], plan: bool = False) -> int:
    """Save the model under ``root`` and run ``pipetrain train`` once per layout, in this
    process, with the timers in every worker: the forkserver, started by the first run,
    imports this module (which must be on ``PYTHONPATH``: the server ignores ``sys.path``)
    with ``TIMERS_ENV`` set. With ``plan``, then ``pipetrain plan`` (calibrated) of the same
    pipeline, its JSON report in ``root/plan.json``. Returns the first non-zero exit code,
    or 0."""
    import contextlib
    import io

    from pipetrain.cli import main
    from pipetrain.runtime.launch import start_context

    save_model(Path(root), size)
    os.environ[TIMERS_ENV] = "1"  # the server inherits this process's environment
    start_context((__name__,))  # ordered before the first launch's own preloads
    for layout in LAYOUTS:
        code = main(train_args(Path(root), size, layout))
        if code:
            return code
    if plan:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(plan_args(Path(root), size))
        (Path(root) / "plan.json").write_text(out.getvalue().splitlines()[-1])
        return code if code != 3 else 0  # 3: nothing fits the limit, still a plan
    return 0


if os.environ.get(TIMERS_ENV) == "1":
    install_timers()

# ------------------------------------------------------------------------ the benchmark


def save_model(root: Path, size: dict[str, int]) -> Path:
    """A Mixtral (its config, or with ``size["stored"]`` its weights too; without them every run
    initialises the model alike from ``--seed``) and a byte-level BPE tokenizer under
    ``root/moe``, and the training text ``root/data.txt``."""
    import transformers as tf

    from pipetrain.testing import train_tokenizer

    tf.logging.set_verbosity_error()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / n).read_text() for n in ("textwrap.py", "shlex.py",
                                                         "fnmatch.py", "heapq.py", "glob.py"))
    (root / "data.txt").write_text(text)
    tok = train_tokenizer(text, VOCAB)
    config = tf.MixtralConfig(
        num_hidden_layers=size["layers"], hidden_size=size["hidden"],
        intermediate_size=size["intermediate"], num_local_experts=size["experts"],
        num_experts_per_tok=size["top_k"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"], vocab_size=len(tok),
        max_position_embeddings=size["seq_len"] * 2, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)
    if size.get("stored"):
        import torch

        torch.manual_seed(0)
        tf.MixtralForCausalLM(config).save_pretrained(root / "moe")
    else:
        config.save_pretrained(root / "moe")
    tok.save_pretrained(root / "moe")
    return root / "moe"


def train_args(root: Path, size: dict[str, int], layout: str) -> list[str]:
    """``pipetrain train`` arguments of one layout's run (its out: ``root/<layout>``)."""
    return ["train", "--hf", str(root / "moe"), "--data", str(root / "data.txt"),
            "--token-cache", str(root / "tokens"), "--nproc", "4", "--pp", "2",
            *LAYOUTS[layout], "--seq-len", str(size["seq_len"]), "--batch-size",
            str(size["batch"]), "--microbatches", str(size["microbatches"]), "--steps",
            str(size["steps"]), "--seed", "0", "--lr", "1e-3", "--warmup", "1",
            "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
            "--no-progress", "--out", str(root / _dirname(layout))]


def plan_args(root: Path, size: dict[str, int]) -> list[str]:
    """``pipetrain plan`` arguments predicting the runs' pipeline (``ep`` searched: 1, 2)."""
    return ["plan", "--hf", str(root / "moe"), "--data", str(root / "data.txt"),
            "--token-cache", str(root / "tokens"), "--nproc", "4", "--pp", "2", "--dp", "2",
            "--seq-len", str(size["seq_len"]), "--batch-size", str(size["batch"]),
            "--schedules", "1f1b", "--memory-limit", "64GiB", "--json",
            "--out", str(root / "plan")]


def predictions(root: Path, size: dict[str, int]) -> dict[str, Any]:
    """What ``pipetrain plan`` predicted for the two runs: each layout's peak bytes per
    pipeline rank (1F1B, the runs' micro-batches, no recompute), and the ep run's seconds per
    step in the experts' all-to-alls, from the all-to-all it timed on the ranks times the
    factor its calibration run of an ep layout fitted (``Scale.ep_talk``; the planner's model,
    :mod:`pipetrain.plan.shardcost`: two per MoE layer in each F and each B, of every (token,
    expert) row's hidden state, float32)."""
    from pipetrain.plan.shardcost import Collectives

    report = json.loads((root / "plan.json").read_text())
    peaks = {c["ep"]: c["predicted_peak_bytes"] for c in report["candidates"]
             if c["microbatches"] == size["microbatches"] and c["recompute"] == "never"}
    rows = size["batch"] // 2 // size["microbatches"]  # a replica's micro-batch
    nbytes = rows * size["seq_len"] * size["top_k"] * size["hidden"] * 4
    talk = report["scale"]["ep_talk"]  # fitted to a calibration run of its own
    one = talk * Collectives(report["collectives"]).seconds("all_to_all", 2, nbytes)
    per_step = size["microbatches"] * 2 * 2 * (size["layers"] // 2) * one  # F and B, 2 each
    return {"peak_bytes": {"pp2 x dp2": peaks[1], "pp2 x ep2": peaks[2]},
            "all_to_all_s": per_step, "one_all_to_all_s": one, "all_to_all_bytes": nbytes,
            "ep_talk": talk,
            "collectives": report["collectives"]}


def _dirname(layout: str) -> str:
    return layout.replace(" x ", "_")


def run_all(root: Path, size: dict[str, int], plan: bool = False) -> None:
    """Both layouts' runs, and with ``plan`` the planner's prediction of them, in one process
    (:func:`train_all`; its output kept back unless it fails)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
    code = ("import json, sys, moe; "
            "sys.exit(moe.train_all(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == '1'))")
    done = subprocess.run([sys.executable, "-c", code, str(root), json.dumps(size),
                           "1" if plan else "0"], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"pipetrain train at {', '.join(LAYOUTS)} failed (the ep run's: "
                         f"{' '.join(train_args(root, size, 'pp2 x ep2'))}):\n"
                         f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


def figures(out: Path, tokens_per_step: int, timed: bool = True) -> dict[str, Any]:
    """One run's figures from its ``out`` directory (the first step left out); ``timed``:
    with every rank's all-to-all seconds (a run without the timers has none)."""
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "step"][1:]
    seconds = sum(tokens_per_step / r["tokens_per_s"] for r in steps)
    ranks = sorted(out.glob("all_to_all/rank*.json"), key=lambda p: int(p.stem[4:]))
    if timed and len(ranks) != summary["layout"]["world"]:
        raise SystemExit(f"{out}: {len(ranks)} ranks timed, not every one: were the timers "
                         f"imported by the workers ({__name__} on their PYTHONPATH)?")
    start = next(r for r in records if r.get("kind") == "start")
    return {"layout": summary["layout"], "steps_timed": len(steps),
            "ranks": [f"pp{r['pp']} dp{r['dp']}" for r in start["ranks"]],
            "tokens_per_s": tokens_per_step * len(steps) / seconds,
            "step_s": summary["step_s"], "peak_memory_bytes": summary["peak_memory_bytes"],
            "losses": [r["loss"] for r in records if r.get("kind") == "step"],
            "imbalance": [r["experts"]["imbalance"] for r in steps if "experts" in r],
            "all_to_all": [_share(json.loads(p.read_text())[1:]) for p in ranks]}


def _share(steps: list[dict[str, float]]) -> dict[str, float]:
    """A rank's all-to-all seconds per step and their share of its step time."""
    total = sum(s["seconds"] for s in steps)
    forward, backward = (sum(s[k] for s in steps) for k in ("forward_s", "backward_s"))
    return {"step_s": total / len(steps), "forward_s": forward / len(steps),
            "backward_s": backward / len(steps), "calls": steps[-1]["calls"],
            "rows": sum(s["rows"] for s in steps) / len(steps),
            "share": (forward + backward) / total, "share_forward": forward / total,
            "share_backward": backward / total}


def _machine() -> dict[str, Any]:
    """As ``gptbench.machine``, the versions read without importing torch (and transformers)."""
    from importlib.metadata import version

    return {"platform": platform.platform(), "python": platform.python_version(),
            "torch": version("torch"), "pipetrain": version("pipetrain"),
            "transformers": version("transformers"), "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def report(size: dict[str, int], runs: dict[str, dict[str, Any]]) -> None:
    """The plain-text table."""
    dp, ep = runs["pp2 x dp2"], runs["pp2 x ep2"]
    print(f"Mixtral from config: {size['layers']} layers x {size['hidden']}, {size['experts']} "
          f"experts of {size['intermediate']} (top {size['top_k']}), vocabulary {VOCAB}; "
          f"batch {size['batch']} x {size['seq_len']} tokens, {size['microbatches']} "
          f"micro-batches, {dp['layout']['schedule']}; 4 gloo processes on {os.cpu_count()} "
          f"CPUs; {size['steps']} steps, the first left out (warm-up)\n")
    print(f"{'':<26} {'pp2 x dp2':>11} {'pp2 x ep2':>11} {'ep/dp':>7}")
    for name, key, fmt in (("tokens/s", "tokens_per_s", ".1f"), ("median step s", "step_s", ".3f")):
        print(f"{name:<26} {dp[key]:>11{fmt}} {ep[key]:>11{fmt}} {ep[key] / dp[key]:>7.2f}")
    for rank, (d, e) in enumerate(zip(dp["peak_memory_bytes"], ep["peak_memory_bytes"],
                                      strict=True)):
        name = f"peak MiB rank {rank} ({ep['ranks'][rank]})"
        print(f"{name:<26} {d / MIB:>11.1f} {e / MIB:>11.1f} {e / d:>7.2f}")
    _report_exchanges(dp, ep)


def report_plan(runs: dict[str, dict[str, Any]], planned: dict[str, Any]) -> None:
    """The planner's predictions beside the measured figures."""
    print("\npipetrain plan (calibrated on these ranks) against the runs:")
    print(f"{'':<34} {'predicted':>10} {'measured':>10}")
    for layout, peaks in planned["peak_bytes"].items():
        measured = runs[layout]["peak_memory_bytes"]
        for pp_rank, peak in enumerate(peaks):
            most = max(measured[2 * pp_rank:2 * pp_rank + 2])  # pp-outer: ranks 2p, 2p + 1
            print(f"{f'{layout} peak MiB, pipeline rank {pp_rank}':<34} {peak / MIB:>10.1f} "
                  f"{most / MIB:>10.1f}")
    spent = [a["forward_s"] + a["backward_s"] for a in runs["pp2 x ep2"]["all_to_all"]]
    print(f"{'ep all-to-all s/step, least rank':<34} {planned['all_to_all_s']:>10.3f} "
          f"{min(spent):>10.3f}")
    print(f"{'ep all-to-all s/step, mean rank':<34} {planned['all_to_all_s']:>10.3f} "
          f"{statistics.mean(spent):>10.3f}")


def _report_exchanges(dp: dict[str, Any], ep: dict[str, Any]) -> None:
    """The experts' load, and the ep run's all-to-alls rank by rank."""
    dp_load, ep_load = (statistics.mean(r["imbalance"]) for r in (dp, ep))
    print(f"\nexperts' load: the most loaded expert's tokens over the mean (worst layer of each "
          f"step), mean over the timed steps: {dp_load:.2f} (dp), {ep_load:.2f} (ep)")
    print(f"\npp2 x ep2, the experts' all-to-alls per step ({ep['all_to_all'][0]['calls']} token "
          "exchanges per rank, each with its backward; rows: (token, expert) pairs its experts "
          "received):")
    print(f"{'rank':<14} {'step s':>8} {'forward s':>10} {'backward s':>11} {'share':>7} "
          f"{'rows':>8}")
    for rank, a in enumerate(ep["all_to_all"]):
        print(f"{rank} ({ep['ranks'][rank]}){'':<4} {a['step_s']:>8.3f} {a['forward_s']:>10.3f} "
              f"{a['backward_s']:>11.3f} {a['share']:>7.3f} {a['rows']:>8.0f}")
    mean = {k: statistics.mean(a[k] for a in ep["all_to_all"]) for k in ep["all_to_all"][0]}
    print(f"{'mean':<14} {mean['step_s']:>8.3f} {mean['forward_s']:>10.3f} "
          f"{mean['backward_s']:>11.3f} {mean['share']:>7.3f} {mean['rows']:>8.0f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a stored 4-layer 128-wide model, 2 steps (the test's)")
    parser.add_argument("--steps", type=int, help="steps per run (the first is warm-up)")
    parser.add_argument("--json", type=Path, help="also write the figures and the machine here")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="run in DIR and keep the model and the runs' out directories")
    parser.add_argument("--plan", action=argparse.BooleanOptionalAction, default=None,
                        help="also run pipetrain plan and put its predictions beside the "
                             "measured figures (default: on, off with --tiny)")
    args = parser.parse_args(argv)
    plan = not args.tiny if args.plan is None else args.plan
    size = dict(SIZES["tiny" if args.tiny else "full"])
    if args.steps is not None:
        if args.steps < 2:
            raise SystemExit("--steps must be at least 2 (the first is warm-up)")
        size["steps"] = args.steps
    with tempfile.TemporaryDirectory(prefix="pipetrain-moe-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        run_all(root, size, plan)
        tokens = size["batch"] * size["seq_len"]
        runs = {name: figures(root / _dirname(name), tokens) for name in LAYOUTS}
        planned = predictions(root, size) if plan else None
    report(size, runs)
    if planned is not None:
        report_plan(runs, planned)
    if args.json:
        dp, ep = runs["pp2 x dp2"]["peak_memory_bytes"], runs["pp2 x ep2"]["peak_memory_bytes"]
        body = {"config": size, "runs": runs, "plan": planned,
                "peak_ratio_ep_over_dp": [e / d for e, d in zip(ep, dp, strict=True)]}
        args.json.write_text(json.dumps({"meta": {"machine": _machine(), "argv": list(sys.argv)},
                                         **body}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
