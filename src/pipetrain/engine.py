"""Engine: what runs a pipeline's steps on this rank, beneath the user's ``Pipeline``.

A :class:`~pipetrain.pipeline.Pipeline` is the user's object: the model's stages, the schedule,
the parameters, and the steps (``step``, ``eval_step``, ``decode``, ``drain``). What runs those
steps on this rank is its :attr:`~pipetrain.pipeline.Pipeline.engine`: the transport to the
other ranks, the executors of the action lists, the watchdog, an asynchronous schedule's
windows, and the stepper that runs each step's kind (:mod:`pipetrain.step_kinds`). Tools and
tests that look inside a pipeline read them here; the rest of pipetrain does not
(``tests/test_pipeline_surface.py``), and they may change between releases.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.runtime.async_steps import AsyncSteps
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.failure.watchdog import Watchdog
from pipetrain.runtime.transport.comm import P2P
from pipetrain.stepper import Stepper

__all__ = ["Engine"]


@dataclass
class Engine:
    """A pipeline's parts on this rank that run its steps."""

    transport: P2P | None
    """The messages to and from the other ranks (None: ``local_ranks``, all in one process)."""
    executor: Executor
    """The training graph's executor (an asynchronous schedule's steady phase)."""
    watchdog: Watchdog | None
    """Turns a stuck or failed peer into an error here within the timeout (None: local)."""
    async_steps: AsyncSteps | None
    """An asynchronous schedule's phases and weight versions (None: a flushing one)."""
    stepper: Stepper
    """Runs one step of a kind, from the batch to its result or failure."""
    evaluator: Executor | None = None
    """The eval graph's executor, when the model was captured in training mode into a graph
    that eval changes (dropout, batch norm), captured at the first eval step; None: not
    (yet)."""
    decoder: Executor | None = None
    """The executor of the last decoding schedule run (``Pipeline.decode``)."""
