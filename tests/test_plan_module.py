"""Planning your own module: ``pipetrain.plan.plan_module``, ``pipetrain plan --module``, a byte
budget as zb-auto's stage-activations (``memory_target``), and docs/planning.md's snippets.

The best layout's keyword arguments build a ``Pipeline`` (one process, ``local_ranks``) whose
step matches ``testing.reference_step`` in float64, on a user's module and on a Hugging Face
Llama built from a tiny config; a limit nothing fits reports every candidate unfit; a tighter
limit picks a lower predicted peak; the CLI writes what ``read_plan`` reads back."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812  (torch's own idiom)
from torch import nn

import pipetrain as pt
import pipetrain.schedules as ps
from pipetrain.cli import main
from pipetrain.plan import ModulePlan, memory_target, plan_module, read_plan, stage_activations
from pipetrain.plan.planner import Profiled, Scale, evaluate
from pipetrain.split.profile import LayerCost
from pipetrain.testing import reference_step
from pipetrain.train.commands.export_command import size_bytes

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
AMPLE = 1 << 40
FEW = ("1f1b", "zb-h1", "zbv", "zb-auto")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.mix(self.norm(x))))


class UserNet(nn.Module):
    """A user's model: an embedding, a ModuleList of blocks run in a loop, a head."""

    def __init__(self, vocab: int = 40, width: int = 16, depth: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _user() -> tuple[UserNet, torch.Tensor]:
    torch.manual_seed(0)
    return UserNet().double(), torch.randint(0, 40, (8, 10))


@pytest.fixture(scope="module")
def user_plans() -> list[ModulePlan]:
    model, ids = _user()
    return plan_module(model, ids, token_loss, ids, 2, AMPLE, schedules=FEW)


def _steps_like_one_process(model: nn.Module, plan: ModulePlan, inputs: Any, target: Any,
                            loss_fn: Any, keywords: bool = False) -> None:
    """The plan's Pipeline (2 local ranks) steps to the reference's loss and gradients."""
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    pipe = pt.Pipeline(mine, **plan.pipeline_kwargs(), loss_fn=loss_fn, local_ranks=2)
    got = pipe.step(inputs, target)
    want = reference_step((lambda x: ref(**x)) if keywords else ref, inputs, target, loss_fn,
                          plan.microbatches)
    assert got.loss is not None
    torch.testing.assert_close(got.loss, want, rtol=1e-12, atol=0)
    refs = dict(ref.named_parameters())
    held = dict(pipe.named_parameters())
    assert set(held) == set(refs)  # every parameter is in some stage
    for name, p in held.items():
        r = refs[name].grad
        assert p.grad is not None and r is not None, name
        torch.testing.assert_close(p.grad, r, rtol=1e-9, atol=1e-9 * r.abs().max().item())


def test_the_best_layout_of_a_user_module_steps_like_one_process(
        user_plans: list[ModulePlan]) -> None:
    best = user_plans[0]
    units = 7  # embed, 5 blocks, head: the units Pipeline(split_points="auto") cuts
    assert best.fits and all(sum(p.balance) == units for p in user_plans)
    assert {p.schedule for p in user_plans} == set(FEW)
    assert [p.fits for p in user_plans] == [True] * len(user_plans)
    kwargs = best.pipeline_kwargs()
    assert kwargs["split_points"] == "auto" and kwargs["microbatches"] == best.microbatches
    assert kwargs["balance"] == list(best.balance) and kwargs["recompute"] == best.recompute
    model, ids = _user()
    _steps_like_one_process(model, best, ids, ids, token_loss)
    # zb-auto's searched Schedule travels itself, and builds the same way
    auto = next(p for p in user_plans if p.schedule == "zb-auto")
    assert isinstance(auto.pipeline_kwargs()["schedule"], ps.Schedule)
    _steps_like_one_process(model, auto, ids, ids, token_loss)
    config = best.pipeline_config(loss_fn=token_loss, local_ranks=2)  # the one configuration
    assert (config.balance, config.recompute) == (list(best.balance), best.recompute)
    assert pt.Pipeline.from_config(model, config).balance == list(best.balance)


def test_a_layer_list_is_planned_layer_by_layer() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    plans = plan_module([m.double() for m in layers], x, F.mse_loss, y, 2, AMPLE,
                        schedules=("1f1b",), recompute=("never",), microbatches=(2, 4))
    assert {p.microbatches for p in plans} == {2, 4}
    assert "split_points" not in plans[0].pipeline_kwargs()
    _steps_like_one_process(nn.Sequential(*layers), plans[0], x, y, F.mse_loss)


def test_a_hugging_face_llama_from_a_tiny_config_steps_like_one_process() -> None:
    pytest.importorskip("transformers")
    from helpers.hf import batch, llama, lm_loss

    torch.manual_seed(0)
    model = llama().double()
    inputs, targets = batch("llama", 8, 12)
    plans = plan_module(model, inputs, lm_loss, targets, 2, AMPLE, schedules=FEW)
    best = plans[0]
    # units: the embedding, 4 decoder layers, the norm, the rotary tables, the head
    assert best.fits and len(best.profile.layers) == sum(best.balance) >= 6
    _steps_like_one_process(model, best, inputs, targets, lm_loss, keywords=True)


def test_a_limit_nothing_fits_reports_every_candidate_unfit() -> None:
    model, ids = _user()
    plans = plan_module(model, ids, token_loss, ids, 2, 1024, schedules=("1f1b", "zbv"))
    assert plans and not any(p.fits for p in plans)
    assert all(max(p.predicted_peak_bytes) > 1024 for p in plans)


def test_a_tighter_limit_picks_a_lower_predicted_peak(user_plans: list[ModulePlan]) -> None:
    loose = max(user_plans[0].predicted_peak_bytes)
    lowest = min(max(p.predicted_peak_bytes) for p in user_plans)
    assert lowest < loose
    limit = (lowest + loose) // 2
    model, ids = _user()
    tight = plan_module(model, ids, token_loss, ids, 2, limit, schedules=FEW)[0]
    assert tight.fits and max(tight.predicted_peak_bytes) <= limit < loose


@pytest.mark.parametrize(("bad", "error", "match"), [
    ({"ranks": 0}, ValueError, "ranks must be a positive integer"),
    ({"memory_limit": -1}, ValueError, "memory_limit must be a number of bytes"),
    ({"schedules": ["1f1b", "fast"]}, ValueError, r"unknown \['fast'\]"),
    ({"recompute": ["sometimes"]}, ValueError, "recompute"),
    ({"microbatches": [3]}, ValueError, "do not split the batch of 8"),
    ({"loss_fn": "mse"}, TypeError, "loss_fn must be callable"),
    ({"model": "net"}, TypeError, "model must be an nn.Module"),
])
def test_bad_arguments_say_how_to_fix(bad: dict[str, Any], error: type, match: str) -> None:
    model, ids = _user()
    args: dict[str, Any] = {"model": model, "example_inputs": ids, "loss_fn": token_loss,
                            "target": ids, "ranks": 2, "memory_limit": AMPLE, **bad}
    with pytest.raises(error, match=match):
        plan_module(**args)


# -- a byte budget as stage-activations ---------------------------------------------------


def _profile(rows: int = 2) -> Profiled:
    # 6 layers: 1 MiB of parameters (largest weight 1/2 MiB), 1 MiB of activations per row,
    # a quarter of them kept by I until W, inputs of 1/8 MiB per row
    layer = LayerCost(f=1e-3 * rows, i=1e-3 * rows, w=1e-3 * rows, param_bytes=MIB,
                      activation_bytes=MIB * rows, i_held_bytes=MIB * rows // 4,
                      largest_grad_bytes=MIB // 2)
    return Profiled(rows, (layer,) * 6, (MIB * rows // 8,) * 6)


def test_stage_activations_is_the_least_room_over_a_unit() -> None:
    assert stage_activations(100, [10, 20], [30, 20]) == 4.0  # 7 units on rank 0, 4 on 1
    with pytest.raises(ValueError, match="rank 1 needs 60 bytes .* raise it by 5 bytes"):
        stage_activations(55, [10, 20], [30, 40])


def test_a_byte_budget_becomes_the_units_of_a_zb_auto_schedule_that_fits_it() -> None:
    prof = _profile()
    # per stage of 3 layers: units of 6 MiB activations + 1/4 MiB input, + on stage 1 the
    # 1.5 MiB I keeps for W; fixed 12 MiB of state + 6 MiB working + 1/2 MiB gradient
    target = memory_target(50 * MIB, prof, [3, 3])
    assert target.memory_limit == min((50 - 18.5) // 6.25, (50 - 18.5) // 7.75) == 4
    with pytest.raises(ValueError, match="rank 1 needs .* raise it by 1,048,576 bytes"):
        memory_target((18.5 + 7.75 - 1) * MIB, prof, [3, 3])
    with pytest.raises(ValueError, match="parameter state and optimizer step"):
        memory_target(12 * MIB, prof, [3, 3])
    for policy in ("never", "always"):
        for budget in (30 * MIB, 40 * MIB, 60 * MIB, 90 * MIB):
            _check_fits(prof, [3, 3], budget, policy, 8)


def test_the_budget_holds_on_a_profiled_user_module(user_plans: list[ModulePlan]) -> None:
    auto = max((p for p in user_plans if p.schedule == "zb-auto"),
               key=lambda p: p.microbatches)  # the most micro-batches: the most units to hold
    limits = set()
    for share in (0.7, 0.85, 1.0, 1.5, 3.0):
        budget = share * max(auto.predicted_peak_bytes)
        try:
            limits.add(_check_fits(auto.profile, list(auto.balance), budget, "never",
                                   auto.microbatches))
        except ValueError as e:
            assert "raise it by" in str(e) or "over the budget" in str(e)
    assert len(limits) >= 2  # the budgets give different limits, each kept


def _check_fits(prof: Profiled, balance: list[int], budget: float, policy: str,
                m: int) -> float:
    """zb-auto under memory_target's limit: simulated within the units, predicted within
    the budget (the planner's bytes)."""
    target = memory_target(budget, prof, balance, recompute=policy)
    assert target.memory_limit is not None and target.costs is not None
    schedule = ps.make_schedule("zb-auto", len(balance), m, target=target)
    assert max(ps.simulate(schedule).peak_activations) <= target.memory_limit
    cand = evaluate(prof, schedule, balance, policy, budget, Scale())
    assert cand.fits and max(cand.predicted_peak_bytes) <= budget
    return target.memory_limit


# -- the command line ----------------------------------------------------------------------

USER_FILE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 12)
        self.blocks = nn.ModuleList(nn.Linear(12, 12) for _ in range(4))
        self.head = nn.Linear(12, 30)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def loss(logits, ids):
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def build():
    torch.manual_seed(0)
    ids = torch.randint(0, 30, (8, 6))
    return {"model": Net().double(), "example_inputs": ids, "loss_fn": loss, "target": ids}


def broken():
    return {"model": Net(), "inputs": None}
'''


def _cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
         ) -> tuple[int, dict[str, Any]]:
    (tmp_path / "user_model.py").write_text(USER_FILE)
    code = main(["plan", "--module", f"{tmp_path / 'user_model.py'}:build", "--pp", "2",
                 "--out", str(tmp_path / "plan"), "--json", *argv])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_plan_module_command_writes_pipeline_kwargs_that_step(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _cli(tmp_path, capsys, "--memory-limit", "1TiB", "--schedules", "1f1b,zbv")
    best = report["best"]
    sys.path.insert(0, str(tmp_path))
    try:
        import user_model  # the file the command planned
    finally:
        sys.path.remove(str(tmp_path))
    given = user_model.build()
    model, ids, loss = given["model"], given["example_inputs"], given["loss_fn"]
    assert code == 0 and best["fits"] and report["memory_limit"] == 2**40
    assert "example_inputs" not in read_plan(report["config"])
    kwargs = read_plan(report["config"], example_inputs=ids)
    assert kwargs["schedule"] == best["schedule"] and kwargs["balance"] == best["balance"]
    assert kwargs["split_points"] == "auto" and kwargs["microbatches"] == best["microbatches"]
    assert kwargs["example_inputs"][0] is ids  # a tensor: forward's one argument
    assert Path(report["png"]).read_bytes()[:4] == b"\x89PNG"
    ref = copy.deepcopy(model)
    pipe = pt.Pipeline(model, **kwargs, loss_fn=loss, local_ranks=2)
    got = pipe.step(ids, ids).loss
    want = reference_step(ref, ids, ids, loss, kwargs["microbatches"])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    refs = dict(ref.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, refs[name].grad, rtol=1e-9, atol=1e-12)


def test_a_searched_schedule_travels_as_a_file_beside_the_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _cli(tmp_path, capsys, "--memory-limit", "64MiB", "--schedules", "zb-auto")
    kwargs = read_plan(report["config"])
    assert code == 0 and (tmp_path / "plan" / "plan.schedule.csv").is_file()
    assert kwargs["schedule"].actions == ps.Schedule.from_text(
        report["best"]["schedule_text"]).actions


def test_nothing_fits_exits_3_and_says_how(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "user_model.py").write_text(USER_FILE)
    code = main(["plan", "--module", f"{tmp_path / 'user_model.py'}:build", "--pp", "2",
                 "--out", str(tmp_path / "plan"), "--memory-limit", "1KiB",
                 "--schedules", "1f1b"])
    captured = capsys.readouterr()
    assert code == 3 and "no layout fits" in captured.err and "NO" in captured.out
    assert "memory limit 1 KiB per rank" in captured.out


def test_a_package_module_spec_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "planned_pkg_model.py").write_text(USER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["plan", "--module", "planned_pkg_model:build", "--nproc", "2", "--out",
                 str(tmp_path / "plan"), "--memory-limit", "1GiB", "--schedules", "1f1b",
                 "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["ranks"] == 2


@pytest.mark.parametrize(("spec", "extra", "match"), [
    ("{dir}/user_model.py", [], "give path/to/file.py:function"),
    ("{dir}/missing.py:build", [], "no file"),
    ("{dir}/user_model.py:biuld", [], "has no function 'biuld'; did you mean 'build'"),
    ("{dir}/user_model.py:broken", [], r"missing \['example_inputs', 'loss_fn', 'target'\], "
                                       r"unknown \['inputs'\]"),
    ("no_such_package_xyz.models:build", [], "no module 'no_such_package_xyz'"),
    ("{dir}/user_model.py:build", ["--dp", "2"], "pipeline ranks only .* drop --dp"),
    ("{dir}/user_model.py:build", ["--schedules", "fast"], r"unknown \['fast'\]"),
])
def test_bad_module_specs_exit_2_and_say_how(spec: str, extra: list[str], match: str,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "user_model.py").write_text(USER_FILE)
    code = main(["plan", "--module", spec.format(dir=tmp_path), "--memory-limit", "1GiB",
                 "--out", str(tmp_path / "plan"), *extra])
    assert code == 2
    assert re.search(match, capsys.readouterr().err)


def test_sizes_reach_tebibytes() -> None:
    assert size_bytes("1TiB", "--memory-limit") == 2**40 == size_bytes("1 tib")
    assert size_bytes("2.5TiB") == 5 * 2**39 and size_bytes("3TB") == 3 * 10**12
    assert size_bytes("1.5 KiB") == 1536 and size_bytes("4096") == 4096


# -- docs/planning.md ----------------------------------------------------------------------

DOC = ROOT / "docs" / "planning.md"


def test_planning_docs_python_blocks_run_as_written(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for k, code in enumerate(blocks):
        exec(compile(code, f"{DOC.name} block {k}", "exec"), {"__name__": "__main__"})


def test_planning_docs_module_command_runs_as_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = [line[2:] for line in DOC.read_text().splitlines()
             if line.startswith("$ pipetrain plan --module")]
    assert lines
    argv = lines[0].split()[1:]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pipetrain plan: pipetrain.examples.own_model:build" in out and "yes" in out
    assert (tmp_path / "plan.toml").is_file()
