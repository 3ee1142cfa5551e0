"""Overhead: the CPU time a pipeline library spends per action, outside the model's own work.

On a GPU a stage's compute can be shorter than a millisecond, and then what the runtime costs
per action (scheduling, message bookkeeping, autograd plumbing, its threads) decides the step.
Here each stage is one of ``calibrated.py``'s layers with zero sleeps: its F and backward
cost only the autograd calls every library makes alike. pipetrain, torch.distributed.pipelining
and DeepSpeed run 1F1B (the schedule all three have) on the same layers in one launch,
alternating step by step. Per rank and step:

    model    the same layer's forward and backward, m times, in a plain loop (no pipeline)
    cpu      the process's CPU time in the step (all its threads: main, gloo's), minus model
    wall     the step's wall time between barriers, minus model

each divided by the rank's actions (2m: an F and a B per micro-batch), the median over steps,
the larger of the ranks. DeepSpeed's step includes its optimizer step (SGD, lr 0, one
parameter per layer).

    python benchmarks/overhead.py             # p = 2, 4; m = 16: about 15 s
    python benchmarks/overhead.py --tiny      # p = 2, m = 8
    python benchmarks/overhead.py --switch-interval 0.0001   # the GIL handed over sooner
    python benchmarks/overhead.py --profile   # pipetrain's rank 0 under cProfile, p = 2
    python benchmarks/overhead.py --threads   # CPU per action of each thread, p = 2
    python benchmarks/overhead.py --threads --p 4   # ... p = 4 (four processes)
    python benchmarks/overhead.py --runs 8 --steps 30   # 8 launches: the spread, the median
    python benchmarks/overhead.py --calls --p 4   # the main thread's CPU, call by call

``--profile`` prints the functions pipetrain's main thread spent most time in over 30 steps
(p = 2, m = 16), and then what one ``dist.isend`` of the same small tensor costs with nothing
else running (200 sends, a receive blocked on another thread of the sender): the gap between
the two is the contention the step meets.

``--threads`` splits each library's CPU per action by thread (``--p`` ranks, m = 16, 30 steps; the
kernel's per-thread run time from ``/proc/self/task/*/schedstat``): the main thread, pipetrain's
other threads (its watchdog; none touches a message), gloo's socket loop (``gloo_tcp_loop``)
and the rest, with how many times per action each was switched in. Then a bare gloo ping-pong
of pipetrain's message size (2112 bytes, its receive posted ahead into an 8 KiB frame, as
pipetrain posts it) gives what gloo's loop costs per message when nothing else runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from calibrated import Case, SleepLayer, _loss, _Runner
from peer_steps import installed, missing
from peers import _deepspeed_engine

import pipetrain as pt


def _model_seconds(case: Case) -> float:
    """One stage's layer, forward and backward, m times (no pipeline), CPU seconds."""
    layer = SleepLayer(0, 0.0, 0.0, 0.0)
    x, y = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    for _ in range(3):
        _loss(layer(x), y).backward()
    start = time.process_time()
    for _ in range(case.microbatches):
        _loss(layer(x), y).backward()
    return time.process_time() - start


def _body(ctx: pt.RankContext, cases: list[Case], switch: float | None = None
          ) -> list[dict[str, tuple[float, float]]]:
    torch.set_num_threads(1)
    if switch is not None:
        sys.setswitchinterval(switch)
    out = []
    for case in cases:
        steps: dict[str, Callable[[], Any]] = {
            lib: _Runner(lib, "1f1b", case, ctx.rank).step for lib in ("pipetrain", "torch")}
        if installed("deepspeed"):
            steps["DeepSpeed"] = _deepspeed_engine(case)
        model = _model_seconds(case)
        seen: dict[str, list[tuple[float, float]]] = {lib: [] for lib in steps}
        for k in range(case.warmup + case.steps):
            for lib, step in steps.items():
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                step()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                dist.barrier()
                if k >= case.warmup:
                    seen[lib].append((cpu - model, wall - model))
        actions = 2 * case.microbatches
        out.append({lib: (statistics.median(c for c, _ in v) / actions,
                          statistics.median(w for _, w in v) / actions)
                    for lib, v in seen.items()})
    return out


def run(ps: Sequence[int], m: int, steps: int, switch: float | None = None) -> list[str]:
    lines = [f"{'p':>2s} {'m':>3s}  {'library':10s} {'cpu us/action':>14s} "
             f"{'wall us/action':>15s} {'cpu vs pipetrain':>17s}"]
    for p in ps:
        case = Case(f"p{p}", p, m, 0.0, 0.0, 0.0, p, ("1f1b",), 2, steps)
        per_rank = pt.launch(_body, p, [case], switch, timeout=600)
        libs = per_rank[0][0]
        for lib in libs:
            cpu = max(r[0][lib][0] for r in per_rank)
            wall = max(r[0][lib][1] for r in per_rank)
            ours = max(r[0]["pipetrain"][0] for r in per_rank)
            lines.append(f"{p:2d} {m:3d}  {lib:10s} {cpu * 1e6:14.0f} {wall * 1e6:15.0f} "
                         f"{cpu / ours:16.2f}x")
    return lines + missing("deepspeed")


def repeated(ps: Sequence[int], m: int, steps: int, runs: int) -> list[str]:
    """``run`` ``runs`` times (a launch each): per p, each run's CPU per action of pipetrain and
    torch, then the median of the runs' ratios and how many runs pipetrain spent less."""
    seen: dict[int, list[tuple[float, float]]] = {p: [] for p in ps}
    for _ in range(runs):
        for p in ps:
            case = Case(f"p{p}", p, m, 0.0, 0.0, 0.0, p, ("1f1b",), 2, steps)
            per_rank = pt.launch(_body, p, [case], None, timeout=600)
            seen[p].append(tuple(max(r[0][lib][0] for r in per_rank)  # type: ignore[misc]
                                 for lib in ("pipetrain", "torch")))
    lines = [f"{'p':>2s} {'m':>3s}  {'pipetrain us/action, run by run':40s} "
             f"{'torch':40s} {'median ratio':>12s} {'lower':>6s}"]
    for p, pairs in seen.items():
        ratios = [ours / theirs for ours, theirs in pairs]
        ours_s = " ".join(f"{o * 1e6:.0f}" for o, _ in pairs)
        theirs_s = " ".join(f"{t * 1e6:.0f}" for _, t in pairs)
        lower = sum(r < 1.0 for r in ratios)
        lines.append(f"{p:2d} {m:3d}  {ours_s:40s} {theirs_s:40s} "
                     f"{statistics.median(ratios):11.2f}x {lower:3d}/{len(ratios)}")
    return lines


def _timed_calls(lib: str) -> dict[str, list[int]]:
    """Wrap the calls of ``lib``'s message path and stages in thread-CPU timers: per label,
    [nanoseconds, calls] (pieces nest: a send holds its encode)."""
    from pipetrain.runtime import stage
    from pipetrain.runtime.transport import comm, receiver

    try:  # (before 571af9a a send encoded through comm.encode)
        from pipetrain.runtime.transport.encoder import Encoder
        encode: tuple[Any, str, str] = (Encoder, "__call__", "  encode")
    except ImportError:
        encode = (comm, "encode", "  encode")
    seen: dict[str, list[int]] = {}
    if lib == "pipetrain":
        pieces: list[tuple[Any, str, str]] = [
            (comm.P2P, "send", "send"), encode,
            (comm.P2P, "recv", "receive"), (receiver.Inbound, "_post", "  post the next"),
            (receiver.Inbound, "_wait", "  wait"), (receiver.Inbound, "_unpack", "  check, decode"),
            (comm.P2P, "_release", "  free proven sends"), (stage.Stage, "forward", "F"),
            (stage.Stage, "backward", "B"), (comm.P2P, "start_step", "start of step"),
            (comm.P2P, "receive_last", "end of step")]
    else:
        from torch.distributed.pipelining import schedules as tps
        from torch.distributed.pipelining import stage as tstage
        base = tstage._PipelineStageBase
        pieces = [(tps, "_batch_p2p", "post sends, receives"), (tps, "_wait_batch_p2p", "wait"),
                  (base, "get_fwd_send_ops", "ops"), (base, "get_bwd_send_ops", "ops"),
                  (base, "get_fwd_recv_ops", "ops"), (base, "get_bwd_recv_ops", "ops"),
                  (base, "forward_one_chunk", "F"), (base, "backward_one_chunk", "B")]
    for owner, attr, label in pieces:
        fn, cell = getattr(owner, attr), seen.setdefault(label, [0, 0])

        def timed(*args: Any, _fn: Any = fn, _cell: list[int] = cell, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return _fn(*args, **kwargs)
            finally:
                _cell[0] += time.thread_time_ns() - start
                _cell[1] += 1
        setattr(owner, attr, timed)
    return seen


def _calls(ctx: pt.RankContext, lib: str, p: int) -> list[str]:
    """This rank's main-thread CPU per action over 40 steps (1F1B, m = 16), call by call."""
    torch.set_num_threads(1)
    seen = _timed_calls(lib)
    case = Case(f"p{p}", p, 16, 0.0, 0.0, 0.0, p, ("1f1b",), 5, 40)
    runner = _Runner(lib, "1f1b", case, ctx.rank)
    for _ in range(case.warmup):
        runner.step()
    for cell in seen.values():
        cell[0] = cell[1] = 0
    dist.barrier()
    start = time.thread_time_ns()
    for _ in range(case.steps):
        runner.step()
    total = time.thread_time_ns() - start
    dist.barrier()
    actions = case.steps * 2 * case.microbatches
    lines = [f"{lib} rank {ctx.rank}: main thread {total / actions / 1e3:.0f} us per action"]
    lines += [f"  {label:22s} {ns / actions / 1e3:6.1f} us/action {ns / max(n, 1) / 1e3:6.1f} "
              f"us/call {n / actions:5.2f} calls/action" for label, (ns, n) in seen.items()]
    return lines


def _profiled(ctx: pt.RankContext, p: int = 2) -> str:
    """pipetrain's 1F1B (p ranks, m = 16) under cProfile on every rank: the top of its
    functions (rank 0's is printed; at p = 4 also rank 1's, a middle rank)."""
    import cProfile
    import io
    import pstats

    torch.set_num_threads(1)
    case = Case(f"p{p}", p, 16, 0.0, 0.0, 0.0, p, ("1f1b",), 5, 30)
    runner = _Runner("pipetrain", "1f1b", case, ctx.rank)
    for _ in range(case.warmup):
        runner.step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(case.steps):
        runner.step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    return text.getvalue()


def _send_alone(ctx: pt.RankContext) -> float:
    """Seconds one isend of 4 floats takes on rank 1, a receive blocked on another thread."""
    import threading

    peer = 1 - ctx.rank
    if ctx.rank == 1:
        blocked = dist.irecv(torch.empty(1), src=peer, tag=99)
        waiter = threading.Thread(target=blocked.wait)
        waiter.start()
    dist.barrier()
    seconds = 0.0
    if ctx.rank == 1:
        x = torch.ones(4)
        start = time.perf_counter()
        works = [dist.isend(x, dst=peer, tag=1) for _ in range(200)]
        seconds = (time.perf_counter() - start) / 200
        for work in works:
            work.wait()
        waiter.join()
    else:
        y = torch.empty(4)
        for _ in range(200):
            dist.recv(y, src=peer, tag=1)
        dist.send(torch.ones(1), dst=peer, tag=99)
    dist.barrier()
    return seconds


def _by_thread() -> dict[str, tuple[int, int]]:
    """CPU nanoseconds and times switched in so far, per kind of thread of this process."""
    import os
    import threading

    names = {t.native_id: "pipetrain's" if t.name.startswith("pipetrain-") else "other"
             for t in threading.enumerate()}
    names[os.getpid()] = "main"
    out: dict[str, tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        kind = "gloo loop" if comm == "gloo_tcp_loop" else names.get(int(tid), "other")
        ns, runs = out.get(kind, (0, 0))
        out[kind] = (ns + int(fields[0]), runs + int(fields[2]))
    return out


THREADS = ("main", "pipetrain's", "gloo loop", "other")


def _threads(ctx: pt.RankContext, lib: str, p: int) -> dict[str, tuple[float, float]]:
    """Per kind of thread: CPU µs and switches-in per action over 30 steps (p ranks, m = 16)."""
    torch.set_num_threads(1)
    case = Case(f"p{p}", p, 16, 0.0, 0.0, 0.0, p, ("1f1b",), 5, 30)
    runner = _Runner(lib, "1f1b", case, ctx.rank)
    for _ in range(case.warmup):
        runner.step()
    dist.barrier()
    before = _by_thread()
    for _ in range(case.steps):
        runner.step()
    after = _by_thread()
    dist.barrier()
    actions = case.steps * 2 * case.microbatches
    return {kind: ((ns - before.get(kind, (0, 0))[0]) / actions / 1e3,
                   (runs - before.get(kind, (0, 0))[1]) / actions)
            for kind, (ns, runs) in after.items()}


def _ping_pong(ctx: pt.RankContext, n: int = 500) -> float:
    """gloo's loop thread, µs of CPU per message: 2112-byte messages back and forth, each
    receive posted ahead into an 8 KiB buffer."""
    torch.set_num_threads(1)
    peer = 1 - ctx.rank
    message = torch.zeros(2112, dtype=torch.uint8)

    def post() -> Any:
        return dist.irecv(torch.empty(8192, dtype=torch.uint8), src=peer, tag=7)

    posted = post()
    dist.barrier()
    start = _by_thread().get("gloo loop", (0, 0))[0]
    for i in range(n):
        if (i + ctx.rank) % 2 == 0:
            dist.isend(message, dst=peer, tag=7).wait()
        else:
            posted.wait()
            posted = post()
    dist.isend(message, dst=peer, tag=7).wait()  # the receive each rank still has posted
    posted.wait()
    end = _by_thread().get("gloo loop", (0, 0))[0]
    dist.barrier()
    return (end - start) / n / 1e3


def threads(p: int = 2) -> list[str]:
    """The ``--threads`` table: CPU µs per action of each thread, each library and rank."""
    lines = [f"{'library':10s} {'rank':>4s} " + " ".join(f"{k:>15s}" for k in THREADS)
             + f" {'total':>7s}"]
    for lib in ("pipetrain", "torch"):
        for rank, seen in enumerate(pt.launch(_threads, p, lib, p, timeout=600)):
            cells = [seen.get(k, (0.0, 0.0)) for k in THREADS]
            lines.append(f"{lib:10s} {rank:4d} " + " ".join(
                f"{us:6.0f} us {sw:4.2f}x" for us, sw in cells)
                + f" {sum(us for us, _ in cells):7.0f}")
    loop = max(pt.launch(_ping_pong, 2, timeout=600))
    lines.append(f"gloo loop alone, ping-pong of 2112-byte messages: {loop:.0f} us per message")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="p = 2, m = 8, 3 steps")
    parser.add_argument("--steps", type=int, default=10, metavar="N")
    parser.add_argument("--switch-interval", type=float, metavar="S",
                        help="sys.setswitchinterval(S) in every rank (Python's is 0.005)")
    parser.add_argument("--profile", action="store_true",
                        help="pipetrain's rank 0 under cProfile, and one isend alone")
    parser.add_argument("--threads", action="store_true",
                        help="CPU per action of each thread (main, pipetrain's, gloo)")
    parser.add_argument("--runs", type=int, metavar="N",
                        help="the p = 2 and 4 comparison N times, a launch each: each run's "
                             "figures, the median pipetrain/torch ratio, runs pipetrain was lower")
    parser.add_argument("--calls", action="store_true",
                        help="each library's main-thread CPU per action, call by call")
    parser.add_argument("--p", type=int, default=2, metavar="P",
                        help="pipeline ranks for --threads, --calls and --profile (default 2)")
    args = parser.parse_args(argv)
    if args.profile:
        profiles = pt.launch(_profiled, args.p, args.p, timeout=600)
        print(profiles[0] if args.p < 3 else profiles[0] + "\n# rank 1\n" + profiles[1])
        alone = pt.launch(_send_alone, 2, timeout=600)[1]
        print(f"one dist.isend of 4 floats, nothing else running: {alone * 1e6:.1f} us")
        return 0
    if args.calls:
        for lib in ("pipetrain", "torch"):
            for lines in pt.launch(_calls, args.p, lib, args.p, timeout=600):
                print("\n".join(lines))
        return 0
    if args.threads:
        print(f"# CPU us per action, and times switched in per action (x), 1F1B p = {args.p}"
              " m = 16")
        print("\n".join(threads(args.p)))
        return 0
    print(f"# torch {torch.__version__}; 1F1B, one zero-cost layer per stage; medians over "
          f"steps, the larger rank")
    ps, m, steps = ((2,), 8, 3) if args.tiny else ((2, 4), 16, args.steps)
    if args.runs:
        print("\n".join(repeated(ps, m, steps, args.runs)))
        return 0
    print("\n".join(run(ps, m, steps, args.switch_interval)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
