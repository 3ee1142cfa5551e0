"""Mesh: the pp x dp x fsdp x cp x tp layout of a training job and the data-parallel all-reduce.

The world is a grid of ranks: ``pp`` pipeline ranks, each held by ``dp`` data-parallel ranks.
Ranks that hold the same stages in different replicas form a ``dp`` group; the ranks of one
replica, one per pipeline rank, form its ``pp`` group (a whole pipeline). By default the
pipeline is the outermost dimension (``--mesh-order pp-outer``, as in torchtitan and
Megatron): global rank ``r`` is pipeline rank ``r // dp`` of replica ``r % dp``, so a stage's
data-parallel ranks are consecutive (launchers number ranks node by node: one node) and the
pipeline crosses nodes. ``dp-outer`` (the only order before ``--mesh-order``) keeps each
replica's pipeline on consecutive ranks instead: ``r`` is pipeline rank ``r % pp`` of replica
``r // pp``::

    dp=2, pp=2        pp-outer (default)    dp-outer
    stage 0 held by   ranks 0, 1            ranks 0, 2
    stage 1 held by   ranks 2, 3            ranks 1, 3
    pp groups         {0, 2} {1, 3}         {0, 1} {2, 3}
    dp groups         {0, 1} {2, 3}         {0, 2} {1, 3}

:mod:`pipetrain.train.placement` holds both formulas and the groups they make.

After each pipeline step every replica holds the gradient of its own part of the batch; the
:class:`GradReducer` sums them over the dp group and then divides by ``dp`` (sum, then scale:
for a power-of-two ``dp`` the division is exact, so a replica's averaged gradient is bitwise
what one pipeline computes on the concatenated batch when the micro-batch sums line up).

With ``fsdp`` shards each replica's ranks are split further: the ``fsdp`` ranks of a shard
group hold the same stages, each a slice of every weight, its gradient and its optimizer state
(FSDP2, :mod:`pipetrain.parallel.sharded`), and each trains on its own rows. Data-parallel ranks are
then ``dp x fsdp``; FSDP2 averages the gradients over the shards, not the reducer, and with
``dp > 1`` too (HSDP) over the replicas: it reduce-scatters over ``dp_shard`` and all-reduces
over ``dp_replicate``. With ``tp`` each pipeline rank is ``tp`` ranks that split its layers
(:mod:`pipetrain.parallel.tensor_parallel`) and see the same rows; each runs its own copy of the
pipeline's point-to-point traffic with the same tensor-parallel rank of the next stage. Global
rank ``((pipeline rank * dp + replica) * fsdp + shard) * tp + tensor-parallel rank`` (tp
innermost, as it talks most; then the shards, whose all-gathers and reduce-scatters move the
most bytes), from one ``init_device_mesh`` with dimensions ``(pp, dp_replicate, dp_shard, tp)``
whenever ``fsdp`` or ``tp`` is more than 1; ``dp-outer`` makes it ``(dp_replicate, dp_shard,
pp, tp)``, rank ``((replica * fsdp + shard) * pp + pipeline rank) * tp + tensor-parallel rank``.

With ``cp`` context-parallel ranks (between the shards and tp,
:mod:`pipetrain.train.placement`) each data-parallel rank is ``cp`` ranks that take the same
rows, each a slice of every sequence (:mod:`pipetrain.runtime.sequence`). They train like
data-parallel ranks on other tokens: the gradients are averaged over ``dp x fsdp x cp`` ranks
(the reducer's group, :attr:`Mesh.data_group`; with ``fsdp`` FSDP2 shards every weight over
``fsdp x cp`` ranks, as torchtitan's ``dp_shard_cp``), and the losses are averaged over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipetrain.runtime.dtensors import local_shard
from pipetrain.runtime.failure import job_failure
from pipetrain.train.placement import MESH_ORDERS, Placement

__all__ = ["Mesh", "build_mesh", "GradReducer"]

BUCKET_BYTES = 25 << 20
"""Gradients are flattened into buckets of about this size, one all-reduce each."""


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the pp x dp grid and the groups it communicates over."""

    dp: int
    """Data-parallel ranks that hold the same stages (replicas x shards)."""
    pp: int
    rank: int
    """Global rank."""
    dp_rank: int
    """Which data-parallel rank (0 .. dp-1): ``replica * fsdp + shard``."""
    pp_rank: int
    """Which pipeline rank inside the replica (0 .. pp-1)."""
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    device: torch.device
    """Where this rank computes."""
    comm_device: torch.device
    """Where small tensors for collectives live (the device under NCCL, else CPU)."""
    fsdp: int = 1
    """Shards of each weight (1: every data-parallel rank holds them whole)."""
    shard_mesh: DeviceMesh | None = None
    """With ``fsdp > 1``: the mesh FSDP2 shards over (``dp_shard``), with ``dp_replicate``
    first when there are replicas too (HSDP)."""
    shard_group: dist.ProcessGroup | None = None
    """With ``fsdp > 1``: the ranks whose slices make up this rank's weights."""
    tp: int = 1
    """Ranks that split each layer (tensor parallel; 1: none)."""
    tp_rank: int = 0
    tp_mesh: DeviceMesh | None = None
    """With ``tp > 1``: the mesh the layers are split over (``tp``)."""
    order: str = MESH_ORDERS[0]
    """How global ranks map to coordinates: ``pp-outer`` or ``dp-outer`` (the module's)."""
    ep: int = 1
    """Data-parallel ranks that share each MoE layer's experts (expert parallel; 1: none)."""
    ep_mesh: DeviceMesh | None = None
    """With ``ep > 1``: the mesh of this rank's expert-parallel group (``ep`` consecutive
    data-parallel ranks), the experts' DTensors are sharded over."""
    batch_mesh: DeviceMesh | None = None
    """With ``ep > 1``: the ranks that hold this rank's rows (itself: transformers' ``AllToAllEP``
    slices a batch shared by tensor-parallel ranks; here none is)."""
    expert_group: dist.ProcessGroup | None = None
    """With ``ep > 1``: the data-parallel ranks holding the same experts as this one (one per
    expert-parallel group), over which the experts' gradients are summed."""
    cp: int = 1
    """Ranks that each hold a slice of every sequence (context parallel; 1: none)."""
    cp_rank: int = 0
    """Which slice of each sequence this rank holds (0 .. cp-1)."""
    cp_group: dist.ProcessGroup | None = None
    """With ``cp > 1``: the ranks holding the other slices of this rank's sequences."""
    data_group: dist.ProcessGroup | None = None
    """With ``cp > 1``: the ``dp x fsdp x cp`` ranks holding this rank's stages, over which
    gradients and losses are averaged (None: :attr:`dp_group`)."""

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @property
    def averaged(self) -> int:
        """The ranks whose gradients and losses are averaged: ``dp x fsdp x cp``."""
        return self.dp * self.cp

    @property
    def mean_group(self) -> dist.ProcessGroup:
        """The group of those ranks."""
        return self.dp_group if self.data_group is None else self.data_group

    @property
    def placement(self) -> Placement:
        """The whole mesh's placement (every rank's coordinates and groups)."""
        return Placement(self.pp, self.dp // self.fsdp, self.fsdp, self.tp, self.order,
                         self.cp)

    def global_rank(self, dp_rank: int, pp_rank: int) -> int:
        """The rank at (dp_rank, pp_rank) with this rank's tensor- and context-parallel
        ranks."""
        return self.placement.rank(pp_rank, dp_rank // self.fsdp, dp_rank % self.fsdp,
                                   self.tp_rank, self.cp_rank)

    def describe(self) -> dict[str, int | str]:
        """The layout's degrees (those above 1 of fsdp, cp and tp), and the mesh order where
        the orders place ranks differently (a resume at another order restores no RNG
        stream)."""
        shards = {"fsdp": self.fsdp} if self.fsdp > 1 else {}
        shards |= {"cp": self.cp} if self.cp > 1 else {}
        split = {"tp": self.tp} if self.tp > 1 else {}
        split |= {"ep": self.ep} if self.ep > 1 else {}
        order = {"mesh_order": self.order} if self.placement.matters else {}
        return {"world": self.world, "dp": self.dp // self.fsdp, **shards, "pp": self.pp,
                **split, **order}

    def ep_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over this rank's expert-parallel group (other experts)."""
        if self.ep_mesh is not None:
            job_failure.all_reduce(tensor, "the sum over expert-parallel ranks",
                            group=self.ep_mesh.get_group())
        return tensor

    def tp_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over this rank's tensor-parallel group (split slices)."""
        if self.tp_mesh is not None:
            job_failure.all_reduce(tensor, "the sum over tensor-parallel ranks",
                            group=self.tp_mesh.get_group())
        return tensor

    def shard_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over this rank's shard group (a sharded weight's slices)."""
        if self.shard_group is not None:
            job_failure.all_reduce(tensor, "the sum over shards", group=self.shard_group)
        return tensor

    def dp_mean(self, value: float) -> float:
        """The mean of ``value`` over the ranks holding this rank's stages, ``dp x fsdp x
        cp`` (call on every rank at once)."""
        if self.averaged == 1:
            return value
        t = torch.tensor(value, dtype=torch.float64, device=self.comm_device)
        job_failure.all_reduce(t, "the dp mean", group=self.mean_group)
        return float(t) / self.averaged

    def pp_sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place over this rank's pipeline group; return it."""
        if self.pp > 1:
            job_failure.all_reduce(tensor, "the pipeline sum", group=self.pp_group)
        return tensor

    def world_max(self, value: float) -> float:
        """The largest ``value`` of any rank (call on every rank at once)."""
        t = torch.tensor(value, dtype=torch.float64, device=self.comm_device)
        job_failure.all_reduce(t, "the world max", op=dist.ReduceOp.MAX)
        return float(t)



def layout(world: int, dp: int, pp: int | None, fsdp: int = 1, tp: int = 1,
           cp: int = 1) -> tuple[int, int]:
    """``(dp, pp)`` for a world of ``world`` ranks; ``pp=None`` takes
    ``world // (dp x fsdp x cp x tp)``.

    Raises:
        ValueError: when ``dp x fsdp x cp x pp x tp`` is not the world size.
    """
    if dp < 1 or fsdp < 1 or tp < 1 or cp < 1 or (pp is not None and pp < 1):
        raise ValueError(f"dp, fsdp, cp, tp and pp must be >= 1, got dp={dp}, fsdp={fsdp}, "
                         f"cp={cp}, tp={tp}, pp={pp}")
    data = dp * fsdp * cp * tp
    degrees = (("dp", dp), ("fsdp", fsdp), ("cp", cp), ("tp", tp))
    named = " x ".join(f"{k}={v}" for k, v in degrees if v > 1 or k == "dp")
    flags = "/".join(f"--{k}" for k, v in degrees if v > 1 or k == "dp")
    if pp is None:
        if world % data:
            raise ValueError(f"the world has {world} ranks, which {named} does not divide; "
                             f"start a multiple of {data} processes or change {flags}")
        pp = world // data
    if data * pp != world:
        raise ValueError(f"the world has {world} ranks but {named} x pp={pp} = {data * pp}; "
                         f"start {data * pp} processes (--nproc) or change {flags}/--pp")
    return dp, pp


def build_mesh(dp: int, pp: int | None, device: str = "auto", fsdp: int = 1,
               tp: int = 1, order: str = MESH_ORDERS[0], ep: int = 1, cp: int = 1) -> Mesh:
    """The mesh of the current ``torch.distributed`` job (call on every rank at once).

    Args:
        dp: data-parallel replicas.
        pp: pipeline ranks per replica; None: world size // (dp x fsdp x tp).
        device: ``auto`` (CUDA under NCCL, else CPU), ``cpu`` or ``cuda``.
        fsdp: shards of each weight within a replica (FSDP2).
        tp: ranks that split each layer (tensor parallel), the innermost dimension.
        order: ``pp-outer`` (pipeline outermost, the default) or ``dp-outer`` (each
            replica's pipeline on consecutive ranks); see the module.
        ep: consecutive data-parallel ranks that share each MoE layer's experts.
        cp: ranks that each hold a slice of every sequence (context parallel), between the
            shards and tp.

    Raises:
        ValueError: when the world is not ``dp x fsdp x cp x pp x tp`` ranks, the order is
            unknown, or CUDA is asked for but absent.
        RuntimeError: when torch.distributed is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: start the job with "
                           "`pipetrain train` (or torchrun), or pt.launch in tests")
    world, rank = dist.get_world_size(), dist.get_rank()
    dp, pp = layout(world, dp, pp, fsdp, tp, cp)
    place = Placement(pp, dp, fsdp, tp, order, cp)
    nccl = dist.get_backend() == "nccl"
    where = _device(device, nccl, rank)
    shard_mesh, shard_group, tp_mesh = _device_meshes(place, where.type)
    pp_group = _my_group(place.groups("pp"), rank)
    dp_group = _my_group(place.groups("dp_replicate", "dp_shard"), rank)
    at = place.coords(rank)
    experts = _expert_groups(place, ep, rank, where.type)
    cp_group = data_group = None
    if cp > 1:
        cp_group = _my_group(place.groups("cp"), rank)
        data_group = _my_group(place.groups("dp_replicate", "dp_shard", "cp"), rank)
    return Mesh(dp * fsdp, pp, rank, at.replica * fsdp + at.shard, at.pp, pp_group, dp_group,
                where, where if nccl else torch.device("cpu"), fsdp, shard_mesh, shard_group,
                tp, at.tp, tp_mesh, order, ep, *experts, cp, at.cp, cp_group, data_group)


def _device_meshes(place: Placement, device_type: str
                   ) -> tuple[DeviceMesh | None, dist.ProcessGroup | None, DeviceMesh | None]:
    """(FSDP2's mesh, its shard group, the tensor-parallel mesh), those a layout has (made
    before any other group: see :func:`_my_group`).

    Replicas of sharded stages (HSDP): FSDP2 shards over ``dp_shard`` and all-reduces over
    ``dp_replicate``. With context parallelism it shards over ``fsdp x cp`` ranks, one
    dimension ``dp_shard_cp`` of the device mesh (``dp_shard`` and ``cp`` are neighbours in
    both orders, so the ranks are the same).
    """
    fsdp, tp, cp = place.fsdp, place.tp, place.cp
    if fsdp == 1 and tp == 1:
        return None, None, None
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = list(place.names), list(place.sizes)
    if fsdp > 1 and cp > 1:  # one dimension for both
        at = names.index("dp_shard")
        names[at:at + 2], sizes[at:at + 2] = ["dp_shard_cp"], [fsdp * cp]
    mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
    shard_mesh = shard_group = None
    if fsdp > 1:
        shard = "dp_shard_cp" if cp > 1 else "dp_shard"
        shard_mesh = mesh["dp_replicate", shard] if place.dp > 1 else mesh[shard]
        shard_group = mesh[shard].get_group()
    return shard_mesh, shard_group, mesh["tp"] if tp > 1 else None


def _expert_groups(place: Placement, ep: int, rank: int, device_type: str
                   ) -> tuple[DeviceMesh | None, DeviceMesh | None, dist.ProcessGroup | None]:
    """With ``ep > 1``: (the expert-parallel mesh, this rank alone as a mesh, the ranks holding
    the same experts); Nones otherwise. Every rank makes every group, in the same order.

    Raises:
        ValueError: when ``ep`` does not divide the data-parallel ranks.
    """
    if ep == 1:
        return None, None, None
    data = place.groups("dp_replicate", "dp_shard")  # each ordered by dp rank, cp fixed
    if len(data[0]) % ep:
        raise ValueError(f"--ep {ep} must divide the {len(data[0])} data-parallel ranks "
                         "(dp x fsdp) that hold each stage; use a divisor of them")
    shared = _my_group([ranks[k:k + ep] for ranks in data
                        for k in range(0, len(ranks), ep)], rank)
    # the same experts: the ranks at one place of their expert-parallel groups, every
    # context-parallel rank's (each trains them on its slice of the sequences)
    averaged = place.groups("dp_replicate", "dp_shard", "cp")  # by dp rank, then cp rank
    cp = place.cp
    same = _my_group([[r for i, r in enumerate(ranks) if (i // cp) % ep == j]
                      for ranks in averaged for j in range(ep)], rank)
    alone = _my_group([[r] for r in range(place.world)], rank)
    return (DeviceMesh.from_group(shared, device_type),
            DeviceMesh.from_group(alone, device_type), same)


def _my_group(partition: list[list[int]], rank: int) -> dist.ProcessGroup:
    """Create a group for each rank list (every rank calls ``new_group`` for every list, in
    order); return the one holding ``rank``.

    Plain ``new_group`` rather than ``init_device_mesh``: in torch 2.13 building a second
    device mesh hangs after a group of a subset of the ranks was made (a pipeline's
    tied-weight group), and tests run several layouts in one process.
    """
    mine: dist.ProcessGroup | None = None
    for ranks in partition:
        group: dist.ProcessGroup = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None  # the partition covers every rank
    return mine


def _device(choice: str, nccl: bool, rank: int) -> torch.device:
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {choice!r}")
    if choice == "cpu" and nccl:
        raise ValueError("device='cpu' needs the gloo backend, but this job runs NCCL; "
                         "use device='cuda' or start the job on CPU")
    if choice == "cuda" or (choice == "auto" and nccl):
        if not torch.cuda.is_available():
            raise ValueError(f"[rank {rank}] device='cuda' but CUDA is not available here; "
                             "use device='cpu'")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GradReducer:
    """Average gradients over a dp group: flattened buckets, summed, then divided by ``dp``.

    Each stage's buckets can start their all-reduce as soon as the pipeline reports that
    stage's gradients final (:attr:`hook`, for ``Pipeline.step(on_grads_ready=...)``), so the
    communication overlaps the schedule's cool-down; :meth:`finish` starts whatever has not
    started, waits, and writes the means back. Every dp peer holds the same stages and runs the
    same schedule, so the peers start the same all-reduces in the same order.

    Args:
        stage_params: this rank's parameters per stage (a parameter in several stages, a tied
            weight, goes with the first; those not requiring grad are left out).
        group: the dp group.
        size: ranks in ``group``.
        bucket_bytes: about this many bytes of gradient per all-reduce.
        divisor: what the sums are divided by (default ``size``): the data-parallel ranks for
            experts, whose gradients already sum the tokens of their expert-parallel group.

    Example::

        reducer = GradReducer({s: st.parameters() for s, st in pipe.stages.items()},
                              mesh.dp_group, mesh.dp)
        pipe.step(x, y, on_grads_ready=reducer.hook)
        reducer.finish()            # every replica now holds the mean gradient
    """

    def __init__(self, stage_params: dict[int, list[nn.Parameter]], group: dist.ProcessGroup,
                 size: int, bucket_bytes: int = BUCKET_BYTES, divisor: int | None = None
                 ) -> None:
        self.group, self.size = group, size
        self.divisor = size if divisor is None else divisor
        self.buckets: dict[int, list[list[nn.Parameter]]] = {}
        seen: set[int] = set()
        for stage in sorted(stage_params):
            own = [p for p in stage_params[stage] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in own)
            self.buckets[stage] = _buckets(own, bucket_bytes)
        self._pending: list[tuple[Any | None, torch.Tensor, list[nn.Parameter]]] = []
        self._started: set[int] = set()

    @property
    def hook(self) -> Callable[[int], None] | None:
        """The ``on_grads_ready`` hook (None when there is nothing to average)."""
        return None if self.divisor == 1 else self.start

    def start(self, stage: int) -> None:
        """Begin the (asynchronous) all-reduce of ``stage``'s gradients."""
        if self.divisor == 1 or stage in self._started:
            return
        self._started.add(stage)
        for bucket in self.buckets.get(stage, []):
            flat = torch.cat([_grad(p).reshape(-1) for p in bucket])
            work = (None if self.size == 1
                    else dist.all_reduce(flat, group=self.group, async_op=True))
            self._pending.append((work, flat, bucket))

    def finish(self) -> None:
        """Start the stages not started yet, wait for every all-reduce, write the means back."""
        for stage in sorted(self.buckets):
            self.start(stage)
        for work, flat, bucket in self._pending:
            if work is not None:
                job_failure.wait(work, f"[rank {dist.get_rank()}] the gradient all-reduce over "
                          "replicas", poll=flat.device.type == "cpu")
            flat.div_(self.divisor)
            grads = [_grad(p) for p in bucket]
            for grad, part in zip(grads, torch.split(flat, [g.numel() for g in grads]),
                                  strict=True):
                grad.copy_(part.view_as(grad))
        self._pending.clear()
        self._started.clear()


def _buckets(params: Sequence[nn.Parameter], limit: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype and device, about ``limit`` bytes per bucket."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        same = buckets and (buckets[-1][0].dtype, buckets[-1][0].device) == (p.dtype, p.device)
        if not same or size >= limit:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


def _grad(p: nn.Parameter) -> torch.Tensor:
    """``p``'s gradient (zeros if none), this rank's slice of it for a DTensor."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return local_shard(p.grad)
