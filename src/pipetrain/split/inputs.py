"""Step inputs: a captured model's step input read in whichever form ``forward`` takes it.

``pipe.step(x, y)``, ``pipe.step((x, mask), y)``, ``pipe.step({"input_ids": ids}, y)`` and
``pipe.step(pipe.pack(ids, attention_mask=mask), y)`` all reach stage 0 as one payload: the
dict of ``forward``'s argument names to values (:class:`Packed`). Of the readings of an input
(keyword arguments, positional arguments, the first argument) the one with the capture's
structure is taken; when none fits, the error names, per reading, the argument that differs,
what was captured and what was given.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pipetrain.runtime.torch_private import pytree

__all__ = ["Packed", "read"]


class Capture(Protocol):
    """What reading an input needs of a capture (:class:`~pipetrain.split.capture.Captured`)."""

    @property
    def signature(self) -> inspect.Signature: ...
    @property
    def in_spec(self) -> pytree.TreeSpec: ...
    @property
    def given(self) -> tuple[str, ...]: ...
    @property
    def inputs(self) -> tuple[Any, ...]: ...  # the capture's Leaf per flattened input

    def pack(self, *args: Any, **kwargs: Any) -> Packed: ...


class Packed(dict[str, Any]):
    """Stage 0's payload of a captured model: ``forward``'s argument names -> values."""


class _Captured:
    """A captured input in an error message: shows as what it was at capture."""

    def __init__(self, leaf: Any) -> None:  # a capture's Leaf
        self.leaf = leaf


def _shape(value: Any) -> str:
    """``a Tensor``, ``a tuple of 2``, ``a dict with keys ['x']``: a value's form, briefly."""
    if isinstance(value, _Captured):
        return "a Tensor" if value.leaf.tensor else repr(value.leaf.constant)
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return repr(value)


def _show_call(given: tuple[str, ...], example: dict[str, Any]) -> str:
    return "forward(" + ", ".join(f"{n}={_shape(example.get(n))}" for n in given) + ")"



def read(captured: Capture, inputs: Any) -> Packed:
    """Stage 0's payload for a step's ``inputs``, in whichever form ``forward`` takes them.

    ``inputs`` is what ``Captured.pack`` made, a dict of keyword arguments, a tuple of
    positional arguments, or the one positional argument itself; of the forms ``inputs``
    can be read as, the one with the structure of the capture is taken (a dict is the
    only argument of a ``forward(batch)`` captured with a dict, else keywords).

    Raises:
        ValueError: when no form matches the capture; it names the argument that differs,
            what was captured and what was given.
    """
    if isinstance(inputs, Packed):
        return inputs
    forms: list[tuple[str, Callable[[], Packed]]] = []
    if isinstance(inputs, dict) and all(isinstance(k, str) for k in inputs):
        forms.append(("keyword arguments", lambda: captured.pack(**inputs)))
    if isinstance(inputs, tuple):
        forms.append(("positional arguments", lambda: captured.pack(*inputs)))
    forms.append(("the first argument", lambda: captured.pack(inputs)))
    tried: list[tuple[str, Packed | TypeError]] = []
    for form, bind in forms:
        try:
            packed = bind()
        except TypeError as e:
            tried.append((form, e))
            continue
        if _structure(captured, packed) == captured.in_spec:
            return packed
        tried.append((form, packed))
    raise ValueError(_mismatch(captured, inputs, tried))

def _structure(captured: Capture, payload: dict[str, Any]) -> pytree.TreeSpec:
    bound = inspect.BoundArguments(captured.signature, payload)
    return pytree.tree_flatten((bound.args, bound.kwargs))[1]

def _mismatch(captured: Capture, inputs: Any, tried: list[tuple[str, Packed | TypeError]]) -> str:
    """Why no reading of ``inputs`` fits the capture: per form, the argument that differs."""
    lines = [f"the model was captured with {_show_call(captured.given, _example(captured))}; this "
             f"step gives {_shape(inputs)}, which fits no form of that call:"]
    for form, got in tried:
        if isinstance(got, TypeError):
            lines.append(f"  - as {form}: {got}")
            continue
        lines.append(f"  - as {form}: {_differs(captured, got)}")
    lines.append("pass the inputs as forward takes them (a tensor, a tuple of positional "
                 "arguments, a dict of keyword arguments, or pipe.pack(*args, **kwargs)) "
                 "with the arguments and structure of example_inputs, or capture again "
                 "with example_inputs of this form")
    return "\n".join(lines)

def _differs(captured: Capture, payload: dict[str, Any]) -> str:
    missing = [n for n in captured.given if n not in payload]
    extra = [n for n in payload if n not in captured.given]
    if missing or extra:
        parts = ([f"{', '.join(missing)} missing (captured with it)"] if missing else []) + (
            [f"{', '.join(extra)} given (not captured)"] if extra else [])
        return "; ".join(parts)
    for name in captured.given:
        want, got = _example(captured).get(name), payload[name]
        if pytree.tree_structure(want) != pytree.tree_structure(got):
            return (f"argument {name!r} was captured as {_shape(want)} and is given as "
                    f"{_shape(got)}")
    return "the arguments are bound in another order than at capture"

def _example(captured: Capture) -> dict[str, Any]:
    """The captured arguments by name, each leaf standing for what it was at capture."""
    args, kwargs = pytree.tree_unflatten([_Captured(leaf) for leaf in captured.inputs],
                                         captured.in_spec)
    return dict(captured.signature.bind(*args, **kwargs).arguments)
