"""Tensor parallel: each layer's large matrices split across the ranks of a mesh (DTensor).

:class:`TensorParallel` is a ``Pipeline(parallelize=...)`` hook that applies torch's
``parallelize_module`` to each layer of each stage the rank holds, with a plan of module
paths inside the layer (``"attn.qkv"``, ``"mlp.0"``) to parallel styles. The default plan is
the Megatron split of a transformer block (Shoeybi et al., "Megatron-LM", 2019, section 3)
for pipetrain's GPT:

    attention:  x ──► qkv  column-wise: each rank computes the q, k, v of its own heads
                      attention over those heads, locally
                      proj row-wise: partial sums, all-reduced ──► x'
    MLP:        x ──► mlp.0 column-wise: each rank its slice of the hidden units
                      GELU, locally
                      mlp.2 row-wise: partial sums, all-reduced ──► x'

so a block costs two all-reduces forward and two backward, and its matrices, their gradients
and optimizer state are split ``tp`` ways. The fused ``qkv`` matrix stacks q, k and v, so it
is split as three (``_StridedShard``, each rank taking its slice of each): a plain row split
would hand one rank all of q; its bias stays whole (DTensor takes each rank's slices of it in
the addition, and sums its gradient back), so FSDP2 can shard it further. Everything else
(embeddings, layer norms, the head) is replicated: every rank of the mesh computes it on the
same input and so holds the same gradient. Between layers activations are whole (no sequence
parallelism yet), so each rank of a stage sends its own copy to the same tensor-parallel rank
of the next stage.

Tensors split this way are DTensors: the optimizer steps their local slices, and
:mod:`pipetrain.checkpoint` saves them as whole tensors, so a checkpoint resumes at any
layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Replicate, _StridedShard

__all__ = ["FusedColwise", "GPT_PLAN", "TensorParallel"]


class FusedColwise(ParallelStyle):
    """Column-wise split of a Linear whose output stacks ``parts`` equal matrices (a fused
    q, k, v projection): each rank gets its slice of each part, and returns its local output
    (its slices side by side, ``parts`` of them)."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwise splits an nn.Linear, got {type(module).__name__}")
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = (_StridedShard(0, split_factor=self.parts) if param.ndim > 1
                         else Replicate())  # a bias: whole (DTensor slices it in the add)
            split = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(split, param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        prepare = partial(ColwiseParallel._prepare_input_fn, (Replicate(),), (Replicate(),))
        out: nn.Module = distribute_module(module, device_mesh, self._partition, prepare,
                                           _local_output)
        return out


def _local_output(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


GPT_PLAN: Mapping[str, ParallelStyle] = {
    "attn.qkv": FusedColwise(3),
    "attn.proj": RowwiseParallel(),
    "mlp.0": ColwiseParallel(),
    "mlp.2": RowwiseParallel(),
}
"""The plan for :mod:`pipetrain.gpt`'s blocks (module paths inside a ``Block``)."""


class TensorParallel:
    """``parallelize_module`` on every layer of every stage (see the module docstring).

    Args:
        mesh: the 1-D mesh of the ranks that split each layer among themselves.
        plan: module path inside a layer -> parallel style; a layer holding none of the
            paths is left replicated. Default :data:`GPT_PLAN`.
    """

    def __init__(self, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle] | None = None) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"TensorParallel needs a 1-D mesh, got {mesh.ndim} dimensions "
                             f"{mesh.mesh_dim_names}; pass mesh[name]")
        self.mesh = mesh
        self.plan = dict(GPT_PLAN if plan is None else plan)
        self.split_layers = 0

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        """Split ``stage``'s layers by the plan (the ``parallelize`` hook)."""
        for layer in layers:
            paths = {name for name, _ in layer.named_modules()}
            mine = {path: style for path, style in self.plan.items() if path in paths}
            if mine:
                parallelize_module(layer, self.mesh, mine)
                self.split_layers += 1
