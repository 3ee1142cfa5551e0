"""Placement: which global rank holds which (pp, dp, fsdp, cp, tp) coordinates, and the rank map.

A launcher numbers the ranks node by node, so consecutive global ranks share a node, and the
innermost dimensions of the mesh are the ones that stay inside a node. Two orders, outermost
first::

    pp-outer (default)   (pp, dp_replicate, dp_shard, cp, tp)
                         r = (((pp_rank * dp + replica) * fsdp + shard) * cp + cp_rank) * tp
                             + tp_rank
    dp-outer             (dp_replicate, dp_shard, cp, pp, tp)
                         r = (((replica * fsdp + shard) * cp + cp_rank) * pp + pp_rank) * tp
                             + tp_rank

The context-parallel ranks (``cp``, each holding a slice of every sequence) sit between the
shards and the tensor-parallel ranks, as in torchtitan: their attention exchanges activations
every layer, less than tensor parallelism and more than the shards. A run with ``cp == 1``
places every rank as before.

``pp-outer`` is torchtitan's and Megatron's: the stages cross nodes (one activation per
micro-batch each way), while the FSDP shards of a stage, whose all-gathers and reduce-scatters
move the most bytes, and the tensor-parallel ranks stay together. ``dp-outer`` keeps each
replica's whole pipeline on consecutive ranks instead, which suits a pipeline that fits in a
node. Both put tp innermost; with ``pp == 1`` or a single data-parallel rank they agree.

:func:`gather_rank_map` collects, on every rank at once, where each rank landed (host,
torchrun's node index ``GROUP_RANK``, local rank and coordinates); :func:`format_rank_map`
turns that list into one line per node.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["MESH_ORDERS", "Coords", "Placement", "check_order", "gather_rank_map",
           "format_rank_map"]

MESH_ORDERS = ("pp-outer", "dp-outer")
"""The values of ``--mesh-order``; the first is the default."""
_DIMS = {"pp-outer": ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
         "dp-outer": ("dp_replicate", "dp_shard", "cp", "pp", "tp")}


@dataclass(frozen=True)
class Coords:
    """One rank's place in the mesh."""

    pp: int
    """Pipeline rank (which stages it holds)."""
    replica: int
    """Data-parallel replica (0 .. dp-1)."""
    shard: int
    """FSDP shard within the replica (0 .. fsdp-1)."""
    tp: int
    """Tensor-parallel rank (0 .. tp-1)."""
    cp: int = 0
    """Context-parallel rank (0 .. cp-1): which slice of each sequence it holds."""


@dataclass(frozen=True)
class Placement:
    """The mesh of ``pp x dp x fsdp x cp x tp`` ranks laid out in ``order`` (see the module).

    Example:
        >>> p = Placement(pp=2, fsdp=2)
        >>> [p.rank(pp=1, shard=s) for s in range(2)], p.groups("pp")
        ([2, 3], [[0, 2], [1, 3]])

    Raises:
        ValueError: for a degree below 1 or an unknown order.
    """

    pp: int
    dp: int = 1
    """Replicas."""
    fsdp: int = 1
    tp: int = 1
    order: str = MESH_ORDERS[0]
    cp: int = 1

    def __post_init__(self) -> None:
        check_order(self.order)
        if min(self.pp, self.dp, self.fsdp, self.tp, self.cp) < 1:
            raise ValueError(f"pp, dp, fsdp, cp and tp must be >= 1, got pp={self.pp}, "
                             f"dp={self.dp}, fsdp={self.fsdp}, cp={self.cp}, tp={self.tp}")

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.fsdp * self.cp * self.tp

    @property
    def names(self) -> tuple[str, ...]:
        """The dimensions' names, outermost first (``init_device_mesh``'s order)."""
        return _DIMS[self.order]

    @property
    def sizes(self) -> tuple[int, ...]:
        """The dimensions' sizes, in the order of :attr:`names`."""
        size = {"pp": self.pp, "dp_replicate": self.dp, "dp_shard": self.fsdp, "cp": self.cp,
                "tp": self.tp}
        return tuple(size[name] for name in self.names)

    @property
    def matters(self) -> bool:
        """Whether the two orders place the ranks differently (pipeline and data both > 1)."""
        return self.pp > 1 and self.dp * self.fsdp * self.cp > 1

    def rank(self, pp: int, replica: int = 0, shard: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at these coordinates."""
        at = {"pp": pp, "dp_replicate": replica, "dp_shard": shard, "cp": cp, "tp": tp}
        r = 0
        for name, size in zip(self.names, self.sizes, strict=True):
            if not 0 <= at[name] < size:
                raise ValueError(f"{name} coordinate {at[name]} is outside 0..{size - 1}")
            r = r * size + at[name]
        return r

    def coords(self, rank: int) -> Coords:
        """The coordinates of global rank ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside this mesh of {self.world} ranks")
        at: dict[str, int] = {}
        for name, size in reversed(list(zip(self.names, self.sizes, strict=True))):
            rank, at[name] = divmod(rank, size)
        return Coords(at["pp"], at["dp_replicate"], at["dp_shard"], at["tp"], at["cp"])

    def groups(self, *varying: str) -> list[list[int]]:
        """The ranks that differ only in the ``varying`` dimensions, one ascending list per
        group, the groups in the order of the other dimensions (outermost first).

        ``groups("pp")``: the pipelines; ``groups("dp_replicate", "dp_shard")``: the
        data-parallel groups; ``groups("dp_shard")``: the FSDP shard groups; ``groups("cp")``:
        the ranks holding the slices of the same sequences.
        """
        unknown = set(varying) - set(self.names)
        if unknown:
            raise ValueError(f"unknown dimensions {sorted(unknown)}; use {list(self.names)}")
        fixed = [n for n in self.names if n not in varying]
        moving = [n for n in self.names if n in varying]
        size = dict(zip(self.names, self.sizes, strict=True))
        out = []
        for held in itertools.product(*(range(size[n]) for n in fixed)):
            ranks = []
            for moved in itertools.product(*(range(size[n]) for n in moving)):
                at = {**dict(zip(fixed, held, strict=True)), **dict(zip(moving, moved,
                                                                        strict=True))}
                ranks.append(self.rank(at["pp"], at["dp_replicate"], at["dp_shard"],
                                       at["tp"], at["cp"]))
            out.append(sorted(ranks))
        return out


def check_order(order: str) -> None:
    """Raise ValueError, naming the choices, unless ``order`` is one of :data:`MESH_ORDERS`."""
    if order not in MESH_ORDERS:
        raise ValueError(f"mesh order must be one of {', '.join(MESH_ORDERS)}, got {order!r}; "
                         "pass --mesh-order pp-outer (stages across nodes) or dp-outer (each "
                         "replica's pipeline on consecutive ranks)")


def gather_rank_map(placement: Placement) -> list[dict[str, Any]]:
    """Where every rank landed, by global rank (collective: every rank calls it at once).

    Each entry: ``rank``, ``node`` (torchrun's ``GROUP_RANK`` when set, else the host's index
    in order of its lowest rank), ``host``, ``local_rank`` (``LOCAL_RANK`` when set, else the
    rank's position on its node), ``pp``, ``dp`` (replica), ``shard``, ``cp`` and ``tp``.
    """
    import torch.distributed as dist

    group = os.environ.get("GROUP_RANK")
    local = os.environ.get("LOCAL_RANK")
    mine = {"host": socket.gethostname(), "group_rank": None if group is None else int(group),
            "local_rank": None if local is None else int(local)}
    seen: list[Any] = [mine]
    if dist.is_initialized():
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
    hosts = list(dict.fromkeys(s["host"] for s in seen))
    ranks: list[dict[str, Any]] = []
    for r, s in enumerate(seen):
        node = s["group_rank"] if s["group_rank"] is not None else hosts.index(s["host"])
        local_rank = s["local_rank"] if s["local_rank"] is not None else sum(
            1 for e in ranks if e["node"] == node)
        c = placement.coords(r)
        ranks.append({"rank": r, "node": node, "host": s["host"], "local_rank": local_rank,
                      "pp": c.pp, "dp": c.replica, "shard": c.shard, "cp": c.cp, "tp": c.tp})
    return ranks


def format_rank_map(ranks: list[dict[str, Any]], order: str | None = None) -> list[str]:
    """One line per node: ``node 0 (host-a): r0 L0 pp0 s0 | r1 L1 pp0 s1``, after a line that
    says what the letters mean (r global rank, L local rank, then the coordinates; those of a
    dimension of size 1 everywhere are left out, pp always shown)."""
    if not ranks:
        return []
    shown = [("pp", "pp")] + [(key, short) for key, short in (("dp", "dp"), ("shard", "s"),
                                                               ("cp", "c"), ("tp", "t"))
                              if any(e.get(key) for e in ranks)]
    legend = {"dp": "dp replica", "s": "s fsdp shard", "c": "c cp rank", "t": "t tp rank"}
    what = ", ".join(["r global rank", "L local rank", "pp pipeline rank",
                      *(legend[short] for _, short in shown[1:])])
    head = f"ranks by node ({what}" + (f"; --mesh-order {order}" if order else "") + "):"
    lines = [head]
    nodes: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for e in ranks:
        nodes.setdefault((e["node"], e["host"]), []).append(e)
    for (node, host), members in sorted(nodes.items()):
        cells = [f"r{e['rank']} L{e['local_rank']} " + " ".join(
            f"{short}{e[key]}" for key, short in shown) for e in members]
        lines.append(f"  node {node} ({host}): " + " | ".join(cells))
    return lines
