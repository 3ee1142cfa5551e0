"""Sharded stages: FSDP2 over a pipeline's layers, their gradients reduce-scattered once a step.

Each layer with parameters of each stage this rank holds is ``fully_shard``-ed over a 1-D
device mesh (the ranks that hold the same stages in different data shards). Within a step the
layers stay unsharded: FSDP2 gathers a layer's parameters at its first forward and, told not
to, neither reshards nor reduces after a forward or a backward, so every micro-batch's F, B, I
and W work on the gathered parameters and accumulate whole gradients, and a split backward's
W finds the very parameters the graph used. When a stage's gradients are final (the
pipeline's ``on_grads_ready``, after its last W or B) its layers' gradients are
reduce-scattered to their shards (the mean over the mesh) and the layers resharded::

    mesh = init_device_mesh("cpu", (shards, pp), mesh_dim_names=("dp_shard", "pp"))
    sharded = ShardedStages(mesh["dp_shard"])
    pipe = Pipeline(model, "zb-h1", 8, loss_fn, group=mesh["pp"].get_group(),
                    parallelize=sharded)
    pipe.step(x, y, on_grads_ready=sharded.reduce)
    sharded.finish()                  # every stage reduced; .grad are the mean's shards
    optimizer.step()                  # on the sharded (DTensor) parameters

This is what torch.distributed.pipelining's stages do for FSDP2 (no gradient sync during the
schedule, a reduction after the last backward); FSDP2 has no public call for "reduce now",
so :func:`_reduce` reaches into its state, and only there.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipetrain.errors import PipelineError

__all__ = ["ShardedStages"]


class ShardedStages:
    """FSDP2 on a pipeline's stages (see the module docstring); pass it as ``parallelize``.

    Args:
        mesh: the 1-D mesh of the ranks that shard each layer among themselves.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"ShardedStages needs a 1-D mesh (the shard dimension), got "
                             f"{mesh.ndim} dimensions {mesh.mesh_dim_names}; pass mesh[name]")
        self.mesh = mesh
        self.modules: dict[int, list[FSDPModule]] = {}
        self._reduced: set[int] = set()

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        """Shard ``stage``'s layers that have parameters (the ``parallelize`` hook)."""
        wrapped = []
        for layer in layers:
            if any(True for _ in layer.parameters()):
                module: Any = fully_shard(layer, mesh=self.mesh, reshard_after_forward=False)
                _hold(module, True)
                wrapped.append(module)
        self.modules[stage] = wrapped

    def reduce(self, stage: int) -> None:
        """Reduce-scatter ``stage``'s gradients and reshard its layers (``on_grads_ready``)."""
        if stage in self._reduced:
            return
        self._reduced.add(stage)
        for module in self.modules.get(stage, []):
            _hold(module, False)
            _reduce(module)

    def finish(self) -> None:
        """Reduce the stages not reduced yet, end FSDP2's backward, and hold the layers
        unsharded again for the next step (call on every rank after each step)."""
        for stage in sorted(self.modules):
            self.reduce(stage)
        for modules in self.modules.values():
            for module in modules:
                state: Any = fully_shard.state(module)  # type: ignore[attr-defined]
                state._root_post_backward_final_callback()
                _hold(module, True)
        self._reduced.clear()


def _hold(module: FSDPModule, hold: bool) -> None:
    """Keep ``module`` gathered, gradients unreduced (``hold``), or let FSDP2 reduce and
    reshard at its next post-backward."""
    module.set_requires_gradient_sync(not hold)
    module.set_reshard_after_backward(not hold)
    module.set_is_last_backward(not hold)


def _reduce(module: FSDPModule) -> None:
    """Run FSDP2's post-backward of ``module``'s parameter groups now."""
    try:
        state: Any = fully_shard.state(module)  # type: ignore[attr-defined]
        groups = state._fsdp_param_groups
    except AttributeError as e:
        raise PipelineError(f"this torch's FSDP2 has no per-module parameter groups ({e}); "
                            "ShardedStages is written against torch 2.13") from None
    for group in groups:
        group.post_backward()
