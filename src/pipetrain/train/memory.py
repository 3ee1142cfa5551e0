"""Peak memory: the most bytes of tensors one rank held during training, measured.

On CUDA this is the caching allocator's own count, ``torch.cuda.max_memory_allocated``, from
the first training step to the last (its peak is reset when training starts).

The CPU allocator keeps no such count, so on CPU one step is measured with the torch profiler's
allocation events (``profile_memory``): the step after the first, because the first also
creates the optimizer state and every later step repeats the allocations of the one before.
Its peak is the bytes of the tensors alive when the step starts (parameters, gradients,
buffers and optimizer state, each storage counted once) plus the most bytes the step's own
allocations held at once. Allocations outside torch's allocator (the Python objects, the
libraries) are not tensors and are not counted.

An asynchronous schedule (``pipedream-2bw``) keeps messages in flight from one step into the
next, and the profiler with ``profile_memory`` crashes the process when gloo operations run
across its start (seen here; ``tests/test_regressions.py`` has the synchronous case): its CPU
peak is not measured (``measure=False``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from pipetrain.runtime.torch_private import profiler_event_type
from pipetrain.split.profile import storages
from pipetrain.train.launch.quiet import held_notes

__all__ = ["MemoryMeter", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind ``tensors`` (views and ties counted once)."""
    return sum(storages(tensors).values())


class MemoryMeter:
    """Measures one rank's peak tensor bytes over the steps of a run (see the module docstring).

    Call :meth:`step` around every training step, in order, with a function that lists the
    tensors the rank holds between steps (called only for the measured step);
    :attr:`peak_bytes` is the measured peak (None before anything is measured).
    """

    def __init__(self, device: torch.device, steps: int, measure: bool = True,
                 verbose: bool = False) -> None:
        self.device = device
        self.verbose = verbose  # the profiler's own notes on stderr too (train.launch.quiet)
        self.cuda = device.type == "cuda"
        self._measured = (1 if steps >= 2 else 0) if measure or self.cuda else -1  # which
        # step of this run the CPU measures (-1: none)
        self._count = 0
        self.peak_bytes: int | None = None
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def step(self, held: Callable[[], Iterable[torch.Tensor]]) -> Iterator[None]:
        """Run one training step under measurement (``held()``: what lives across steps)."""
        index, self._count = self._count, self._count + 1
        if self.cuda:
            yield
            self.peak_bytes = int(torch.cuda.max_memory_allocated(self.device))
            return
        if index != self._measured:
            yield
            return
        base = tensor_bytes(held())
        with held_notes(self.verbose), _cpu_profile() as prof:
            yield
        extra = _peak_allocated(prof)
        self.peak_bytes = None if extra is None else base + extra


@contextlib.contextmanager
def _cpu_profile() -> Iterator[Any]:
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():  # frees of tensors made before the step are not events
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield prof


def _peak_allocated(prof: Any) -> int | None:
    """The most bytes the profiled block's own CPU allocations held at once (None: this torch
    does not expose allocation events)."""
    try:
        event_type = profiler_event_type()
        roots = list(prof.profiler.kineto_results.experimental_event_tree())
    except (ImportError, AttributeError):
        return None
    allocations: list[tuple[int, int, int]] = []
    stack = roots
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == event_type.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.alloc_size, fields.ptr))
    return _peak(sorted(allocations))


def _peak(allocations: Iterable[tuple[int, int, int]]) -> int:
    """The most bytes live at once, from (time, size, address) events in time order (a free
    is a negative size).

    A free made on a thread the profiler does not watch (a collective's buffer released by
    the communication library's own thread) has no event; the allocator handing the same
    address out again proves it happened, so that is when it is counted.
    """
    live: dict[int, int] = {}
    held = peak = 0
    for _, size, ptr in allocations:
        if size > 0:
            held += size - live.pop(ptr, 0)
            live[ptr] = size
        else:  # a tensor of this block's, or one made before it (then not in ``live``)
            held -= live.pop(ptr, -size)
        peak = max(peak, held)
    return peak
