"""Published: runs whose layout, batch, sequence and hardware are all given, and their throughput.

Each :class:`Published` row is one measured step of one run from a paper or a project's own
benchmark page: the model's shape, the GPU (a key of :data:`pipetrain.plan.cluster.hardware.GPUS`)
and
the layout, the batch and micro-batch, the schedule (pipetrain's names), the recomputation and
precision, and the one figure the source publishes for it (``metric``/``value``), so that
``pipetrain plan --cluster`` can be checked against it. Layout convention, as in
:class:`pipetrain.plan.shardcost.Sharding`: ``gpus == tp * pp * cp * dp * fsdp``, where ``dp``
counts replicas (plain data parallelism) and ``fsdp`` the ranks each replica's state is sharded
over (ZeRO-3/FSDP), and the ``ep`` expert-parallel ranks are drawn from the ``dp * fsdp``
data-parallel ones. ``global_batch`` and ``micro_batch`` are sequences of ``model["seq_len"]``
tokens. Every row's ``source`` says where each figure was read (paper, table, row, URL, and
whether it was verified from a stored copy here); ``assumed`` lists what the source does not
give and what was taken for it.

Metrics: ``hardware_tflops_per_gpu`` (FLOP/s per GPU counting recomputation, TFLOP/s),
``model_tflops_per_gpu`` (without recomputation, TFLOP/s), ``mfu`` (a fraction),
``tokens_per_s_per_gpu`` and ``step_s`` (seconds per optimizer step).

The rows are kept by source family: :mod:`~pipetrain.plan.cluster.published_megatron`,
:mod:`~pipetrain.plan.cluster.published_pytorch`, :mod:`~pipetrain.plan.cluster.published_bloom`
and :mod:`~pipetrain.plan.cluster.published_nemo`; the record and its rules are
:mod:`~pipetrain.plan.cluster.published_record`.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipetrain.plan.cluster import (
    published_bloom,
    published_megatron,
    published_nemo,
    published_pytorch,
)
from pipetrain.plan.cluster.published_record import (
    METRICS,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    Published,
    check,
)

__all__ = ["Published", "PUBLISHED", "METRICS", "SCHEDULES", "RECOMPUTE", "PRECISIONS", "rows"]

PUBLISHED: list[Published] = [
    *published_megatron.MEGATRON, *published_megatron.KORTHIKANTI,
    *published_pytorch.ZERO_BUBBLE, *published_pytorch.TORCHTITAN, *published_pytorch.LLAMA3,
    *published_megatron.MEGASCALE, *published_bloom.BLOOM, *published_nemo.NEMO,
]
"""Every row, in the order of ``benchmarks/published.py``'s table."""

check(PUBLISHED)


def rows(keys: Iterable[str] | None = None) -> list[Published]:
    """The rows named by ``keys``, in that order (all of :data:`PUBLISHED` when ``None``).

    A key may also be a prefix ending in ``-`` or ``*`` (``"megatron-"``, ``"zb-*"``) for every
    row it begins. An unknown key raises :class:`ValueError` listing the known ones.
    """
    if keys is None:
        return list(PUBLISHED)
    by_key = {r.key: r for r in PUBLISHED}
    out: list[Published] = []
    for key in keys:
        if key in by_key:
            out.append(by_key[key])
            continue
        prefix = key[:-1] if key.endswith("*") else key if key.endswith("-") else ""
        matched = [r for r in PUBLISHED if prefix and r.key.startswith(prefix)]
        if not matched:
            raise ValueError(f"unknown published run {key!r}; known: {', '.join(by_key)}")
        out.extend(matched)
    return out
