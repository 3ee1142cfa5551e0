"""Generate: pipelined decoding with a KV cache per stage next to transformers' ``generate``.

For each Llama config (``small``, ``medium``; built from a config, random weights, float32, on
CPU) and each pipeline size p, the same greedy work three ways:

    transformers  ``model.generate(do_sample=False)`` on one process, all cores' threads
    pipetrain     :class:`pipetrain.generation.Generator` on p processes, one thread each,
                  groups = p (every rank busy in the steady state)
    re-run        the old way (``pipetrain.train.infer``'s): the whole context through the
                  pipeline for every new token, one sequence: its cost per token (once)

Figures (medians of ``--repeat`` runs, after a warm-up):

    tok/s       new tokens per second over the batch (``--batch`` prompts of ``--prompt``
                tokens, ``--new`` new tokens each)
    TTFT        seconds to the first new token (the prefill), ``generate(..., 1)``
    ms/token    one decode step of the whole batch, (t(new) - t(1)) / (new - 1), at prompts of
                64, 256 and 1024 tokens, each with a cache of prompt + new positions; and
                what re-running the whole window costs per token instead
    bubble      the idle share of the ranks in a window of decode steps, measured from the
                window's timeline (median over the runs), next to the simulator's for the
                same schedule with the measured forward time per stage and message delay
                (the median wait of an action for a message from another rank), ``cores`` =
                this machine's

    python benchmarks/generate.py                       # small and medium, p = 2 and 4
    python benchmarks/generate.py --configs small --ranks 2 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import pipetrain as pt

CONFIGS = {  # Llama shapes: hidden, layers, heads, kv heads, MLP, vocab
    "tiny": (64, 4, 4, 2, 128, 512),
    "small": (256, 8, 8, 4, 688, 4096),
    "medium": (512, 8, 8, 4, 1376, 8192),
}


def build(name: str, positions: int) -> Any:
    import transformers as tf

    tf.logging.set_verbosity_error()
    hidden, layers, heads, kv, mlp, vocab = CONFIGS[name]
    torch.manual_seed(0)
    config = tf.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv,
                            intermediate_size=mlp, vocab_size=vocab,
                            max_position_embeddings=positions, pad_token_id=0)
    return tf.LlamaForCausalLM(config).eval()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _timed(fn: Any, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _hf_generate(model: Any, batch: list[list[int]], new: int) -> Any:
    ids = torch.tensor(batch)
    config = model.generation_config
    config.eos_token_id = None
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, generation_config=config)


def transformers_side(args: argparse.Namespace, name: str) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model = build(name, max(args.contexts) + args.new + 8)
    vocab = model.config.vocab_size
    batch = prompts(args.batch, args.prompt, vocab)
    one = _timed(lambda: _hf_generate(model, batch, 1), args.repeat)
    full = _timed(lambda: _hf_generate(model, batch, args.new), args.repeat)
    per_token = {}
    for ctx in args.contexts:
        b = prompts(args.batch, ctx, vocab)
        t1 = _timed(lambda b=b: _hf_generate(model, b, 1), args.repeat)
        tn = _timed(lambda b=b: _hf_generate(model, b, args.new), args.repeat)
        per_token[ctx] = 1e3 * (tn - t1) / (args.new - 1)
    return {"ttft": one, "tok_s": args.batch * args.new / full, "ms_token": per_token}


def _pipeline_rank(ctx: pt.RankContext, args: argparse.Namespace, name: str
                   ) -> dict[str, Any]:
    from pipetrain.generation import Generator
    from pipetrain.schedules.calibration import hop_delays
    from pipetrain.schedules.simulator import Costs, simulate

    model = build(name, max(args.contexts) + args.new + 8)
    vocab = model.config.vocab_size
    p = ctx.world_size
    rows = max(args.batch // p, 1)
    gen = Generator(model, rows=rows, length=args.prompt + args.new, prefill=args.prefill,
                    window=args.new // 2)
    batch = prompts(args.batch, args.prompt, vocab)
    one = _timed(lambda: gen.generate(batch, 1), args.repeat)
    windows: list[Any] = []  # the window of decode steps only, of every timed run

    def run() -> None:
        gen.generate(batch, args.new)
        windows.append(gen.windows[-1])

    full = _timed(run, args.repeat)
    timelines = [w.timeline for w in windows[1:]]  # after the warm-up
    schedule = windows[-1].times.schedule
    cost = tuple(statistics.median(x.end - x.start for t in timelines for x in t.spans
                                   if x.action.stage == s) for s in range(schedule.n_stages))
    cores = os.cpu_count() or p
    delays = hop_delays(timelines, schedule)  # each message's wait, the fed-back tokens too
    comm = statistics.median(delays) if delays else 0.0
    simulated = simulate(schedule, Costs(F=cost), comm=comm, cores=cores if cores < p else None)
    bubble = statistics.median(t.bubble_fraction for t in timelines)
    per_token = {}
    for c in args.contexts:  # a cache sized as the run needs, as generate sizes its own
        sized = Generator(model, rows=rows, length=c + args.new, prefill=args.prefill,
                          window=args.new)
        b = prompts(args.batch, c, vocab)
        t1 = _timed(lambda b=b, g=sized: g.generate(b, 1), args.repeat)
        tn = _timed(lambda b=b, g=sized: g.generate(b, args.new), args.repeat)
        per_token[c] = 1e3 * (tn - t1) / (args.new - 1)
    return {"ttft": one, "tok_s": args.batch * args.new / full, "ms_token": per_token,
            "bubble": bubble, "bubble_sim": simulated.bubble_fraction,
            "groups": -(-args.batch // rows), "forward_ms": [1e3 * c for c in cost],
            "comm_ms": 1e3 * comm}


def rerun_rank(ctx: pt.RankContext, args: argparse.Namespace, name: str) -> dict[int, float]:
    """The old way: ``pipetrain.train.infer.generate`` runs the whole window per new token."""
    from pipetrain.hf.model import split_points
    from pipetrain.split.partition import even_balance
    from pipetrain.train.infer import generate
    from pipetrain.train.mesh import build_mesh

    model = build(name, max(args.contexts) + args.new + 8)
    model.config.use_cache = False
    mesh = build_mesh(1, ctx.world_size, "cpu")
    out = {}
    for c in args.contexts:
        example = {"input_ids": torch.zeros(1, c, dtype=torch.long)}
        points = split_points(model, ctx.world_size, example)
        pipe = pt.Pipeline(model, "gpipe", 1, split_points=points, example_inputs=example,
                           balance=even_balance(len(points) + 1, ctx.world_size))
        prompt = prompts(1, c, model.config.vocab_size)[0]
        n = 4

        def run(n: int = n, prompt: list[int] = prompt, c: int = c, pipe: Any = pipe) -> Any:
            return generate(pipe, mesh, prompt, n, context=c,
                            feed=lambda ids: pipe.pack(input_ids=ids),
                            logits=lambda out: out.logits)

        out[c] = 1e3 * _timed(run, 1) / n
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="small,medium")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--contexts", default="64,256,1024")
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="transformers' threads (default: every core)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one repeat: the script's own check")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        args.batch, args.prompt, args.new, args.contexts, args.repeat = 4, 8, 6, [16, 48], 1
    report: dict[str, Any] = {}
    for name in args.configs.split(","):
        hf = transformers_side(args, name)
        print(f"{name}: transformers generate, 1 process x {args.threads} threads: "
              f"{hf['tok_s']:.1f} tok/s, TTFT {hf['ttft'] * 1e3:.1f} ms, ms/token "
              + ", ".join(f"{c}: {v:.2f}" for c, v in hf["ms_token"].items()), flush=True)
        report[name] = {"transformers": hf}
        for p in (int(x) for x in args.ranks.split(",")):
            got = pt.launch(_pipeline_rank, p, args, name, timeout=1800)[0]
            old = pt.launch(rerun_rank, p, args, name, timeout=1800)[0]
            report[name][f"p{p}"] = {**got, "rerun_ms_token": old}
            print(f"{name}: pipetrain p={p} ({got['groups']} groups): {got['tok_s']:.1f} tok/s "
                  f"({got['tok_s'] / hf['tok_s']:.2f}x), TTFT {got['ttft'] * 1e3:.1f} ms, "
                  "ms/token " + ", ".join(f"{c}: {v:.2f}" for c, v in got["ms_token"].items())
                  + "; re-run per token " + ", ".join(f"{c}: {v:.1f}" for c, v in old.items())
                  + f"; bubble {got['bubble']:.3f} measured, {got['bubble_sim']:.3f} simulated"
                  f" (forward {', '.join(f'{x:.2f}' for x in got['forward_ms'])} ms per stage,"
                  f" messages {got['comm_ms']:.2f} ms)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
