"""Automatic split points: the units a traced model may be cut between, in execution order.

``Pipeline(model, split_points="auto", example_inputs=...)`` needs candidate places to cut an
ordinary module. The candidates are its *units*: the model's direct children, with every
container (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``), and every module holding a
stack of same-class layers, replaced by its own children, recursively. For a usual
transformer that gives ``embed, pos, blocks.0, ..., blocks.N-1, norm, head``; for Hugging Face
Llama ``model.embed_tokens, model.layers.0, ..., model.norm, model.rotary_emb, lm_head``.
The units are ordered by their first use in the captured ``forward``; units used at the same
place (an embedding used only as the tied head's weight) or never used collapse into the unit
before them.

Cutting at every unit (:func:`pipetrain.split.trace.split_model` with all of them) gives one small
stage per unit; those stages chain like the layers of ``nn.Sequential``, so the balancer
(:mod:`pipetrain.split.balance`) groups them into pipeline stages by parameters, time or memory,
exactly as it does for a layer list.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from pipetrain.errors import PartitionError
from pipetrain.split.capture import Captured, capture
from pipetrain.split.trace import _first_use

__all__ = ["units", "cut_points"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def units(model: nn.Module) -> list[str]:
    """The model's units in registration order: children, containers opened recursively, and
    so is a module that holds a stack of layers somewhere inside it (a Hugging Face
    ``GPT2Model`` holding ``h``), so that the stack's layers are units."""
    found: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS) or any(_is_stack(m) for m in child.modules()):
                visit(path + ".", child)
            else:
                found.append(path)

    visit("", model)
    return found


def _is_stack(module: nn.Module) -> bool:
    """A container of two or more layers of one class (transformer blocks, residual blocks),
    or of layers whose classes all say they are one (Mllama's self- and cross-attention
    ``...DecoderLayer`` s, interleaved)."""
    kids = list(module.children())
    return isinstance(module, _CONTAINERS) and len(kids) > 1 and (
        len({type(k) for k in kids}) == 1
        or all(type(k).__name__.endswith(("Layer", "Block")) for k in kids))


def cut_points(model: nn.Module, example_inputs: tuple[Any, ...] | dict[str, Any], *,
               captured: Captured | None = None) -> list[str]:
    """Every unit that starts a new place in ``forward``, in execution order.

    The first unit used is left out (a stage cannot start before the first one), so the
    result can be given to :func:`~pipetrain.split.trace.split_model` as ``split_points``; it makes
    ``len(result) + 1`` unit stages. ``captured`` is the model's capture, when already made.

    Raises:
        PartitionError: when ``forward`` cannot be captured, or uses fewer than two units (then
            there is nothing to cut between: give ``split_points`` by hand).
    """
    if captured is None:
        captured = capture(model, example_inputs)
    return _ordered(model, list(captured.graph.nodes))


def _ordered(model: nn.Module, nodes: list[fx.Node]) -> list[str]:
    first: dict[int, str] = {}
    for name in units(model):
        at = _first_use(nodes, name)
        if at is not None and at not in first:
            first[at] = name
    ordered = [first[at] for at in sorted(first)]
    if len(ordered) < 2:
        raise PartitionError(
            f"split_points='auto' found {len(ordered)} unit(s) used by "
            f"{type(model).__name__}.forward ({ordered}), so there is nothing to cut between; "
            "name the split points by hand (split_points=['blocks.4', ...])")
    return ordered[1:]
