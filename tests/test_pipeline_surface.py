"""The user's `Pipeline` over its engine: what the rest of the package may reach of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pipetrain

ROOT = Path(pipetrain.__file__).parent
ENGINE = {"transport", "executor", "windows", "async_steps", "watchdog", "evaluator",
          "_stepper", "_decoder", "_copies", "_tied_grads"}
"""A Pipeline's engine parts: its transport, executors (the training one, an asynchronous
schedule's phases, the eval graph's, a decoding run's), watchdog, stepper and gradient
copies."""
OWN = {"pipeline.py", "stepper.py", "step_kinds.py",
       "testing.py"}  # testing.py: gathers a pipeline's parameters over its own CPU group
"""The pipeline's own modules, which build and drive the engine."""
PIPE_NAMES = {"pipe", "pipeline"}


def _reaches(path: Path) -> list[str]:
    """``pipe.<engine part>`` (also ``x.pipe.<part>``) in ``path``, as file:line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or node.attr not in ENGINE:
            continue
        holder = node.value
        name = holder.id if isinstance(holder, ast.Name) else (
            holder.attr if isinstance(holder, ast.Attribute) else None)
        if name in PIPE_NAMES:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    return found


def test_outside_its_own_modules_a_pipeline_is_reached_by_its_surface() -> None:
    """train, generation, verify, hf and plan use ``step``, ``eval_step``, ``decode``,
    ``drain``, ``asynchronous``, ``running``, ``StepResult.gave_grads``, the parameters and
    the schedule: never the transport, an executor, the windows or the watchdog, which the
    pipeline's own modules may rearrange."""
    against = [hit for path in sorted(ROOT.rglob("*.py")) if path.name not in OWN
               for hit in _reaches(path)]
    assert against == []


def test_the_check_finds_a_reach(tmp_path: Path) -> None:
    global ROOT
    bad = tmp_path / "loop.py"
    bad.write_text("def f(trainer):\n    return trainer.pipe.windows is None\n")
    saved, ROOT = ROOT, tmp_path
    try:
        assert _reaches(bad) == ["loop.py:2 .windows"]
    finally:
        ROOT = saved
