"""Compiled stage: a stage's layers as three compiled programs, F, I and W, from one joint graph.

``torch.compile`` turns a module's forward and backward into two programs; its backward makes
input and weight gradients in one call, which a zero-bubble schedule cannot split (one autograd
node computes both). Here AOTAutograd traces the stage's joint graph once per input signature,
its partitioner cuts it into a forward and a backward graph, and the backward graph is cut
again, by what each output needs::

    F graph:  (weights, inputs)           -> (outputs, saved)
    backward: (saved, output grads)       -> (weight grads, input grads)
        I:    (saved, output grads)       -> (input grads, boundary)     the input grads' cone
        W:    (saved W reads, boundary)   -> (weight grads)              the rest

The boundary holds the values of I's cone that W reads (gradients at the layers' outputs, the
weight-gradient outputs of an op that makes both), so W recomputes nothing. Each graph is
compiled on its own (``torch.compile``, inductor by default). The three run inside one autograd
node: during the split backward's input pass (:data:`~pipetrain.runtime.backward.INPUT_PASS`)
it runs I and keeps what W needs; W's later pass over it runs W; any other pass (B, or a
user's own backward) runs both.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx, nn

from pipetrain.runtime.backward import INPUT_PASS
from pipetrain.runtime.torch_private import (
    aot_function,
    buffers_dict,
    default_partition,
    is_view,
    parameters_dict,
    pytree,
)

__all__ = ["CompiledLayers", "compile_stages"]

Graph = Callable[..., Any]


@dataclass
class Program:
    """The three compiled graphs of one input signature, and how to call them."""

    forward: Graph
    input_grads: Graph
    weight_grads: Graph
    n_outputs: int  # user outputs of ``forward``; the rest of its results are saved values
    w_reads: list[int]  # indices into saved values that W reads
    tangents: list[int]  # which outputs get a gradient (AOTAutograd's tangents, in order)
    i_inputs: list[int]  # which primals (weights, then inputs) I makes gradients of
    w_params: list[int]  # which primals W makes gradients of
    out_spec: pytree.TreeSpec
    constants: list[Any]  # each output leaf: None for a tensor, else the value itself


class CompiledLayers:
    """A stage's module, called through compiled F, I and W graphs (one set per signature).

    Weights are read at each call (an optimizer's in-place update is seen); ``backend`` is a
    ``torch.compile`` backend (``"inductor"``), or ``"eager"``: the split graphs run as they
    are, uncompiled (a check of the split alone).
    """

    def __init__(self, module: nn.Module, backend: str = "inductor", stage: int = 0) -> None:
        self.module, self.backend, self.stage = module, backend, stage
        self.programs: dict[Any, Program] = {}
        self.compiles = 0  # how many signatures were traced and compiled
        params = [n for n, _ in module.named_parameters()]
        buffers = [n for n, _ in module.named_buffers()]
        self.names = params + buffers
        self._slots = [(parameters_dict(_owner(module, n)), n.rpartition(".")[2])
                       for n in params] + [
            (buffers_dict(_owner(module, n)), n.rpartition(".")[2]) for n in buffers]
        """Where each weight lives: read at each call by one lookup, not a walk of the
        module tree (which costs about 60 microseconds per F at 50 weights)."""

    def __call__(self, x: Any) -> Any:
        leaves, spec = pytree.tree_flatten(x)
        weights = self._weights()
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        key = (spec, self.module.training, _autocast(),
               tuple((id(t), t.dtype, t.device, t.requires_grad) for t in weights),
               tuple(_signature(t) for t in tensors),
               tuple(repr(v) for v in leaves if not isinstance(v, torch.Tensor)))
        program = self.programs.get(key)
        if program is None:
            program = self._compile(self.names, weights, leaves, spec)
            self.programs[key] = program
        call = _Call(program, len(weights) + len(tensors))
        outs = _Apply.apply(call, *weights, *tensors)  # type: ignore[no-untyped-call]
        it = iter(outs)
        flat = [next(it) if c is None else c for c in program.constants]
        return pytree.tree_unflatten(flat, program.out_spec)

    def _weights(self) -> list[torch.Tensor]:
        """The module's parameters and buffers of the moment (a weight replaced by another
        tensor is read, and keys a program of its own)."""
        return [cast(torch.Tensor, held[name]) for held, name in self._slots]

    def _compile(self, names: list[str], weights: list[torch.Tensor], leaves: list[Any],
                 spec: pytree.TreeSpec) -> Program:
        fw, bw, n_out, out_spec, constants, differentiable = _trace(
            self.module, names, weights, leaves, spec)
        n_primals = len(weights) + sum(isinstance(t, torch.Tensor) for t in leaves)
        requires = [w.requires_grad for w in weights] + [
            t.requires_grad for t in leaves if isinstance(t, torch.Tensor)]
        saved_names = [n.name for n in _outputs(fw)[n_out:]]
        holders = [n for n in bw.graph.nodes if n.op == "placeholder"]
        tangents = [n for n in holders if n.name.startswith("tangents")]
        if [n.name for n in holders[:len(saved_names)]] != saved_names \
                or len(holders) != len(saved_names) + len(tangents):
            raise TypeError(f"stage {self.stage}: compile=True could not match the backward "
                            "graph's inputs to the forward graph's saved values; run this "
                            "stage without compile=True")
        if len(differentiable) != len(tangents):
            raise TypeError(f"stage {self.stage}: {len(tangents)} output gradients expected, "
                            f"{len(differentiable)} differentiable outputs found; run this "
                            "stage without compile=True")
        outs = _outputs(bw)
        if len(outs) != n_primals:
            raise TypeError(f"stage {self.stage}: the stage updates a buffer or an input in "
                            "place (batch norm's running statistics, say), which compile=True "
                            "does not split; run it without compile=True")
        i_idx = [j for j in range(len(weights), n_primals) if requires[j] and outs[j] is not None]
        w_idx = [j for j in range(len(weights)) if requires[j] and outs[j] is not None]
        i_gm, w_gm, w_reads = split_backward(bw, i_idx, w_idx)
        self.compiles += 1
        return Program(self._c(fw), self._c(i_gm), self._c(w_gm), n_out, w_reads,
                       differentiable, i_idx, w_idx, out_spec, constants)

    def _c(self, gm: fx.GraphModule) -> Graph:
        if self.backend == "eager" or not any(n.op == "call_function" for n in gm.graph.nodes):
            return gm  # the split graph itself (nothing to compile, or asked so)
        backend = self.backend
        return kept(_graph_key(gm, backend), lambda: torch.compile(
            gm, backend=backend, fullgraph=True, dynamic=False))


_COMPILED: OrderedDict[tuple[str, ...], Graph] = OrderedDict()
"""Compiled graphs by their code and inputs: stages of the same layers (a transformer's
blocks, on the stages of every rank in local mode, or the pipelines of one process) share one
compilation. At most :data:`KEPT`, the least recently used going first."""
KEPT = 64


def kept(key: tuple[str, ...] | None, make: Callable[[], Graph]) -> Graph:
    """The compiled graph kept under ``key``, else ``make()``'s, kept (None: never kept)."""
    if key is None:
        return make()
    compiled = _COMPILED.get(key)
    if compiled is not None:
        _COMPILED.move_to_end(key)
        return compiled
    compiled = _COMPILED[key] = make()
    while len(_COMPILED) > KEPT:
        _COMPILED.popitem(last=False)
    return compiled


def _graph_key(gm: fx.GraphModule, backend: str) -> tuple[str, ...] | None:
    """``gm``'s code, backend and input metadata; None for a graph that reads constants of its
    own (the same code may read other values)."""
    metas = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            return None
        if n.op == "placeholder":
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return None
            metas.append(f"{tuple(v.shape)} {v.stride()} {v.dtype} {v.device}")
    return (backend, gm.code, *metas)


def _owner(module: nn.Module, name: str) -> nn.Module:
    return module.get_submodule(name.rpartition(".")[0])


def compile_stages(stages: Mapping[int, Any], compile: bool | str, recompute: Any,
                   parallelize: Any, splits: bool = False, draws: bool = False) -> None:
    r"""Give each of ``stages`` (runtime :class:`~pipetrain.runtime.stage.Stage`\ s) compiled
    layers, for ``Pipeline(compile=...)`` (``splits``: the schedule splits its backward;
    ``draws``: micro-batches carry random streams); raises ValueError for what cannot be
    combined."""
    if compile is False:  # its type, recompute= and parallelize=: PipelineConfig's
        return
    if draws:
        raise ValueError("compile=True with a model that draws random numbers in training "
                         "(dropout of p > 0): its graphs draw other numbers than the eager "
                         "model, so no step could equal one device's; set the dropouts to 0 "
                         "(in a Hugging Face config: its *dropout* fields), or pass rng=False "
                         "to let the compiled graphs draw as they do")
    if splits and _torch_version() < (2, 13):
        raise ValueError(f"compile=True under a split-backward schedule needs torch >= 2.13 "
                         f"(this is {torch.__version__}: its autograd cannot start W at a "
                         "compiled stage); upgrade torch, or use gpipe or 1f1b")
    backend = "inductor" if compile is True else compile
    for index, stage in stages.items():
        stage.compiled = CompiledLayers(stage.module, backend, index)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _autocast() -> tuple[Any, ...]:
    """The autocast state, which the traced graph bakes in (its casts)."""
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.dtype, t.device, t.requires_grad, t.stride())


def _outputs(gm: fx.GraphModule) -> list[Any]:
    outs: Sequence[Any] = gm.graph.output_node().args[0]  # type: ignore[assignment]
    return list(outs)


def _is_float(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _trace(module: nn.Module, names: list[str], weights: list[torch.Tensor], leaves: list[Any],
           spec: pytree.TreeSpec
           ) -> tuple[fx.GraphModule, fx.GraphModule, int, pytree.TreeSpec, list[Any], list[int]]:
    """The forward and backward graphs of ``module`` on these inputs (AOTAutograd's default
    partition: the forward saves what the backward reads)."""
    n_weights = len(weights)
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    found: dict[str, Any] = {}

    def fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = list(leaves)
        for i, t in zip(positions, flat[n_weights:]):
            inputs[i] = t
        state = dict(zip(names, flat[:n_weights]))
        out = torch.func.functional_call(module, state, (pytree.tree_unflatten(inputs, spec),))
        out_leaves, found["spec"] = pytree.tree_flatten(out)
        found["constants"] = [None if isinstance(v, torch.Tensor) else v for v in out_leaves]
        found.setdefault("grad", [v.requires_grad and _is_float(v) for v in out_leaves
                                  if isinstance(v, torch.Tensor)])
        return _own(flat, [v for v in out_leaves if isinstance(v, torch.Tensor)])

    def partition(joint: fx.GraphModule, joint_inputs: Any, **kw: Any) -> Any:
        fw, bw = default_partition(joint, joint_inputs, **kw)
        found["fw"], found["bw"], found["n"] = fw, bw, kw["num_fwd_outputs"]
        return fw, bw

    def keep(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return gm

    tensors = [leaves[i] for i in positions]
    with torch.enable_grad():
        aot_function(fn, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)(
            *weights, *tensors)
    if "fw" not in found:
        raise TypeError("compile=True: nothing in this stage needs a gradient, so it has no "
                        "backward to split; run it without compile=True")
    n_tensors = sum(c is None for c in found["constants"])
    if found["n"] != n_tensors:
        raise TypeError(f"compile=True: the stage returns {n_tensors} tensor(s) but its forward "
                        f"graph {found['n']} (it updates an input or buffer in place, or returns "
                        "views of one tensor); run it without compile=True")
    return (found["fw"], found["bw"], found["n"], found["spec"], found["constants"],
            [i for i, g in enumerate(found["grad"]) if g])


def _own(given: Sequence[torch.Tensor], outs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``outs``, each its own tensor: an output that is an input (a passed-on mask), a view
    (of an input, of another output or of an intermediate) or a repeat of another output is
    copied, which AOTAutograd otherwise regenerates outside the graph without a gradient
    input of its own."""
    seen = set(map(id, given))
    owned = []
    for v in outs:
        owned.append(v.clone() if id(v) in seen or is_view(v) else v)
        seen.add(id(v))
    return tuple(owned)


def split_backward(bw: fx.GraphModule, i_idx: Sequence[int], w_idx: Sequence[int]
                   ) -> tuple[fx.GraphModule, fx.GraphModule, list[int]]:
    """Cut ``bw`` into I (``i_idx``'s outputs, then the boundary) and W (``w_idx``'s outputs,
    from the inputs of ``bw`` listed third, and then the boundary)."""
    outs = _outputs(bw)
    cone_i = _cone([outs[j] for j in i_idx])
    for node in list(cone_i):  # an op of several results: its results travel, not the tuple
        cone_i |= {u for u in node.users if u.op == "call_function" and u.target is
                   operator.getitem}
    cone_w = _cone([outs[j] for j in w_idx])
    w_only = [n for n in bw.graph.nodes if n in cone_w and n not in cone_i
              and n.op != "placeholder"]
    reads: list[fx.Node] = []
    for n in w_only + [outs[j] for j in w_idx]:
        for arg in ([n] if n in cone_i or n.op == "placeholder" else n.all_input_nodes):
            if arg not in w_only and arg not in reads:
                reads.append(arg)
    holders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    saved_reads = [n for n in reads if n.op == "placeholder"]
    boundary = [n for n in reads if n.op != "placeholder"]
    i_gm = _subgraph(bw, holders, [n for n in bw.graph.nodes if n in cone_i and
                                   n.op != "placeholder"], [outs[j] for j in i_idx] + boundary)
    w_gm = _subgraph(bw, saved_reads + boundary, w_only, [outs[j] for j in w_idx])
    index = {n: k for k, n in enumerate(holders)}
    return i_gm, w_gm, [index[n] for n in saved_reads]


def _cone(roots: Sequence[Any]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _subgraph(gm: fx.GraphModule, inputs: Sequence[fx.Node], body: Sequence[fx.Node],
              outputs: Sequence[fx.Node]) -> fx.GraphModule:
    """A graph module of ``body``'s nodes (in order) from ``inputs`` to ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in body:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    graph.eliminate_dead_code()
    return fx.GraphModule(gm, graph)


class _Call:
    """One micro-batch's run of a :class:`Program`: what its I leaves for its W."""

    def __init__(self, program: Program, n_primals: int) -> None:
        self.program, self.n_primals = program, n_primals
        self.saved: list[torch.Tensor] | None = []  # F's saved values, until I
        self.kept: list[torch.Tensor] | None = None  # W's reads, from I until W

    def forward(self, primals: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        results = list(self.program.forward(*primals))
        n = self.program.n_outputs
        self.saved = results[n:]
        return results[:n]

    def backward(self, input_pass: bool, grads: Sequence[torch.Tensor | None],
                 outputs: list[tuple[Any, ...]]) -> list[torch.Tensor | None]:
        """I's gradients if not made yet, then W's unless this is an ``input_pass``."""
        p = self.program
        result: list[torch.Tensor | None] = [None] * self.n_primals
        if self.kept is None and self.saved is not None:  # I not run yet
            given = self.saved + [_grad(grads[i], outputs[i]) for i in p.tangents]
            got = list(p.input_grads(*given))
            for j, g in zip(p.i_inputs, got):
                result[j] = g
            self.kept = [given[k] for k in p.w_reads] + got[len(p.i_inputs):]
            self.saved = None
        if not input_pass and self.kept is not None:  # W not run yet
            for j, g in zip(p.w_params, p.weight_grads(*self.kept)):
                result[j] = g
            self.kept = None
        return result


def _grad(g: torch.Tensor | None, out: tuple[Any, ...]) -> torch.Tensor:
    return g if g is not None else torch.zeros(out[0], dtype=out[1], device=out[2])


class _Apply(torch.autograd.Function):
    """The autograd node of one compiled call: weights and inputs in, outputs out."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = call.forward(primals)
        ctx.call = call
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs)
                                      if i not in call.program.tangents])
        ctx.outs = [(o.shape, o.dtype, o.device) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.call.backward(INPUT_PASS[0] > 0, grads, ctx.outs))
