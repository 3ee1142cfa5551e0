"""Payload: what flows between stages (tensors, tuples, lists, dicts, plain values) as flat tensors.

A payload is flattened into a list of tensors plus a JSON-able *spec* of its structure, so it
can cross a process boundary without pickle: the spec travels as JSON bytes, the tensors as raw
bytes described by (dtype, shape, requires_grad) in a fixed-size integer header.
"""

from __future__ import annotations

import json
from typing import Any

import torch

__all__: list[str] = []

Spec = Any  # JSON: {"t": i} | {"v": value} | ["tuple"|"list", [...]] | ["dict", {...}]

_PLAIN = (int, float, bool, str, type(None))


def flatten(obj: Any) -> tuple[list[torch.Tensor], Spec]:
    """Split ``obj`` into its tensors (depth-first) and a spec that rebuilds it.

    Raises:
        TypeError: for a leaf that is neither a tensor nor a plain JSON value.
    """
    tensors: list[torch.Tensor] = []
    return tensors, _flatten(obj, tensors)


def _flatten(obj: Any, out: list[torch.Tensor]) -> Spec:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return {"t": len(out) - 1}
    if isinstance(obj, (tuple, list)):
        return ["tuple" if isinstance(obj, tuple) else "list", [_flatten(x, out) for x in obj]]
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("stage payload dicts need string keys, got keys " f"{list(obj)!r}")
        return ["dict", {k: _flatten(v, out) for k, v in obj.items()}]
    if isinstance(obj, _PLAIN):
        return {"v": obj}
    raise TypeError(
        f"a stage passed a {type(obj).__name__} to the next stage; payloads may hold tensors, "
        "tuples, lists, str-keyed dicts and plain values (int, float, bool, str, None)"
    )


def unflatten(tensors: list[torch.Tensor], spec: Spec) -> Any:
    """Inverse of :func:`flatten`."""
    if isinstance(spec, dict):
        return tensors[spec["t"]] if "t" in spec else spec["v"]
    kind, body = spec
    if kind == "dict":
        return {k: unflatten(tensors, v) for k, v in body.items()}
    items = [unflatten(tensors, x) for x in body]
    return tuple(items) if kind == "tuple" else items


def spec_to_bytes(spec: Spec) -> bytes:
    return json.dumps(spec, separators=(",", ":")).encode()


def spec_from_bytes(data: bytes) -> Spec:
    return json.loads(data.decode())


# dtype <-> small integer code for the wire header
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODE:
        raise TypeError(f"cannot send tensors of dtype {dtype} between stages")
    return DTYPE_CODE[dtype]
