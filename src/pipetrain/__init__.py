"""pipetrain: pipeline-parallel training of PyTorch models, every schedule as data.

What a user calls is here: :class:`Pipeline` and its :class:`StepResult`, :func:`launch` and
its :class:`RankContext`, :func:`verify`, :class:`Generator`, :func:`build_layers` and the
errors. The toolkits are their subpackages: :mod:`pipetrain.schedules` (make, simulate and
calibrate schedules), :mod:`pipetrain.parallel` (FSDP2 and tensor parallelism on the stages),
:mod:`pipetrain.plan` (plan a model's layout).
"""

import warnings as _warnings
from typing import Any as _Any

from pipetrain._version import __version__ as __version__
from pipetrain.errors import PipelineError
from pipetrain.generation import Generator, Sampling
from pipetrain.pipeline import Pipeline, StepResult
from pipetrain.pipeline_config import PipelineConfig
from pipetrain.runtime.launch import RankContext, launch
from pipetrain.split.lazy import LayerSpec, build_layers
from pipetrain.verify import Verification, VerificationFailed, verify

__all__ = [
    "Generator", "LayerSpec", "Pipeline", "PipelineConfig", "PipelineError", "RankContext",
    "Sampling",
    "StepResult", "Verification", "VerificationFailed", "build_layers", "launch", "verify",
]
_MOVED = {**{name: "pipetrain.schedules" for name in (
    "Action", "Costs", "Op", "Schedule", "Target", "calibrate", "make_schedule", "simulate")},
    "ShardedStages": "pipetrain.parallel", "TensorParallel": "pipetrain.parallel",
    "plan_module": "pipetrain.plan"}
"""Names that were here until 0.1.0 and live in their toolkit now; the old spelling works,
with a DeprecationWarning, for one more release."""


def __getattr__(name: str) -> _Any:
    if name in _MOVED:
        import importlib

        _warnings.warn(f"pipetrain.{name} is {_MOVED[name]}.{name} now; the old name goes in "
                      "the next release", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
