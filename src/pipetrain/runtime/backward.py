"""Split backward: I computes only input gradients now, W only weight gradients later.

The autograd graph of one stage for one micro-batch is cut in two (the method of Qi et al.,
"Zero Bubble Pipeline Parallelism", 2024), without redoing work:

    stage input x ──► [node N1] ──► [node N2] ──► ... ──► stage output y
                        │              │
                        ▼              ▼                      X = nodes that lead back to x
                     weights        weights                   P = nodes that lead to weights

  I: ``autograd.grad(y, x)`` runs only the X nodes, computing only the outputs that lead to x.
     A pre-hook on every X node that also has an edge into P-only territory (an "intermediate",
     such as the matmul whose other operand is a weight) saves the gradient arriving there.
  W: for each intermediate N, ``autograd.backward(GradientEdge(N), saved grads, inputs=its
     weights)`` runs N again computing only its weight outputs, plus the P-only nodes below it,
     and accumulates each weight's gradient into ``.grad`` as it is made (one alive at a time,
     not a group's). Stage outputs that do not lead to x at all (a first stage fed integer
     tokens) are W roots with their own grad.

A weight reachable from two intermediates (a weight used twice inside one stage) would be
counted twice by W, so such micro-batches fall back to a full backward inside I and W is a no-op;
so do those where a stage returns a weight itself as an output (it has no node for W to run).
Outputs may be given as tensors or as ``GradientEdge``s (a stage that recomputes its last
layers keeps only the edge, not the output's memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__: list[str] = []


Root = torch.Tensor | GradientEdge  # a stage output to start the backward from

INPUT_PASS = [0]
"""Above 0 while :func:`backward_input` runs its pass: a node that makes input and weight
gradients in one call (a compiled stage, :mod:`pipetrain.runtime.compiled`) then makes only
the input gradients, and the weights' later, when W runs it again."""


@runtime_checkable
class Gathering(Protocol):
    """A ``parallelize`` that keeps layers' weights sharded between uses (FSDP2 resharding
    after each forward and backward) tells the pipeline where a step's gradients go and
    gathers the weights a deferred W reads."""

    def gathered(self, param: nn.Parameter) -> nn.Parameter:
        """The tensor ``param``'s gradients accumulate in during a step (itself if none)."""

    def gather(self, weights: Sequence[torch.Tensor]) -> None:
        """Make ``weights`` (graph leaves, gathered tensors) hold their values for W."""

    def release(self) -> None:
        """Reshard what :meth:`gather` gathered (after a W)."""


def backward_full(
    outputs: Sequence[Root | None], grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> list[torch.Tensor | None]:
    """B: input and weight gradients in one pass; weights accumulate into ``.grad``."""
    roots, root_grads = _roots(outputs, grads)
    if roots:
        torch.autograd.backward(cast(Any, roots), root_grads)  # tensors and edges mixed
    return [x.grad for x in inputs]


@dataclass
class WeightWork:
    """What W needs from I: the saved gradients at intermediates, and the W-only roots."""

    groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list
    )  # (output edges, their grads, weights reached)
    done: bool = False

    def run(self, gathering: Gathering | None = None) -> None:
        """W: compute the weight gradients and accumulate them into ``.grad`` (``gathering``
        gathers each group's weights first, should they have been resharded since I)."""
        for edges, edge_grads, params in self.groups:  # one call each: an intermediate's input
            # gradient leads on to the weights of the layers below, which their own group owns.
            # Accumulated as autograd makes them (AccumulateGrad, as B does), so one weight's
            # gradient at a time is alive beside .grad, not the whole group's.
            if gathering is not None:
                gathering.gather(params)
            torch.autograd.backward(cast(Any, edges), edge_grads, inputs=params)
        if gathering is not None:
            gathering.release()
        self.groups.clear()
        self.done = True


def backward_input(
    outputs: Sequence[Root | None], grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """I: gradients w.r.t. ``inputs`` only; returns them and the deferred :class:`WeightWork`.

    The weights are the graph's leaves other than ``inputs``: the tensors the forward used,
    which need not be the module's parameters of the moment (FSDP2 swaps a resharded layer's
    gathered weights for its shards between the forward and this backward).
    """
    roots, root_grads = _roots(outputs, grads)
    diff_inputs = [x for x in inputs if x.requires_grad]
    graph = _Graph(roots, diff_inputs)
    weight_as_output = any(n in graph.param_of for n in graph.root_nodes)  # W would not see it
    if graph.shared_weights or weight_as_output:
        return backward_full(outputs, grads, inputs), WeightWork(done=True)
    work = WeightWork()
    saved: dict[Node, tuple[Any, ...]] = {}
    handles = [n.register_prehook(_saver(saved, n)) for n in graph.intermediates]
    passing = bool(diff_inputs and roots)
    INPUT_PASS[0] += passing
    try:
        got: Sequence[torch.Tensor | None] = []
        if passing:
            got = torch.autograd.grad(cast(Any, roots), diff_inputs, root_grads,
                                      retain_graph=True, allow_unused=True)
    finally:
        INPUT_PASS[0] -= passing
        for h in handles:
            h.remove()
    for node in graph.intermediates:
        _add_group(work, graph, node, saved.get(node))
    for root, node, g in zip(roots, graph.root_nodes, root_grads):
        if node in graph.w_roots:
            params_hit = graph.weights_below(node)
            if params_hit:
                work.groups.append(([_edge(root)], [g], params_hit))
    by_input = dict(zip(map(id, diff_inputs), got))
    return [by_input.get(id(x)) for x in inputs], work


def _saver(saved: dict[Node, tuple[Any, ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Any, ...]) -> None:
        saved[node] = grad_outputs
    return hook


def _add_group(work: WeightWork, graph: _Graph, node: Node, got: tuple[Any, ...] | None) -> None:
    if got is None:
        return
    pairs = [(GradientEdge(node, i), g) for i, g in enumerate(got) if g is not None]
    params_hit = graph.weights_below(node)
    if pairs and params_hit:
        work.groups.append(([e for e, _ in pairs], [g for _, g in pairs], params_hit))


def _edge(root: Root) -> GradientEdge:
    return root if isinstance(root, GradientEdge) else get_gradient_edge(root)


def _node(root: Root) -> Node:
    if isinstance(root, GradientEdge):
        return root.node
    return root.grad_fn if root.grad_fn is not None else get_gradient_edge(root).node


_ACCUMULATE = type(get_gradient_edge(torch.zeros((), requires_grad=True)).node)  # leaves' node


def _roots(
    outputs: Sequence[Root | None], grads: Sequence[torch.Tensor | None]
) -> tuple[list[Root], list[torch.Tensor]]:
    """Outputs to start from, with their gradients; a scalar output without one is a loss.

    ``None`` stands for an output that needs no gradient; an output given as a GradientEdge
    is never a loss (a stage keeps its loss as a tensor).
    """
    roots: list[Root] = []
    root_grads: list[torch.Tensor] = []
    for y, g in zip(outputs, grads):
        if y is None or (isinstance(y, torch.Tensor) and not y.requires_grad):
            continue
        if g is None:
            if isinstance(y, GradientEdge) or y.numel() != 1:
                continue  # no gradient arrived for this output: it did not influence the loss
            g = torch.ones_like(y)
        roots.append(y)
        root_grads.append(g)
    return roots, root_grads


class _Graph:
    """Reachability over one stage's autograd graph: X (leads to inputs), P (leads to weights)."""

    def __init__(self, roots: list[Root], inputs: list[torch.Tensor]) -> None:
        self._inputs = {id(x) for x in inputs}
        self.param_of: dict[Node, torch.Tensor] = {}  # filled as the walk meets weights
        self.children: dict[Node, list[Node]] = {}
        self.reach_x: dict[Node, bool] = {}
        self.reach_p: dict[Node, bool] = {}
        self._below: dict[Node, list[torch.Tensor]] = {}
        self.root_nodes = [_node(r) for r in roots]
        for node in self.root_nodes:
            self._visit(node)
        self.x_nodes = {n for n, v in self.reach_x.items() if v}
        # in the walk's order, the same in every process (W's gathers are collectives)
        self.intermediates = [n for n, v in self.reach_x.items()
                              if v and any(self._p_only(c) for c in self.children[n])]
        self.w_roots = [n for n in self.root_nodes if n not in self.x_nodes]
        self.shared_weights = self._weights_shared(self.w_roots)

    def _visit(self, root: Node) -> None:
        """Depth-first from ``root``; a node is settled once all its children are (a DAG)."""
        children, reach_x, reach_p = self.children, self.reach_x, self.reach_p
        stack = [root]
        while stack:
            node = stack[-1]
            if node in reach_x:  # settled already (it was on the stack twice)
                stack.pop()
                continue
            kids = children.get(node)
            if kids is None:
                kids = children[node] = [n for n, _ in node.next_functions if n is not None]
                unseen = [k for k in kids if k not in children]
                if unseen:
                    stack.extend(unseen)
                    continue
            stack.pop()
            if type(node) is _ACCUMULATE:  # a leaf: an input, or else a weight
                leaf = cast(Any, node).variable
                reach_x[node] = id(leaf) in self._inputs
                reach_p[node] = not reach_x[node]
                if reach_p[node]:
                    self.param_of[node] = leaf
            else:  # a loop, not any(): this runs for every node of every I
                to_x = to_p = False
                for k in kids:
                    to_x = to_x or reach_x[k]
                    to_p = to_p or reach_p[k]
                reach_x[node], reach_p[node] = to_x, to_p

    def _p_only(self, node: Node) -> bool:
        return self.reach_p.get(node, False) and not self.reach_x.get(node, False)

    def weights_below(self, node: Node) -> list[torch.Tensor]:
        """Weights reached from ``node`` through P-only children (computed once per node)."""
        if node not in self._below:
            self._below[node] = self._search_below(node)
        return self._below[node]

    def _search_below(self, node: Node) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        seen: set[Node] = set()
        stack = [c for c in self.children.get(node, []) if self._p_only(c)]
        if node in self.param_of or (self._p_only(node) and node not in self.x_nodes):
            stack.append(node)
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.param_of:
                found.append(self.param_of[n])
            stack.extend(c for c in self.children.get(n, []) if self._p_only(c))
        return found

    def _weights_shared(self, w_roots: list[Node]) -> bool:
        owners: dict[int, int] = {}
        for i, n in enumerate(self.intermediates + w_roots):
            for p in self.weights_below(n):
                if owners.setdefault(id(p), i) != i:
                    return True
        return False
