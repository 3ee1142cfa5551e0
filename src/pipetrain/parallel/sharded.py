"""Sharded stages: FSDP2 over a pipeline's layers, their gradients reduce-scattered once a step.

Each layer with parameters of each stage this rank holds (and, by default, each large part of
it) is ``fully_shard``-ed over a 1-D device mesh (the ranks that hold the same stages in
different data shards). Gradients are never reduced per micro-batch: told not to, FSDP2
accumulates every micro-batch's whole gradients on the gathered parameters, and when a stage's
gradients are final (the pipeline's ``on_grads_ready``, after its last W or B) its layers'
gradients are reduce-scattered to their shards (the mean over the mesh), once a step.

The weights are gathered for each use and resharded after it (``reshard``, default): FSDP2's
own hooks gather a layer for each F and for each I or B, and a split backward's W, deferred
past other micro-batches' work, has its layers gathered again by :meth:`ShardedStages.gather`
(the pipeline calls it, see :class:`pipetrain.parallel.parallelize.Gathering`). So a rank holds its
weights' shards, one layer (or part) gathered at a time, the step's whole gradients and the
optimizer state's shards::

    mesh = init_device_mesh("cpu", (shards, pp), mesh_dim_names=("dp_shard", "pp"))
    sharded = ShardedStages(mesh["dp_shard"])
    pipe = Pipeline(model, "zb-h1", 8, loss_fn, group=mesh["pp"].get_group(),
                    parallelize=sharded)
    pipe.step(x, y, on_grads_ready=sharded.reduce)
    sharded.finish()                  # every stage reduced; .grad are the mean's shards
    optimizer.step()                  # on the sharded (DTensor) parameters

This is what torch.distributed.pipelining's stages do for FSDP2 (no gradient sync during the
schedule, a reduction after the last backward); FSDP2 has no public call for "reduce now",
so :func:`_reduce` reaches into its state, and only there. On CPU nothing overlaps a
collective, so FSDP2's backward prefetch (one more layer gathered early) is turned off there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipetrain.errors import PartitionError, PipelineError
from pipetrain.parallel import RESHARD
from pipetrain.runtime.dtensors import strided_on
from pipetrain.runtime.torch_distributed import (
    fsdp_param_groups,
    fsdp_state,
    group_params,
    post_backward,
    root_post_backward_final_callback,
    sharded_param,
    unsharded_param,
)

__all__ = ["RESHARD", "ShardedStages", "unit_bytes"]


class ShardedStages:
    """FSDP2 on a pipeline's stages (see the module docstring); pass it as ``parallelize``.

    Args:
        mesh: the 1-D mesh of the ranks that shard each layer among themselves, or a 2-D
            ``(replicate, shard)`` mesh: replicas of the sharded layers (HSDP), whose
            reduction all-reduces the shards' gradients over the replicas too.
        reshard: how long gathered weights live, trading memory for all-gathers.
            ``"step"``: from a layer's first forward to its stage's reduction (ZeRO-2: the
            stage's whole weights held, the fewest collectives). ``"layer"`` (default): only
            while a layer computes, each F, I, B and W of each micro-batch gathering it again
            (ZeRO-3). ``"part"``: the same per part of a layer, each submodule holding at
            least 1/16 of the layer's weights itself (a block's projections) gathered on its
            own, so the largest transient is a part, not a layer (the most collectives). Only
            for layers whose parts run as modules: one that reads a part's weight directly
            (``F.linear(x, self.proj.weight)``) would meet it sharded (in a traced layer only
            the parts its graph calls are taken).

    Example: 4 processes, pipelines of 2 ranks, each stage sharded over 2 (``tests/
    test_sharded_dist.py`` runs this)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "pp"))
        pipe = pt.Pipeline(layers, "1f1b", 8, loss_fn, group=mesh.get_group("pp"),
                           parallelize=pt.parallel.ShardedStages(mesh["fsdp"]))
        pipe.step(x, y)  # each stage's gradients reduce-scattered over its fsdp group
    """

    def __init__(self, mesh: DeviceMesh, reshard: str = "layer") -> None:
        if mesh.ndim not in (1, 2):
            raise ValueError(f"ShardedStages needs a 1-D mesh (the shard dimension) or a 2-D "
                             f"one (replicate, shard: HSDP), got {mesh.ndim} dimensions "
                             f"{mesh.mesh_dim_names}; pass mesh[name] or mesh[name, name]")
        if reshard not in RESHARD:
            raise ValueError(f"reshard must be one of {', '.join(RESHARD)}, got {reshard!r}")
        self.mesh = mesh
        self.reshard = reshard != "step"
        self.split = reshard == "part"
        self.modules: dict[int, list[Any]] = {}  # per stage its sharded layers
        self._units: dict[int, list[FSDPModule]] = {}  # and every unit in them
        self._reduced: set[int] = set()
        self._sharded: dict[int, Any] = {}  # id(sharded parameter) -> its FSDPParam
        self._owner: dict[int, FSDPModule] = {}  # id(gathered parameter) -> its layer
        self._gathered: list[FSDPModule] = []  # what gather() gathered for the running W
        self.ignored: list[nn.Parameter] = []
        """Parameters left whole to another hook (expert-parallel experts: spread over
        ranks already, their gradients reduced by the trainer)."""

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        """Shard ``stage``'s layers that have parameters (the ``parallelize`` hook).

        Raises:
            PartitionError: when two of the layers share a weight (an embedding and its tied
                head in one stage): FSDP2 would shard it twice, untying it.
        """
        _refuse_sharing(stage, layers)
        _refuse_sharded(stage, layers, self._sharded)
        roots, units = [], []
        for layer in layers:
            if not any(True for _ in layer.parameters()):
                continue
            for part in _big_parts(layer) if self.split else []:
                units.append(self._shard(part))
            root = self._shard(layer)
            self._hold(root, True)  # the layer, and so its parts
            units.append(root)
            roots.append(root)
        self.modules[stage], self._units[stage] = roots, units

    def _shard(self, module: nn.Module) -> Any:
        """``fully_shard`` one unit."""
        held = {id(p) for p in module.parameters()}
        ignored = {p for p in self.ignored if id(p) in held} or None
        unit: Any = fully_shard(module, mesh=self.mesh, reshard_after_forward=self.reshard,
                                shard_placement_fn=_placement, ignored_params=ignored)
        if self.mesh.device_type == "cpu":  # no overlap to win: prefetch nothing
            unit.set_modules_to_backward_prefetch([unit])
        for param in _fsdp_params(unit):
            self._sharded[id(sharded_param(param))] = param
        return unit

    def gathered(self, param: nn.Parameter) -> nn.Parameter:
        """The gathered parameter a step's gradients of sharded ``param`` accumulate in."""
        owner = self._sharded.get(id(param))
        gathered = None if owner is None else unsharded_param(owner)
        if gathered is None:
            return param  # not sharded, gathered already, or never gathered yet
        return gathered

    def gather(self, weights: Sequence[torch.Tensor]) -> None:
        """Gather the layers of ``weights`` for a W, resharding the ones gathered before."""
        if not self.reshard:
            return
        if any(id(w) not in self._owner for w in weights):
            self._learn_owners()
        wanted = list({id(m): m for w in weights if (m := self._owner.get(id(w)))}.values())
        for module in self._gathered:
            if module not in wanted:
                module.reshard()
        for module in wanted:
            module.unshard()
        self._gathered = wanted

    def release(self) -> None:
        """Reshard the layers :meth:`gather` gathered."""
        for module in self._gathered:
            module.reshard()
        self._gathered = []

    def _learn_owners(self) -> None:
        for units in self._units.values():
            for module in units:
                for param in _fsdp_params(module):
                    gathered = unsharded_param(param)
                    if gathered is not None:
                        self._owner[id(gathered)] = module

    def reduce(self, stage: int) -> None:
        """Reduce-scatter ``stage``'s gradients and reshard its layers (``on_grads_ready``)."""
        if stage in self._reduced:
            return
        self._reduced.add(stage)
        for module in self._units.get(stage, []):
            self._hold(module, False)
            _reduce(module)

    def finish(self) -> None:
        """Reduce the stages not reduced yet, end FSDP2's backward, and hold the layers
        unsharded again for the next step (call on every rank after each step)."""
        for stage in sorted(self.modules):
            self.reduce(stage)
        for modules in self.modules.values():
            for module in modules:
                root_post_backward_final_callback(fsdp_state(module))
                self._hold(module, True)
        self._reduced.clear()

    def _hold(self, module: FSDPModule, hold: bool) -> None:
        """Keep ``module``'s gradients unreduced (``hold``; and its weights gathered unless
        resharding), or let FSDP2 reduce and reshard at its next post-backward."""
        module.set_requires_gradient_sync(not hold)
        module.set_reshard_after_backward(not hold or self.reshard)
        module.set_is_last_backward(not hold)


def _refuse_sharing(stage: int, layers: list[nn.Module]) -> None:
    owner: dict[int, int] = {}
    for k, layer in enumerate(layers):
        for p in layer.parameters():
            first = owner.setdefault(id(p), k)
            if first != k:
                raise PartitionError(
                    f"stage {stage}: its layers {first} and {k} share a weight (of shape "
                    f"{tuple(p.shape)}), which sharding each layer would untie; place them in "
                    "different stages (more pipeline ranks, or another balance), or untie it")


def _refuse_sharded(stage: int, layers: list[nn.Module], sharded: dict[int, Any]) -> None:
    """Refuse layers holding a weight sharded already: a module that another stage of this
    process shares (FSDP2 cannot shard one module twice)."""
    for k, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if id(p) in sharded:
                raise PartitionError(
                    f"stage {stage}: its layer {k} holds {name!r} (of shape {tuple(p.shape)}), "
                    "which another stage of this process sharded already: the two stages share "
                    "a module, which FSDP2 cannot shard twice. Tie the weight, not the module "
                    "(head.weight = embedding.weight), or place the stages on different ranks")


def unit_bytes(layer: nn.Module) -> tuple[int, ...]:
    """The parameter bytes of ``layer``'s FSDP2 units under reshard "part": each large part
    (gathered on its own), then the rest of the layer (gathered with the layer's root)."""
    parts = _big_parts(layer)
    inside = {id(p) for m in parts for p in m.parameters()}
    rest = sum(p.numel() * p.element_size() for p in layer.parameters() if id(p) not in inside)
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in parts]
    return (*sizes, rest)


def _big_parts(layer: nn.Module) -> list[nn.Module]:
    """The submodules of ``layer`` that hold at least 1/16 of its parameters themselves, and
    whose forward runs (in a traced layer, those its graph calls: it may read a weight of
    another submodule directly, which FSDP2 would never gather)."""
    total = sum(p.numel() for p in layer.parameters())
    called = _called(layer)
    return [m for m in layer.modules() if m is not layer and (called is None or m in called)
            and 16 * sum(p.numel() for p in m.parameters(recurse=False)) >= total]


def _called(layer: nn.Module) -> set[nn.Module] | None:
    """The submodules of ``layer`` that run as modules: in a traced (fx) graph, those it
    calls, all the way down (it may read a weight of another submodule directly); outside any
    graph (an image-text model's eager prefix beside its graph), every one. None for a layer
    without graphs (its parts are taken to run as modules)."""
    graphs = [m for m in layer.modules() if isinstance(m, fx.GraphModule)]
    if not graphs:
        return None
    inside = {m for g in graphs for m in g.modules()}
    found = {m for m in layer.modules() if m not in inside}
    nested = {c for g in graphs for c in g.modules() if c is not g}
    todo = [g for g in graphs if g not in nested]  # the outermost graphs
    found.update(todo)
    while todo:
        graph_module = todo.pop()
        for node in graph_module.graph.nodes:
            if node.op == "call_module":
                module = graph_module.get_submodule(str(node.target))
                found.add(module)
                if isinstance(module, fx.GraphModule):
                    todo.append(module)
    return found


def _placement(param: nn.Parameter) -> Any:
    """FSDP2's shard dimension of ``param``: dim 1 for a matrix that tensor parallelism split
    in strides along dim 0 (a fused q, k, v), whose halves of slices DTensor cannot describe
    (its whole value would come out wrong); FSDP2's own choice (dim 0) otherwise."""
    placements = getattr(param, "placements", ())
    if param.ndim >= 2 and any(strided_on(p) == 0 for p in placements):
        from torch.distributed.tensor import Shard

        return Shard(1)
    return None


def _fsdp_params(module: FSDPModule) -> list[Any]:
    """FSDP2's records of ``module``'s parameters (sharded and gathered tensors)."""
    return [p for group in _param_groups(module) for p in group_params(group)]


def _reduce(module: FSDPModule) -> None:
    """Run FSDP2's post-backward of ``module``'s parameter groups now."""
    for group in _param_groups(module):
        post_backward(group)


def _param_groups(module: FSDPModule) -> list[Any]:
    """FSDP2's parameter groups of ``module`` (its private state: see the module docstring)."""
    try:
        groups = fsdp_param_groups(fsdp_state(module))
    except AttributeError as e:
        raise PipelineError(f"this torch's FSDP2 has no per-module parameter groups ({e}); "
                            "ShardedStages is written against torch 2.13") from None
    return groups
