"""Groups: the process groups and tags that one pipeline's messages travel on.

Headers and CPU payloads go over two gloo groups of the pipeline's ranks, one per direction
(:func:`twin_group`); on GPUs, payloads go over one NCCL group per ordered pair of ranks. Each
pipeline built over the same ranks talks on tags of its own (:func:`next_instance`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from pipetrain.errors import CommError
from pipetrain.runtime.torch_distributed import PrefixStore, Store, default_store

__all__: list[str] = []

_instances: dict[tuple[int, ...], int] = {}  # pipelines built so far over each set of ranks


def next_instance(ranks: Sequence[int]) -> int:
    """How many pipelines this process built over ``ranks`` before (the same on every rank).

    Each pipeline talks on tags of its own, so a pipeline built after another failed never
    receives the failed one's leftover messages, nor loses its own to a receive the failed
    one left posted.
    """
    key = tuple(ranks)
    n = _instances.get(key, 0)
    _instances[key] = n + 1
    return n


def rank_name(rank: int, global_rank: int) -> str:
    """A pipeline rank as the job knows it: ``rank 1``, or ``rank 3 (rank 1 of its pipeline)``
    where data-parallel replicas make the pipeline rank and the global rank differ."""
    if rank == global_rank:
        return f"rank {rank}"
    return f"rank {global_rank} (rank {rank} of its pipeline)"


def frame_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The group headers travel in, as an object (None means the default group)."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise CommError("torch.distributed has no default process group")
    return world


class Channel(Protocol):
    """What point-to-point messages are posted on: a process group, or a gloo backend of ours."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> dist.Work: ...


def twin_group(members: Sequence[int], rank: int, generation: int, timeout: float
               ) -> Channel | None:
    """A second gloo group over a pipeline's ranks, with TCP connections of its own.

    Made by the pipeline's members alone, through the job's store under the pipeline's own key
    (its ranks and generation), so no other rank takes part and torch's group count is
    untouched. Messages to a higher pipeline rank travel in the pipeline's group, those to a
    lower one in this twin: each connection then carries one direction, and one thread at each
    end (its main thread) posts on it. When a connection is shared, threads at one end both
    take gloo's lock of that connection, and gloo's socket thread, which only
    tries that lock, spins on ``epoll_wait`` while either holds it: measured by
    ``benchmarks/overhead.py --threads``. None outside a job with a store (then both directions
    share the pipeline's group).

    The keys the rendezvous wrote are deleted once every member is connected: the store holds
    nothing of the group after this returns.
    """
    try:
        store = default_store()
    except (RuntimeError, ValueError):
        return None
    key = f"pipetrain/twin/{'-'.join(map(str, members))}/{generation}/"
    written = _Written(PrefixStore(key, store))
    backend = dist.ProcessGroupGloo(written, rank, len(members), timedelta(seconds=timeout))
    # gloo's mesh is whole on one side before the other: without this wait, a rank that built
    # its pipeline last and returned (a test, a script that only builds) could close its
    # sockets while a peer still connects ("Connection closed by peer" in connectFullMesh).
    # Once it passed, every member has read every key (a member enters it once connected)
    backend.barrier(dist.BarrierOptions()).wait()  # type: ignore[attr-defined]
    written.forget()
    return cast(Channel, backend)  # torch's stubs give a backend no send/recv; it has them


class _Written(Store):
    """A store that remembers the keys set through it, to delete them (:meth:`forget`)."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self.store, self.keys = store, set[str]()

    def set(self, key: str, value: str) -> None:
        self.keys.add(key)
        self.store.set(key, value)

    def add(self, key: str, amount: int) -> int:
        self.keys.add(key)
        return int(self.store.add(key, amount))

    def get(self, key: str) -> bytes:
        return bytes(self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        return bool(self.store.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.store.wait(keys)
        else:
            self.store.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self.store.delete_key(key))

    def forget(self) -> None:
        """Delete every key set through this store."""
        for key in sorted(self.keys):
            self.store.delete_key(key)
        self.keys.clear()


def pipeline_groups(group: dist.ProcessGroup | None, n_ranks: int, device: torch.device
                    ) -> tuple[dist.ProcessGroup | None, dict[tuple[int, int], dist.ProcessGroup],
                               list[dist.ProcessGroup]]:
    """A gloo group for frames, on GPUs one NCCL group per ordered pair of ranks, and the
    groups made for them (:func:`release` ends them with the pipeline)."""
    if device.type == "cpu" and dist.get_backend(group) == "gloo":
        return group, {}, []
    members = [dist.get_global_rank(group, r) if group is not None else r for r in range(n_ranks)]
    return symmetric_groups(members, device)


def symmetric_groups(members: list[int], device: torch.device
                     ) -> tuple[dist.ProcessGroup, dict[tuple[int, int], dist.ProcessGroup],
                                list[dist.ProcessGroup]]:
    """This pipeline's frame group and pair groups, made by every rank of the job alike.

    torch names a new group after how many groups the process made before, so a group made by
    some ranks only (a pair) would get different names on different ranks and hang. Instead
    every rank learns every pipeline's members (all pipelines of a data-parallel job are built
    together) and every rank makes every group, in one order. The last item: every group made.
    """
    world = dist.get_world_size()
    mine = torch.full((world,), -1, dtype=torch.int64, device=collective_device(device))
    mine[:len(members)] = torch.tensor(members)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    layouts = sorted({tuple(int(r) for r in t.tolist() if r >= 0) for t in gathered})
    frames: dist.ProcessGroup | None = None
    pairs: dict[tuple[int, int], dist.ProcessGroup] = {}
    me = dist.get_rank()
    every: list[dist.ProcessGroup] = []
    for ranks in layouts:
        made = dist.new_group(list(ranks), backend="gloo")
        every.append(made)
        if list(ranks) == members:
            frames = made
        for a, ra in enumerate(ranks):
            for b, rb in enumerate(ranks):
                if a != b:
                    pg = dist.new_group([ra, rb])
                    every.append(pg)
                    if list(ranks) == members and me in (ra, rb):
                        pairs[(a, b)] = pg
    if frames is None:
        raise CommError(f"rank {me}: its pipeline group {members} is missing from the job's")
    return frames, pairs, every


def release(groups: Sequence[dist.ProcessGroup]) -> None:
    """End groups a pipeline made (a local call: torch's ``destroy_process_group`` of each)."""
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # the job's default group is gone already
            continue


def collective_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")
