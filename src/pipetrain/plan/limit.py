"""Plan's memory limit: ``--memory-limit`` as given, or by default the memory of the device.

Left out, the limit is what one rank has: on GPUs (``--device`` resolving to CUDA and NCCL, as
``pipetrain train`` would resolve it) the total memory of GPU 0, one GPU per rank; on CPU the
RAM available now (``MemAvailable`` of ``/proc/meminfo``, else ``os.sysconf``'s free pages)
divided by the local ranks, which share it. Either is an upper bound: the allocator, CUDA's
context, the Python process itself and anything else running take their share, so give a
smaller ``--memory-limit`` to keep a margin.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MEMINFO", "available_ram", "memory_limit"]

MEMINFO = Path("/proc/meminfo")


def available_ram() -> tuple[int, str] | None:
    """Bytes of RAM available to new processes now and where that was read: Linux's
    ``MemAvailable`` (which counts the page cache the kernel can drop), elsewhere the free
    pages; None when neither says."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                scale = 1024 if unit.lower() == "kb" else 1
                return int(value) * scale, f"MemAvailable, {MEMINFO}"
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free pages, sysconf"
    except (ValueError, OSError, AttributeError):
        return None


def memory_limit(text: str | None, device: str, nproc: int) -> tuple[int, str | None]:
    """The bytes each rank may hold, and None, for ``--memory-limit text``; for None, the
    device's memory and a line saying where it came from.

    Raises:
        ValueError: an unreadable size, a ``device`` that cannot run ``nproc`` local ranks
            (:func:`pipetrain.train.launch.elastic.backend_for`), or no way to read the RAM.
    """
    from pipetrain.train.commands.export_command import size_bytes

    if text is not None:
        return size_bytes(text, "--memory-limit"), None
    import torch

    from pipetrain.train.launch.elastic import backend_for

    if backend_for(device, nproc) == "nccl":
        props = torch.cuda.get_device_properties(0)
        total = int(props.total_memory)
        return total, (f"--memory-limit not given: {_gib(total)}, the total memory of GPU 0 "
                       f"({props.name}), one GPU per rank")
    found = available_ram()
    if found is None:
        raise ValueError("--memory-limit not given and this system does not say how much RAM "
                         "is available; give it, e.g. --memory-limit 16GiB")
    ram, source = found
    share = ram // max(nproc, 1)
    return share, (f"--memory-limit not given: {_gib(share)}, the available RAM ({_gib(ram)}, "
                   f"{source}) / {nproc} local rank{'s' * (nproc != 1)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
