"""An image-text model's pipelined fine-tuning step: tokens per second on 2 and 4 processes,
with the stages balanced by parameters and by profiled time (the vision tower counted in the
stage that runs it, stage 0).

The model is a Qwen2-VL from a small config built here (nothing is downloaded: a 4-block
vision tower, a 8-layer language model), float32, trained with ``pt.Pipeline`` under 1F1B on
local gloo processes, one thread each. Every row holds one image of 8x8 patches (16 image
tokens after the 2x2 merge) in a sequence of ``--seq-len`` tokens. Prints, per layout, the
balance (units per stage; unit 0 is the vision prefix and the first unit of the language
model), the median step time over the steps after the first, and text tokens per second::

    python benchmarks/vlm.py                       # 2 and 4 processes, 6 steps each
    python benchmarks/vlm.py --procs 2 --steps 3 --json vlm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)

import pipetrain as pt

V, IMG = 512, 511


def build(hidden: int, layers: int) -> torch.nn.Module:
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    half = hidden // 4 // 2  # rotary frequencies per head: time, height and width share them
    sections = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    config = tf.Qwen2VLConfig(
        text_config=dict(vocab_size=V, hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              mrope_section=sections)),
        vision_config=dict(depth=4, embed_dim=hidden, hidden_size=hidden, num_heads=4,
                           patch_size=2, spatial_merge_size=2, temporal_patch_size=2,
                           in_channels=3),
        image_token_id=IMG, video_token_id=V - 2, vision_start_token_id=V - 3,
        vision_end_token_id=V - 4)
    return tf.Qwen2VLForConditionalGeneration(config)  # type: ignore[no-any-return]


def batch(rows: int, seq: int, grid: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V - 5, (rows, seq), generator=g)
    tokens = grid * grid // 4
    ids[:, 1], ids[:, 2:2 + tokens], ids[:, 2 + tokens] = V - 3, IMG, V - 4
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "pixel_values": torch.randn(rows * grid * grid, 3 * 2 * 2 * 2, generator=g),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * rows),
            "mm_token_type_ids": (ids == IMG).int()}


def lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    logits = out.logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _rank(ctx: pt.RankContext, args: dict[str, Any], balance: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = build(args["hidden"], args["layers"])
    full = batch(args["rows"], args["seq_len"])
    example = {k: v for k, v in batch(2, args["seq_len"]).items()}
    pipe = pt.Pipeline(model, "1f1b", args["microbatches"], lm_loss, split_points="auto",
                       example_inputs=example, balance=balance)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    times = []
    for step in range(args["steps"]):
        start = time.perf_counter()
        pipe.step(full if ctx.rank == 0 else None, full["input_ids"], step=step)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    pipe.close()
    return {"balance": list(pipe.balance), "times": times}


def measure(procs: int, balance: str, args: dict[str, Any]) -> dict[str, Any]:
    ranks = pt.launch(_rank, procs, args, balance, timeout=1800)
    step = statistics.median(max(r["times"][i] for r in ranks)
                             for i in range(1, args["steps"]))
    tokens = args["rows"] * args["seq_len"]
    return {"procs": procs, "balance_mode": balance, "balance": ranks[0]["balance"],
            "step_s": step, "tokens_per_s": tokens / step}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None)
    a = parser.parse_args(argv)
    if a.steps < 2:
        parser.error("--steps must be at least 2 (the first is not timed)")
    args = {k: getattr(a, k) for k in ("steps", "rows", "microbatches", "seq_len", "hidden",
                                       "layers")}
    results = [measure(p, mode, args) for p in a.procs for mode in ("params", "time")]
    print(f"{'procs':>5}  {'balance by':<10} {'units per stage':<24} {'step s':>8} "
          f"{'tokens/s':>9}")
    for r in results:
        print(f"{r['procs']:>5}  {r['balance_mode']:<10} {str(r['balance']):<24} "
              f"{r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": args, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
