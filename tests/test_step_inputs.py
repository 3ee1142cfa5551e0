"""A captured model is stepped with its inputs as its ``forward`` takes them (tensor, tuple,
dict of keywords, or ``pack``), and a form the capture does not match is named in the error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.testing import grad_mismatches, reference_step

LOSS = nn.MSELoss()


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.b(h if scale is None else h * scale))


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _pipe(example: Any) -> pt.Pipeline:
    return pt.Pipeline(Scaled(), "1f1b", 4, LOSS, local_ranks=3, split_points=["b", "c"],
                       example_inputs=example)


@pytest.mark.parametrize("form", ["tensor", "tuple", "dict", "pack"])
def test_a_model_captured_from_a_tuple_steps_with_every_form(form: str) -> None:
    x, y = _xy()
    pipe, ref = _pipe((x[:2],)), Scaled()
    inputs = {"tensor": x, "tuple": (x,), "dict": {"x": x}, "pack": pipe.pack(x)}[form]
    got = pipe.step(inputs, y).loss
    assert got is not None and torch.equal(got, reference_step(ref, x, y, LOSS, 4))
    assert grad_mismatches(pipe.named_parameters(), ref) == []


def test_two_arguments_step_as_a_tuple_or_keywords_and_eval_takes_them_too() -> None:
    x, y = _xy()
    pipe = _pipe({"x": x[:2], "scale": x[:2]})
    a = pipe.step((x, x), y).loss
    b = pipe.step({"x": x, "scale": x}, y).loss
    c = pipe.eval_step((x, x), y).loss
    assert a is not None and b is not None and c is not None
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("example,given,names", [
    ((torch.zeros(2, 8),), (torch.zeros(8, 8), torch.zeros(8, 8)), ["scale given (not captured)"]),
    ({"x": torch.zeros(2, 8), "scale": torch.zeros(2, 8)}, torch.zeros(8, 8),
     ["scale missing (captured with it)"]),
    ((torch.zeros(2, 8),), [torch.zeros(8, 8)],
     ["argument 'x' was captured as a Tensor and is given as a list of 1"]),
    ((torch.zeros(2, 8),), {"z": torch.zeros(8, 8)},
     ["as keyword arguments: missing a required argument: 'x'"]),
])
def test_a_form_that_fits_no_capture_is_named(example: Any, given: Any, names: list[str]) -> None:
    pipe = _pipe(example)
    with pytest.raises(ValueError) as e:
        pipe.step(given, torch.zeros(8, 8))
    text = str(e.value)
    assert "[rank 0] step 0, stage 0: the model was captured with forward(x=a Tensor" in text
    assert all(n in text for n in names), text


def test_hf_gpt2_captured_from_a_tuple_steps_with_a_tensor() -> None:
    pytest.importorskip("transformers")
    from helpers.hf import gpt2, lm_loss

    torch.manual_seed(0)
    model = gpt2()
    torch.manual_seed(0)
    ref = gpt2()
    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    pipe = pt.Pipeline(model, "zbv", 4, lm_loss, local_ranks=2, split_points="auto",
                       example_inputs=(ids[:2],))
    got = pipe.step(ids, ids).loss
    want = reference_step(ref, ids, ids, lm_loss, 4)
    assert got is not None and torch.allclose(got, want, rtol=1e-6)


class DictIn(nn.Module):
    """A ``forward(batch)`` that takes one dict."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.lin(batch["x"])  # type: ignore[no-any-return]


def test_the_reference_gives_a_dict_as_keywords_only_where_forward_takes_them() -> None:
    x, y = _xy()
    one, keywords = DictIn(), Scaled()
    assert torch.equal(reference_step(one, {"x": x}, y, LOSS, 1),
                       LOSS(one({"x": x}), y))  # the dict, whole
    assert torch.equal(reference_step(keywords, {"x": x}, y, LOSS, 1),
                       LOSS(keywords(x), y))
