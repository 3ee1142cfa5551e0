"""Replicas: fault-tolerant data parallelism over whole pipelines, through torchft (``--ft``).

Each replica is a whole pipeline (its pp x fsdp x tp ranks), a torch.distributed world of its
own started and restarted by its own elastic agent, and one torchft replica group: every rank
runs a ``torchft.Manager`` (the replica's group rank 0 hosts its server, which talks to the
Lighthouse). Group rank ``g`` of each replica averages its gradients with group rank ``g`` of
the others over torchft's managed process group, which is formed again whenever a replica
leaves or joins. One step under ``--ft`` (markers as in :mod:`pipetrain.train.loop`)::

    [0]  start_quorum         who takes part (the Lighthouse); a replica behind the others, a
                              restarted one, loads a healthy one's state here (weights,
                              optimizer, RNG, step: the step is the data position), before its
                              forwards; a process's first quorum waits for all dp replicas
    [2]  pipe.step            as without --ft, this replica's rows of the batch
    [3]  in-replica reduction FSDP2's and tensor parallel's (inside a replica dp is 1)
    [3'] average_             gradients summed over the participants, divided by their number
    [3"] turnout              the loss summed, who took part, who loaded whose state
    [5'] should_commit        every rank of every participant says its step held; if one did
                              not (a peer died mid-step), nobody steps and the step runs again
    [7]  optimizer step       only on commit

A replica that fails is restarted by its agent and rejoins at the next quorum; the others lose
the step in flight (run again) and the time torchft takes to see the failure (a dead peer's
socket closes at once; a hung one is waited for up to ``--timeout``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime.dtensors import local_shard
from pipetrain.train.config import TrainConfig
from pipetrain.train.mesh import BUCKET_BYTES, Mesh

__all__ = ["Replicas", "Turnout", "changes", "require_torchft", "replica_out", "lighthouse_url",
           "reach"]

INSTALL = "pip install torchft (or pipetrain's extra: pip install \"pipetrain[ft]\")"
"""What to run when torchft is missing."""


def require_torchft() -> None:
    """Raise unless torchft can be imported.

    Raises:
        ValueError: saying how to install it.
    """
    if importlib.util.find_spec("torchft") is None:
        raise ValueError(f"--ft runs on torchft, which is not installed: {INSTALL}")


def lighthouse_url(address: str) -> str:
    """``HOST:PORT`` or ``http://HOST:PORT`` as the URL torchft takes.

    Raises:
        ValueError: without a port.
    """
    url = address if "://" in address else f"http://{address}"
    host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ft-lighthouse {address!r}: give HOST:PORT (the port the "
                         "Lighthouse listens on, torchft_lighthouse's --bind; 29510 by default)")
    return url.rstrip("/")


def reach(url: str, timeout: float) -> None:
    """Wait until the Lighthouse at ``url`` accepts a connection (it may start a moment after
    the replicas).

    Raises:
        ValueError: nothing answered within ``timeout`` seconds; says how to start one.
    """
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"--ft-lighthouse {url}: no Lighthouse answered within --timeout "
                    f"{timeout:g} s ({e}); start one first, e.g. torchft_lighthouse "
                    "--min_replicas 1 --join_timeout_ms 10000 on that host") from None
            time.sleep(0.5)


def replica_out(out: str, replica: int) -> str:
    """Where replica ``replica`` writes (its logs, summary and checkpoints) under ``out``."""
    return os.path.join(out, f"replica-{replica}") if out else ""


@dataclass(frozen=True)
class Turnout:
    """What a step's participants said of themselves."""

    loss: float
    """The mean of their losses."""
    members: tuple[int, ...]
    """The replicas that took part."""
    healed: dict[int, int]
    """Replicas that loaded another's state at this step's quorum: replica -> the source."""


def changes(before: tuple[int, ...], said: Turnout, step: int
            ) -> list[tuple[str, dict[str, Any]]]:
    """The ``replica_left`` and ``replica_joined`` records of a step whose turnout is ``said``
    after ``before`` took part in the one before."""
    left = [("replica_left", {"replica": r, "step": step})
            for r in sorted(set(before) - set(said.members))]
    return left + [("replica_joined", {"replica": r, "step": step,
                                       "recovered_from": said.healed.get(r)})
                   for r in sorted(set(said.members) - set(before))]


class Replicas:
    """This rank's torchft Manager and what a step asks of it (the module's diagram).

    Args:
        cfg: the run (``dp`` replicas, ``ft_lighthouse``, ``ft_min_replicas``, ``timeout``).
        mesh: this rank's place in its replica (dp 1 inside).
        replica: this replica's id, 0 .. dp-1.
    """

    def __init__(self, cfg: TrainConfig, mesh: Mesh, replica: int) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        self.count, self.replica, self.rank = cfg.dp, replica, mesh.rank
        self.timeout = cfg.timeout
        self._device = mesh.device
        self._stack = contextlib.ExitStack()
        host, port = _attempt_store(mesh, self._stack)
        wait = timedelta(seconds=cfg.timeout)
        pg = (ProcessGroupNCCL(timeout=wait) if mesh.device.type == "cuda"
              else ProcessGroupGloo(timeout=wait))
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        warnings.filterwarnings("ignore", category=FutureWarning, module="torchft")
        transport = PGTransport(pg, timeout=wait, device=self._comm_device())
        self._pg = pg
        self.manager = Manager(
            pg=pg, load_state_dict=None, state_dict=None,
            min_replica_size=cfg.ft_min_replicas, use_async_quorum=False, timeout=wait,
            quorum_timeout=wait, connect_timeout=wait, rank=mesh.rank, world_size=mesh.world,
            store_addr=host, store_port=port, lighthouse_addr=lighthouse_url(cfg.ft_lighthouse),
            replica_id=f"pipetrain_{replica}", hostname=host, init_sync=False,
            checkpoint_transport=transport)
        self.healed_from: int | None = None
        """The replica whose state this one loaded at the last quorum, if it did."""
        self.said: Turnout | None = None
        """The last step's :meth:`turnout`."""
        self._first = True
        self._load: Callable[[dict[str, Any]], None] | None = None

    def serve(self, state: Callable[[], dict[str, Any]],
              load: Callable[[dict[str, Any]], None], step: int) -> None:
        """Give torchft this rank's state (sent to a recovering peer) and how to load a
        peer's; ``step``: where this replica stands (its checkpoint's, or 0)."""
        self._load = load
        self.manager.register_state_dict_fn(
            "pipetrain", self._loaded, lambda: {"replica": self.replica, **state()})
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def _loaded(self, state: dict[str, Any]) -> None:
        self.healed_from = int(state["replica"])
        if self._load is not None:
            self._load(state)

    def start(self) -> None:
        """[0]: the step's quorum. A process's first quorum, unless it loads a peer's state,
        waits until all ``dp`` replicas take part (so that a job starts with all of them).

        Raises:
            TimeoutError: not every replica joined within ``--timeout`` (naming how many did).
        """
        self.healed_from, self.said = None, None
        deadline = time.monotonic() + self.timeout
        while True:
            self.manager.start_quorum()
            n = self.manager.num_participants()
            if not self._first or self.healed_from is not None or n >= self.count:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"[rank {self.rank}] replica {self.replica}: {n} of {self.count} replicas "
                    f"joined within --timeout {self.timeout:g} s; start every replica (one "
                    "torchrun each, --ft-replica-id 0 .. dp-1) against the same Lighthouse")
            self.manager.report_error(RuntimeError("waiting for every replica"))
            self.manager.should_commit()  # the step does not count: ask again
            time.sleep(0.2)
        self._first = False

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """[3']: each tensor (a gradient, or its local shard) becomes the mean over the
        participants; flattened into buckets of about ``BUCKET_BYTES``."""
        for bucket in _buckets([local_shard(t) for t in tensors]):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in bucket:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def turnout(self, loss: float) -> Turnout:
        """[3'']: the participants' mean loss, who they are, and who loaded whose state (also
        kept as :attr:`said`)."""
        r, n = self.replica, self.count
        said = torch.zeros(1 + 2 * n, dtype=torch.float64, device=self._comm_device())
        said[0], said[1 + r] = loss, 1.0
        if self.healed_from is not None:
            said[1 + n + r] = self.healed_from + 1
        self.manager.allreduce(said, reduce_op=dist.ReduceOp.SUM).wait()
        said = said.cpu()
        members = tuple(i for i in range(n) if said[1 + i] > 0.5)
        healed = {i: int(said[1 + n + i]) - 1 for i in members if said[1 + n + i] > 0.5}
        self.said = Turnout(float(said[0]) / max(len(members), 1), members, healed)
        return self.said

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the last quorum's participants (an eval loss); this
        replica's own when that quorum has broken up since."""
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        self.manager.allreduce(t).wait()
        return float(t[0]) if self.manager.errored() is None else value

    def commit(self) -> bool:
        """[5']: whether every participant's step held (call on every rank of the replica)."""
        return bool(self.manager.should_commit())

    def same_everywhere(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether every participating replica holds these tensors bitwise alike (a digest
        compared with a max and a min over the replicas; one quorum of its own)."""
        digest = hashlib.blake2b(digest_size=7)
        for t in tensors:
            digest.update(bytes(local_shard(t).detach().cpu().reshape(-1).view(torch.uint8)
                                .numpy()))
        value = int.from_bytes(digest.digest(), "little")
        self.manager.start_quorum()
        high = torch.tensor([value, -value], dtype=torch.int64, device=self._comm_device())
        self.manager.allreduce(high, reduce_op=dist.ReduceOp.MAX).wait()
        return int(high[0]) == value and int(high[1]) == -value

    def close(self) -> None:
        """Stop the Manager (its quorum thread joined, its server and transport stopped),
        drop torchft's process group now rather than at the interpreter's exit (whose
        teardown order is not the threads'), and close the attempt's store."""
        with contextlib.suppress(Exception):
            self.manager.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self._pg.shutdown()
        self._stack.close()

    def _comm_device(self) -> torch.device:
        return self._device if self._device.type == "cuda" else torch.device("cpu")


def _attempt_store(mesh: Mesh, stack: contextlib.ExitStack) -> tuple[str, int]:
    """A TCPStore for this restart attempt's Managers, hosted by the replica's rank 0 (a
    restarted replica must not read the keys of the attempt before it); (host, port)."""
    from pipetrain.runtime.torch_distributed import TCPStore

    local = os.environ.get("PIPETRAIN_LAUNCHER") == "local"
    said: list[Any] = [None]
    if mesh.rank == 0:
        if local:
            from pipetrain.runtime.launch import loopback_store

            said = [("127.0.0.1", stack.enter_context(loopback_store()))]
        else:
            store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
            stack.callback(lambda: store)  # held for the run
            said = [(socket.gethostname(), int(store.port))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(said, src=0)
    host, port = said[0]
    return str(host), int(port)


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, about ``BUCKET_BYTES`` a bucket."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        last = out[-1] if out else None
        if (last is None or size + t.numel() * t.element_size() > BUCKET_BYTES
                or last[0].dtype != t.dtype or last[0].device != t.device):
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.numel() * t.element_size()
    return out
