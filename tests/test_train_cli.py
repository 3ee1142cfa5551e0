"""`pipetrain train` options: flags from TrainConfig, --config TOML, torchrun detection."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from pipetrain.cli import build_parser, main
from pipetrain.train.commands import finetune
from pipetrain.train.commands import train_command as train_cli
from pipetrain.train.config import TrainConfig, config_toml, format_config
from pipetrain.train.launch import elastic
from pipetrain.train.logs import report


def _resolve(argv: list[str]) -> TrainConfig:
    return train_cli.resolve(build_parser().parse_args(["train", *argv]))


def test_every_field_is_a_documented_flag() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    train = sub.choices["train"]
    flags = {opt for action in train._actions for opt in action.option_strings}
    docs = train_cli.field_docs()
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
        assert docs.get(f.name), f"TrainConfig.{f.name} has no docstring"
    assert "--no-progress" in flags and "--config" in flags


def test_flags_parse_to_the_field_types() -> None:
    cfg = _resolve(["--steps", "7", "--lr", "1e-2", "--schedule", "zbv", "--no-progress",
                    "--pp", "2", "--data", "corpus.txt"])
    assert (cfg.steps, cfg.lr, cfg.schedule, cfg.progress, cfg.pp, cfg.data) == (
        7, 0.01, "zbv", False, 2, "corpus.txt")
    assert _resolve([]) == TrainConfig()  # nothing given: the dataclass defaults


def test_toml_sets_and_flags_override(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('schedule = "zbv"\nsteps = 50\nseq-len = 32\nlr = 1\nprogress = false\n')
    cfg = _resolve(["--config", str(path), "--steps", "9"])
    assert (cfg.schedule, cfg.steps, cfg.seq_len, cfg.lr, cfg.progress) == (
        "zbv", 9, 32, 1.0, False)
    assert isinstance(cfg.lr, float)


def test_written_config_reads_back(tmp_path: Path) -> None:
    cfg = TrainConfig(schedule="zbv", steps=3, prompt='say "hi"', pp=2)
    path = tmp_path / "config.toml"
    path.write_text(config_toml(cfg))
    assert _resolve(["--config", str(path)]) == cfg
    assert "schedule=zbv" in format_config(cfg, world=2)


# ------------------------------------------------- --hf with stored weights: fine-tuning defaults

SCRATCH = {name: getattr(TrainConfig, name) for name in finetune.SETTINGS}  # today's defaults


def _hf_dir(root: Path, weights: str | None = "model.safetensors") -> str:
    """A directory resolve() takes for --hf: config.json, and the weights file if named (its
    presence is what counts; no model is opened to resolve the settings)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text("{}")
    if weights:
        (root / weights).write_text("{}")
    return str(root)


def _settings(cfg: TrainConfig) -> dict[str, object]:
    return {name: getattr(cfg, name) for name in finetune.SETTINGS}


def _resolved(argv: list[str]) -> tuple[TrainConfig, tuple[str, ...]]:
    cfg, tuned, _ = train_cli.resolved(build_parser().parse_args(["train", *argv]), env={})
    return cfg, tuned


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_stored_weights_take_the_fine_tuning_defaults(tmp_path: Path, weights: str) -> None:
    hf = _hf_dir(tmp_path / "m", weights)
    cfg, tuned = _resolved(["--hf", hf])
    assert _settings(cfg) == {"lr": 2e-5, "min_lr": 2e-6, "warmup": 45, "weight_decay": 0.0}
    assert tuned == finetune.SETTINGS
    # everything else as from scratch
    assert dataclasses.replace(cfg, **SCRATCH) == TrainConfig(hf=hf)
    assert train_cli.resolve(build_parser().parse_args(["train", "--hf", hf])) == cfg


@pytest.mark.parametrize(("argv", "expected"), [
    (["--lr", "1e-4"], {"lr": 1e-4, "min_lr": 1e-5}),  # min_lr follows the lr given
    (["--min-lr", "0"], {"min_lr": 0.0}),
    (["--warmup", "100"], {"warmup": 100}),
    (["--weight-decay", "0.1"], {"weight_decay": 0.1}),
    (["--steps", "200"], {"warmup": 6}),  # 3 % of the steps given
    (["--lr", "0.01", "--min-lr", "3e-4", "--warmup", "50", "--weight-decay", "0.1"], SCRATCH),
], ids=["lr", "min-lr", "warmup", "weight-decay", "steps", "all"])
def test_a_flag_overrides_its_fine_tuning_default(tmp_path: Path, argv: list[str],
                                                  expected: dict[str, object]) -> None:
    cfg, tuned = _resolved(["--hf", _hf_dir(tmp_path / "m"), *argv])
    want = {"lr": 2e-5, "min_lr": 2e-6, "warmup": 45, "weight_decay": 0.0, **expected}
    assert _settings(cfg) == want
    given = {a[2:].replace("-", "_") for a in argv if a.startswith("--")}
    assert tuned == tuple(n for n in finetune.SETTINGS if n not in given)


def test_a_config_key_overrides_a_fine_tuning_default_and_a_flag_the_key(
        tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'hf = "{_hf_dir(tmp_path / "m")}"\nlr = 3e-5\nwarmup = 0\n')
    cfg, tuned = _resolved(["--config", str(path)])
    assert _settings(cfg) == {"lr": 3e-5, "min_lr": 3e-6, "warmup": 0, "weight_decay": 0.0}
    assert tuned == ("min_lr", "weight_decay")
    cfg, tuned = _resolved(["--config", str(path), "--warmup", "7", "--weight-decay", "0.01"])
    assert _settings(cfg) == {"lr": 3e-5, "min_lr": 3e-6, "warmup": 7, "weight_decay": 0.01}
    assert tuned == ("min_lr",)


def test_no_stored_weights_keep_the_from_scratch_defaults(tmp_path: Path) -> None:
    bare = _hf_dir(tmp_path / "bare", weights=None)  # config and tokenizer: trains from --seed
    assert _resolved(["--hf", bare]) == (TrainConfig(hf=bare), ())
    assert _resolved([]) == (TrainConfig(), ())  # a preset
    assert _settings(TrainConfig()) == {"lr": 1e-2, "min_lr": 3e-4, "warmup": 50,
                                        "weight_decay": 0.1}


def test_the_printed_config_marks_the_fine_tuning_defaults(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    hf = _hf_dir(tmp_path / "m")
    launched: list[tuple[TrainConfig, tuple[str, ...]]] = []
    monkeypatch.setattr(elastic, "launch_local",
                        lambda cfg, tuned=(): launched.append((cfg, tuned)))
    assert main(["train", "--hf", hf, "--lr", "1e-4", "--no-progress"]) == 0
    [(cfg, tuned)] = launched  # the launcher hands them to the workers
    assert tuned == ("min_lr", "warmup", "weight_decay")
    # what rank 0's worker prints at the start
    monkeypatch.setattr(elastic.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(report, "ProgressReporter", lambda cfg: elastic.NullReporter())
    elastic._reporter(dataclasses.replace(cfg, out=""), 0, tuned)
    printed = capsys.readouterr().out
    assert printed == format_config(dataclasses.replace(cfg, out=""), world=2,
                                    fine_tuned=tuned) + "\n"
    pairs = printed.split()
    assert {"lr=0.0001", "min_lr=1e-05*", "warmup=45*", "weight_decay=0.0*"} <= set(pairs)
    assert " ".join(printed.split()).endswith(
        "* the fine-tuning defaults, as --hf has stored weights (--help says how each is "
        "chosen); a flag or --config key overrides each")
    assert "*" not in format_config(TrainConfig())  # a from-scratch run: no marks


def test_a_plan_toml_leaves_the_fine_tuning_defaults_to_train(tmp_path: Path) -> None:
    """pipetrain plan --hf writes plan.toml with the optimiser settings as comments, so that
    train --config plan.toml takes the fine-tuning ones, not lr=1e-2 written out."""
    hf = _hf_dir(tmp_path / "m")
    path = tmp_path / "plan.toml"
    path.write_text(config_toml(TrainConfig(hf=hf, pp=2),
                                left_out=finetune.fine_tuning_defaults({"hf": hf})))
    assert "# lr: the default" in path.read_text()
    cfg, tuned = _resolved(["--config", str(path), "--steps", "100"])
    assert _settings(cfg) == {"lr": 2e-5, "min_lr": 2e-6, "warmup": 3, "weight_decay": 0.0}
    assert tuned == finetune.SETTINGS and cfg.pp == 2


@pytest.mark.parametrize(("text", "message"), [
    ("stpes = 5\n", "unknown key 'stpes' (did you mean 'steps'?); valid keys: preset, "),
    ("steps = \"5\"\n", "steps must be an integer, got '5'"),
    ("progress = 1\n", "progress must be true or false, got 1"),
    ("steps = true\n", "steps must be an integer, got True"),
    ("pp = \"auto\"\n", "pp must be an integer (leave the key out for the default)"),
    ("steps = \n", "not valid TOML"),
], ids=["unknown-key", "wrong-type", "bool", "bool-for-int", "optional", "syntax"])
def test_bad_toml_is_exit_2_naming_the_key(tmp_path: Path, text: str, message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--schedule", "wavefront"], "unknown schedule 'wavefront'; choose one of"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--nproc", "0"], "--nproc must be at least 1, got 0"),
    (["--fsdp", "0"], "--fsdp must be at least 1, got 0"),
    (["--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--steps", "many"], "invalid int value: 'many'"),
    (["--config", "no/such.toml"], "no/such.toml"),
    # found before any worker starts, as the workers would find them
    (["--nonfinite", "bogus"], "nonfinite must be 'skip' or 'abort', got 'bogus'"),
    (["--precision", "fp8"], "precision must be one of"),
    (["--nproc", "3", "--dp", "2"], "which dp=2 does not divide"),
    (["--batch-size", "6"], "batch_size=6 must split into dp=1 equal batches"),
])
def test_bad_flags_are_exit_2(argv: list[str], message: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(("env", "expected"), [
    ({}, False),
    ({"RANK": "0"}, False),
    ({"RANK": "1", "WORLD_SIZE": "2"}, True),
    ({"TORCHELASTIC_RUN_ID": "abc"}, True),
])
def test_torchrun_detection(env: dict[str, str], expected: bool) -> None:
    assert elastic.under_torchrun(env) is expected


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
def test_auto_device_refuses_a_node_with_too_few_gpus(gpus: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from pipetrain.runtime import launch

    monkeypatch.setattr(elastic.torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(elastic.torch.cuda, "device_count", lambda: gpus)
    assert elastic.backend_for("cpu", 4) == "gloo"
    if gpus == 0:  # no GPU at all: CPU and gloo, as before
        assert elastic.backend_for("auto", 4) == "gloo" == launch._backend(4, None)
    elif gpus >= 4:
        assert elastic.backend_for("auto", 4) == "nccl" == launch._backend(4, None)
    else:
        s = "s" if gpus > 1 else ""
        with pytest.raises(ValueError, match=(
                f"--device auto found {gpus} GPU{s} on this node but 4 local ranks, and each "
                f"rank needs its own GPU: pass --device cpu to run on CPU \\(gloo\\), or "
                f"start at most {gpus} process{'es' * (gpus > 1)} per node")):
            elastic.backend_for("auto", 4)
        with pytest.raises(ValueError, match="device='cuda' needs one GPU per local rank"):
            elastic.backend_for("cuda", 4)
        with pytest.warns(UserWarning, match=f"launch found {gpus} GPU{s} for 4 processes.*"
                                             "the ranks run on CPU with gloo"):
            assert launch._backend(4, None) == "gloo"
        assert launch._backend(4, "gloo") == "gloo"
        assert elastic.backend_for("auto", gpus) == "nccl"  # fewer ranks: one GPU each


def test_backend_choice() -> None:
    assert elastic.backend_for("cpu", 4) == "gloo"
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda'"):
        elastic.backend_for("tpu", 1)
    if not elastic.torch.cuda.is_available():
        assert elastic.backend_for("auto", 2) == "gloo"
        with pytest.raises(ValueError, match="one GPU per local rank"):
            elastic.backend_for("cuda", 2)


def test_reporter_files_without_a_terminal(tmp_path: Path) -> None:
    """Plain progress lines, JSON lines (NaN as null), summary and loss picture."""
    cfg = TrainConfig(out=str(tmp_path), steps=4)
    lines: list[str] = []
    console = report.Console(file=_Lines(lines), force_terminal=False, width=100)
    rep = report.ProgressReporter(cfg, console=console)
    rep.record("start", {"world": 2, "params": 10, "start_step": 0})
    for step, loss in enumerate([3.0, math.nan, 2.0, 1.5]):
        rep.record("step", {"step": step, "loss": loss, "tokens_per_s": 10.0, "bubble": 0.25,
                            "skipped": math.isnan(loss)})
    rep.record("eval", {"step": 3, "eval_loss": 1.75})
    rep.record("end", {"final_loss": 1.5, "steps": 4})
    rep.close()
    text = "".join(lines)
    assert "step 1/4  loss nan (skipped)" in text and "final loss" in text
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start"] + ["step"] * 4 + ["eval", "end"]
    assert records[2]["loss"] is None and all("time" in r for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_loss"] == 1.5 and "loss.png" in summary["files"]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def _log(path: Path, entries: list[tuple[str, str, int, float]]) -> None:
    """(kind, run id, step or start step, value) as log.jsonl lines."""
    lines = []
    for kind, run, step, value in entries:
        fields: dict[str, object] = (
            {"start_step": step, "run_id": run or None} if kind == "start"
            else {} if kind == "end" else {"step": step, "loss": value})
        lines.append(json.dumps({"kind": kind, **fields}))
    path.write_text("\n".join(lines) + "\n")


def test_read_log_keeps_every_attempt_of_the_latest_run(tmp_path: Path) -> None:
    # a restart from step 0 (no checkpoint committed yet) once read as a fresh job: the records
    # of the attempts before it were dropped, and the soak had to read the raw log
    _log(tmp_path / "log.jsonl", [
        ("start", "old", 0, 0), ("step", "", 0, 9.0), ("step", "", 1, 9.0),  # an earlier job
        ("start", "b", 0, 0), ("step", "", 0, 5.0), ("step", "", 1, 4.0), ("eval", "", 1, 4.5),
        ("step", "", 2, 3.0),                                          # killed, nothing saved
        ("start", "b", 0, 0), ("step", "", 0, 5.0), ("step", "", 1, 4.1),  # the same job again
        ("checkpoint", "", 2, 0), ("step", "", 2, 3.1), ("step", "", 3, 2.0),  # killed
        ("start", "b", 2, 0), ("step", "", 2, 3.2),                    # restart from step 2
        ("start", "c", 3, 0), ("step", "", 3, 2.5), ("end", "", 0, 0)])  # a new job resumes
    got = [(r["kind"], r.get("run_id", r.get("step")), r.get("loss"))
           for r in report.read_log(tmp_path / "log.jsonl")]
    assert got == [("start", "b", None), ("start", "b", None), ("step", 0, 5.0),
                   ("step", 1, 4.1), ("eval", 1, 4.5), ("checkpoint", 2, 0),
                   ("start", "b", None), ("step", 2, 3.2), ("start", "c", None),
                   ("step", 3, 2.5), ("end", None, None)], got
    _log(tmp_path / "log.jsonl", [("start", "", 0, 0), ("step", "", 0, 5.0),
                                  ("start", "", 4, 0), ("step", "", 4, 3.0),
                                  ("start", "", 0, 0), ("step", "", 0, 6.0)])  # no run ids
    assert [(r["kind"], r.get("loss")) for r in report.read_log(tmp_path / "log.jsonl")] == [
        ("start", None), ("step", 6.0)]


class _Lines:
    def __init__(self, sink: list[str]) -> None:
        self.sink = sink

    def write(self, text: str) -> int:
        self.sink.append(text)
        return len(text)

    def flush(self) -> None:
        return None


# ------------------------------------------------------------- docs/cli.md, as printed now

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def _console_block(starting: str) -> list[str]:
    """The lines of docs/cli.md's console block that begins with ``starting``, to its fence."""
    lines = DOCS.read_text().splitlines()
    first = lines.index(starting)
    return lines[first + 1:lines.index("```", first)]


def test_docs_help_excerpt_is_what_train_help_prints(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["train", "--help"]) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in _console_block("$ pipetrain train --help"):
        if line == "...":
            continue
        assert line in printed[at:], f"docs/cli.md shows {line!r}; --help no longer prints it"
        at = printed.index(line, at) + 1


def test_docs_example_run_prints_the_config_train_resolves(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    toml = _console_block("$ cat run.toml")
    run = toml[:toml.index("$ pipetrain train --config run.toml --steps 30 --no-progress")]
    (tmp_path / "run.toml").write_text("\n".join(run) + "\n")
    monkeypatch.chdir(tmp_path)
    cfg = _resolve(["--config", "run.toml", "--steps", "30", "--no-progress"])
    shown = toml[len(run) + 1:]
    config = shown[:next(i for i, x in enumerate(shown) if x.startswith("start: "))]
    assert "\n".join(config) == format_config(cfg, world=2)


def test_docs_command_table_names_every_command() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    table = [x for x in DOCS.read_text().splitlines() if x.startswith("| `pipetrain ")]
    assert sorted(x.split()[2].strip("`") for x in table) == sorted(sub.choices)
