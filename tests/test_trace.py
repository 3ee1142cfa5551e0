"""Trace: a usual-style transformer LM cut by split points runs bitwise like the whole model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from helpers.lm import captured_lm, lm_batch, lm_loss, tiny_lm
from pipetrain.errors import PartitionError, StageError
from pipetrain.split.trace import TracedSplit, split_model

POINTS = [[], ["blocks.2"], ["blocks.1", "blocks.3"], ["pos", "blocks.1.attn", "norm"],
          ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]]


def _inputs(masked: bool) -> tuple[dict[str, Any], torch.Tensor]:
    ids, mask, targets = lm_batch()
    return ({"input_ids": ids, "attention_mask": mask} if masked else {"input_ids": ids}), targets


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.clone()
    return grads


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
@pytest.mark.parametrize("points", POINTS, ids=str)
def test_chained_stages_match_the_model_bitwise(points: list[str], masked: bool) -> None:
    model, captured = captured_lm(masked)
    model.zero_grad()
    kwargs, targets = _inputs(masked)
    want = model(**kwargs)
    lm_loss(want, targets).backward()  # type: ignore[no-untyped-call]
    want_grads = _grads(model)
    model.zero_grad()
    split = split_model(model, points, kwargs, captured=captured)
    assert len(split.stages) == len(points) + 1
    got = split.run(split.pack(**kwargs))
    assert torch.equal(got, want)
    lm_loss(got, targets).backward()  # type: ignore[no-untyped-call]
    got_grads = _grads(model)
    assert all(torch.equal(got_grads[n], g) for n, g in want_grads.items())


def test_positional_example_inputs_and_pack() -> None:
    model = tiny_lm()
    ids, mask, _ = lm_batch()
    split = split_model(model, ["blocks.2"], (ids, mask))
    assert split.input_names == ["input_ids", "attention_mask"]
    assert split.pack(ids, attention_mask=mask) == {"input_ids": ids, "attention_mask": mask}
    assert torch.equal(split.run(split.pack(ids, mask)), model(ids, mask))


@pytest.mark.parametrize("points", POINTS[1:], ids=str)
def test_parameters_are_the_models_own_under_their_names(points: list[str]) -> None:
    model, captured = captured_lm(True)
    split = split_model(model, points, _inputs(True)[0], captured=captured)
    seen = set()
    for stage, names in zip(split.stages, split.param_names):
        assert set(names) == {n for n, _ in stage.named_parameters()}
        for name, p in stage.named_parameters():
            assert p is model.get_parameter(names[name])
            seen.add(names[name])
    assert seen == {n for n, _ in model.named_parameters()}


def test_each_block_lands_in_its_stage() -> None:
    model, captured = captured_lm(True)
    split = split_model(model, ["blocks.1", "blocks.3"], _inputs(True)[0], captured=captured)
    owners = [{n.split(".")[0] + "." + n.split(".")[1] for n in names.values()
               if n.startswith("blocks.")} for names in split.param_names]
    assert owners == [{"blocks.0"}, {"blocks.1", "blocks.2"}, {"blocks.3"}]
    assert "norm.weight" in split.param_names[2].values()


@pytest.mark.parametrize("points", POINTS[1:], ids=str)
def test_tied_embedding_is_one_parameter_in_first_and_last_stage(points: list[str]) -> None:
    model, captured = captured_lm(True)
    split = split_model(model, points, _inputs(True)[0], captured=captured)
    last = len(split.stages) - 1
    assert split.shared == {"embed.weight": [0, last]}
    first_params = dict(split.stages[0].named_parameters())
    last_params = dict(split.stages[last].named_parameters())
    assert first_params["embed.weight"] is model.embed.weight
    assert last_params["head.weight"] is model.embed.weight
    assert split.param_names[last]["head.weight"] == "embed.weight"


def test_mask_passes_through_the_middle_stage() -> None:
    model, captured = captured_lm(True)
    split = split_model(model, ["blocks.1", "blocks.3"], _inputs(True)[0], captured=captured)
    payload = split.stages[0](split.pack(**_inputs(True)[0]))
    assert set(payload) == set(split.boundaries[0])
    mask_keys = {k for k in set(split.boundaries[0]) & set(split.boundaries[1])
                 if isinstance(payload[k], torch.Tensor)}
    assert len(mask_keys) == 1  # the padding mask; the residual stream changes name
    assert {type(payload[k]) for k in split.boundaries[0]} == {torch.Tensor, int}  # sizes
    (key,) = mask_keys
    assert payload[key].dtype == torch.bool and payload[key].shape == (4, 1, 8, 8)


class Skip(nn.Module):
    """A skip from the first stage to the last, an int from a shape, a fixed keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 2.0, extra: Any = None) -> torch.Tensor:
        n = x.size(-1)
        h = self.a(x)
        skip = h * torch.tensor(0.5)  # a tensor constant, stored by the tracer
        h = self.c(self.b(h)) + skip
        return h * scale / n


def test_skip_and_int_travel_through_every_stage() -> None:
    torch.manual_seed(0)
    model, x = Skip(), torch.randn(3, 4)
    split = split_model(model, ["b", "c"], {"x": x})
    assert split.input_names == ["x"]  # scale and extra keep their defaults
    mid = split.stages[1](split.stages[0](split.pack(x)))
    assert len([v for v in mid.values() if isinstance(v, torch.Tensor)]) == 2  # skip, b's out
    assert torch.equal(split.run(split.pack(x)), model(x))
    y = torch.randn(5, 4)  # another batch size: the capture's dimensions are symbolic
    assert torch.equal(split.run(split.pack(y)), model(y))
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]


def test_fixed_plain_argument_is_checked_at_run_time() -> None:
    torch.manual_seed(0)
    model, x = Skip(), torch.randn(3, 4)
    split = split_model(model, ["c"], {"x": x, "scale": 3.0})
    assert torch.equal(split.run(split.pack(x, 3.0)), model(x, 3.0))
    with pytest.raises(ValueError, match=r"scale was 3.0 when the model was captured.*4.0"):
        split.run(split.pack(x, 4.0))
    with pytest.raises(ValueError, match=r"captured with the arguments \['x', 'scale'\] but "
                       r"this step gives \['x'\]"):
        split.run(split.pack(x))


@pytest.mark.parametrize("points,match", [
    (["blocks.9"], r"'blocks.9' is not a submodule of TinyLM \(candidates: blocks\.\d"),
    (["blocks.3", "blocks.1"], r"execution order.*'blocks.1' \(node \d+\) is not after"),
    (["blocks.1", "blocks.1"], r"'blocks.1' appear more than once"),
    (["blocks.1", "blocks.1.ln1"], r"distinct places"),
    ("blocks.1", r"must be a list of module names"),
])
def test_bad_split_points(points: Any, match: str) -> None:
    model, captured = captured_lm(True)
    with pytest.raises(PartitionError, match=match):
        split_model(model, points, _inputs(True)[0], captured=captured)


def test_unused_split_point_and_bad_inputs() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(PartitionError, match=r"\['unused'\] are never used"):
        split_model(Skip(), ["unused"], {"x": x})
    with pytest.raises(PartitionError, match="do not fit forward"):
        split_model(Skip(), ["b"], {"y": x})
    with pytest.raises(PartitionError, match="must be a tuple"):
        split_model(Skip(), ["b"], [x])  # type: ignore[arg-type]


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.head = Gate(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x))


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: export cannot capture it
            return self.lin(x)
        return x


def test_data_dependent_control_flow_is_a_clear_error_with_a_way_out() -> None:
    torch.manual_seed(0)
    model, x = Branchy(), torch.randn(3, 4)
    with pytest.raises(PartitionError, match=r"(?s)could not capture Branchy.forward at .*"
                       r"test_trace.py:\d+ \(`if x.sum\(\) > 0:.*torch.where.*balance"):
        split_model(model, ["head"], (x,))


class DtypeSender(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype  # made in stage 0, used in both stages
        return self.b(self.a(x).to(dtype)).to(dtype)


def test_a_dtype_read_in_one_stage_and_used_in_another_is_not_a_payload() -> None:
    model, x = DtypeSender(), torch.randn(2, 4)
    split = split_model(model, ["b"], (x,))  # the capture fixes the dtype in the graph
    assert all(isinstance(v, (torch.Tensor, int)) for v in split.stages[0](split.pack(x)).values())
    assert torch.equal(split.run(split.pack(x)), model(x))


# -- the real Pipeline, local mode --------------------------------------------------------
def _reference(model: nn.Module, kwargs: dict[str, Any], targets: torch.Tensor,
               m: int) -> torch.Tensor:
    """The model on m micro-batches one after another, losses weighted as the pipeline does."""
    n = targets.shape[0]
    total = torch.zeros(())
    for part in range(m):
        rows = slice(part * n // m, (part + 1) * n // m)
        loss = lm_loss(model(**{k: v[rows] for k, v in kwargs.items()}),
                       targets[rows]) * ((rows.stop - rows.start) / n)
        loss.backward()  # type: ignore[no-untyped-call]
        total = total + loss.detach()
    return total


def _pipeline_grads(pipe: pt.Pipeline, split: TracedSplit) -> dict[str, torch.Tensor]:
    grads = {}
    for stage, names in zip(split.stages, split.param_names):
        for name, p in stage.named_parameters():
            assert p.grad is not None, name
            grads[names[name]] = p.grad
    assert {id(p) for p in pipe.parameters()} == {id(p) for s in split.stages
                                                   for p in s.parameters()}
    return grads


@pytest.mark.parametrize("schedule,points", [
    ("1f1b", ["blocks.2"]),
    ("gpipe", ["blocks.2"]),
    ("interleaved-1f1b", ["blocks.1", "blocks.2", "blocks.3"]),
    ("zbv", ["blocks.1", "blocks.2", "blocks.3"]),
])
def test_pipeline_trains_the_split_lm_like_the_model(schedule: str, points: list[str]) -> None:
    ref, model = tiny_lm(), tiny_lm()
    kwargs, targets = _inputs(True)
    split = split_model(model, points, kwargs)
    pipe = pt.Pipeline(split.stages, schedule, microbatches=2, loss_fn=lm_loss, local_ranks=2)
    got = pipe.step(split.pack(**kwargs), targets)
    want = _reference(ref, kwargs, targets, 2)
    assert got.loss is not None and torch.equal(got.loss, want)
    grads = _pipeline_grads(pipe, split)
    ref_grads = dict(ref.named_parameters())
    untied = [n for n in grads if n != "embed.weight"]
    assert [n for n in untied if not torch.equal(grads[n], ref_grads[n].grad)] == []
    # the tied weight's two contributions per micro-batch are summed in another order
    torch.testing.assert_close(grads["embed.weight"], ref_grads["embed.weight"].grad)


@pytest.mark.parametrize("schedule,balance", [("1f1b", None), ("zbv", "time")])
def test_auto_split_points_balance_the_units(schedule: str, balance: str | None) -> None:
    ref, model = tiny_lm(), tiny_lm()
    kwargs, targets = _inputs(True)
    pipe = pt.Pipeline(model, schedule, microbatches=2, loss_fn=lm_loss, local_ranks=2,
                       split_points="auto", example_inputs=kwargs, balance=balance)
    assert pipe.traced is not None and len(pipe.traced.stages) == 8  # embed, pos, 4 blocks, ...
    assert pipe.balance_plan is not None and sum(pipe.balance) == 8
    assert len(pipe.balance) == pipe.schedule.n_stages
    got = pipe.step(pipe.pack(**kwargs), targets)
    want = _reference(ref, kwargs, targets, 2)
    assert got.loss is not None and torch.equal(got.loss, want)
    ref_grads = dict(ref.named_parameters())
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    assert sorted(grads) == sorted(ref_grads)
    assert [n for n, g in grads.items() if n != "embed.weight"
            and not torch.equal(g, ref_grads[n].grad)] == []
    torch.testing.assert_close(grads["embed.weight"], ref_grads["embed.weight"].grad)


def test_auto_split_points_need_example_inputs() -> None:
    with pytest.raises(TypeError, match="example_inputs="):
        pt.Pipeline(tiny_lm(), "1f1b", 2, lm_loss, local_ranks=2, split_points="auto")


def test_a_capture_at_fixed_shapes_steps_like_the_symbolic_one_and_refuses_other_shapes(
) -> None:
    """``dynamic=False`` (what ``pipetrain train`` captures with): a Hugging Face Llama under
    ZB-V gives bitwise the loss and gradients of the default capture (every dimension symbolic;
    its loss is one device's bitwise), every input dimension is fixed, and a step of another
    sequence length is refused naming the dimension, where the default capture takes it."""
    pytest.importorskip("transformers")
    from helpers.hf import llama, lm_loss, points
    from pipetrain.testing import grad_mismatches, reference_step
    from pipetrain.train.infer import fixed_shape

    ids = torch.randint(1, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    pipes, losses = [], []
    for dynamic in (False, True):
        torch.manual_seed(0)
        pipes.append(pt.Pipeline(llama(), "zbv", 4, lm_loss, local_ranks=2,
                                 split_points=points("llama", 4),
                                 example_inputs={"input_ids": ids[:2]}, dynamic=dynamic))
        losses.append(pipes[-1].step({"input_ids": ids}, ids).loss)
    fixed, symbolic = pipes
    torch.manual_seed(0)
    want = reference_step(llama(), {"input_ids": ids}, ids, lm_loss, 4)
    assert losses[0] is not None and torch.equal(losses[0], want) and torch.equal(*losses)
    assert grad_mismatches(fixed.named_parameters(), _held(symbolic)) == []
    assert fixed.traced is not None and symbolic.traced is not None
    assert [leaf.static for leaf in fixed.traced.captured.inputs] == [((0, 2), (1, 12))]
    assert [leaf.static for leaf in symbolic.traced.captured.inputs] == [()]
    # what train.infer.generate pads a window to: the captured rows and positions, or nothing
    assert fixed_shape(fixed) == (2, 12) and fixed_shape(symbolic) == (1, None)
    with pytest.raises(StageError, match=r"dimension 1 of input_ids was fixed at 12 when the "
                       r"model was captured \(at fixed shapes: dynamic=False\)"):
        fixed.step({"input_ids": ids[:, :10]}, ids[:, :10])
    assert symbolic.step({"input_ids": ids[:, :10]}, ids[:, :10]).loss is not None


def _held(pipe: pt.Pipeline) -> nn.Module:
    """A module holding ``pipe``'s parameters under their names (a reference to compare with)."""
    held = nn.Module()
    for name, p in pipe.named_parameters():
        *path, leaf = name.split(".")
        parent = held
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, p)
    return held
