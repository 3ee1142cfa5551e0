"""Trace: cut an ordinary ``nn.Module`` (not a layer list) into pipeline stages with torch.fx.

A transformer's ``forward`` is not a sequence of layers: it embeds, builds a mask from a keyword
argument, loops over a ``ModuleList`` and uses the mask in every block, then normalises and
projects with a weight tied to the embedding. :func:`split_model` records that forward once as an
fx graph (``torch.fx.Tracer``, which keeps every Python-level call as it was, so the stages run
the very same operations and match the model bitwise) and cuts the graph at the first use of
each split-point module, like ``SplitPoint.BEGINNING``.

Each stage is an ``fx.GraphModule`` that takes ONE payload and returns ONE payload, so the
stages chain like the layers of ``nn.Sequential`` and fit :class:`~pipetrain.Pipeline`:

* stage 0 takes a dict of ``forward``'s parameter names to values (:meth:`TracedSplit.pack`
  binds positional and keyword arguments and fills in defaults);
* stage k < last returns a dict of every value a later stage needs, keyed by the name of the
  graph node that produced it (:attr:`TracedSplit.boundaries`). Ints, None and other plain
  values travel too;
* the last stage returns what ``model.forward`` returns.

Run as a chain (:meth:`TracedSplit.run`, or the stages given to ``Pipeline`` as a layer list),
a value made in stage 1 and used in stage 3 passes through stage 2. ``Pipeline(model,
split_points=...)`` does not relay it: from :attr:`TracedSplit.made_in` and
:attr:`TracedSplit.used_in` it derives :meth:`TracedSplit.routes`, and stage 1 sends the value
to stage 3 directly (:mod:`pipetrain.routes`). A stage carries on a value it neither makes nor
uses only when its payload holds it, so the same stages serve both ways.

Stages hold the model's own submodules and Parameters (no copies); a weight used by two stages
(a tied embedding and LM head) is the same Parameter in both. Tracing needs no values, so the
model may live on the ``meta`` device; :class:`~pipetrain.lazy.NamedInit` then materialises any
stage with the values the whole model would get.

Limits of tracing: Python-level decisions are taken once, at trace time (a branch on
``self.training`` or on a plain argument); control flow on tensor values cannot be traced (name
the module holding it in ``leaf_modules``). A split point cuts at the first use of its module, so
a module used again later (other than through a shared Parameter) is called from both stages.
"""

from __future__ import annotations

import inspect
import operator
import os
import traceback
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

import torch
from torch import fx, nn

from pipetrain.errors import PartitionError
from pipetrain.lazy import is_meta
from pipetrain.payload import flatten, unflatten
from pipetrain.routes import Routes, direct

__all__ = ["TracedSplit", "split_model"]  # public: split_model and its result

_PLAIN = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class TracedSplit:
    """The stages of a traced model and how their names and payloads relate to it."""

    stages: list[nn.Module]
    """One ``fx.GraphModule`` per stage; ``stages[k](payload)`` returns stage k+1's payload."""
    param_names: list[dict[str, str]]
    """Per stage: its parameter name (``"blocks.5.attn.qkv.weight"``) -> the model's name for
    that Parameter as ``model.named_parameters()`` reports it (so a tied ``"head.weight"`` maps
    to ``"embed.weight"``)."""
    input_names: list[str]
    """The keys of stage 0's payload: ``forward``'s parameter names, in order."""
    boundaries: list[list[str]]
    """``boundaries[k]``: the keys of the dict stage k returns to stage k+1."""
    signature: inspect.Signature
    """The signature of ``model.forward`` (used by :meth:`pack`)."""
    made_in: dict[str, int] = field(default_factory=dict)
    """Per boundary key: the stage that makes the value."""
    used_in: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per boundary key: the stages that use the value (the last: its output), ascending."""

    def pack(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Stage 0's payload for ``model(*args, **kwargs)``: parameter name -> value.

        Raises:
            TypeError: if the arguments do not fit ``model.forward``.
        """
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def run(self, payload: dict[str, Any]) -> Any:
        """Run the stages one after another on stage 0's payload; returns the model output."""
        x: Any = payload
        for stage in self.stages:
            x = stage(x)
        return x

    def routes(self, balance: Sequence[int]) -> Routes:
        """Direct routes when consecutive stages are grouped ``balance[i]`` at a time."""
        stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
        return direct(self.made_in, self.used_in, stage_of, len(balance))

    @property
    def shared(self) -> dict[str, list[int]]:
        """Parameters held by more than one stage (tied weights): model name -> stages."""
        held: dict[str, list[int]] = {}
        for k, names in enumerate(self.param_names):
            for name in dict.fromkeys(names.values()):
                held.setdefault(name, []).append(k)
        return {name: ks for name, ks in held.items() if len(ks) > 1}


def split_model(
    model: nn.Module, split_points: Sequence[str],
    example_inputs: tuple[Any, ...] | dict[str, Any], *,
    leaf_modules: Collection[str] = (), check: bool = True,
) -> TracedSplit:
    """Cut ``model`` into ``len(split_points) + 1`` stages by tracing its ``forward``.

    Args:
        model: any module whose ``forward`` torch.fx can trace (no control flow on tensor
            values; see ``leaf_modules``).
        split_points: module names (``"blocks.4"``); a stage starts right before the first use
            of each, in execution order.
        example_inputs: positional (tuple) or keyword (dict) arguments of ``model.forward``.
            Tensor arguments stay symbolic; plain values (None, ints, bools, floats, strings,
            and parameters left at their default) are fixed at trace time, and a different
            value at run time fails an assertion in stage 0.
        leaf_modules: names of submodules to call as one opaque step instead of tracing into
            them (for code fx cannot trace); torch.nn's own layers are leaves already.
        check: run the stages once on ``example_inputs`` (without autograd; modules with
            running statistics update them) and check that every payload can travel between
            processes. A model on the ``meta`` device runs on meta copies of the inputs (no
            values, the same payload structure).

    Returns:
        A :class:`TracedSplit`; ``split.run(split.pack(*args, **kwargs))`` equals
        ``model(*args, **kwargs)``.

    Raises:
        PartitionError: for unknown, unused, duplicate or out-of-order split points, for
            arguments that do not fit ``forward``, for a forward fx cannot trace, and (with
            ``check``) for a payload value that cannot be sent.

    Example::

        split = split_model(lm, ["blocks.2"], {"input_ids": ids, "attention_mask": mask})
        pipe = Pipeline(split.stages, "1f1b", microbatches=4, loss_fn=loss_fn)
        pipe.step(split.pack(ids, attention_mask=mask), targets)
    """
    signature = _signature(model)
    inputs = _bind(signature, example_inputs)
    points = _check_names(model, split_points, "split_points")
    leaves = frozenset(_check_names(model, leaf_modules, "leaf_modules"))
    before = set(model.__dict__)
    graph = _trace(model, inputs, leaves)
    try:
        stages, boundaries, uses = _build(model, graph, points, signature, inputs)
    finally:  # the tracer stores tensor constants on the model; the stages hold their own
        for name in set(model.__dict__) - before:
            delattr(model, name)
    canonical = {id(p): name for name, p in model.named_parameters()}
    names = [{n: canonical[id(p)] for n, p in s.named_parameters()} for s in stages]
    split = TracedSplit(list(stages), names, list(signature.parameters), boundaries, signature,
                        *uses)
    if check:
        _check_payloads(split, _on_meta(inputs) if is_meta(model) else inputs)
    return split


# -- arguments and names ------------------------------------------------------------------
def _signature(model: nn.Module) -> inspect.Signature:
    signature = inspect.signature(model.forward)
    variadic = [p.name for p in signature.parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise PartitionError(
            f"{type(model).__name__}.forward{signature} takes *{variadic[0]}; tracing needs "
            "named parameters. Wrap the model in a module whose forward names its arguments"
        )
    return signature


def _bind(signature: inspect.Signature, example: Any) -> dict[str, Any]:
    if not isinstance(example, (tuple, dict)):
        raise PartitionError("example_inputs must be a tuple (positional arguments) or a dict "
                             f"(keyword arguments) of forward, got {type(example).__name__}")
    try:
        bound = (signature.bind(*example) if isinstance(example, tuple)
                 else signature.bind(**example))
    except TypeError as e:
        raise PartitionError(f"example_inputs do not fit forward{signature}: {e}") from e
    bound.apply_defaults()
    return dict(bound.arguments)


def _check_names(model: nn.Module, names: Collection[str], what: str) -> list[str]:
    """Every problem with a list of module names, raised at once."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise PartitionError(f"{what} must be a list of module names such as ['blocks.4'], "
                             f"got {names!r}")
    known = [n for n, _ in model.named_modules() if n]
    problems = []
    for name in dict.fromkeys(names):
        if name not in known:
            near = get_close_matches(name, known, n=3) or known[:6]
            problems.append(f"{name!r} is not a submodule of {type(model).__name__} "
                            f"(candidates: {', '.join(near)}, ...)")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        problems.append(f"{', '.join(map(repr, repeated))} appear more than once")
    if problems:
        raise PartitionError(f"bad {what}:\n" + "\n".join(f"  - {p}" for p in problems))
    return list(names)


# -- tracing ------------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    def __init__(self, leaves: frozenset[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name)


def _trace(model: nn.Module, inputs: dict[str, Any], leaves: frozenset[str]) -> fx.Graph:
    concrete = {k: v for k, v in inputs.items() if isinstance(v, _PLAIN)}
    try:
        return _Tracer(leaves).trace(model, concrete_args=concrete or None)
    except Exception as e:
        raise PartitionError(
            f"torch.fx could not trace {type(model).__name__}.forward{_user_frame(e)}: "
            f"{type(e).__name__}: {e}\nTracing runs forward on symbolic values, so Python "
            "control flow on tensor values (if/while on a tensor, len() or iteration of a "
            "tensor, .item(), ...) and calls that need a real number (torch.ones(n) with n "
            "from a shape) cannot be traced. Alternatives: name the submodule holding "
            "that code in leaf_modules=[...] (it is then called as one step), make the branch "
            "depend on a plain argument fixed in example_inputs, or give Pipeline an explicit "
            "layer list (nn.Sequential) with balance=[...]"
        ) from e


def _user_frame(e: BaseException) -> str:
    """`` at file:line (`code`)`` of the innermost traceback frame outside torch and this file."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(torch_dir) and f.filename != __file__]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"


# -- cutting the graph --------------------------------------------------------------------
def _paths(node: fx.Node) -> set[str]:
    """The module paths a node runs inside of (its module stack, or its own target)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = {str(v[0]) for v in stack.values()}
    if node.op in ("call_module", "get_attr"):
        paths.add(str(node.target))
    return paths


def _first_use(nodes: list[fx.Node], point: str) -> int | None:
    for i, node in enumerate(nodes):
        if any(p == point or p.startswith(point + ".") for p in _paths(node)):
            return i
    return None


def _cuts(model: nn.Module, nodes: list[fx.Node], points: list[str]) -> list[int]:
    """The node index each stage after the first starts at, checked for order."""
    found = {p: _first_use(nodes, p) for p in points}
    unused = [p for p, i in found.items() if i is None]
    if unused:
        raise PartitionError(
            f"split points {unused} are never used by {type(model).__name__}.forward (or only "
            "inside a leaf module, which runs as one step); choose modules that forward calls")
    cuts = [i for i in found.values() if i is not None]
    bad = [f"{a!r} (node {i}) is not after {b!r} (node {j})"
           for (b, j), (a, i) in zip(zip(points, cuts), zip(points[1:], cuts[1:])) if i <= j]
    if bad:
        order = sorted(points, key=lambda p: found[p] or 0)
        raise PartitionError(
            "split points must be in execution order and cut at distinct places: "
            + "; ".join(bad) + f". Execution order: {order}")
    return cuts


def _build(model: nn.Module, graph: fx.Graph, points: list[str],
           signature: inspect.Signature, inputs: dict[str, Any]
           ) -> tuple[list[fx.GraphModule], list[list[str]],
                      tuple[dict[str, int], dict[str, tuple[int, ...]]]]:
    nodes = list(graph.nodes)
    cuts = _cuts(model, nodes, points)
    stage_of = {n: sum(i >= c for c in cuts) for i, n in enumerate(nodes)}
    n_stages = len(cuts) + 1
    live = _live(nodes, stage_of, n_stages)
    arg_of = _arg_names(nodes, signature, inputs)
    stages = []
    for k in range(n_stages):
        builder = _StageBuilder(k, arg_of)
        for n in nodes:
            if stage_of[n] == k and n.op not in ("placeholder", "get_attr", "output"):
                builder.copy(n)
        out = nodes[-1]
        builder.graph.output(fx.node.map_arg(out.args[0], builder.value) if k == n_stages - 1
                             else builder.live(live[k], stage_of))
        builder.graph.lint()
        stages.append(fx.GraphModule(model, builder.graph, class_name=f"Stage{k}"))
    crossing = {n for ns in live for n in ns}
    made_in = {n.name: stage_of[n] for n in nodes if n in crossing}
    used_in = {n.name: tuple(sorted({stage_of[u] for u in n.users})) for n in nodes
               if n in crossing}
    return stages, [[n.name for n in ns] for ns in live], (made_in, used_in)


def _live(nodes: list[fx.Node], stage_of: dict[fx.Node, int], n_stages: int
          ) -> list[list[fx.Node]]:
    """``live[k]``: values made in stages <= k that a stage > k uses (parameters excluded)."""
    live: list[list[fx.Node]] = [[] for _ in range(n_stages - 1)]
    for n in nodes:
        if n.op == "get_attr" or not n.users:
            continue
        last_use = max(stage_of[u] for u in n.users)
        for k in range(stage_of[n], last_use):
            live[k].append(n)
    return live


def _arg_names(nodes: list[fx.Node], signature: inspect.Signature,
               inputs: dict[str, Any]) -> dict[fx.Node, str]:
    """Placeholder -> forward parameter (fx names a fixed argument ``x`` ``x_1``)."""
    wanted = {}
    for name in signature.parameters:
        wanted[f"{name}_1" if isinstance(inputs[name], _PLAIN) else name] = name
    found = {n: wanted[str(n.target)] for n in nodes if n.op == "placeholder"}
    assert len(found) == len(wanted), (wanted, found)  # one placeholder per parameter
    return found


class _StageBuilder:
    """One stage's graph: the stage's own nodes, with earlier values read from its payload."""

    def __init__(self, k: int, arg_of: dict[fx.Node, str]) -> None:
        self.k, self.arg_of = k, arg_of
        self.graph = fx.Graph()
        self.payload = self.graph.placeholder("inputs" if k == 0 else "payload")
        self.env: dict[fx.Node, fx.Node] = {}

    def copy(self, node: fx.Node) -> None:
        self.env[node] = self.graph.node_copy(node, self.value)

    def live(self, nodes: list[fx.Node], stage_of: dict[fx.Node, int]) -> Any:
        """The output of a stage k < last: the values of ``nodes``, made or used here or carried.

        A value this stage neither makes nor uses is carried from its payload if present: it is
        there when the stages run as a chain, and absent when it was sent directly to the stage
        that uses it (:mod:`pipetrain.routes`).
        """
        here = {n.name: self.value(n) for n in nodes if n in self.env or stage_of[n] == self.k}
        if len(here) == len(nodes):
            return here
        return self.graph.call_function(_carry, (self.payload, here,
                                                 tuple(n.name for n in nodes)))

    def value(self, node: fx.Node) -> fx.Node:
        """``node``'s value in this stage: computed here, a parameter, or from the payload."""
        if node not in self.env:
            if node.op == "get_attr":  # parameters and buffers are re-read, never sent
                self.env[node] = self.graph.get_attr(str(node.target))
            else:
                key = self.arg_of[node] if self.k == 0 else node.name
                self.env[node] = self.graph.create_node(
                    "call_function", operator.getitem, (self.payload, key), name=node.name)
        return self.env[node]


def _carry(payload: dict[str, Any], here: dict[str, Any], names: tuple[str, ...]
           ) -> dict[str, Any]:
    """``names`` from ``here``, else from ``payload`` where it holds them (see ``live``)."""
    return {k: here[k] if k in here else payload[k] for k in names
            if k in here or k in payload}


# -- checking payloads --------------------------------------------------------------------
def _on_meta(inputs: dict[str, Any]) -> dict[str, Any]:
    """The tensors of ``inputs`` (also inside tuples, lists, dicts) as meta tensors."""
    out = {}
    for key, value in inputs.items():
        try:
            tensors, spec = flatten(value)
        except TypeError:  # not a payload: passed as it is
            out[key] = value
            continue
        out[key] = unflatten([t.to("meta") for t in tensors], spec)
    return out


def _check_payloads(split: TracedSplit, inputs: dict[str, Any]) -> None:
    x: Any = inputs
    with torch.no_grad():
        for k, stage in enumerate(split.stages[:-1]):
            x = stage(x)
            for key, value in x.items():
                try:
                    flatten(value)
                except TypeError as e:
                    raise PartitionError(
                        f"stage {k} would send {key!r}, a {type(value).__name__}, to stage "
                        f"{k + 1}: {e}. Move the split point so that value is made and used "
                        "in one stage, or compute it from a tensor in the stage that uses it"
                    ) from e
