"""Payload: flatten/unflatten round trips, spec bytes, dtype codes, errors for bad leaves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipetrain.runtime.transport.payload import (
    DTYPES,
    dtype_code,
    flatten,
    spec_from_bytes,
    spec_to_bytes,
    unflatten,
)


def _same(a: Any, b: Any) -> bool:
    """Structural equality that compares tensors by identity (flatten must not copy them)."""
    if isinstance(a, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


T1, T2, T3 = torch.randn(2, 3), torch.arange(4), torch.tensor(1.5)

PAYLOADS = {
    "tensor": T1,
    "tuple": (T1, T2),
    "list": [T1, T2, T3],
    "empty tuple": (),
    "nested dict": {"h": T1, "aux": {"ids": T2, "pair": (T3, [T1])}, "note": "x"},
    "int": 7,
    "float": 0.25,
    "bool": True,
    "str": "tokens",
    "None": None,
    "mixed": (T1, 3, None, {"flag": False, "scale": 0.5, "mask": T2}),
}


@pytest.mark.parametrize("obj", PAYLOADS.values(), ids=list(PAYLOADS))
def test_round_trip(obj: Any) -> None:
    tensors, spec = flatten(obj)
    assert _same(unflatten(tensors, spec), obj)


@pytest.mark.parametrize("obj", PAYLOADS.values(), ids=list(PAYLOADS))
def test_round_trip_through_spec_bytes(obj: Any) -> None:
    tensors, spec = flatten(obj)
    data = spec_to_bytes(spec)
    assert isinstance(data, bytes)
    assert spec_from_bytes(data) == spec
    assert _same(unflatten(tensors, spec_from_bytes(data)), obj)


def test_tensors_come_out_depth_first() -> None:
    tensors, _ = flatten({"a": (T1, [T2]), "b": T3})
    assert [id(t) for t in tensors] == [id(T1), id(T2), id(T3)]


def test_plain_values_keep_their_type() -> None:
    # bool is an int subclass, and JSON has one number type: neither may blur on the way back
    obj = (True, 1, 1.0, "1", None)
    back = unflatten([], spec_from_bytes(spec_to_bytes(flatten(obj)[1])))
    assert back == obj
    assert [type(v) for v in back] == [bool, int, float, str, type(None)]


def test_unsupported_leaf_is_a_type_error() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError) as e:
        flatten((T1, {"x": Opaque()}))
    assert str(e.value) == (
        "a stage passed a Opaque to the next stage; payloads may hold tensors, tuples, lists, "
        "str-keyed dicts and plain values (int, float, bool, str, None)"
    )


def test_non_str_dict_keys_are_a_type_error() -> None:
    with pytest.raises(TypeError) as e:
        flatten({"a": T1, 1: T2})
    assert str(e.value) == "stage payload dicts need string keys, got keys ['a', 1]"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_code_round_trip(dtype: torch.dtype) -> None:
    assert DTYPES[dtype_code(dtype)] == dtype


def test_dtype_codes_are_distinct() -> None:
    assert sorted(dtype_code(d) for d in DTYPES) == list(range(len(DTYPES)))


def test_unsupported_dtype_is_a_type_error() -> None:
    with pytest.raises(TypeError) as e:
        dtype_code(torch.quint8)
    assert str(e.value) == "cannot send tensors of dtype torch.quint8 between stages"
