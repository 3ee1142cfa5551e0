"""The capture check (:mod:`pipetrain.split.check`): stages that compute another function than
the model are refused before any step, naming the output and the size of the difference; a
model's buffers are as they were after the check; and a Hugging Face config's ``use_cache`` is
off only while the model is captured."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain.errors import PartitionError


class Sly(nn.Module):
    """Doubles its output when torch.export traces it: a branch taken only under capture."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        return y * 2 if torch.compiler.is_exporting() else y


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def _pipe(model: nn.Module) -> pt.Pipeline:
    return pt.Pipeline(model, "gpipe", 2, nn.MSELoss(), split_points=["b"],
                       example_inputs=(torch.randn(4, 4),), local_ranks=2)


def test_a_branch_taken_only_under_capture_is_refused_with_the_size_of_the_difference() -> None:
    with pytest.raises(PartitionError, match=r"the capture of Sly does not compute what its "
                       r"forward computes on example_inputs: the output: max \|difference\| "
                       r"[0-9.e-]+ of max \|value\|"):
        _pipe(Sly())


def test_the_check_leaves_running_statistics_as_they_were() -> None:
    model = Normed()
    before = copy.deepcopy(model.state_dict())
    pipe = _pipe(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)  # the step, not the check, updates them
    assert not torch.equal(before["norm.running_mean"], model.state_dict()["norm.running_mean"])


def test_a_config_that_keeps_its_cache_on_is_captured_and_keeps_it_on() -> None:
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    config = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, use_cache=True)
    model = tf.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (4, 8))
    pipe = pt.Pipeline(model, "1f1b", 2, lambda out, y: out.logits.float().mean(),
                       split_points="auto", example_inputs={"input_ids": ids}, local_ranks=2)
    assert pipe.step({"input_ids": ids}, ids).loss is not None
    assert model.config.use_cache is True


class Counted(nn.Module):
    """Reshapes by the example's row count while torch.export traces it, by the input's own
    otherwise: a count the capture fixed from the example, as a ``.tolist()`` of a value the
    example decides does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = 8 if torch.compiler.is_exporting() else x.shape[0]
        return self.b(self.a(x).reshape(rows, -1))


def test_a_count_fixed_from_the_example_is_refused_on_its_first_half_of_rows() -> None:
    with pytest.raises(PartitionError, match=r"the capture of Counted fails on the first half "
                       r"of example_inputs' rows, where the model runs: RuntimeError"):
        pt.Pipeline(Counted(), "gpipe", 2, nn.MSELoss(), split_points=["b"],
                    example_inputs=(torch.randn(8, 4),), local_ranks=2)
