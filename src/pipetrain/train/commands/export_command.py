"""Export command: ``pipetrain export-hf CHECKPOINT OUT``, a ``--hf`` run's checkpoint as a
Hugging Face ``save_pretrained`` directory.

    $ pipetrain export-hf runs/llama/checkpoints/step_000200 llama-tuned
    $ pipetrain export-hf runs/llama/checkpoints llama-tuned      # the newest checkpoint

The directory holds the checkpoint's parameters bitwise, the run's config, and its tokenizer
(read from the run's ``--hf`` directory, if it is still there). One process converts, one
shard of at most ``--shard-size`` in memory at a time. Exit codes: 0 written, 1 the
checkpoint is unusable, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import re
import sys
from fractions import Fraction
from pathlib import Path

__all__ = ["HELP", "configure", "run"]

HELP = "write a --hf run's checkpoint as a Hugging Face save_pretrained directory"
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, metavar="CHECKPOINT",
                        help="a committed checkpoint directory (step_NNNNNN), or a run's "
                             "checkpoints directory (its newest is taken)")
    parser.add_argument("out", type=Path, metavar="OUT", help="the directory to write")
    parser.add_argument("--shard-size", default="2GiB", metavar="SIZE",
                        help="largest shard file, e.g. 500MB or 2GiB (default: 2GiB)")


def size_bytes(text: str, flag: str = "--shard-size") -> int:
    """``2GiB``, ``500MB``, ``1TiB``, ``4096``: a size in bytes (B, KiB, MiB, GiB, TiB or
    KB, MB, GB, TB; any case), rounded down to a whole byte.

    Raises:
        ValueError: for anything else, or a size under 1 byte.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or Fraction(match.group(1)) * _UNITS[unit] < 1:
        raise ValueError(f"{flag} {text!r}: give a size such as 500MB, 2GiB or 1TiB")
    return int(Fraction(match.group(1)) * _UNITS[unit])  # exact, however large


def run(args: argparse.Namespace) -> int:
    """Convert; print where the directory went.

    Raises:
        CheckpointError: the checkpoint is missing, uncommitted, damaged or not of ``--hf``.
        ValueError: a bad ``--shard-size``.
    """
    from pipetrain.checkpoint import run as checkpoint
    from pipetrain.errors import CheckpointError
    from pipetrain.hf.save import export_checkpoint

    shard = size_bytes(args.shard_size)
    path: Path | None = args.checkpoint
    try:
        if path is not None and path.is_dir() and not (path / "meta.json").exists():
            path = checkpoint.latest(path)
            if path is None:
                raise CheckpointError(f"{args.checkpoint} holds no committed checkpoint")
        out = export_checkpoint(Path(str(path)), args.out, shard_bytes=shard)
    except CheckpointError as e:
        print(f"pipetrain export-hf: {e}", file=sys.stderr)
        return 1
    print(f"pipetrain export-hf: wrote {out} (AutoModelForCausalLM.from_pretrained loads it)")
    return 0
