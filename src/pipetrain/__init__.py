"""pipetrain: pipeline-parallel training of PyTorch models, every schedule as data."""

from pipetrain.action import Action, Op
from pipetrain.calibrate import calibrate
from pipetrain.errors import PipelineError
from pipetrain.generators import make_schedule
from pipetrain.launch import RankContext, launch
from pipetrain.lazy import LayerSpec, build_layers
from pipetrain.pipeline import Pipeline, StepResult
from pipetrain.schedule import Schedule
from pipetrain.simulate import Costs, simulate
from pipetrain.verify import Verification, VerificationFailed, verify

__all__ = [
    "Action", "Costs", "LayerSpec", "Op", "Pipeline", "PipelineError", "RankContext", "Schedule",
    "StepResult", "Verification", "VerificationFailed", "build_layers", "calibrate", "launch",
    "make_schedule", "simulate", "verify",
]
__version__ = "0.1.0"
