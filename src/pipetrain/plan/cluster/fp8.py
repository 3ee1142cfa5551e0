"""fp8: what training a layer's matrix multiplies in fp8 adds to its cost, as torchao runs it.

The recipe is torchao's ``Float8Linear`` with dynamic tensorwise scaling (what torchtitan's
``--model.converters float8`` runs, and so the published fp8 rows): each nn.Linear of a
transformer block multiplies in e4m3 with bf16 output; attention, the norms and the output
layer stay in bf16. Per matrix multiply ``Y = X W^T`` of shape (m, n, k)::

    F  casts X (m k) and W (n k)             I  casts dY (m n) and W again (n k)
    W  casts dY again (m n) and X again (m k)

because torchao saves X and W for the backward in bf16 and casts each operand for each use.
A cast of a tensor with a scale over the whole tensor takes two passes over it: its absolute
maximum (read 2 bytes an element), then the scaled cast (read 2, write 1): 5 bytes an element
of memory-bound work (torch.compile can fuse the maximum into the op that produced the
tensor; this does not assume it). A tensor split by tensor parallelism takes its maximum over
all of its shards: an all-reduce of one number over the tp group for each activation cast
(latency alone; the weights' scales are computed once a step, together, after the optimizer
step, as torchao's ``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce of a few
thousand numbers, not counted). In memory, each layer's
weights exist once more in fp8 while it runs (1 byte a parameter of the layer, freed after),
and the activations kept for the backward stay bf16.
"""

from __future__ import annotations

from pipetrain.plan.cluster.collectives import Link
from pipetrain.plan.cluster.kernels import Kernels

__all__ = ["CAST_BYTES", "WEIGHT_BYTES", "casts", "scale_reductions"]

CAST_BYTES = 5
"""Bytes of memory traffic per element cast: the maximum's read, the cast's read and write."""
WEIGHT_BYTES = 1
"""Bytes a parameter of the running layer takes once more: its fp8 copy."""

Gemm = tuple[float, float, float]


def casts(kernels: Kernels, gemms: list[Gemm]) -> tuple[float, float, float]:
    """Seconds of the casts of F, I and W for a layer's forward matrix multiplies ``gemms``
    ((m, n, k) each)."""
    f = sum(kernels.memory(CAST_BYTES * (m * k + n * k)) for m, n, k in gemms)
    i = sum(kernels.memory(CAST_BYTES * (m * n + n * k)) for m, n, k in gemms)
    w = sum(kernels.memory(CAST_BYTES * (m * n + m * k)) for m, n, k in gemms)
    return f, i, w


def scale_reductions(gemms: list[Gemm], tp: int, link: Link) -> tuple[float, float, float]:
    """Seconds of the all-reduces of the activations' maxima over ``tp`` in F, I and W: one
    for each activation operand cast (X in F and W, dY in I and W)."""
    if tp <= 1:
        return 0.0, 0.0, 0.0
    one = link.all_reduce(4.0, tp)
    n = len(gemms)
    return n * one, n * one, 2 * n * one

