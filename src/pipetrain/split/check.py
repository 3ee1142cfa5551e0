"""Capture check: a traced model's stages against its eager ``forward``, on the example, before
any step.

torch.export records the branch a model's Python takes while it traces, and a model may take
another one under tracing than when it runs (a check of ``torch.compiler.is_exporting()``, a
value read from a fake tensor): the stages would then train a different function, silently.
:func:`check_capture` runs the model and its stages on the example inputs, without gradients,
and raises when an output differs by more than its dtype's rounding; the model's buffers are put
back afterwards. Where the capture kept sizes symbolic and the example has 4 rows or more, it
checks a second input too, the example's first half of rows: a capture that fixed a count from
the example's values (a split by ``.tolist()``) fails there, before any step. It cannot compare
a model on the meta device (no values) or one whose stages draw random numbers (dropout: the two
runs draw differently), and leaves those out; of an image-text model's outputs, it leaves out
the vision tower's own (``image_outputs``), which its vision prefix
(:mod:`pipetrain.split.prefix`) does not pass on.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pipetrain.errors import PartitionError
from pipetrain.runtime import microbatch
from pipetrain.runtime.torch_private import pytree
from pipetrain.split.inputs import Packed
from pipetrain.split.lazy import is_meta
from pipetrain.split.trace import TracedSplit

__all__ = ["check_capture"]

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2,
             torch.float16: 3e-3}
"""Per dtype: the largest difference allowed, relative to the output's largest magnitude."""


def check_capture(model: nn.Module, split: TracedSplit, example: Any) -> None:
    """Raise when ``split``'s stages, run one after another on ``example``, give another
    output than ``model`` itself (see the module).

    Raises:
        PartitionError: naming the model, the output and the size of the difference.
    """
    if is_meta(model) or any(split.draws):
        return
    payload = split.payload(example)
    _check_on(model, split, payload, "example_inputs", second=False)
    half = _first_half(split, payload)
    if half is not None:
        _check_on(model, split, half, "the first half of example_inputs' rows", second=True)


def _first_half(split: TracedSplit, payload: Packed) -> Packed | None:
    """A second input, where one can be made: the example's first half of rows, as a first
    of two micro-batches gets them, when the capture kept sizes symbolic and the example has
    4 rows or more (a capture that fixed a size from the example's values fails on it)."""
    ids = payload.get("input_ids")
    try:
        rows = ids.shape[0] if torch.is_tensor(ids) else microbatch.batch_size(payload, 0)
        if not split.captured.dynamic or rows < 4:
            return None
        half: Packed = split.split(payload, 2, 0)[0]
    except ValueError:
        return None
    return half


def _check_on(model: nn.Module, split: TracedSplit, payload: Packed, what: str,
              second: bool) -> None:
    """Compare the model and its stages on ``payload`` (``what`` it is); a ``second`` input
    that the model or the capture's fixed sizes refuse is left out."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        with torch.no_grad():
            bound = inspect.BoundArguments(split.captured.signature, payload)
            try:
                want = model(*bound.args, **bound.kwargs)
            except Exception:  # noqa: BLE001  (the model itself cannot take the second input:
                if not second:  # a KV cache sized for the example, say)
                    raise
                return
            _put_back(model, saved)  # a forward that updates a buffer runs on the same one
            try:
                got = split.run(payload)
            except ValueError:  # sizes the capture fixed (its error names them at a step)
                if not second:
                    raise
                return
            except Exception as e:  # noqa: BLE001  (what the captured graph raised)
                raise PartitionError(
                    f"the capture of {type(model).__name__} fails on {what}, where the model "
                    f"runs: {type(e).__name__}: {e}. The capture fixed what example_inputs "
                    "decided (a count read with .tolist(), say); capture with an example of "
                    "the micro-batches' size, or report the model") from e
    finally:
        _put_back(model, saved)
    problems = _differences(want, got, visual=split.prefix is not None)
    if problems and split.prefix is not None and split.prefix.dropped:
        raise PartitionError(
            f"{type(model).__name__} passes its {split.prefix.path} "
            f"{', '.join(split.prefix.dropped)}, which its own forward does not take; captured "
            f"from its language model on without them, it computes another function on {what} "
            f"({'; '.join(problems)}), so it cannot be split from its language "
            "model on yet (docs/multimodal.md)")
    if problems:
        raise PartitionError(
            f"the capture of {type(model).__name__} does not compute what its forward computes "
            f"on {what}: {'; '.join(problems)}. torch.export recorded another branch "
            "of its Python than the one it runs eagerly (code that checks whether it is being "
            "traced, or reads a value torch.export cannot know); training these stages would "
            "train another function. Split it as a layer list, or report the model")


def _put_back(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(saved[name])


def _differences(want: Any, got: Any, visual: bool) -> list[str]:
    """The outputs that differ: path, largest difference and largest magnitude (``visual``:
    the vision tower's own outputs, which a prefix keeps to itself, left out)."""
    flat_want, _ = pytree.tree_flatten_with_path(want)
    flat_got = dict(pytree.tree_flatten_with_path(got)[0])
    problems = []
    for path, a in flat_want:
        b = flat_got.get(path)
        if not torch.is_tensor(a) or not a.is_floating_point() or a.numel() == 0:
            continue
        where = pytree.keystr(path) or "the output"
        if visual and (b is None or "_outputs'" in where) and ("image" in where
                                                              or "video" in where):
            continue  # the tower's outputs: the prefix's own (the graph may echo its stand-in)
        if not torch.is_tensor(b) or b.shape != a.shape:
            problems.append(f"{where}: {tuple(a.shape)} eagerly, "
                            f"{tuple(b.shape) if torch.is_tensor(b) else type(b).__name__} "
                            "captured")
            continue
        scale = float(a.abs().max())
        diff = float((a.double() - b.double()).abs().max())
        if not diff <= TOLERANCE.get(a.dtype, 1e-4) * max(scale, 1.0):
            problems.append(f"{where}: max |difference| {diff:.3g} of max |value| {scale:.3g} "
                            f"({str(a.dtype).removeprefix('torch.')})")
    return problems
