"""Memory probe: the peak of live CPU tensor bytes in this process during a block, every thread.

torch's CPU allocator keeps a process-wide count of live bytes, but only while a profiler with
``profile_memory=True`` runs on the allocating thread, or while the c10 flag
``caffe2_report_cpu_memory_usage`` is set. :func:`enable` sets the flag (through ``ctypes``;
torch has no Python switch for it), so allocations made on any thread (pipetrain's receiver
threads allocate incoming messages) are counted from then on. :class:`Probe` then runs
``torch.profiler`` on the calling thread: each allocation or free made there reports the
process-wide total, and the probe's peak is the largest total seen, taking a free's total from
just before it. An allocation made and freed on another thread between two of the calling
thread's events would be missed; receive buffers live until the main thread consumes them.

Next to it, :class:`Probe` reads the process's resident set: ``VmHWM`` after resetting it
through ``/proc/self/clear_refs`` (Linux), which also counts allocator caches, Python objects
and library buffers. The profiler's own buffers add tens of MiB to it, so take the resident
peak from a block probed with ``tensors=False``.

    memprobe.enable()                    # first, before the tensors to be counted exist
    with memprobe.Probe() as probe:
        train_step()
    probe.peak_bytes, probe.start_bytes  # live tensor bytes: the step's peak, at its start
"""

from __future__ import annotations

import ctypes
import os
from types import TracebackType
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def enable() -> None:
    """Count every CPU allocation from now on, whichever thread makes it."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, _FLAG).value = True


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        return True
    except OSError:
        return False


class Probe:
    """Live tensor bytes (start, peak, end) and resident-set bytes of the block it wraps."""

    def __init__(self, tensors: bool = True) -> None:
        self.tensors = tensors
        self.start_bytes = self.peak_bytes = self.end_bytes = 0
        self.events = 0
        self.rss_start_bytes: int | None = None
        self.rss_peak_bytes: int | None = None
        self._prof: Any = None

    def __enter__(self) -> Probe:
        rss = _status_kib("VmRSS")
        self.rss_start_bytes = None if rss is None or not _reset_rss_peak() else rss * 1024
        if self.tensors:
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._prof is not None:
            self._prof.__exit__(kind, error, tb)
        hwm = _status_kib("VmHWM")
        if self.rss_start_bytes is not None and hwm is not None:
            self.rss_peak_bytes = hwm * 1024
        if kind is None and self._prof is not None:
            self._read(self._prof)

    def _read(self, prof: Any) -> None:
        allocs = sorted((n.start_time_ns, n.extra_fields.alloc_size, n.extra_fields.total_allocated)
                        for n in _walk(prof.profiler.kineto_results.experimental_event_tree())
                        if n.tag == _EventType.Allocation and n.extra_fields.device.type == "cpu")
        if not allocs:
            return
        _, size, total = allocs[0]
        self.start_bytes = total - size
        self.peak_bytes = max(max(total, total - size) for _, size, total in allocs)
        self.end_bytes = allocs[-1][2]
        self.events = len(allocs)

    def to_dict(self) -> dict[str, int | None]:
        return {"start_bytes": self.start_bytes, "peak_bytes": self.peak_bytes,
                "end_bytes": self.end_bytes, "events": self.events,
                "rss_start_bytes": self.rss_start_bytes, "rss_peak_bytes": self.rss_peak_bytes}


def _walk(nodes: Any) -> Any:
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)


def mib(n: float | None) -> str:
    """Bytes as MiB, one decimal; '-' for None."""
    return "-" if n is None else f"{n / 2**20:.1f}"
