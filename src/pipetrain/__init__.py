"""pipetrain: pipeline-parallel training of PyTorch models, every schedule as data."""

from pipetrain.action import Action, Op
from pipetrain.errors import PipelineError
from pipetrain.generators import make_schedule
from pipetrain.schedule import Schedule

__all__ = ["Action", "Op", "PipelineError", "Schedule", "make_schedule"]
__version__ = "0.1.0"
