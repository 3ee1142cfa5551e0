"""LoRA against full fine-tuning: each rank's measured peak memory and step time, same model.

Saves a Llama (``--hidden`` wide, ``--layers`` deep, a byte-level tokenizer) with random
weights, then trains it with ``pipetrain train --hf`` twice per round, alternating: every
weight (AdamW states for all of them), and ``--lora-r`` adapters on q_proj and v_proj (the base
frozen: no gradients, no optimizer state). Prints each rank's ``peak_memory_bytes`` from the
runs' ``summary.json`` (on CPU, the torch profiler's allocations during the second step plus
what lives across steps: pipetrain.train.memory) and the median step time::

    python benchmarks/lora_memory.py                      # hidden 512, 8 layers, 2 ranks
    python benchmarks/lora_memory.py --hidden 1024 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def save_llama(root: Path, hidden: int, layers: int) -> Path:
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tf.logging.set_verbosity_error()
    tokens = {bytes([b]).decode("latin-1"): b for b in range(256)}
    bpe = Tokenizer(models.BPE(vocab=tokens, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=bytes([0]).decode())
    config = tf.LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 3,
                            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                            num_key_value_heads=max(1, hidden // 128),
                            max_position_embeddings=512, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def run(base: Path, out: Path, lora: int, args: argparse.Namespace) -> dict[str, Any]:
    argv = [sys.executable, "-m", "pipetrain", "train", "--hf", str(base), "--nproc",
            str(args.nproc), "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--batch-size", "8", "--microbatches", "4", "--eval-every", "0",
            "--sample-tokens", "0", "--no-progress", "--out", str(out)]
    if lora:
        argv += ["--lora-r", str(lora), "--lora-targets", "q_proj,v_proj"]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = save_llama(Path(tmp) / "base", args.hidden, args.layers)
        found: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
        for round_ in range(args.rounds):
            for name, r in (("full", 0), ("lora", args.lora_r)):
                found[name].append(run(base, Path(tmp) / f"{name}{round_}", r, args))
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.nproc} pipeline ranks, "
          f"seq {args.seq_len}, batch 8 in 4 micro-batches; {args.rounds} rounds, alternating")
    print(f"{'run':<28}{'peak MiB per rank':>28}{'step s (median)':>18}")
    for name, runs in found.items():
        label = "full fine-tuning" if name == "full" else f"LoRA r {args.lora_r} (q, v)"
        peaks = [max(r["peak_memory_bytes"][i] for r in runs) / 2**20
                 for i in range(args.nproc)]
        step = statistics.median(r["step_s"] for r in runs)
        print(f"{label:<28}{', '.join(f'{p:.1f}' for p in peaks):>28}{step:>18.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
