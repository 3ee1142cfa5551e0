"""Long context: peak bytes per rank and tokens/s at cp 1, 2 and 4 as the sequence grows.

``pipetrain train --pp 2 --cp C`` (2 x C processes) on a Llama of width 128, 4 layers and 8
heads (2 key-value heads), built from its config with seeded weights in a temporary
directory, for each sequence length and each C. Each run's ``summary.json`` gives
``peak_memory_bytes`` (one figure per rank: the most bytes of tensors it held while training,
:mod:`pipetrain.train.memory`) and ``tokens_per_s``. The table shows the largest peak of any
rank, its ratio to cp 1's at the same length, the tokens/s, and then, per cp, the longest
sequence whose peak stays under ``--limit`` MiB.

    python benchmarks/long_context.py                       # docs/long-context.md's table
    python benchmarks/long_context.py --tiny --json out.json
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
CPS = (1, 2, 4)
LENGTHS = (512, 1024, 2048, 4096)


def model_dir(root: Path, positions: int) -> Path:
    """A saved Llama config and a byte-level tokenizer (no weights: seeded by --seed)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    tf.logging.set_verbosity_error()
    out = root / "llama"
    config = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                            num_attention_heads=8, num_key_value_heads=2, vocab_size=300,
                            max_position_embeddings=positions, bos_token_id=0, eos_token_id=0)
    config.save_pretrained(out)
    vocab = {f"<{i}>": i for i in range(44)} | {chr(c): 44 + c for c in range(256)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tf.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<0>").save_pretrained(out)
    return out


def run(model: Path, cp: int, length: int, steps: int, work: Path) -> dict[str, Any]:
    """One run; its largest per-rank peak (MiB) and tokens/s."""
    out = work / f"cp{cp}_{length}"
    argv = ["train", "--hf", str(model), "--token-cache", str(work / "tokens"),
            "--pp", "2", "--cp", str(cp), "--nproc", str(2 * cp), "--seq-len", str(length),
            "--batch-size", "4", "--microbatches", "2", "--steps", str(steps),
            "--sample-tokens", "0", "--eval-every", "0", "--eval-batches", "1",
            "--no-progress", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIPETRAIN_")}
    done = subprocess.run([sys.executable, "-m", "pipetrain", *argv], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"cp {cp}, {length} tokens: pipetrain {' '.join(argv)} failed:\n"
                         f"{done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {"cp": cp, "seq_len": length, "ranks": 2 * cp,
            "peak_mib": max(summary["peak_memory_bytes"]) / MIB,
            "tokens_per_s": summary["tokens_per_s"]}


def table(rows: list[dict[str, Any]], limit: float) -> list[str]:
    """The markdown table, then the longest sequence under ``limit`` MiB per cp."""
    base = {r["seq_len"]: r["peak_mib"] for r in rows if r["cp"] == 1}
    lines = ["| seq_len | cp | ranks | peak MiB (largest rank) | vs cp 1 | tokens/s |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['cp']} | {r['ranks']} | {r['peak_mib']:.1f} | "
                     f"{r['peak_mib'] / base[r['seq_len']]:.2f} | {r['tokens_per_s']:.0f} |")
    lines.append("")
    for cp in sorted({r["cp"] for r in rows}):
        fits = [r["seq_len"] for r in rows if r["cp"] == cp and r["peak_mib"] <= limit]
        lines.append(f"cp {cp}: longest sequence under {limit:g} MiB a rank: "
                     f"{max(fits) if fits else 'none of those run'}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="cp 1 and 2 at 128 and 256 tokens")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--limit", type=float, default=64.0, help="MiB a rank may hold")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    cps, lengths = ((1, 2), (128, 256)) if args.tiny else (CPS, LENGTHS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = model_dir(work, max(lengths))
        for length in lengths:
            for cp in cps:
                rows.append(run(model, cp, length, args.steps, work))
                print(f"  seq_len {length} cp {cp}: {rows[-1]['peak_mib']:.1f} MiB, "
                      f"{rows[-1]['tokens_per_s']:.0f} tokens/s", flush=True)
    print("\n".join(table(rows, args.limit)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
