"""Load: ``load_program`` gives ``torch.export.load``'s program, without repeating its work."""

from __future__ import annotations

import functools
import io
import typing
from typing import Any

import pytest
import sympy
import torch
import torch.utils._pytree as pytree
from torch._export.serde import serialize

from pipetrain.split.load import _ParsedOnce, load_program

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

pytest.importorskip("transformers")


@functools.cache
def _saved(name: str) -> tuple[bytes, tuple[Any, ...], dict[str, Any]]:
    """A transformers model from a small config, exported with every input dimension
    symbolic and saved, and arguments at other sizes than the export's: a Llama called with
    a bare tensor, or a zoo model (T5: encoder-decoder, ViT: vision) called with keywords."""
    torch.manual_seed(0)
    if name == "llama":
        from helpers import hf

        model = hf.llama()
        args: tuple[Any, ...] = (torch.randint(0, hf.VOCAB, (2, 8)),)
        kwargs: dict[str, Any] = {}
        other: tuple[tuple[Any, ...], dict[str, Any]] = (
            (torch.randint(0, hf.VOCAB, (3, 5)),), {})
    else:
        import test_zoo as zoo

        arch = zoo.BY_NAME[name]
        model = zoo.build(arch)
        inputs, _ = zoo.batch(arch)
        args, kwargs = (), {k: v[:2] for k, v in inputs.items()}
        other = ((), {k: v[:3] for k, v in inputs.items()})  # another batch size
    dims = pytree.tree_map(lambda t: {d: torch.export.Dim.AUTO for d in range(t.dim())},
                           args or kwargs)  # by position, or by keyword
    program = torch.export.export(model, args, kwargs, dynamic_shapes=dims, strict=False)
    out = io.BytesIO()
    torch.export.save(program, out)
    return out.getvalue(), *other


def _seeded(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``module`` called at sizes it was not saved at, its dropout (T5's) drawn from seed 0."""
    torch.manual_seed(0)
    return module(*args, **kwargs)


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


@pytest.mark.parametrize("name", ["llama", "t5", "vit"])
def test_the_program_is_torchs_in_every_node(name: str) -> None:
    data, args, kwargs = _saved(name)
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
    got, want = (pytree.tree_leaves(_seeded(p.module(), args, kwargs)) for p in (lean, plain))
    assert len(got) == len(want) > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_load_asks_each_class_once_and_parses_each_expression_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = _saved("llama")[0]
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
