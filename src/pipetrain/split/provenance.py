"""Provenance: proof that every value a stage reads comes from the stage that made it, or a refusal.

A captured graph is one program; cut into stages, each value a stage reads must be the one it
reads on one device. Three ways it could be another, each checked here:

* **Routing**: a value read from the payload must arrive in a message from the stage whose part
  made it, once (:func:`prove_routes`; :mod:`pipetrain.runtime.transport.routes` builds them so,
  this
  proves it).
* **In-place writes**: an op that writes into a tensor (``add_``, ``copy_``, ``index_put_``, a
  batch norm's running statistics) changes it for every later reader on one device. Across
  stages a later reader holds its own copy (sent before the write, or a buffer of its own
  rank), and would read the old value::

      unit 1: v = f(x)        unit 2: v.add_(1)        unit 3: g(v)     one device: g(v + 1)
      stages {1} {2, 3}: fine (stage 2's units share its copy of v, written)
      stages {1, 2} {3}: fine (stage 3 gets v from stage 1 after the write)
      stages {1} {2} {3}: stage 3 gets v from stage 1, unwritten: refused

  :func:`writes` lists every write with the parts that read the value after it, and
  :func:`prove_writes` refuses a grouping that puts such a reader in another stage than the
  writer, naming the op, the value and both stages.
* **Random state**: dropout draws from a generator, a hidden value every random op reads and
  writes; :mod:`pipetrain.runtime.rng` makes it an explicit value routed like any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import fx

from pipetrain.errors import PartitionError
from pipetrain.runtime.torch_private import op_schema
from pipetrain.runtime.transport.routes import Routes

__all__: list[str] = []


@dataclass(frozen=True)
class Write:
    """One in-place write of a captured graph, and who reads the written value after it."""

    op: str
    """The op and its node, as ``aten.add_.Tensor (add_3)``."""
    value: str
    """What is written: a parameter or buffer name, or the node that made the value."""
    part: int
    """The part (traced unit) that writes."""
    made: int | None
    """The part that made the value, which sends it on after its own writes; None for a
    parameter or buffer (every rank holds its own copy)."""
    readers: tuple[int, ...]
    """The other parts that read the value after the write (a parameter or buffer: at all)."""


# composite ops that write into arguments their schema does not mark: (op, arg indices, flag)
_HIDDEN_WRITES = {"aten.batch_norm.default": ((3, 4), 5)}


def _written(node: fx.Node) -> list[fx.Node]:
    """The tensors ``node`` writes into, as the nodes that hold them."""
    if node.op != "call_function":
        return []
    hidden = _HIDDEN_WRITES.get(str(node.target))
    if hidden is not None:
        indices, flag = hidden
        if len(node.args) > flag and node.args[flag] is True:
            return [a for i in indices if i < len(node.args)
                    for a in [node.args[i]] if isinstance(a, fx.Node)]
        return []
    schema = op_schema(node.target)
    if schema is None:
        return []
    return [a for arg, a in zip(schema.arguments, node.args) if isinstance(a, fx.Node)
            and arg.alias_info is not None and arg.alias_info.is_write]


def _base(node: fx.Node) -> fx.Node:
    """The tensor a view was taken of (``x.view(...)[0]`` -> ``x``)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        schema = op_schema(node.target)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None \
                or schema.returns[0].alias_info.is_write:
            return node
        node = node.args[0]
    return node


def _aliases(base: fx.Node) -> list[fx.Node]:
    """``base`` and every view taken of it, transitively."""
    out, todo = [], [base]
    while todo:
        node = todo.pop()
        out.append(node)
        todo += [u for u in node.users if u is not node and _base(u) is base and u not in out
                 and u not in todo]
    return out


def writes(nodes: Sequence[fx.Node], part_of: Mapping[fx.Node, int]) -> list[Write]:
    """Every in-place write in ``nodes`` (a captured graph in order) that another part reads:
    after it, or, for a parameter or buffer (read under its name), anywhere (the next step
    reads what this one wrote); ``part_of`` gives each node's part."""
    order = {n: i for i, n in enumerate(nodes)}
    by_target: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if n.op == "get_attr":
            by_target.setdefault(str(n.target), []).append(n)
    found = []
    for node in nodes:
        for target in _written(node):
            base = _base(target)
            roots = by_target.get(str(base.target), [base]) if base.op == "get_attr" else [base]
            attr = base.op == "get_attr"  # a model's tensor: read again in the next step too
            readers = {part_of[u] for r in roots for a in _aliases(r) for u in a.users
                       if (attr or order.get(u, -1) > order[node])
                       and part_of.get(u, part_of[node]) != part_of[node]}
            if readers:
                name = str(base.target) if base.op == "get_attr" else base.name
                found.append(Write(f"{node.target} ({node.name})", name, part_of[node],
                                   None if attr else part_of[base], tuple(sorted(readers))))
    return found


def written_inputs(nodes: Sequence[fx.Node], part_of: Mapping[fx.Node, int]) -> list[set[str]]:
    """Per part: the values made in another part that it writes in place (directly or through a
    view). A stage receives such a value as a leaf of autograd, which must not be written in
    place, so the part works on a copy (:mod:`pipetrain.split.trace`); on one device it writes the
    producer's own tensor, and export's graph reads the written value afterwards."""
    out: list[set[str]] = [set() for _ in range(max(part_of.values(), default=0) + 1)]
    for node in nodes:
        for target in _written(node):
            base = _base(target)
            if base.op != "get_attr" and part_of[base] != part_of[node] and (
                    base.op != "placeholder" or part_of[node] > 0):
                out[part_of[node]].add(base.name)
    return out


def prove_writes(found: Sequence[Write], stage_of: Sequence[int]) -> None:
    """Refuse a grouping of parts into stages where a value written in place is read after the
    write by another stage that gets it from elsewhere: a parameter or buffer (every rank holds
    its own copy), or a value sent by the stage that made it, when another stage wrote it (a
    value written by the stage that made it is sent written).

    Raises:
        PartitionError: naming the op, the value and the stages, and what to do.
    """
    bad = [(w, r) for w in found for r in w.readers if stage_of[r] != stage_of[w.part] and (
        w.made is None or stage_of[w.made] != stage_of[w.part])]
    if bad:
        lines = [f"  - stage {stage_of[w.part]} writes {w.value!r} in place ({w.op}), and "
                 f"stage {stage_of[r]} reads it" for w, r in bad]
        raise PartitionError(
            "these cuts would make a stage read its own copy of a value that another stage "
            "writes in place (on one device it reads the written value; after the split its "
            "copy stays unwritten):\n" + "\n".join(lines) + "\nmove the split points so "
            "that each writer and its readers are in one stage (or write the value "
            "out of place in forward)")


def prove_routes(routes: Routes, reads: Sequence[Mapping[str, int]],
                 stage_of: Sequence[int]) -> None:
    """Every value a stage reads from outside itself arrives once, from the stage that made it.

    ``reads[s]``: the payload keys stage ``s``'s parts read from parts of other stages -> the
    part that made each.

    Raises:
        PartitionError: for a value that would arrive from another stage, twice, or never.
    """
    problems = []
    for s, wanted in enumerate(reads):
        arriving: dict[str, list[int]] = {}
        for src, keys in routes.ports[s].act_in:
            for k in keys or ():
                arriving.setdefault(k, []).append(src)
        for k, part in wanted.items():
            got, want = arriving.get(k, []), stage_of[part]
            if got != [want]:
                problems.append(f"stage {s} reads {k!r}, made in stage {want}, but it arrives "
                                f"from {got or 'no stage'}")
    if problems:
        raise PartitionError("internal: the routes do not deliver every value from its maker "
                             "(please report this):\n" + "\n".join(f"  - {p}" for p in problems))
