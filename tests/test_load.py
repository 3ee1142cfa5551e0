"""Load: ``load_program`` gives ``torch.export.load``'s program, without repeating its work."""

from __future__ import annotations

import io
import typing
from typing import Any

import pytest
import sympy
import torch
from torch._export.serde import serialize

from pipetrain.split.load import _ParsedOnce, load_program

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved() -> tuple[bytes, torch.Tensor]:
    """A 4-layer Llama from transformers, exported with its batch and sequence symbolic."""
    import hf

    torch.manual_seed(0)
    model = hf.llama()
    ids = torch.randint(0, hf.VOCAB, (2, 8))
    dims = {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
    program = torch.export.export(model, (ids,), dynamic_shapes=(dims,), strict=False)
    out = io.BytesIO()
    torch.export.save(program, out)
    return out.getvalue(), torch.randint(0, hf.VOCAB, (3, 5))  # another batch and length


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the calls torch's loader makes to typing's hints and sympy's parse."""
    asked = {"hints": 0, "parses": 0}
    hints, sympify = typing.get_type_hints, sympy.sympify

    def counted_hints(*args: Any, **kwargs: Any) -> Any:
        asked["hints"] += 1
        return hints(*args, **kwargs)

    def counted_sympify(a: Any, *args: Any, **kwargs: Any) -> Any:
        asked["parses"] += isinstance(a, str)
        return sympify(a, *args, **kwargs)

    monkeypatch.setattr(typing, "get_type_hints", counted_hints)
    monkeypatch.setattr(sympy, "sympify", counted_sympify)
    return asked


def test_the_program_is_torchs_in_every_node(saved: tuple[bytes, torch.Tensor]) -> None:
    data, other = saved
    plain = torch.export.load(io.BytesIO(data))
    lean = load_program(data)
    assert str(lean.graph) == str(plain.graph)
    assert str(lean.range_constraints) == str(plain.range_constraints)
    assert str(lean.graph_signature) == str(plain.graph_signature)
    for a, b in zip(lean.graph.nodes, plain.graph.nodes, strict=True):
        va, vb = a.meta.get("val"), b.meta.get("val")
        assert type(va) is type(vb), a
        if isinstance(va, torch.Tensor):  # symbolic sizes, strides: the same expressions
            assert (str(va.shape), str(va.stride()), va.dtype) == \
                   (str(vb.shape), str(vb.stride()), vb.dtype), a
    got, want = lean.module()(other), plain.module()(other)  # at a shape it was not saved at
    assert torch.equal(got[0] if isinstance(got, tuple) else got.logits,
                       want[0] if isinstance(want, tuple) else want.logits)


def test_a_load_asks_each_class_once_and_parses_each_expression_once(
        saved: tuple[bytes, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = saved
    asked = _counting(monkeypatch)
    torch.export.load(io.BytesIO(data))
    plain = dict(asked)
    load_program(data)  # this process's first: each class's hints worked out here
    asked.update(hints=0, parses=0)
    load_program(data)
    assert plain["hints"] > 100 and asked["hints"] == 0
    assert plain["parses"] > 100 and 0 < asked["parses"] < plain["parses"] / 4
    assert serialize.typing is typing and serialize.sympy is sympy  # handed back


def test_torch_gets_its_modules_back_when_a_load_fails() -> None:
    with pytest.raises(Exception):  # noqa: B017  (whatever torch raises on a bad archive)
        load_program(b"not an archive")
    assert serialize.typing is typing and serialize.sympy is sympy


def test_a_kept_parse_serves_only_where_its_symbols_are_the_names_now() -> None:
    parsed = _ParsedOnce()
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    first = parsed.sympify("2*s0 + 1", locals={"s0": s0})
    assert first == 2 * s0 + 1 and parsed.sympify("2*s0 + 1", locals={"s0": s0}) is first
    other = sympy.Symbol("s0", integer=True)  # another deserializer's s0
    again = parsed.sympify("2*s0 + 1", locals={"s0": other})
    assert again == 2 * other + 1 and again != first
    plain = parsed.sympify("2*s0 + 1", locals={})  # a name not known: sympy's own symbol
    assert plain == 2 * sympy.Symbol("s0") + 1
    assert parsed.sympify("3", locals={}) == 3
    assert parsed.sympify(sympy.Integer(4), locals={"s0": s0}) == 4  # not a string: sympy's
