"""Trace: cut an ordinary ``nn.Module`` (not a layer list) into pipeline stages of its capture.

A transformer's ``forward`` is not a sequence of layers: it embeds, builds a mask from a keyword
argument, loops over a ``ModuleList`` and uses the mask and the rotary tables in every block,
then normalises and projects with a weight tied to the embedding. :func:`split_model` records
that forward once with torch.export (:mod:`pipetrain.split.capture`, one graph of ATen ops) and cuts
the graph before the first operation run inside each split-point module, like
``SplitPoint.BEGINNING``.

Each stage is an ``fx.GraphModule`` that takes ONE payload and returns ONE payload, so the
stages chain like the layers of ``nn.Sequential`` and fit :class:`~pipetrain.Pipeline`:

* stage 0 takes a dict of ``forward``'s argument names to values (:meth:`TracedSplit.pack`
  binds positional and keyword arguments; arguments not given keep their defaults);
* stage k < last returns a dict of every value a later stage needs, keyed by the name of the
  graph node that produced it (:attr:`TracedSplit.boundaries`). Ints (sizes read from a
  shape) travel too;
* the last stage returns what ``model.forward`` returns, in its own structure (a Hugging Face
  ``ModelOutput``, a dict, a tuple, a tensor).

Run as a chain (:meth:`TracedSplit.run`, or the stages given to ``Pipeline`` as a layer list),
a value made in stage 1 and used in stage 3 passes through stage 2. ``Pipeline(model,
split_points=...)`` does not relay it: from :attr:`TracedSplit.made_in` and
:attr:`TracedSplit.used_in` it derives :meth:`TracedSplit.routes`, and stage 1 sends the value
to stage 3 directly (:mod:`pipetrain.runtime.transport.routes`). A stage carries on a value it
neither makes
nor uses only when its payload holds it, so the same stages serve both ways.

Stages hold the model's own Parameters and buffers under the model's names (no copies); a weight
used by two stages (a tied embedding and LM head) is the same Parameter in both, and a buffer
that forward updates (BatchNorm's running statistics) is updated in place by the stage that
runs its module. Capture needs no values, so the model may live on the ``meta`` device;
:class:`~pipetrain.split.lazy.NamedInit` then materialises any stage with the values the whole model
would get.

Limits of capture: Python-level decisions are taken once (a branch on ``self.training`` or on
a plain argument: dropout stays as captured, so capture the model in the mode it trains in);
control flow on tensor values cannot be captured (:mod:`pipetrain.split.capture` says what to do).
A split point cuts at the first operation of its module, so a module used again later (other
than through a shared Parameter) runs in both stages.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from typing import Any

import torch
from torch import fx, nn

from pipetrain.errors import PartitionError
from pipetrain.runtime import microbatch, rng
from pipetrain.runtime.transport.routes import Routes, direct
from pipetrain.split.capture import Captured, capture
from pipetrain.split.inputs import Packed, read
from pipetrain.split.prefix import Prefixed, VisionPrefix
from pipetrain.split.provenance import Write, prove_routes, prove_writes, writes, written_inputs

__all__ = ["TracedSplit", "split_model"]  # public: split_model and its result

@dataclass(frozen=True)
class TracedSplit:
    """The stages of a captured model and how their names and payloads relate to it."""

    stages: list[nn.Module]
    """One ``fx.GraphModule`` per stage; ``stages[k](payload)`` returns stage k+1's payload."""
    param_names: list[dict[str, str]]
    """Per stage: its parameter name (``"blocks.5.attn.qkv.weight"``) -> the model's name for
    that Parameter as ``model.named_parameters()`` reports it (so a tied ``"head.weight"`` maps
    to ``"embed.weight"``)."""
    input_names: list[str]
    """The keys of stage 0's payload: the ``forward`` arguments the example gave, in order."""
    boundaries: list[list[str]]
    """``boundaries[k]``: the keys of the dict stage k returns to stage k+1."""
    captured: Captured
    """The capture the stages were cut from (:mod:`pipetrain.split.capture`)."""
    made_in: dict[str, int] = field(default_factory=dict)
    """Per boundary key: the stage that makes the value."""
    used_in: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per boundary key: the stages that use the value (the last: its output), ascending."""
    draws: tuple[bool, ...] = ()
    """Per stage: whether it draws random numbers (dropout; :mod:`pipetrain.runtime.rng`)."""
    writes: tuple[Write, ...] = ()
    """In-place writes that a later stage reads after (:mod:`pipetrain.split.provenance`)."""
    points: tuple[str, ...] = ()
    """The split points the stages start at (what :func:`split_model` was given)."""
    prefix: VisionPrefix | None = None
    """An image-text model's vision prefix, run eagerly in stage 0 before its graph
    (:mod:`pipetrain.split.prefix`); stage 0's payload is then the model's own arguments."""

    def pack(self, *args: Any, **kwargs: Any) -> Packed:
        """Stage 0's payload for ``model(*args, **kwargs)``: argument name -> value.

        Arguments not given are left out and keep their defaults, as in the capture.

        Raises:
            TypeError: if the arguments do not fit ``model.forward``.
        """
        return self.captured.pack(*args, **kwargs)

    def payload(self, inputs: Any) -> Packed:
        """Stage 0's payload for ``inputs`` given as ``forward`` takes them: a tensor, a tuple
        of positional arguments, a dict of keyword arguments, or what :meth:`pack` made
        (:func:`pipetrain.split.inputs.read`)."""
        if self.prefix is not None:
            return self.prefix.payload(inputs)
        return read(self.captured, inputs)

    def split(self, payload: Packed, m: int, dim: int) -> list[Any]:
        """Stage 0's payload in ``m`` micro-batches (an image-text model's images go with the
        rows that show them: :meth:`~pipetrain.split.prefix.VisionPrefix.split`)."""
        if self.prefix is not None:
            return self.prefix.split(payload, m, dim)
        return microbatch.split(payload, m, dim)

    def run(self, payload: dict[str, Any]) -> Any:
        """Run the stages one after another on stage 0's payload; returns the model output."""
        x: Any = payload
        for stage in self.stages:
            x = stage(x)
        return x

    def routes(self, balance: Sequence[int]) -> Routes:
        """Direct routes when consecutive stages are grouped ``balance[i]`` at a time, proven to
        deliver every value a stage reads from the stage that made it.

        A micro-batch's random state goes from stage 0 to the first stage that draws, and
        from each stage that draws to the next one (:mod:`pipetrain.runtime.rng`).

        Raises:
            PartitionError: when a stage would read a value before another stage's in-place
                write to it (:func:`~pipetrain.split.provenance.prove_writes`).
        """
        stage_of = [s for s, n in enumerate(balance) for _ in range(n)]
        prove_writes(self.writes, stage_of)
        made, used = dict(self.made_in), dict(self.used_in)
        chain = [0] + [k for k, d in enumerate(self.draws) if d and k > 0]
        if any(self.draws):
            for a, b in zip(chain, chain[1:]):
                made[rng.key(a)], used[rng.key(a)] = a, (b,)
        routes = direct(made, used, stage_of, len(balance),
                        forward_only=[k for k in made if rng.is_key(k)])
        reads: list[dict[str, int]] = [{} for _ in balance]
        for k, part in made.items():
            for user in used.get(k, ()):
                if stage_of[user] != stage_of[part]:
                    reads[stage_of[user]][k] = part
        prove_routes(routes, reads, stage_of)
        return routes

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
    example_inputs: tuple[Any, ...] | dict[str, Any], *, check: bool = True,
    captured: Captured | None = None,
) -> TracedSplit:
    """Cut ``model`` into ``len(split_points) + 1`` stages of its captured ``forward``.

    Args:
        model: any module that ``torch.export.export(model, args, kwargs, strict=False)``
            captures (:mod:`pipetrain.split.capture`).
        split_points: module names (``"blocks.4"``); a stage starts right before the first
            operation run inside each, in execution order.
        example_inputs: positional (tuple) or keyword (dict) arguments of ``model.forward``.
            Tensor dimensions stay symbolic where the code allows; plain values (None, ints,
            bools, floats, strings) are fixed at capture, and a different value at run time
            is an error in stage 0. Arguments not given keep their defaults.
        check: check that every value crossing a stage boundary can travel between
            processes, from what capture recorded of it (nothing runs: buffers stay as they
            are).
        captured: the capture of ``model`` on ``example_inputs``, when already made.

    Returns:
        A :class:`TracedSplit`; ``split.run(split.pack(*args, **kwargs))`` equals
        ``model(*args, **kwargs)``.

    Raises:
        PartitionError: for unknown, unused, duplicate or out-of-order split points, for
            arguments that do not fit ``forward``, for a forward torch.export cannot capture,
            and (with ``check``) for a payload value that cannot be sent.

    Example::

        split = split_model(lm, ["blocks.2"], {"input_ids": ids, "attention_mask": mask})
        pipe = Pipeline(split.stages, "1f1b", microbatches=4, loss_fn=loss_fn)
        pipe.step(split.pack(ids, attention_mask=mask), targets)
    """
    points = _check_names(model, split_points, "split_points")
    if captured is None:
        captured = capture(model, example_inputs)
    stages, boundaries, uses, found = _build(model, captured, points, check)
    canonical = {id(p): name for name, p in model.named_parameters()}
    names = [{n: canonical[id(p)] for n, p in s.named_parameters()} for s in stages]
    split = TracedSplit(list(stages), names, list(captured.given), boundaries, captured,
                        *uses, tuple(rng.graph_draws(stage) for stage in stages),
                        tuple(found), tuple(points))
    return split


def with_prefix(split: TracedSplit, prefix: VisionPrefix, model: nn.Module) -> TracedSplit:
    """``split``, whose capture began at the language model, with ``prefix`` run first in
    stage 0 (:mod:`pipetrain.split.prefix`)."""
    first = Prefixed(prefix, split.stages[0], split.captured.pack)
    canonical = {id(p): name for name, p in model.named_parameters()}
    names = [{n: canonical[id(p)] for n, p in first.named_parameters()}, *split.param_names[1:]]
    given = [n for n in prefix.given]
    return replace(split, stages=[first, *split.stages[1:]], param_names=names,
                   input_names=given, prefix=prefix)


# -- names --------------------------------------------------------------------------------
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


# -- cutting the graph --------------------------------------------------------------------
def _paths(node: fx.Node) -> set[str]:
    """The module paths an operation runs inside of (its module stack)."""
    stack = node.meta.get("nn_module_stack") or {}
    return {str(v[0]) for v in stack.values()}


def _first_use(nodes: list[fx.Node], point: str) -> int | None:
    """The first operation run inside module ``point`` (parameter reads are not uses)."""
    for i, node in enumerate(nodes):
        if node.op == "call_function" and any(
                p == point or p.startswith(point + ".") for p in _paths(node)):
            return i
    return None


def _cuts(model: nn.Module, nodes: list[fx.Node], points: list[str]) -> list[int]:
    """The node index each stage after the first starts at, checked for order."""
    found = {p: _first_use(nodes, p) for p in points}
    unused = [p for p, i in found.items() if i is None]
    if unused:
        raise PartitionError(
            f"split points {unused} are never used by {type(model).__name__}.forward; choose "
            "modules that forward calls")
    cuts = [i for i in found.values() if i is not None]
    bad = [f"{a!r} (node {i}) is not after {b!r} (node {j})"
           for (b, j), (a, i) in zip(zip(points, cuts), zip(points[1:], cuts[1:])) if i <= j]
    if bad:
        order = sorted(points, key=lambda p: found[p] or 0)
        raise PartitionError(
            "split points must be in execution order and cut at distinct places: "
            + "; ".join(bad) + f". Execution order: {order}")
    return cuts


def _build(model: nn.Module, captured: Captured, points: list[str], check: bool
           ) -> tuple[list[fx.GraphModule], list[list[str]],
                      tuple[dict[str, int], dict[str, tuple[int, ...]]], list[Write]]:
    nodes = list(captured.graph.nodes)
    cuts = _cuts(model, nodes, points)
    stage_of = {n: sum(i >= c for c in cuts) for i, n in enumerate(nodes)}
    n_stages = len(cuts) + 1
    live = _live(nodes, stage_of, n_stages)
    if check:
        _check_payloads(captured, live)
    stages = []
    copied = written_inputs(nodes, stage_of)
    for k in range(n_stages):
        builder = _StageBuilder(k, captured, nodes, copied[k] if k < len(copied) else set())
        for n in nodes:
            if stage_of[n] == k and n.op not in ("placeholder", "get_attr", "output"):
                builder.copy(n)
        if k == n_stages - 1:
            builder.finish_output(nodes[-1])
        else:
            builder.graph.output(builder.live(live[k], stage_of))
        builder.graph.lint()
        stages.append(fx.GraphModule(builder.attrs, builder.graph, class_name=f"Stage{k}"))
    crossing = {n for ns in live for n in ns}
    made_in = {n.name: stage_of[n] for n in nodes if n in crossing}
    used_in = {n.name: tuple(sorted({stage_of[u] for u in n.users})) for n in nodes
               if n in crossing}
    return (stages, [[n.name for n in ns] for ns in live], (made_in, used_in),
            writes(nodes, stage_of))


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


class _StageBuilder:
    """One stage's graph: the stage's own nodes, with earlier values read from its payload."""

    def __init__(self, k: int, captured: Captured, nodes: list[fx.Node],
                 copied: set[str]) -> None:
        self.k, self.captured, self.copied = k, captured, copied
        self.index = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
        self.graph = fx.Graph()
        self.payload = self.graph.placeholder("inputs" if k == 0 else "payload")
        self.env: dict[fx.Node, fx.Node] = {}
        self.attrs: dict[str, Any] = {}
        self._leaves: fx.Node | None = None

    def copy(self, node: fx.Node) -> None:
        self.env[node] = self.graph.node_copy(node, self.value)

    def finish_output(self, out: fx.Node) -> None:
        """The last stage returns what ``model.forward`` returns (its own structure)."""
        flat = fx.node.map_arg(out.args[0], self.value)
        self.graph.output(self.graph.call_function(
            _model_output, (self._attr(_CAPTURE, self.captured), flat)))

    def live(self, nodes: list[fx.Node], stage_of: dict[fx.Node, int]) -> Any:
        """The output of a stage k < last: the values of ``nodes``, made or used here or carried.

        A value this stage neither makes nor uses is carried from its payload if present: it is
        there when the stages run as a chain, and absent when it was sent directly to the stage
        that uses it (:mod:`pipetrain.runtime.transport.routes`).
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
                target = str(node.target)
                self.env[node] = self._attr(target, self.captured.attrs[target])
            elif node.op == "placeholder" and self.k == 0:
                self.env[node] = self.graph.call_function(
                    operator.getitem, (self._stage_inputs(), self.index[node]))
            else:
                self.env[node] = self.graph.create_node(
                    "call_function", operator.getitem, (self.payload, node.name), name=node.name)
                if node.name in self.copied:  # written in place here: a received leaf must not be
                    self.env[node] = self.graph.call_function(torch.ops.aten.clone.default,
                                                              (self.env[node],))
        return self.env[node]

    def _stage_inputs(self) -> fx.Node:
        """Stage 0: the graph's flattened inputs, checked against the capture (once)."""
        if self._leaves is None:
            self._leaves = self.graph.call_function(
                _graph_inputs, (self._attr(_CAPTURE, self.captured), self.payload))
        return self._leaves

    def _attr(self, target: str, value: Any) -> fx.Node:
        self.attrs[target] = value
        return self.graph.get_attr(target)


_CAPTURE = "_pipetrain_capture"


def _graph_inputs(captured: Captured, payload: dict[str, Any]) -> list[Any]:
    return captured.leaves(payload)


def _model_output(captured: Captured, flat: list[Any]) -> Any:
    return captured.output(list(flat))


def _carry(payload: dict[str, Any], here: dict[str, Any], names: tuple[str, ...]
           ) -> dict[str, Any]:
    """``names`` from ``here``, else from ``payload`` where it holds them (see ``live``)."""
    return {k: here[k] if k in here else payload[k] for k in names
            if k in here or k in payload}


# -- checking payloads --------------------------------------------------------------------
_SENDABLE = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool, str,
             type(None))


def _check_payloads(captured: Captured, live: list[list[fx.Node]]) -> None:
    """Every value crossing a stage boundary can travel, as capture recorded it (no run)."""
    for k, nodes in enumerate(live):
        for node in nodes:
            value = node.meta.get("val")
            items = value if isinstance(value, (tuple, list)) else [value]
            if node.op != "placeholder" and not all(isinstance(v, _SENDABLE) for v in items):
                raise PartitionError(
                    f"stage {k} would send {node.name!r}, a {type(value).__name__}, to stage "
                    f"{k + 1}; payloads hold tensors, sizes and plain values. Move the split "
                    "point so that value is made and used in one stage")
