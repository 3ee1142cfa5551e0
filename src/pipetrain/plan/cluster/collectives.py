"""Collectives: what NCCL's collectives and point-to-point sends cost, inside a node and across.

Each is latency + bytes / bandwidth, with the bytes each GPU sends in NCCL's algorithm (the "bus
bandwidth" of nccl-tests' PERFORMANCE.md: an all-reduce of S bytes over n GPUs moves
2 (n - 1) / n x S through each GPU's link in a ring)::

    all-reduce      ring: 2 (n-1)/n S / bw + 2 (n-1) a      tree: 2 S / bw + 2 log2(n) a
    all-gather      (n-1)/n S / bw + (n-1) a                S: the whole gathered tensor
    reduce-scatter  (n-1)/n S / bw + (n-1) a                S: the whole input
    all-to-all      (n-1)/n S / bw + (n-1) a                S: what one GPU holds
    send / recv     S / bw + a

NCCL picks the faster of ring and tree for an all-reduce; the cost here does too. Bandwidths
are what NCCL reaches, not line rates: each link's figure times the GPU's measured efficiency
(:data:`pipetrain.plan.cluster.hardware.NVLINK_EFFICIENCY` and its neighbours, from nccl-tests).

A group whose GPUs all sit in one node talks over NVLink. A group that spans nodes runs one
ring per NIC of its GPUs in a node (NCCL's channels), so its bandwidth is that of the NICs its
``k`` members in one node bring, ``k x nic``, capped by NVLink: a data-parallel group of 8
GPUs per node over 8 NICs reaches the node's whole network (nccl-tests across 4-NIC A100 nodes:
96 GB/s of the node's 100, https://github.com/NVIDIA/nccl-tests/issues/119), one GPU per node
(stride 8, beside the other tp ranks' groups) its own NIC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipetrain.plan.cluster.hardware import Gpu

__all__ = ["Fabric", "Link"]

NVLINK_LATENCY_S = 5e-6
"""One NCCL step inside a node: a few microseconds (nccl-tests' small-message times on DGX)."""
NIC_LATENCY_S = 15e-6
"""One NCCL step across nodes over InfiniBand: about three times NVLink's."""


@dataclass(frozen=True)
class Link:
    """What one GPU's messages travel over: bandwidth one way (bytes/s) and latency per step."""

    bandwidth: float
    latency: float

    def all_reduce(self, size: float, n: int) -> float:
        """Seconds to all-reduce ``size`` bytes over ``n`` GPUs (ring or tree, the faster)."""
        if n <= 1 or size <= 0:
            return 0.0
        ring = 2 * (n - 1) / n * size / self.bandwidth + 2 * (n - 1) * self.latency
        tree = 2 * size / self.bandwidth + 2 * math.log2(n) * self.latency
        return min(ring, tree)

    def all_gather(self, size: float, n: int) -> float:
        """Seconds to gather a tensor of ``size`` bytes in all, 1/n from each GPU."""
        if n <= 1 or size <= 0:
            return 0.0
        return (n - 1) / n * size / self.bandwidth + (n - 1) * self.latency

    def reduce_scatter(self, size: float, n: int) -> float:
        """Seconds to reduce a tensor of ``size`` bytes on each GPU into 1/n on each."""
        return self.all_gather(size, n)

    def all_to_all(self, size: float, n: int) -> float:
        """Seconds for each GPU to send 1/n of its ``size`` bytes to each other GPU."""
        return self.all_gather(size, n)

    def send(self, size: float) -> float:
        """Seconds for one point-to-point message of ``size`` bytes."""
        return size / self.bandwidth + self.latency if size > 0 else 0.0


@dataclass(frozen=True)
class Fabric:
    """A cluster's links: NVLink inside a node of ``gpus_per_node``, the NIC across nodes."""

    nvlink: Link
    nic: Link
    gpus_per_node: int

    @classmethod
    def of(cls, gpu: Gpu) -> Fabric:
        return cls(Link(gpu.nvlink_bw * gpu.nvlink_efficiency, NVLINK_LATENCY_S),
                   Link(gpu.nic_bw * gpu.nic_efficiency, NIC_LATENCY_S), gpu.gpus_per_node)

    def group(self, size: int, stride: int) -> Link:
        """The link of a group of ``size`` GPUs whose ranks are ``stride`` apart (the product
        of the layout's dimensions inside it): NVLink when all of them fit one node, else the
        NICs of its members in one node (see the module docstring)."""
        if size * stride <= self.gpus_per_node:
            return self.nvlink
        in_node = min(size, max(1, self.gpus_per_node // stride))
        return Link(min(in_node * self.nic.bandwidth, self.nvlink.bandwidth), self.nic.latency)

    def hop(self, stride: int) -> Link:
        """The link between two GPUs ``stride`` ranks apart (a pipeline's neighbours)."""
        return self.nvlink if stride < self.gpus_per_node else self.nic
