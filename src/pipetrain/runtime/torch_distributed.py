"""Private torch.distributed: every internal of torch.distributed that pipetrain reaches.

The twin of :mod:`pipetrain.runtime.torch_private` (which holds the rest of torch, and the
:class:`~pipetrain.runtime.torch_private.Dependency` records): no other module of pipetrain
reaches into torch.distributed's private names, each dependency is a name here and an entry
of :data:`DEPENDENCIES`, which ``tests/test_torch_private.py`` resolves on the installed torch.
Importing this module imports nothing torch has not imported at ``import pipetrain`` already:
FSDP2, DTensor's tensor parallelism and its placements are imported at the first call of what
reaches them.

The table, one row per dependency: the symbol, the name pipetrain reaches it by, what it uses
it for, the public alternative considered and why it does not serve, and the torch versions
it was checked on.

- ``torch.distributed.distributed_c10d._get_default_store``: :func:`default_store`. Use: the
  default group's store, which holds the watchdog's probes and the job's failure news
  (``runtime/failure/watchdog.py``), the rendezvous of the twin groups
  (``runtime/transport/groups.py``) and rank 0's shared capture (``split/shared_capture.py``).
  Public: none; a job started with ``env://`` (torchrun, ``init_process_group()``) has no other
  handle on its store. Checked: 2.13.
- ``torch.distributed.Store``, ``torch.distributed.TCPStore`` and
  ``torch.distributed.PrefixStore``: :data:`Store`, :data:`TCPStore`, :data:`PrefixStore`. Not
  private by name: documented, but ``torch.distributed`` imports them without re-exporting
  them to a type checker (mypy: not exported), so one ``type: ignore`` here serves every user.
  Use: the loopback store of a local launch (``runtime/launch.py``), the worker's store and
  each attempt's prefix (``train/launch/elastic.py``), the replicas' store
  (``train/launch/replicas.py``), the twin groups' keys and the store that counts what they
  wrote (``runtime/transport/groups.py``). Public: these are the public names;
  ``torch._C._distributed_c10d`` types them, privately. Checked: 2.13.
- ``torch.distributed.fsdp.fully_shard.state``: :func:`fsdp_state`. Undocumented (the
  ``contract`` decorator sets it). Use: a sharded module's FSDP2 state
  (``parallel/sharded.py``). Public: ``FSDPModule``'s methods set its flags but never hand out
  the state. Checked: 2.13.
- ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._fsdp_param_groups``:
  :func:`fsdp_param_groups`. Use: ``ShardedStages`` reduce-scatters a stage's gradients once a
  step, when the pipeline says they are final. Public: FSDP2 has no "reduce now";
  ``torch.distributed.pipelining``'s stage reaches the same groups. Checked: 2.13.
- ``torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState._root_post_backward_final_callback``:
  :func:`root_post_backward_final_callback`. Use: ends FSDP2's backward after the schedule's
  last one (``ShardedStages.finish``). Public: none; ``torch.distributed.pipelining``'s stage
  calls the same. Checked: 2.13.
- ``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.fsdp_params`` and
  ``torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPParamGroup.post_backward``:
  :func:`group_params`, :func:`post_backward`. Public names of a private class: a group's
  parameters, and its reduce-scatter now. Public: none, as above. Checked: 2.13.
- ``torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam.sharded_param`` and
  ``torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._unsharded_param``:
  :func:`sharded_param`, :func:`unsharded_param`. Use: which record holds a sharded
  parameter, and the gathered parameter a step's gradients accumulate in (a deferred W gathers
  its layers again). Public: ``FSDPModule.unshard()`` gathers but does not say into which
  tensor. Checked: 2.13.
- ``torch.distributed.tensor.parallel.ColwiseParallel._prepare_input_fn``:
  :func:`colwise_prepare_input_fn`. Use: ``FusedColwise`` (``parallel/tensor_parallel.py``)
  lays its input out as a column-wise split does. Public: ``ColwiseParallel`` itself cannot
  split a fused projection per part; a copy of its hook would fork torch's. Checked: 2.13.
- ``torch.distributed.tensor.parallel.style.ParallelStyle._apply``: no accessor, overridden by
  ``FusedColwise``: the method ``parallelize_module`` calls on a style. Public: none; a style
  of one's own is this method. Checked: 2.13.
- ``torch.distributed.tensor.placement_types._StridedShard``: :func:`strided_shard`,
  :func:`is_strided_shard`. Use: ``FusedColwise`` gives each rank its slice of each part of a
  fused q, k, v weight, which ``runtime/dtensors.py`` then tells apart (DCP cannot describe
  it; FSDP2 shards such a weight along its other dimension). Public: ``Shard`` splits the
  rows contiguously, not per part. Checked: 2.13.
- ``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING``,
  ``torch.distributed.checkpoint.filesystem._StorageInfo`` and
  ``torch.serialization._get_layout``: :data:`DCP_PICKLED`. Use: globals DCP's ``.metadata``
  pickle names, which ``checkpoint/store.py``'s unpickler admits by name. Public:
  ``FileSystemReader.read_metadata`` unpickles any global, with no allow-list. Checked: 2.13.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed import (  # type: ignore[attr-defined]  # not exported
    PrefixStore,
    Store,
    TCPStore,
)

from pipetrain.runtime.torch_private import Dependency

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["DCP_PICKLED", "DEPENDENCIES", "PrefixStore", "Store", "TCPStore",
           "colwise_prepare_input_fn", "default_store", "fsdp_param_groups", "fsdp_state",
           "group_params", "is_strided_shard", "post_backward",
           "root_post_backward_final_callback", "sharded_param", "strided_shard",
           "unsharded_param"]


def default_store() -> Store:
    """The default process group's store (RuntimeError or ValueError when there is none)."""
    return dist.distributed_c10d._get_default_store()


# -- FSDP2 (imported at the first call) --------------------------------------------------------
def fsdp_state(module: FSDPModule | nn.Module) -> Any:
    """FSDP2's state of ``module``, which ``fully_shard`` sharded."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(module)  # type: ignore[attr-defined]


def fsdp_param_groups(state: Any) -> list[Any]:
    """The parameter groups of an FSDP2 state (AttributeError on a torch without them)."""
    groups: list[Any] = state._fsdp_param_groups
    return groups


def root_post_backward_final_callback(state: Any) -> None:
    """End FSDP2's backward of ``state``'s root."""
    state._root_post_backward_final_callback()


def group_params(group: Any) -> list[Any]:
    """The records (``FSDPParam``) of a parameter group's parameters."""
    params: list[Any] = group.fsdp_params
    return params


def post_backward(group: Any) -> None:
    """Run a parameter group's post-backward (its gradients' reduce-scatter) now."""
    group.post_backward()


def sharded_param(fsdp_param: Any) -> nn.Parameter:
    """The sharded parameter (a DTensor) of an ``FSDPParam``: the module's."""
    param: nn.Parameter = fsdp_param.sharded_param
    return param


def unsharded_param(fsdp_param: Any) -> nn.Parameter | None:
    """The gathered parameter of an ``FSDPParam``; None before its first all-gather (FSDP2
    makes it then, and keeps it)."""
    gathered: nn.Parameter | None = getattr(fsdp_param, "_unsharded_param", None)
    return gathered


# -- tensor parallelism (imported at the first call) -------------------------------------------
def colwise_prepare_input_fn(input_layouts: Any, desired_input_layouts: Any, mod: nn.Module,
                             inputs: Any, device_mesh: DeviceMesh) -> Any:
    """``ColwiseParallel._prepare_input_fn``: a column-wise split's input hook (the same
    arguments, the first two bound by ``functools.partial``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel._prepare_input_fn(  # type: ignore[no-untyped-call]
        input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def strided_shard(dim: int, split_factor: int) -> Placement:
    """``_StridedShard(dim, split_factor=split_factor)``: ``dim`` split as ``split_factor``
    parts, each rank taking its slice of each."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (told by its class's name: DTensor need not
    be imported)."""
    return type(placement).__name__ == "_StridedShard"


DCP_PICKLED = (("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("torch.serialization", "_get_layout"))
"""(module, name) of the private globals DCP's ``.metadata`` pickle names."""

_FSDP = "torch.distributed.fsdp._fully_shard."
DEPENDENCIES = (
    Dependency("torch.distributed.distributed_c10d", "_get_default_store"),
    Dependency("torch.distributed", "Store"),
    Dependency("torch.distributed", "TCPStore"),
    Dependency("torch.distributed", "PrefixStore"),
    Dependency("torch.distributed.fsdp", "fully_shard.state"),
    Dependency(_FSDP + "_fsdp_state", "FSDPState._fsdp_param_groups"),
    Dependency(_FSDP + "_fsdp_state", "FSDPState._root_post_backward_final_callback"),
    Dependency(_FSDP + "_fsdp_param_group", "FSDPParamGroup.fsdp_params"),
    Dependency(_FSDP + "_fsdp_param_group", "FSDPParamGroup.post_backward"),
    Dependency(_FSDP + "_fsdp_param", "FSDPParam.sharded_param"),
    Dependency(_FSDP + "_fsdp_param", "FSDPParam._unsharded_param"),
    Dependency("torch.distributed.tensor.parallel", "ColwiseParallel._prepare_input_fn"),
    Dependency("torch.distributed.tensor.parallel.style", "ParallelStyle._apply"),
    Dependency("torch.distributed.tensor.placement_types", "_StridedShard"),
    *(Dependency(module, name) for module, name in DCP_PICKLED),
)
"""What this module reaches in torch.distributed (the table's rows, one entry per symbol)."""
