"""pipetrain: pipeline-parallel training of PyTorch models, every schedule as data."""

import sys
from typing import Any

from pipetrain._version import __version__ as __version__
from pipetrain.errors import PipelineError
from pipetrain.generation import Generator, Sampling
from pipetrain.pipeline import Pipeline, StepResult
from pipetrain.runtime.launch import RankContext, launch
from pipetrain.schedules.action import Action, Op
from pipetrain.schedules.calibrate import calibrate
from pipetrain.schedules.generators import Target, make_schedule
from pipetrain.schedules.schedule import Schedule
from pipetrain.schedules.simulate import Costs, simulate
from pipetrain.split.lazy import LayerSpec, build_layers
from pipetrain.verify import Verification, VerificationFailed, verify

__all__ = [
    "Action", "Costs", "Generator", "LayerSpec", "Op", "Pipeline", "PipelineError", "RankContext",
    "Sampling", "Schedule", "ShardedStages", "StepResult", "Target", "TensorParallel",
    "Verification", "VerificationFailed", "build_layers", "calibrate", "launch", "make_schedule",
    "plan_module", "simulate", "verify",
]
_LAZY = {"ShardedStages": "pipetrain.parallel.sharded",
         "TensorParallel": "pipetrain.parallel.tensor_parallel",
         "plan_module": "pipetrain.plan.module_plan"}
"""Imported on first use: FSDP and DTensor take half a second to import, and the planner
sits at the top of the package's ladder."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")


if "pdoc" in sys.modules:  # the API reference is being built: let it see every public name
    globals().update({name: __getattr__(name) for name in _LAZY})
