"""HF expert parallel: a mixture of experts' experts spread over ranks, tokens moved to them.

A Hugging Face MoE declares its expert-parallel plan in its config (``base_model_ep_plan``):
its experts modules (``layers.*.mlp.experts``, style ``ep_dispatch_experts``) and their stacked
weights (``gate_up_proj``, ``down_proj``, style ``grouped_gemm``: split along the experts).
transformers implements the plan itself (``transformers.distributed.expert_parallel``): the
weights become ``Shard(0)`` DTensors, ``num_experts`` the local count, and the experts'
forward goes through its ``AllToAllEP``, which sends each (token, expert) pair to the rank
holding the expert and the result back, two ``all_to_all`` each way per layer (the method of
Lepikhin et al., "GShard", 2020). pipetrain applies that plan, unchanged, to a traced stage:

    captured stage graph                         after :class:`TracedExpertParallel`
    ... router ──► top_k_index, top_k_weights     ... router ──► top_k_index, top_k_weights
    x ──► [ the experts' ops, inlined:             x ──► call_module model.layers.3.mlp.experts
           sort, histc, grouped_mm, ...  ] ──► y          (transformers' module, run eagerly:
                                                           dispatch, local experts, combine) ──► y

The capture inlines the experts' forward into ATen ops whose token counts are shapes, which an
all-to-all (data-dependent sizes) cannot be recorded in. So the experts' region of the graph
(every node whose ``nn_module_stack`` holds the experts module) is cut out and replaced by one
call of the model's own experts module, its weights this rank's slice of the materialised ones
(named as before, so loading, checkpoints and the gradient norm see the whole tensors). The
region's inputs are told apart by what they are: the integer one is ``top_k_index``, the float
one shaped like the output is ``hidden_states``, the other ``top_k_weights``.

Autograd does the rest: the all-to-all's backward is another all-to-all, on the path to the
stage input, so a split backward's I runs it and W (the experts' weight gradients, from the
gradients I saved at the expert matmuls) waits for nothing else (:mod:`pipetrain.runtime.backward`).
The ranks of an expert-parallel group are data-parallel peers: they run the same schedule, so
they reach each layer's all-to-all in the same order. An expert's gradient sums the tokens
every rank of its group sent it; :class:`pipetrain.train.mesh.GradReducer` divides it by the
data-parallel ranks, as the replicated weights' mean does.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from pipetrain.runtime.torch_private import set_parameters_dict

__all__ = ["EP_STYLE", "TracedExpertParallel", "called", "experts_paths", "experts_patterns",
           "region", "roles"]

EP_STYLE = "ep_dispatch_experts"
"""The plan's style of an experts module (the weights' is ``grouped_gemm``)."""

Counter = Callable[[str, torch.Tensor], None]
"""Told each experts call's module path and ``top_k_index`` (global expert ids)."""


def experts_patterns(model: nn.Module) -> list[re.Pattern[str]]:
    """The model's experts modules, as full-path patterns from its expert-parallel plan;
    empty when it declares none."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    full = [f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k
            for k, v in plan.items() if v == EP_STYLE]
    return [re.compile(re.escape(k).replace(r"\*", r"\d+") + "$") for k in full]


def experts_paths(model: nn.Module) -> list[str]:
    """The module paths of ``model``'s experts modules (from its plan)."""
    patterns = experts_patterns(model)
    return [p for p, _ in model.named_modules() if any(r.match(p) for r in patterns)]


class TracedExpertParallel:
    """The ``parallelize`` hook of the module docstring.

    Args:
        model: the model as captured (on ``meta`` is enough): its experts modules are copied.
        ep_mesh: the 1-D mesh of the ranks the experts are spread over.
        tp_mesh: the 1-D mesh of the ranks that hold the same batch (size 1 without tensor
            parallelism), as transformers' ``AllToAllEP`` takes it.
        count: told every experts call's ``top_k_index`` (expert load statistics).

    Raises:
        ValueError: when the model declares no expert-parallel plan, or the mesh does not
            divide its experts.
    """

    def __init__(self, model: nn.Module, ep_mesh: Any, tp_mesh: Any,
                 count: Counter | None = None) -> None:
        self.paths = experts_paths(model)
        if not self.paths:
            raise ValueError(f"{type(model).__name__} declares no expert-parallel plan "
                             "(config.base_model_ep_plan with an ep_dispatch_experts module); "
                             "train it without --ep")
        self.model, self.ep_mesh, self.tp_mesh, self.count = model, ep_mesh, tp_mesh, count
        self.size, self.rank = ep_mesh.size(), ep_mesh.get_local_rank()
        self.params: list[nn.Parameter] = []
        """The expert weights this rank holds (its slices, as ``Shard(0)`` DTensors)."""
        self.replaced = 0

    def __call__(self, stage: int, layers: list[nn.Module]) -> None:
        for layer in layers:
            for gm in [m for m in layer.modules() if isinstance(m, fx.GraphModule)]:
                for path in called(gm, self.paths):
                    self._replace(gm, path)

    def _replace(self, gm: fx.GraphModule, path: str) -> None:
        nodes, inputs, output = region(gm.graph, path)
        hidden, index, weights = roles(inputs, output, path)
        gm.set_submodule(path, self._experts(gm, path))
        graph = gm.graph
        with graph.inserting_after(output):
            call = graph.call_module(path, (hidden, index, weights))
        call.meta = dict(output.meta)
        output.replace_all_uses_with(call, delete_user_cb=lambda user: user is not call)
        for node in reversed(nodes):  # sizes that later layers reuse stay
            if not node.users:
                graph.erase_node(node)
        graph.eliminate_dead_code()
        graph.lint()
        gm.recompile()
        self.replaced += 1

    def _experts(self, gm: fx.GraphModule, path: str) -> nn.Module:
        """The model's experts module ``path`` with this rank's slices of the stage's weights,
        its forward transformers' expert-parallel one."""
        from torch.distributed.tensor import DTensor, Shard
        from transformers.distributed.expert_parallel import EpDispatchExpertsParallel

        held = gm.get_submodule(path)
        experts: Any = copy.deepcopy(self.model.get_submodule(path))
        total = int(experts.num_experts)
        if total % self.size:
            raise ValueError(f"{path} has {total} experts, which ep={self.size} does not "
                             "divide; use a divisor of the experts count as --ep")
        local = total // self.size
        lo = self.rank * local
        params: OrderedDict[str, nn.Parameter | None] = OrderedDict()
        for name, whole in held.named_parameters(recurse=False):
            part = whole.detach()[lo:lo + local].clone()
            shard = DTensor.from_local(part, self.ep_mesh, [Shard(0)], run_check=False,
                                       shape=whole.shape, stride=whole.stride())
            params[name] = nn.Parameter(shard, requires_grad=whole.requires_grad)
            self.params.append(params[name])  # type: ignore[arg-type]
        set_parameters_dict(experts, params)
        experts.num_experts, experts._is_expert_parallel = local, True
        EpDispatchExpertsParallel().install_forward(
            experts, self.ep_mesh, tp_mesh=self.tp_mesh, ep_implementation="all_to_all")
        if self.count is not None:
            experts.forward = _counting(experts.forward, path, self.count)
        module: nn.Module = experts
        return module


def _counting(forward: Callable[..., torch.Tensor], path: str, count: Counter
              ) -> Callable[..., torch.Tensor]:
    def counted(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        count(path, index)
        return forward(hidden, index, weights)
    return counted


def _stack(node: fx.Node) -> set[str]:
    return {str(v[0]) for v in (node.meta.get("nn_module_stack") or {}).values()}


def called(gm: fx.GraphModule, paths: list[str]) -> list[str]:
    """The experts modules whose forward ``gm``'s graph inlines."""
    wanted = set(paths)
    found = dict.fromkeys(p for n in gm.graph.nodes for p in _stack(n) if p in wanted)
    return list(found)


def region(graph: fx.Graph, path: str) -> tuple[list[fx.Node], list[fx.Node], fx.Node]:
    """The nodes of one call of module ``path`` (in order), the tensors it reads from outside
    (not its weights), and its one output.

    Raises:
        ValueError: when the call does not have exactly one output used outside it.
    """
    nodes = [n for n in graph.nodes if path in _stack(n)]
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a.op != "get_attr" and isinstance(a.meta.get("val"),
                                                                     torch.Tensor):
                inputs[a] = None
    outputs = [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)
               and any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        raise ValueError(f"the captured call of {path} has {len(outputs)} outputs used after "
                         "it, not one; expert parallelism cannot replace it")
    return nodes, list(inputs), outputs[0]


def roles(inputs: list[fx.Node], output: fx.Node, path: str
          ) -> tuple[fx.Node, fx.Node, fx.Node]:
    """(hidden_states, top_k_index, top_k_weights) among a region's inputs.

    Raises:
        ValueError: when the inputs are not one integer tensor and two float ones, one of
            them shaped like the output.
    """
    vals = {n: n.meta["val"] for n in inputs}
    index = [n for n, v in vals.items() if not v.is_floating_point()]
    floats = [n for n, v in vals.items() if v.is_floating_point()]
    width = output.meta["val"].shape[-1]
    hidden = [n for n in floats if vals[n].dim() == 2 and vals[n].shape[-1] == width]
    if len(index) != 1 or len(floats) != 2 or len(hidden) != 1:
        shapes = {n.name: (tuple(v.shape), v.dtype) for n, v in vals.items()}
        raise ValueError(f"the captured call of {path} reads {shapes}; expert parallelism "
                         "expects (hidden_states, top_k_index, top_k_weights)")
    weights = next(n for n in floats if n is not hidden[0])
    return hidden[0], index[0], weights
