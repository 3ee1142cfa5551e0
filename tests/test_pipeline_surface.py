"""The user's `Pipeline` over its engine: what the rest of the package may reach of it."""

from __future__ import annotations

import ast
from pathlib import Path

import pipetrain

ROOT = Path(pipetrain.__file__).parent
ENGINE = {"engine", "transport", "executor", "windows", "async_steps", "watchdog", "evaluator",
          "_copies"}
"""A Pipeline's engine (:mod:`pipetrain.engine`), and the old names of its parts."""
OWN = {"pipeline.py", "engine.py", "stepper.py", "step_kinds.py",
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


def test_the_engines_parts_under_their_old_names_warn() -> None:
    import pytest
    import torch
    from torch import nn

    pipe = pipetrain.Pipeline([nn.Linear(2, 2), nn.Linear(2, 2)], "1f1b", 2, local_ranks=2)
    for old, part in (("transport", "transport"), ("executor", "executor"),
                      ("watchdog", "watchdog"), ("evaluator", "evaluator"),
                      ("windows", "async_steps")):
        with pytest.warns(DeprecationWarning, match=f"Pipeline.{old} is Pipeline.engine.{part}"):
            assert getattr(pipe, old) is getattr(pipe.engine, part)
    assert pipe.step(torch.ones(2, 2)).loss is None  # no loss_fn: the engine still runs


def test_running_names_the_action_of_the_step_in_progress() -> None:
    """A forward hook sees F in forwards, the backward's op in a recomputation's replay, F in
    an eval step, and nothing between steps."""
    import torch
    from torch import nn

    from pipetrain.schedules.action import Op

    torch.manual_seed(0)
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    pipe = pipetrain.Pipeline(layers, "1f1b", 2, nn.functional.mse_loss, local_ranks=2,
                              recompute="always")
    seen: list[Op | None] = []
    layers_held = [m for s in pipe.stages.values() for m in s.module.modules()
                   if isinstance(m, nn.Linear)]
    for layer in layers_held:
        layer.register_forward_hook(lambda *_: seen.append(
            None if pipe.running() is None else pipe.running().op))  # type: ignore[union-attr]
    x, y = torch.randn(4, 2), torch.randn(4, 2)
    pipe.step(x, y)
    assert seen.count(Op.F) == 4 and len(seen) == 8 and None not in seen  # 4 F, 4 replays
    assert set(seen) - {Op.F} <= {Op.B, Op.I}
    seen.clear()
    pipe.eval_step(x, y)
    assert seen == [Op.F] * 4 and pipe.running() is None


def test_running_sees_an_asynchronous_schedules_fill_phase() -> None:
    """pipedream-2bw's first step runs its fill phase's executor, not the steady one."""
    import torch
    from torch import nn

    from pipetrain.schedules.action import Op

    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    pipe = pipetrain.Pipeline(layers, "pipedream-2bw", 2, nn.functional.mse_loss,
                              local_ranks=2)
    seen: list[Op | None] = []
    for stage in pipe.stages.values():
        stage.module.register_forward_hook(lambda *_: seen.append(
            None if pipe.running() is None else pipe.running().op))  # type: ignore[union-attr]
    pipe.step(torch.randn(4, 2), torch.randn(4, 2))  # the fill
    assert seen == [Op.F] * 4
    pipe.drain()
