"""Hardware: the GPUs a cluster plan runs on, their peak rates, memory and links, with sources.

A :class:`Gpu` holds what ``pipetrain plan --cluster`` needs of one accelerator and its node:
dense peak bf16 (and fp8) tensor throughput, HBM capacity and bandwidth, NVLink bandwidth to the
other GPUs of its node and the scale-out network bandwidth per GPU, all in SI units (FLOP/s,
bytes, bytes/s; link figures one direction). :data:`GPUS` is the built-in table, each entry
naming its sources and the node (DGX or equivalent) assumed for the network; :func:`gpu` looks one
up by name or alias, :func:`load_toml` reads another from a ``--hardware FILE.toml`` and
:func:`with_overrides` changes the network figures of one (a cluster is often not the reference
node). Peaks are datasheet figures without 2:4 sparsity; what a kernel reaches is the planner's
business, not this module's.

A ``--hardware`` file is flat TOML in the units its people write (GB, GB/s, Gbit/s)::

    name = "H100-PCIe"
    bf16_tflops = 756          # dense
    fp8_tflops = 1513          # optional; leave out where there is no fp8
    hbm_gb = 80
    hbm_gbps = 2000            # HBM, GB/s
    nvlink_gbps = 300          # NVLink per GPU, one direction, GB/s
    nic_gbps = 400             # scale-out network per GPU, one direction, Gbit/s
    gpus_per_node = 8
    source = "vendor datasheet, ..."   # optional
    nvlink_efficiency = 0.82   # optional: NCCL's bus bandwidth / nvlink_gbps (nccl-tests)
    nic_efficiency = 0.96      # optional: the same across nodes
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NVLINK_EFFICIENCY = 0.82
"""NCCL's bus bandwidth over NVLink 4 as a share of the line rate: 'With the protocol overhead
(~20%) NCCL can get an effective NVLink bandwidth of 370GB/s' of H100's 450 GB/s (NCCL's
maintainer, https://github.com/NVIDIA/nccl-tests/issues/212)."""
A100_NVLINK_EFFICIENCY = 0.69
"""All-reduce bus bandwidth measured by nccl-tests on 8 A100 SXM4 over NVLink 3: about 200
GB/s (https://github.com/NVIDIA/nccl-tests/issues/149) and 208 GB/s
(https://github.com/NVIDIA/nccl-tests/issues/178) of 300 GB/s."""
NIC_EFFICIENCY = 0.96
"""All-reduce bus bandwidth across 3 nodes of 8 A100 with 4 x 200 Gb/s HDR each: peak 96 GB/s
of the 100 GB/s the NICs give a node (https://github.com/NVIDIA/nccl-tests/issues/119)."""

__all__ = ["Gpu", "GPUS", "ALIASES", "TOML_KEYS", "gpu", "load_toml", "with_overrides"]


@dataclass(frozen=True)
class Gpu:
    """One accelerator and its node, in SI units; every link figure is one direction."""

    name: str  # e.g. "H100-SXM"
    bf16_flops: float  # dense bf16 peak, FLOP/s (no sparsity)
    fp8_flops: float | None  # dense fp8 peak; None where the GPU has no fp8 tensor cores
    hbm_bytes: float  # memory per GPU, bytes: what the device reports (:data:`_REPORTED`)
    hbm_bw: float  # HBM bandwidth, bytes/s
    nvlink_bw: float  # NVLink bandwidth per GPU inside a node, one direction, bytes/s
    nic_bw: float  # scale-out network bandwidth per GPU, one direction, bytes/s
    gpus_per_node: int
    source: str  # where each figure comes from, with URLs
    nvlink_efficiency: float = NVLINK_EFFICIENCY
    """Share of ``nvlink_bw`` NCCL's ring collectives reach (its bus bandwidth, large messages)."""
    nic_efficiency: float = NIC_EFFICIENCY
    """Share of ``nic_bw`` NCCL reaches across nodes."""


_A100_SHEET = (
    "NVIDIA A100 Tensor Core GPU datasheet "
    "(https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), figures read here from "
    "https://glennklockwood.com/garden/processors/A100 (BF16 312 TFLOP/s dense, 624 sparse; "
    "300+300 GB/s NVLink) and https://www.thundercompute.com/blog/nvidia-a100-specs-full-guide "
    "(SXM HBM bandwidth 1,555 GB/s for 40 GB HBM2, 2,039 GB/s for 80 GB HBM2e). NVLink 3: "
    "600 GB/s bidirectional = 300 GB/s per direction. No fp8 tensor cores (Ampere). "
)
_A100_NODE = (
    "nic_bw: a DGX A100 node, 8 GPUs and 8 x 200 Gb/s HDR InfiniBand (one HCA per GPU) = "
    "25 GB/s per GPU; 8 x 200 Gb/s per node is verified here for Selene (Narayanan et al., "
    "SC'21, arXiv 2104.04473, sec. 5, via stored transcriptions) and for MegaScale's Ampere "
    "nodes (Jiang et al., NSDI'24, arXiv 2402.15627, sec. 3.6: 'eight 200G NICs on the "
    "server'); the DGX A100 datasheet itself (8 x ConnectX-6 200 Gb/s) is from memory, not "
    "verified here."
)
_HOPPER_SHEET = (
    "H100 SXM5 peaks from the NVIDIA H100 Tensor Core GPU Architecture whitepaper as tabulated "
    "at https://glennklockwood.com/garden/processors/h100 (BF16 989.4 TFLOP/s dense, 1,978.9 "
    "sparse; FP8 1,978.9 dense, 3,957.8 sparse; 80 GB HBM3, 3.35 TB/s; NVLink 4 900 GB/s "
    "bidirectional = 450 GB/s per direction). "
)
MIB = 2**20
_REPORTED = (
    "Memory: the total the device reports, not the datasheet's 'GB' (which are binary: an A100 "
    "80 GB has 81,920 MiB): nvidia-smi's totals of 40,960 MiB (A100 40 GB), 81,920 MiB "
    "(A100 80 GB) and 81,559 MiB (H100 80 GB HBM3), as listed in "
    "https://github.com/modal-labs/modal-client/pull/2797 and seen in nvidia-smi output "
    "quoted in https://github.com/NVIDIA/nccl/issues/1264; the H200's is torch's "
    "total_memory on the H200 this project was lent (plan/data/kernels-h200-2026-11-28.json: "
    "150,109,880,320 bytes). ")
_DGX_HOPPER_NET = (
    "nic_bw: a DGX H100/H200 node, 8 GPUs and 'four OSFP ports serving eight single-port "
    "NVIDIA ConnectX-7 VPI, up to 400 Gb/s InfiniBand/Ethernet' (NVIDIA DGX BasePOD reference "
    "architecture, Core Components, https://docs.nvidia.com/dgx-basepod/"
    "reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
    "core-components.html) = 400 Gb/s NDR per GPU = 50 GB/s."
)

GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("A100-40GB", 312e12, None, 40960 * MIB, 1.555e12, 300e9, 25e9, 8,
            "A100 SXM4 40 GB (HBM2). " + _A100_SHEET + _REPORTED + _A100_NODE,
            A100_NVLINK_EFFICIENCY),
        Gpu("A100-80GB", 312e12, None, 81920 * MIB, 2.039e12, 300e9, 25e9, 8,
            "A100 SXM4 80 GB (HBM2e). " + _A100_SHEET + _REPORTED + _A100_NODE,
            A100_NVLINK_EFFICIENCY),
        Gpu("H100-SXM", 989.4e12, 1978.9e12, 81559 * MIB, 3.35e12, 450e9, 50e9, 8,
            "H100 SXM5 80 GB (HBM3, 700 W). " + _HOPPER_SHEET + "DGX H100: 640 GB total GPU "
            "memory for 8 GPUs (DGX BasePOD page below). " + _REPORTED + _DGX_HOPPER_NET),
        Gpu("H200", 989.4e12, 1978.9e12, 150109880320, 4.8e12, 450e9, 50e9, 8,
            "H200 SXM (HBM3e). Same GH100 compute and NVLink 4 as H100 SXM, so the peaks are "
            "H100's: " + _HOPPER_SHEET + "Memory: DGX H200 '1,128 GB total GPU memory' for 8 "
            "GPUs = 141 GB each (DGX BasePOD page below); 4.8 TB/s from third-party pages "
            "quoting the NVIDIA H200 datasheet (https://www.saulelectric.com/nvidia-h200.html, "
            "https://uvation.com/articles/"
            "nvidia-dgx-h200-components-deep-dive-into-the-hardware-architecture); the H200 "
            "datasheet itself (BF16 1,979 TFLOP/s with sparsity) is from memory, not verified "
            "here. " + _REPORTED + _DGX_HOPPER_NET),
        Gpu("H800", 989.4e12, 1978.9e12, 81559 * MIB, 3.35e12, 200e9, 50e9, 8,
            "H800 SXM (HBM3): the H100 SXM die with reduced NVLink and FP64; bf16/fp8 peaks, "
            "memory (the H100's 81,559 MiB assumed) and HBM bandwidth as H100 SXM (https://www.philisun.com/"
            "technical-analysis/nvidia-h800-vs-h100-a-technical-deep-dive-into-politically-"
            "defined-ai-chips, third-party; no NVIDIA H800 datasheet stored). NVLink: 400 GB/s "
            "bidirectional (same third-party pages) = 200 GB/s per direction; early press "
            "(https://www.tomshardware.com/news/nvidia-gimps-h100-hopper-gpu-to-sell-as-h800-to-"
            "china) reported about 300 GB/s, and DeepSeek-V3's report (arXiv 2412.19437, sec. "
            "3.2.2) states 160 GB/s achievable NVLink and 50 GB/s InfiniBand per GPU on its H800 "
            "cluster (sentence seen here only in a stored third-party copy). nic_bw: 8 x 400 "
            "Gb/s InfiniBand per 8-GPU node as in DeepSeek's cluster (50 GB/s per GPU, "
            "DeepSeek-V3 report; 400G IB switches per arXiv 2505.09343) - assumed, not a "
            "datasheet figure."),
        Gpu("B200", 2.25e15, 4.5e15, 180e9, 8e12, 900e9, 50e9, 8,
            "B200 in HGX/DGX B200 (HBM3e, 1,000 W). Peaks: HGX B200 at 1,000 W, BF16 2,250 "
            "TFLOP/s dense (4,500 sparse), FP8 4,500 dense (9,000 sparse), as tabulated at "
            "https://glennklockwood.com/garden/processors/B200 from NVIDIA's Blackwell "
            "datasheet; DGX B200 'FP8 72 PFLOPS sparse' for 8 GPUs agrees (9 PF sparse each). "
            "Memory: DGX B200 '1,440 GB total HBM3e, 64 TB/s' for 8 GPUs = 180 GB (the datasheet's "
            "figure: no device-reported total was seen here) and 8 TB/s "
            "each (https://brent-newsom-nvidia.github.io/AIPS-Boom/wiki/NVIDIA-DGX-B200 citing "
            "https://www.nvidia.com/en-us/data-center/dgx-b200/); NVLink 5 1.8 TB/s "
            "bidirectional per GPU (DGX B200 14.4 TB/s over 8 GPUs) = 900 GB/s per direction. "
            "nic_bw: DGX B200, '4x OSFP ports serving 8x single-port NVIDIA ConnectX-7 VPI, up "
            "to 400Gb/s InfiniBand/Ethernet' (NVIDIA DGX BasePOD reference architecture, Core "
            "Components, https://docs.nvidia.com/dgx-basepod/"
            "reference-architecture-infrastructure-foundation-enterprise-ai/latest/"
            "core-components.html) = 50 GB/s per GPU."),
    )
}

# Other spellings a user may give; keys are lower case, as :func:`gpu` compares them.
ALIASES: dict[str, str] = {
    "a100": "A100-80GB", "a100-80": "A100-80GB", "a100-sxm": "A100-80GB",
    "a100-sxm4": "A100-80GB", "a100-80gb-sxm": "A100-80GB", "a100-sxm-80gb": "A100-80GB",
    "a100-sxm4-80gb": "A100-80GB",
    "a100-40": "A100-40GB", "a100-40gb-sxm": "A100-40GB", "a100-sxm-40gb": "A100-40GB",
    "a100-sxm4-40gb": "A100-40GB",
    "h100": "H100-SXM", "h100-sxm5": "H100-SXM", "h100-80gb": "H100-SXM",
    "h100-sxm-80gb": "H100-SXM",
    "h200-sxm": "H200", "h200-141gb": "H200",
    "h800-sxm": "H800",
    "b200-sxm": "B200", "hgx-b200": "B200", "dgx-b200": "B200",
}

# A --hardware file's keys: (key, required).
TOML_KEYS: tuple[tuple[str, bool], ...] = (
    ("name", True), ("bf16_tflops", True), ("fp8_tflops", False), ("hbm_gb", True),
    ("hbm_gbps", True), ("nvlink_gbps", True), ("nic_gbps", True), ("gpus_per_node", True),
    ("source", False), ("nvlink_efficiency", False), ("nic_efficiency", False),
)


def _key(name: str) -> str:
    return "-".join(name.strip().lower().replace("_", "-").split())


def gpu(name: str) -> Gpu:
    """The built-in GPU ``name`` or one of its :data:`ALIASES`, in any case.

    >>> gpu("a100").name, gpu("H100").name, gpu("a100-80gb").name
    ('A100-80GB', 'H100-SXM', 'A100-80GB')
    """
    key = _key(name)
    for known, g in GPUS.items():
        if key == known.lower():
            return g
    if key in ALIASES:
        return GPUS[ALIASES[key]]
    spellings = [k.lower() for k in GPUS] + list(ALIASES)
    close = get_close_matches(key, spellings, n=1)
    hint = ""
    if close:
        hint = f" (did you mean {ALIASES.get(close[0], close[0]).upper()!r}?)"
    raise ValueError(
        f"unknown GPU {name!r}{hint}; known: {', '.join(GPUS)} (also "
        f"{', '.join(sorted(a.upper() for a in ALIASES))}); describe another in "
        f"--hardware FILE.toml with keys {', '.join(k for k, _ in TOML_KEYS)}")


def _number(table: Mapping[str, object], key: str, where: str) -> float:
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, not {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive number, not {value!r}")
    return float(value)


def load_toml(path: str | os.PathLike[str]) -> Gpu:
    """Read one GPU from a flat TOML file (see the module docstring for its keys and units).

    ``bf16_tflops``/``fp8_tflops`` are TFLOP/s, ``hbm_gb`` GB, ``hbm_gbps`` and ``nvlink_gbps``
    GB/s (NVLink one direction), ``nic_gbps`` Gbit/s one direction; the :class:`Gpu` returned
    is in FLOP/s, bytes and bytes/s. A missing or unknown key, or a value of the wrong type,
    raises :class:`ValueError` naming the key and the file.
    """
    where = os.fspath(path)
    try:
        with Path(path).open("rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot read the hardware file: {e.strerror or e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: not valid TOML: {e}") from e
    keys = [k for k, _ in TOML_KEYS]
    unknown = [k for k in table if k not in keys]
    if unknown:
        close = get_close_matches(unknown[0], keys, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}: unknown key {unknown[0]!r}{hint}; the keys are "
                         f"{', '.join(keys)}")
    for key, required in TOML_KEYS:
        if required and key not in table:
            raise ValueError(f"{where}: missing key {key!r} (required: "
                             f"{', '.join(k for k, r in TOML_KEYS if r)})")
    name = table["name"]
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: name must be a non-empty string, not {name!r}")
    per_node = table["gpus_per_node"]
    if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"{where}: gpus_per_node must be a positive integer, not {per_node!r}")
    source = table.get("source", f"read from {where}")
    if not isinstance(source, str):
        raise ValueError(f"{where}: source must be a string, not {source!r}")
    fp8 = _number(table, "fp8_tflops", where) * 1e12 if "fp8_tflops" in table else None
    return Gpu(
        name=name.strip(),
        bf16_flops=_number(table, "bf16_tflops", where) * 1e12,
        fp8_flops=fp8,
        hbm_bytes=_number(table, "hbm_gb", where) * 1e9,
        hbm_bw=_number(table, "hbm_gbps", where) * 1e9,
        nvlink_bw=_number(table, "nvlink_gbps", where) * 1e9,
        nic_bw=_number(table, "nic_gbps", where) * 1e9 / 8,
        gpus_per_node=per_node,
        source=source,
        nvlink_efficiency=_share(table, "nvlink_efficiency", NVLINK_EFFICIENCY, where),
        nic_efficiency=_share(table, "nic_efficiency", NIC_EFFICIENCY, where),
    )


def _share(table: Mapping[str, object], key: str, default: float, where: str) -> float:
    if key not in table:
        return default
    value = _number(table, key, where)
    if value > 1:
        raise ValueError(f"{where}: {key} is a share of the line rate, at most 1, not {value!r}")
    return value


def with_overrides(gpu: Gpu, nic_gbps: float | None = None,
                   gpus_per_node: int | None = None) -> Gpu:
    """``gpu`` with another network (``nic_gbps``, Gbit/s per GPU, one direction) or node size.

    >>> with_overrides(GPUS["H100-SXM"], nic_gbps=200).nic_bw
    25000000000.0
    """
    notes = []
    nic_bw = gpu.nic_bw
    if nic_gbps is not None:
        if isinstance(nic_gbps, bool) or not math.isfinite(nic_gbps) or nic_gbps <= 0:
            raise ValueError(f"nic_gbps must be a positive number of Gbit/s, not {nic_gbps!r}")
        nic_bw = nic_gbps * 1e9 / 8
        notes.append(f"nic {nic_gbps:g} Gb/s per GPU")
    per_node = gpu.gpus_per_node
    if gpus_per_node is not None:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) \
                or gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be a positive integer, not {gpus_per_node!r}")
        per_node = gpus_per_node
        notes.append(f"{gpus_per_node} GPUs per node")
    if not notes:
        return gpu
    return dataclasses.replace(gpu, nic_bw=nic_bw, gpus_per_node=per_node,
                               source=f"{gpu.source} Overridden by the user: {', '.join(notes)}.")
