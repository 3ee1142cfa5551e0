"""PipelineConfig: a pipeline's settings, frozen, each rule between them checked once."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import pipetrain as pt
from pipetrain import PipelineConfig
from pipetrain.schedules import make_schedule


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


M4: dict[str, Any] = {"microbatches": 4}
RULES: list[tuple[dict[str, Any], type[Exception], str, str]] = [
    # settings, error, message, a fixed part of it as written in the source
    ({"schedule": "zbv"}, ValueError, "microbatches is required with a schedule name",
     "microbatches is required with a schedule name"),
    ({"schedule": make_schedule("1f1b", 2, 4), "microbatches": 8}, ValueError,
     "has 4 micro-batches, but microbatches=8 was passed", "micro-batches, but microbatches="),
    ({**M4, "loss_reduction": "avg"}, ValueError, "loss_reduction must be 'mean' or 'sum'",
     "loss_reduction must be 'mean' or 'sum'"),
    ({**M4, "local_ranks": 0}, ValueError, "local_ranks must be >= 1", "local_ranks must be >="),
    ({**M4, "timeout": 0}, ValueError, "timeout must be a positive number of seconds",
     'f"timeout must be a positive number'),  # (the command's --timeout is its own)
    ({**M4, "split_points": "auto"}, TypeError, "split_points= needs example_inputs=",
     "split_points= needs example_inputs="),
    ({**M4, "compile": 3}, TypeError, "compile must be True, False or a torch.compile backend",
     "compile must be True, False"),
    ({**M4, "compile": True, "recompute": "always"}, ValueError, "compile=True with recompute",
     "compile=True with recompute"),
    ({**M4, "compile": True, "parallelize": lambda s, layers: None}, ValueError,
     "compile=True with parallelize=", "compile=True with parallelize="),
    ({**M4, "schedule": "pipedream"}, ValueError,
     "'pipedream' steps each stage after every backward: pass optimizer=",
     "steps each stage after every backward: pass"),
    ({**M4, "optimizer": _sgd}, ValueError, "optimizer= is for schedule 'pipedream'",
     "optimizer= is for schedule 'pipedream'"),
    ({**M4, "schedule": "pipedream-2bw", "compile": True}, ValueError,
     "'pipedream-2bw' (asynchronous: weight versions per step) does not run with compile=",
     "(asynchronous: weight versions per step) does not"),
    ({**M4, "schedule": "pipedream", "optimizer": _sgd,
      "parallelize": lambda s, layers: None}, ValueError, "does not run with parallelize=",
     "(asynchronous: weight versions per step) does not"),
]


def _pattern(message: str) -> str:
    return message.replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize(("settings", "error", "message", "written"), RULES)
def test_each_rule_names_the_settings_and_the_pipeline_refuses_by_it(
        settings: dict[str, Any], error: type[Exception], message: str, written: str) -> None:
    with pytest.raises(error, match=_pattern(message)):
        PipelineConfig(**settings)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    with pytest.raises(error, match=_pattern(message)):
        pt.Pipeline(layers, **{"local_ranks": 2, **settings})


def test_each_rules_message_is_written_in_one_place() -> None:
    """A rule lives in the config alone: its message is in no other module."""
    root = Path(pt.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py")}
    for _, _, _, written in RULES:
        where = [p.relative_to(root).as_posix() for p, text in sources.items()
                 if written in text]
        assert where == ["pipeline_config.py"], (written, where)


def test_a_config_is_frozen_and_replace_checks_again() -> None:
    config = PipelineConfig("1f1b", 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.microbatches = 8  # type: ignore[misc]
    assert config.replace(microbatches=8).microbatches == 8
    with pytest.raises(ValueError, match="loss_reduction"):
        config.replace(loss_reduction="avg")


def test_from_config_builds_what_the_constructor_builds() -> None:
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()]
    config = PipelineConfig("zbv", 4, nn.functional.mse_loss, local_ranks=2)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    a = pt.Pipeline.from_config(layers, config).step(x, y).loss
    b = pt.Pipeline(layers, "zbv", 4, nn.functional.mse_loss, local_ranks=2)
    assert b.config == config and torch.equal(b.step(x, y).loss, a)


def test_verify_and_generator_refuse_by_the_same_rules() -> None:
    with pytest.raises(ValueError, match="microbatches is required"):
        pt.verify(nn.Sequential(nn.Linear(4, 4)), torch.randn(4, 4), microbatches=None,
                  split_points=None)  # type: ignore[arg-type]
