"""TP plan: a Hugging Face model's own tensor-parallel plan, on its traced stages.

A traced stage is one flat graph (torch.export): its weights are ``get_attr`` nodes that
``aten.linear`` calls read, with no module a parallel style could wrap, and the sizes the model
computed from a tensor's shape are constants in it (grouped-query attention expands the
key/value heads to a recorded count). So the split happens on both sides of the capture:

1. :func:`shrink`, on the meta model before the capture, gives each ``nn.Linear`` that the
   model's plan (``_tp_plan``, from its config's ``base_model_tp_plan``) calls ``"colwise"``
   or ``"rowwise"`` one rank's shape: 1/tp of its output rows, or of its input columns. The
   capture then records one rank's computation (its heads, its share of the MLP's units).
2. :class:`TracedTensorParallel`, the ``parallelize`` hook, on each stage: makes each split
   weight a DTensor, ``Shard(0)`` or ``Shard(1)`` of the whole on the tp mesh (loading a
   checkpoint, saving one and the gradient norm see the whole), read through ``to_local`` in
   the graph, and puts Megatron's two conjugate operators around the split matrices
   (Shoeybi et al., "Megatron-LM", 2019, section 3)::

       x ──► copy ──► colwise linear ··· rowwise linear ──► reduce ──► (+ bias) ──► x'
             forward: identity                            forward: all-reduce (sum)
             backward: all-reduce                         backward: identity

Entries of other styles (a vocabulary-split embedding or head, ``colwise_rep``, ...) leave
their modules whole and replicated, as are norms and embeddings. The split weights' values must
come from the checkpoint: initialised from a seed, each rank would draw the same slice.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from pipetrain.parallel.tensor_parallel import keep_slice

__all__ = ["STYLES", "model_plan", "require_weights", "shrink", "TracedTensorParallel"]

STYLES = ("colwise", "rowwise")
"""The plan's styles split here; other entries stay whole."""

Splits = dict[str, tuple[str, tuple[int, ...]]]
"""Parameter name in the model -> (style, its whole shape)."""


def model_plan(model: nn.Module) -> dict[str, str]:
    """The model's tensor-parallel plan, module path patterns (``*``: any layer index) ->
    style, with full paths; empty when it declares none."""
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan:
        base = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v
                for k, v in base.items()}
    return dict(plan)


def shrink(model: nn.Module, tp: int, rank: int = 0) -> Splits:
    """Give the plan's column- and row-wise ``nn.Linear`` s of ``model`` tensor-parallel rank
    ``rank``'s (of ``tp``) shapes, in place: on the meta device, shapes only; with real
    weights, that rank's slices of them. The split parameters, by name.

    Example (each rank of a 2-D ``(pp, tp)`` mesh)::

        splits = shrink(model, 2, mesh["tp"].get_local_rank())
        pipe = Pipeline(model, "zb-h1", 8, loss_fn, split_points=points, example_inputs=x,
                        group=mesh["pp"].get_group(),
                        parallelize=TracedTensorParallel(mesh["tp"], splits))

    Raises:
        ValueError: when the model declares no plan, or a split does not divide evenly.
    """
    plan = model_plan(model)
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan (config."
                         "base_model_tp_plan); train it without --tp (--pp, --dp, --fsdp)")
    _check_heads(model, tp)
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+") + "$"), v)
                for k, v in plan.items() if v in STYLES]
    splits: Splits = {}
    for path, module in model.named_modules():
        style = next((v for p, v in patterns if p.match(path)), None)
        if style is None:
            continue
        if not isinstance(module, nn.Linear):
            raise ValueError(f"the plan splits {path} {style}, but it is a "
                             f"{type(module).__name__}, not an nn.Linear")
        dim = 0 if style == "colwise" else 1
        for name in ("weight", "bias") if style == "colwise" else ("weight",):
            param = getattr(module, name)
            if param is not None:
                splits[f"{path}.{name}"] = (style, tuple(param.shape))
                keep_slice(module, name, dim, tp, rank, where=path)
    return splits


def require_weights(stored: bool, where: object) -> None:
    """Refuse a split of a model without stored weights (ValueError)."""
    if not stored:
        raise ValueError(f"--tp with --hf needs the checkpoint's weights, and {where} has no "
                         "safetensors: initialised from --seed, every rank would draw the "
                         "same slice; save the model with its weights first, or train "
                         "without --tp")


def _check_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % tp:
            raise ValueError(f"tp={tp} must divide the model's {key}={heads}: each rank "
                             "computes whole heads; use a divisor of it")


class TracedTensorParallel:
    """The ``parallelize`` hook of the module docstring's second step.

    Args:
        mesh: the 1-D mesh of the ranks that split each layer.
        splits: what :func:`shrink` split, by parameter name in the model.
    """

    def __init__(self, mesh: Any, splits: Splits) -> None:
        self.mesh, self.splits = mesh, splits
        self.group = mesh.get_group()
        self.params: list[nn.Parameter] = []
        self.split_layers = 0
        self.sequence_parallel = False  # activations between layers stay whole

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        for layer in layers:
            graphs = [m for m in layer.modules() if isinstance(m, fx.GraphModule)]
            if sum(self._split(gm) for gm in graphs):
                self.split_layers += 1

    def finish(self) -> None:
        """Nothing to add up: no whole weight is used in slices here."""

    def _split(self, gm: fx.GraphModule) -> int:
        """Split ``gm``'s weights and put the collectives around them; how many."""
        from torch.distributed.tensor import DTensor, Shard

        gm.add_submodule("_pipetrain_tp_copy", Collective("copy", self.group))
        gm.add_submodule("_pipetrain_tp_reduce", Collective("reduce", self.group))
        graph, done = gm.graph, 0
        for node in list(graph.nodes):
            found = self.splits.get(str(node.target)) if node.op == "get_attr" else None
            if found is None:
                continue
            style, whole = found
            owner, _, attr = str(node.target).rpartition(".")
            module = gm.get_submodule(owner)
            param = getattr(module, attr)
            if not isinstance(param, DTensor):  # a graph nested in another may share it
                split = DTensor.from_local(param.detach(), self.mesh,
                                           [Shard(0 if style == "colwise" else 1)],
                                           run_check=False, shape=torch.Size(whole),
                                           stride=torch.empty(whole, device="meta").stride())
                param = nn.Parameter(split, requires_grad=param.requires_grad)
                setattr(module, attr, param)
                self.params.append(param)
            with graph.inserting_after(node):
                local = graph.call_function(to_local, (node,))
            node.replace_all_uses_with(local, delete_user_cb=lambda user, local=local:
                                       user is not local)
            if attr == "weight":
                for user in list(local.users):
                    if user.target is torch.ops.aten.linear.default:
                        _surround(graph, user, style)
            done += 1
        graph.lint()
        gm.recompile()
        return done


def _surround(graph: fx.Graph, linear: fx.Node, style: str) -> None:
    """The copy before a column-wise ``linear``, the reduce (then its bias) after a row-wise."""
    x, weight, *rest = linear.args
    if style == "colwise":
        with graph.inserting_before(linear):
            copied = graph.call_module("_pipetrain_tp_copy", (x,))
        linear.args = (copied, weight, *rest)
        return
    bias = rest[0] if rest else None
    linear.args = (x, weight)
    with graph.inserting_after(linear):
        out = graph.call_module("_pipetrain_tp_reduce", (linear,))
    last = out
    if bias is not None:
        with graph.inserting_after(out):
            last = graph.call_function(torch.ops.aten.add.Tensor, (out, bias))
    linear.replace_all_uses_with(last, delete_user_cb=lambda user: user is not out)


def to_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local slice (differentiable); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class Collective(nn.Module):
    """Megatron's ``copy`` (identity forward, all-reduce backward) or ``reduce`` (all-reduce
    forward, identity backward) over ``group``."""

    def __init__(self, kind: str, group: Any) -> None:
        super().__init__()
        self.kind, self.group = kind, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fn = _Copy if self.kind == "copy" else _Reduce
        out: torch.Tensor = fn.apply(x, self.group)  # type: ignore[no-untyped-call]
        return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None
