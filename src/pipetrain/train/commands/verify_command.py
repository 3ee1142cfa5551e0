"""Verify command: ``pipetrain verify --hf DIR``: one float64 step, split as ``train`` splits.

The model is built from ``DIR/config.json`` alone (no weights are read), optionally shrunk
(``--layers K`` decoder layers, ``--width W`` hidden size), in float64 on ``meta``; the
pipeline is the one ``pipetrain train --hf`` builds (:func:`~pipetrain.train.sources.hf_source.
hf_pipeline`: the same cut, balance, schedule, recomputation, loss and by-name
initialisation from ``--seed``), all its ranks in this process, and
:func:`pipetrain.verify.verify_with` compares one step on random token ids with one process.

    $ pipetrain verify --hf tiny-llama --schedule zbv --pp 2
    $ pipetrain verify --hf llama-3-8b --layers 4 --width 64 --schedule dualpipev --pp 4

Exit codes: 0 every gradient matches, 1 one does not, 2 bad arguments.
"""

from __future__ import annotations

import argparse

import torch

from pipetrain.errors import PipelineError
from pipetrain.train.commands.verify_hf import WIDTH, verify_hf
from pipetrain.train.config import TrainConfig

__all__ = ["HELP", "configure", "run"]

HELP = ("check one float64 step of --hf DIR's architecture, split as train splits it, "
        "against one process, gradient by gradient")
EXIT_OK, EXIT_FAILED = 0, 1
DTYPES = {"float64": torch.float64, "float32": torch.float32}
_SHARED = ("schedule", "microbatches", "stages_per_rank", "balance", "recompute", "seed")
"""The flags of ``pipetrain train`` that ``verify`` takes as they are."""


def configure(parser: argparse.ArgumentParser) -> None:
    """``--hf`` (required), the layout flags of ``pipetrain train``, the size and tolerance."""
    from pipetrain.train.commands.train_command import field_docs

    docs, defaults = field_docs(), TrainConfig()
    parser.add_argument("--hf", required=True, metavar="DIR|ORG/NAME",
                        help="a save_pretrained directory or a Hub id ORG/NAME[@REVISION]; "
                             "only its config.json is read")
    parser.add_argument("--pp", type=int, default=2, metavar="N",
                        help="pipeline ranks, all run in this process (default: 2)")
    for name in _SHARED:
        value = getattr(defaults, name)
        kind = int if name in ("microbatches", "stages_per_rank", "seed") else str
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=value,
                            metavar="N" if kind is int else "TEXT",
                            help=f"{docs[name]} (default: {value})".replace("%", "%%"))
    parser.add_argument("--seq-len", type=int, default=16, metavar="N",
                        help="tokens per sequence (default: 16)")
    parser.add_argument("--layers", type=int, metavar="K",
                        help="keep only the first K decoder layers (default: all)")
    parser.add_argument("--width", type=int, metavar="W",
                        help=f"hidden size W (e.g. {WIDTH}): 2 key-value heads grouped as the "
                             "model groups them, MLP 2W, vocabulary at most 256 (default: the "
                             "model's own sizes)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64",
                        help="the precision of both steps (default: float64)")
    parser.add_argument("--tolerance", type=float, metavar="X",
                        help="largest relative difference that passes (default: 1e-9 in "
                             "float64, 1e-5 in float32)")


def run(args: argparse.Namespace) -> int:
    """Run ``pipetrain verify``: print the table; 0 when it passes, 1 when not.

    Raises:
        ValueError, OSError: bad flags, or a directory without a config.
    """
    from pipetrain.train.commands.train_command import check

    cfg = TrainConfig(hf=args.hf, seq_len=args.seq_len,
                      **{name: getattr(args, name) for name in _SHARED})
    check(cfg, training=False)
    if args.pp < 1:
        raise ValueError(f"--pp must be at least 1, got {args.pp}")
    try:
        result = verify_hf(cfg, args.pp, layers=args.layers, width=args.width,
                           tolerance=args.tolerance, dtype=DTYPES[args.dtype], announce=print)
    except PipelineError as e:
        print(f"FAIL: the pipelined step failed where one process did not: {e}")
        return EXIT_FAILED
    print(result.table())
    return EXIT_OK if result.passed else EXIT_FAILED
