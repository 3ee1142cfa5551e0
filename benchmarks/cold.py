"""Cold: what a runtime piece costs right after an action's compute, against back to back.

Every message pipetrain sends is encoded (header + payload copied into one buffer), and every
message it receives needs a posted frame and a header read; each of these runs once per
message, right after a forward or a backward has run for milliseconds and pushed the
interpreter's code and data out of the caches. This script times each piece (CPU time of the
calling thread, median, interleaved round-robin so that every condition sees the same machine)
under three conditions:

    warm     back to back, the piece's code and data in the caches
    busy     after --gap ms of spinning on a clock (the core stays busy, the caches stay)
    sleep    after a sleep of --gap ms (the core idles or runs other processes meanwhile)
    evict    after the same sleep and a pass over --evict-mib MiB of memory (what a compute
             that touches its activations does to the caches)

A plain torch call (``detach``) is timed alike, as the scale every piece is measured against.

    python benchmarks/cold.py                         # about 20 s
    python benchmarks/cold.py --tiny --json out.json  # CI: runs, timings not checked
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import gptbench as gb
import torch

from pipetrain.runtime.transport import wire
from pipetrain.runtime.transport.payload import flatten

CONDITIONS = ("warm", "busy", "sleep", "evict")


def _message(t: torch.Tensor) -> wire.Message:
    flat, spec = flatten(t)
    return wire.Message(wire.Key(wire.ACT, 3, 2, 0, 1), list(flat), spec, [True])


def pieces() -> dict[str, Callable[[], object]]:
    """The timed pieces: pipetrain's per-message work and one plain torch call."""
    small = _message(torch.randn(2, 8, requires_grad=True))  # the calibrated stages' message
    large = _message(torch.randn(8, 128, 128))  # 512 KiB, the GPT benchmark's activation
    frame = wire.encode(small, 0)[0]
    received = wire.new_frame()
    received[:frame.numel()].copy_(frame)
    x = torch.randn(2, 8)

    def read() -> object:
        header = wire.read_header(received)
        return wire.decode(header, wire.inline_payload(header, received))

    return {
        "encode 64 B": lambda: wire.encode(small, 0),
        "encode 512 KiB": lambda: wire.encode(large, 0, 0, 1 << 20),
        "new_frame": wire.new_frame,
        "read_header+decode": read,
        "torch detach": x.detach,
    }


def measure(gap_s: float, evict_mib: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median CPU microseconds of every piece under every condition."""
    fns = pieces()
    junk = torch.zeros(evict_mib * (1 << 18))  # float32: 4 bytes each
    times: dict[tuple[str, str], list[float]] = {(p, c): [] for p in fns for c in CONDITIONS}
    for fn in fns.values():  # first calls (lazy initialisation) are not measured
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            for cond in CONDITIONS:
                if cond == "busy":
                    _spin(gap_s)
                elif cond != "warm":
                    time.sleep(gap_s)
                if cond == "evict":
                    junk.add_(1.0)
                if cond == "warm":
                    fn()  # the call before: the same code, just run
                start = time.thread_time()
                fn()
                times[(name, cond)].append(time.thread_time() - start)
    return {p: {c: 1e6 * statistics.median(times[(p, c)]) for c in CONDITIONS} for p in fns}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def format_table(result: dict[str, dict[str, float]]) -> str:
    lines = [f"{'piece':20s}" + "".join(f"{c + ' us':>10s}" for c in CONDITIONS)
             + f"{'sleep/warm':>11s}", "-" * 71]
    for name, by in result.items():
        lines.append(f"{name:20s}" + "".join(f"{by[c]:10.1f}" for c in CONDITIONS)
                     + f"{by['sleep'] / max(by['warm'], 1e-9):11.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gap", type=float, default=5.0, help="sleep before a cold call, ms")
    parser.add_argument("--evict-mib", type=int, default=16, help="memory passed over, MiB")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", help="write the medians and the machine here")
    parser.add_argument("--tiny", action="store_true", help="1 ms, 1 MiB, 10 rounds (CI)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.gap, args.evict_mib, args.rounds = 1.0, 1, 10
    torch.set_num_threads(1)
    m = gb.machine()
    print(f"torch {m['torch']} | {m['platform']}, {m['processor']}, {m['cpus']} CPUs")
    print(f"gap {args.gap:g} ms, evict {args.evict_mib} MiB, median of {args.rounds} "
          "(CPU time of this thread)")
    result = measure(args.gap / 1e3, args.evict_mib, args.rounds)
    print(format_table(result))
    if args.json:
        gb.save_json(args.json, {"pieces": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
