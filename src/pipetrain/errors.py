"""Errors: the small exception family every pipetrain failure is raised as."""

from __future__ import annotations

__all__ = ["PipelineError", "ScheduleError", "PartitionError", "StageError", "CommError",
           "CheckpointError"]


class PipelineError(RuntimeError):
    """A pipeline run failed; the message names rank, stage, micro-batch and action."""


class ScheduleError(PipelineError, ValueError):
    """A schedule is malformed, incomplete, out of order or deadlocks."""


class PartitionError(ValueError):
    """A model cannot be split into stages as asked (wrong balance, bad split points)."""


class StageError(PipelineError):
    """A stage's forward, backward or loss raised; the cause is chained."""


class CommError(PipelineError):
    """A message between ranks was missing, late, malformed, or a peer died."""


class CheckpointError(PipelineError):
    """A checkpoint cannot be saved or loaded: missing, uncommitted, corrupt or incompatible."""
