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
the addition), so FSDP2 can shard it further. Everything else (embeddings, layer norms, the
head) is replicated: every rank of the mesh computes it on the same input and so holds the
same gradient. Between layers activations are whole, so each rank of a stage sends its own
copy to the same tensor-parallel rank of the next stage; with ``sequence_parallel`` they are
split along the sequence instead (:func:`gpt_plan`), and each rank sends its slice.

A whole weight used in slices (the fused bias; the layer norms under sequence parallelism)
gets a partial sum of its gradient on each rank: :meth:`TensorParallel.finish`, once a step
before the optimizer, adds them up.

Tensors split this way are DTensors: the optimizer steps their local slices, and
:mod:`pipetrain.checkpoint.run` saves them as whole tensors, so a checkpoint resumes at any
layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from pipetrain.runtime.torch_distributed import colwise_prepare_input_fn, strided_shard

__all__ = ["FusedColwise", "GPT_PLAN", "Plan", "TensorParallel", "gpt_plan", "keep_slice",
           "local_layer", "traffic"]


class FusedColwise(ParallelStyle):
    """Column-wise split of a Linear whose output stacks ``parts`` equal matrices (a fused
    q, k, v projection): each rank gets its slice of each part, and returns its local output
    (its slices side by side, ``parts`` of them). ``input_layout``: how a plain input is
    split (``Shard(1)``: the sequence, under sequence parallelism), gathered first."""

    def __init__(self, parts: int, input_layout: Placement | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.input_layout = input_layout or Replicate()

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"FusedColwise splits an nn.Linear, got {type(module).__name__}")
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = (strided_shard(0, self.parts) if param.ndim > 1
                         else Replicate())  # a bias: whole (DTensor slices it in the add)
            split = distribute_tensor(param, mesh, [placement])
            module.register_parameter(pname, nn.Parameter(split, param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        prepare = partial(colwise_prepare_input_fn, (self.input_layout,), (Replicate(),))
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
"""The plan for :mod:`pipetrain.models.gpt`'s blocks (module paths inside a ``Block``)."""

Plan = Mapping[str, ParallelStyle] | Callable[[nn.Module], Mapping[str, ParallelStyle]]
"""Module paths inside a layer -> styles, or a function of the layer giving them (``""``: the
layer itself)."""


def gpt_plan(sequence_parallel: bool) -> Callable[[nn.Module], Mapping[str, ParallelStyle]]:
    """The plan of each layer of :mod:`pipetrain.models.gpt`; ``sequence_parallel``: between the
    split matrices activations are split along the sequence too (Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models", 2022): each block's layer norms
    and residual additions run on a slice of the positions, gathered before the column-wise
    matrices and reduce-scattered after the row-wise ones (an all-gather and a
    reduce-scatter where an all-reduce was), the embedding hands on its slice and the head
    gathers the positions back."""
    from pipetrain.models.gpt import Block, Embedding, Head

    seq = Shard(1)
    blocks: Mapping[str, ParallelStyle] = GPT_PLAN if not sequence_parallel else {
        "ln1": SequenceParallel(), "attn.qkv": FusedColwise(3, seq),
        "attn.proj": RowwiseParallel(output_layouts=seq), "ln2": SequenceParallel(),
        "mlp.0": ColwiseParallel(input_layouts=seq), "mlp.2": RowwiseParallel(output_layouts=seq)}

    def plan(layer: nn.Module) -> Mapping[str, ParallelStyle]:
        if isinstance(layer, Block):
            return blocks
        if sequence_parallel and isinstance(layer, Embedding):
            return {"": PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=seq)}
        if sequence_parallel and isinstance(layer, Head):
            return {"": PrepareModuleInput(input_layouts=seq, desired_input_layouts=Replicate(),
                                           use_local_output=True)}
        return {}
    return plan


class TensorParallel:
    """``parallelize_module`` on every layer of every stage (see the module docstring).

    Args:
        mesh: the 1-D mesh of the ranks that split each layer among themselves.
        plan: module path inside a layer -> parallel style (a layer holding none of the paths
            is left replicated), or a function of the layer giving its plan. Default: the
            plan of pipetrain's GPT (:func:`gpt_plan`).
        sequence_parallel: with the default plan, split the activations between layers along
            the sequence (the sequence length must divide by the mesh's size).

    Example: 4 processes, pipelines of 2 ranks, each GPT block split over 2
    (``tests/test_tensor_parallel_dist.py``; ``pipetrain train --tp 2``)::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
        pipe = pt.Pipeline(gpt_layers(config), "1f1b", 8, lm_loss, group=mesh.get_group("pp"),
                           parallelize=pt.parallel.TensorParallel(mesh["tp"]))
    """

    def __init__(self, mesh: DeviceMesh, plan: Plan | None = None, *,
                 sequence_parallel: bool = False) -> None:
        if mesh.ndim != 1:
            raise ValueError(f"TensorParallel needs a 1-D mesh, got {mesh.ndim} dimensions "
                             f"{mesh.mesh_dim_names}; pass mesh[name]")
        if plan is not None and sequence_parallel:
            raise ValueError("sequence_parallel applies to the default plan; put "
                             "SequenceParallel styles into your own plan instead")
        self.mesh = mesh
        self.sequence_parallel = sequence_parallel
        """Activations between layers are split along the sequence (its length must divide
        by the mesh's size)."""
        self.plan: Plan = gpt_plan(sequence_parallel) if plan is None else dict(plan) \
            if not callable(plan) else plan
        self.split_layers = 0
        self.params: list[nn.Parameter] = []  # the DTensor parameters the plan made

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        """Split ``stage``'s layers by the plan (the ``parallelize`` hook)."""
        for layer in layers:
            plan = self.plan(layer) if callable(self.plan) else self.plan
            paths = {name for name, _ in layer.named_modules()}
            mine = {path: style for path, style in plan.items() if path in paths and path}
            if "" in plan:
                parallelize_module(layer, self.mesh, plan[""])
            if mine:
                parallelize_module(layer, self.mesh, mine)
                self.split_layers += 1
            self.params += [p for p in layer.parameters() if isinstance(p, DTensor)]

    def finish(self) -> None:
        """Give each gradient its parameter's placements (call once a step, after the
        data-parallel reduction): a whole weight used in slices (the fused bias, the layer
        norms under sequence parallelism) gets partial sums per rank, added up here."""
        for p in self.params:
            grad = p.grad
            if isinstance(grad, DTensor) and isinstance(p, DTensor) \
                    and grad.placements != p.placements:
                p.grad = grad.redistribute(p.device_mesh, p.placements)


# -- one rank's share, for profiling in one process ----------------------------------------


def local_layer(layer: nn.Module, plan: Plan, ranks: int) -> nn.Module:
    """``layer`` as one of ``ranks`` tensor-parallel ranks computes it, as a plain module (no
    mesh; the layer itself when the plan splits none of it, else a copy): each column-wise
    ``nn.Linear`` of the plan keeps 1/ranks of its output rows (of each part of a fused one),
    each row-wise one 1/ranks of its input columns. Its times, activations and parameter
    bytes are a rank's; sequence parallelism and the collectives are left out (see
    :mod:`pipetrain.plan.shardcost`)."""
    linears = _split_linears(layer, plan)
    if not linears or ranks == 1:
        return layer
    local = copy.deepcopy(layer)
    for path, style in linears.items():
        module = local.get_submodule(path)
        if isinstance(style, RowwiseParallel):
            keep_slice(module, "weight", 1, ranks)
        else:
            parts = style.parts if isinstance(style, FusedColwise) else 1
            keep_slice(module, "weight", 0, ranks, parts=parts)
            if module.bias is not None:
                keep_slice(module, "bias", 0, ranks, parts=parts)
    return local


def traffic(layer: nn.Module, plan: Plan, x: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes a tensor-parallel rank of ``layer`` all-reduces on input ``x`` (one forward of
    ``layer``, no gradients): in F each row-wise matrix's output, in I each column-wise
    matrix's input gradient (the size of its input)."""
    import torch

    linears = _split_linears(layer, plan)
    sizes: dict[str, list[int]] = {"F": [], "I": []}

    def hook(style: ParallelStyle, module: nn.Module, args: Any, out: Any) -> None:
        seen = out if isinstance(style, RowwiseParallel) else args[0]
        sizes["F" if isinstance(style, RowwiseParallel) else "I"].append(
            seen.numel() * seen.element_size())
    handles = [layer.get_submodule(path).register_forward_hook(partial(hook, style))
               for path, style in linears.items()]
    try:
        with torch.no_grad():
            layer(x)
    finally:
        for handle in handles:
            handle.remove()
    return tuple(sizes["F"]), tuple(sizes["I"])


def _split_linears(layer: nn.Module, plan: Plan) -> dict[str, ParallelStyle]:
    """The plan's ``nn.Linear`` s of ``layer`` split column- or row-wise, by path."""
    styles = plan(layer) if callable(plan) else plan
    paths = dict(layer.named_modules())
    return {path: style for path, style in styles.items()
            if path and isinstance(paths.get(path), nn.Linear)
            and isinstance(style, ColwiseParallel | RowwiseParallel | FusedColwise)}


def keep_slice(module: nn.Module, name: str, dim: int, ranks: int, rank: int = 0,
               parts: int = 1, where: str = "") -> None:
    """Replace ``module.<name>`` with tensor-parallel ``rank``'s 1/ranks of each of its
    ``parts`` along ``dim`` (a ``Linear`` 's feature counts follow its weight).

    Raises:
        ValueError: when the slices are not equal; ``where`` names the module in it.
    """
    import torch

    whole = getattr(module, name)
    size = whole.shape[dim]
    if size % (parts * ranks):
        raise ValueError(f"{where or type(module).__name__}.{name} of {size} along dim {dim} "
                         f"does not split into {parts} x {ranks} equal slices; use a tp that "
                         "divides it")
    step, piece = size // parts, size // parts // ranks
    kept = [whole.detach().narrow(dim, k * step + rank * piece, piece) for k in range(parts)]
    local = torch.cat(kept, dim).clone()
    setattr(module, name, nn.Parameter(local, requires_grad=whole.requires_grad))
    if name == "weight" and isinstance(module, nn.Linear):
        module.out_features, module.in_features = local.shape[0], local.shape[1]
