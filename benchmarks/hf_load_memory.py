"""HF load memory: what each rank of ``pipetrain train --hf`` holds after reading its stages.

A Llama of about 100 M parameters (400 MiB in float32) is saved by transformers into a
temporary directory, then ``pipetrain train --hf`` runs one step of it on 1, 2 and 4 local
processes. Each rank reports, before its first step (the ``start`` record's ``load``): the bytes
it read from the safetensors files, its share of the model, and its peak resident memory
(``getrusage``) before building its stages and after loading them. The growth should be its
share, not the model: a rank materialises only its own stages and reads only their tensors.

    python benchmarks/hf_load_memory.py                 # README figures (about 1 minute)
    python benchmarks/hf_load_memory.py --tiny --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

MIB = 2**20


def save_model(directory: Path, hidden: int, layers: int) -> None:
    """A Llama of ``layers`` x ``hidden`` (untied, vocab 4096) and a small tokenizer."""
    import torch
    import transformers as tf

    from pipetrain.testing import train_tokenizer

    tf.logging.set_verbosity_error()
    tok = train_tokenizer(Path(__file__).read_text())
    config = tf.LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                            num_hidden_layers=layers, num_attention_heads=hidden // 64,
                            num_key_value_heads=max(hidden // 256, 1),
                            max_position_embeddings=128)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)


def measure(directory: Path, nproc: int, work: Path) -> list[dict[str, Any]]:
    """One step on ``nproc`` processes; each rank's ``load`` figures."""
    out = work / f"run{nproc}"
    data = work / "data.txt"
    data.write_text(Path(__file__).read_text() * 20)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    command = [sys.executable, "-m", "pipetrain", "train", "--hf", str(directory),
               "--data", str(data), "--token-cache", str(work / "tokens"), "--nproc",
               str(nproc), "--schedule", "1f1b", "--steps", "1", "--seq-len", "32",
               "--batch-size", "4", "--microbatches", "4", "--eval-batches", "1",
               "--sample-tokens", "0", "--no-progress", "--out", str(out), "--no-resume"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    start = next(json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()
                 if json.loads(line).get("kind") == "start")
    return list(start["load"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 256-wide model, on 2 ranks")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    hidden, layers, worlds = (256, 2, [2]) if args.tiny else (1024, 8, [1, 2, 4])
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipetrain-hfmem-") as tmp:
        work = Path(tmp)
        save_model(work / "model", hidden, layers)
        print(f"Llama {layers} x {hidden}, float32; one process per rank\n")
        print(f"{'ranks':>5} {'rank':>4} {'model MiB':>9} {'share MiB':>9} {'read MiB':>8} "
              f"{'RSS before':>10} {'RSS after':>9} {'growth':>7} {'growth/share':>12}")
        for nproc in worlds:
            for rank, load in enumerate(measure(work / "model", nproc, work)):
                growth = load["peak_rss_bytes"] - load["rss_before_bytes"]
                row = {"ranks": nproc, "rank": rank, **load, "growth_bytes": growth}
                rows.append(row)
                print(f"{nproc:>5} {rank:>4} {load['model_bytes'] / MIB:>9.1f} "
                      f"{load['share_bytes'] / MIB:>9.1f} {load['bytes_read'] / MIB:>8.1f} "
                      f"{load['rss_before_bytes'] / MIB:>10.0f} "
                      f"{load['peak_rss_bytes'] / MIB:>9.0f} {growth / MIB:>7.1f} "
                      f"{growth / max(load['share_bytes'], 1):>12.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
