"""train/sources/choice.py: the one place a run's config picks its model source, and what each
kind refuses, prepares and records before any rank starts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.hf import save_dir
from pipetrain.plan.unit_profile import UNITS
from pipetrain.train.checks import check_config
from pipetrain.train.config import TrainConfig
from pipetrain.train.sources.choice import GPTKind, HFKind, Kind, kind_of

SRC = Path(__file__).resolve().parents[1] / "src" / "pipetrain"


def test_the_config_names_the_kind_and_the_planner_knows_every_kind() -> None:
    assert isinstance(kind_of(TrainConfig()), GPTKind)
    assert isinstance(kind_of(TrainConfig(hf="some/dir")), HFKind)
    assert set(UNITS) == set(Kind.__subclasses__())


def test_the_gpt_kind_refuses_what_only_a_hugging_face_model_has(tmp_path: Path) -> None:
    kind = GPTKind()
    assert kind.problems(TrainConfig()) == []
    [said] = kind.problems(TrainConfig(preset="huge"))
    assert said.startswith("unknown preset 'huge'; choose one of")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    said = kind.problems(TrainConfig(lora_r=4, ep=2, data=str(data)))
    assert [p.split(" ")[0] for p in said] == ["--ep", "--lora-r", "--data"], said
    assert kind.label(TrainConfig(preset="small")) == "small"
    assert kind.provenance(TrainConfig()) == {} and kind.rank_modules(TrainConfig()) == ()
    assert kind.meta_model(TrainConfig()) is None


def test_the_hf_kind_refuses_a_directory_without_config_or_a_split_without_weights(
        tmp_path: Path) -> None:
    kind = HFKind()
    [said] = kind.problems(TrainConfig(hf=str(tmp_path / "none")))
    assert "no config.json there" in said
    bare = save_dir("llama", tmp_path / "bare", "some text to train a tokenizer on " * 20,
                    weights=False)
    cfg = TrainConfig(hf=str(bare), tp=2)
    [said] = kind.problems(cfg)
    assert "--tp with --hf needs the checkpoint's weights" in said
    with pytest.raises(ValueError, match="needs the checkpoint's weights"):
        check_config(TrainConfig(hf=str(bare), tp=2, pp=1, batch_size=2, microbatches=1), 2)
    assert kind.problems(TrainConfig(hf=str(bare))) == []
    assert kind.provenance(cfg) == {"hf_source": str(bare.resolve())}
    assert kind.label(cfg) == str(bare)
    assert type(kind.meta_model(cfg)).__name__ == "LlamaForCausalLM"


def _asks_for_hf(node: ast.AST) -> bool:
    """Whether ``node`` is a test on a config's ``hf`` field (``cfg.hf``, ``args.hf``)."""
    tests = [n.test for n in ast.walk(node) if isinstance(n, (ast.If, ast.IfExp))]
    tests += [v for n in ast.walk(node) if isinstance(n, ast.BoolOp) for v in n.values]
    return any(isinstance(a, ast.Attribute) and a.attr == "hf"
               for t in tests for a in ast.walk(t))


def test_no_command_or_loop_branches_on_the_hf_flag_outside_the_choice() -> None:
    """A new source touches its classes and the choice, not the commands and the loop.

    Left to branch: the sources themselves, the Hugging Face modules, the commands that only
    take a Hugging Face model (verify_hf, generate), and the cluster planner, which reads a
    model's architecture numbers from its config.json (``--hf``, ``--config-json``) or a
    preset."""
    allowed = {"train/commands/verify_hf.py", "train/commands/generate_command.py",
               "plan/cluster/cluster_command.py"}
    found = [str(p.relative_to(SRC)) for p in sorted(SRC.rglob("*.py"))
             if not str(p.relative_to(SRC)).startswith(("hf/", "train/sources/"))
             and str(p.relative_to(SRC)) not in allowed and _asks_for_hf(ast.parse(p.read_text()))]
    assert found == []
