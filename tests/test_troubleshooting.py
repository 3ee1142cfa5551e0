"""docs/troubleshooting.md stays true to the code, read without importing it (ast only).

- every exception class defined anywhere in ``src/pipetrain`` is named on the page (a name two
  modules define, by its module too);
- every ``EXIT_*`` constant of a command's module, and every number its ``run`` returns
  directly, is a row of that command in the page's exit-code table, and the table covers
  exactly the commands ``pipetrain.cli.subcommands()`` lists;
- the messages the page quotes still occur in the source file that raises them.
"""

from __future__ import annotations

import ast
import builtins
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "pipetrain"
PAGE = ROOT / "docs" / "troubleshooting.md"

COMMANDS = {  # the module of a command's code -> the commands its exit codes belong to
    "pipetrain.cli": ("simulate", "validate"),
    "pipetrain.train.commands.train_command": ("train",),
    "pipetrain.train.commands.export_command": ("export-hf",),
    "pipetrain.train.commands.verify_command": ("verify",),
    "pipetrain.train.commands.generate_command": ("generate",),
    "pipetrain.plan.plan_command": ("plan",),
    "pipetrain.plan.module_command": ("plan",),
    "pipetrain.plan.cluster.cluster_command": ("plan",),
}

QUOTED = [  # (a fragment the page quotes, the source file under src/pipetrain that says it)
    ("this pipeline failed earlier and cannot run again", "stepper.py"),
    ("torch.distributed is not initialised: start the processes with pt.launch or torchrun, "
     "or pass local_ranks=N to run all ranks in this process", "pipeline_args.py"),
    ("this rank holds stage 0 and needs inputs, got None", "stepper.py"),
    ("micro-batches; use a batch of at least", "runtime/microbatch.py"),
    ("the peer closed the connection (did its process die?)", "runtime/transport/receiver.py"),
    ("[passed on by ", "runtime/transport/receiver.py"),
    ("the ranks disagree on the schedule or on the step (did a rank skip a step?)",
     "runtime/transport/receiver.py"),
    ("is stuck in its own stage code", "runtime/failure/watchdog.py"),
    ("has not begun the next, so its own code between steps (data loading, the optimizer, "
     "logging) is stuck", "runtime/failure/watchdog.py"),
    ("does not answer (its process died or is frozen)", "runtime/failure/watchdog.py"),
    ("the gradient all-reduce over replicas", "train/mesh.py"),
    ("failed first: ", "train/launch/elastic.py"),
    (" local ranks, and each rank needs its own GPU: pass --device cpu to run on CPU (gloo), or "
     "start at most ", "train/launch/elastic.py"),
    ("the ranks run on CPU with gloo", "runtime/launch.py"),
    ("the cause, found by rank ", "train/launch/elastic.py"),
    ("every worker was stopped (rerun the same command to resume from the newest checkpoint)",
     "train/launch/elastic.py"),
    ("process exited with code ", "runtime/launch.py"),
    ("timed out (launch timeout)", "runtime/launch.py"),
    ("every rank stops here (nonfinite='abort'). Lower --lr, keep --grad-clip on",
     "train/nonfinite.py"),
    ("is not a committed checkpoint (", "checkpoint/store.py"),
    ("(truncated or overwritten): restore it or load an older checkpoint",
     "checkpoint/store.py"),
    ("is this checkpoint from another model?", "checkpoint/run.py"),
    ("(each stage needs at least one layer); use fewer ranks or stages per rank",
     "split/partition.py"),
    ("is not a submodule of", "split/trace.py"),
    ("when the model was captured (forward makes a decision on it, or the example had size 1 "
     "there)", "split/capture.py"),
    ("Plain (non-tensor) arguments are constants of the capture: pass the same value, or a "
     "tensor", "split/capture.py"),
    ("a KV cache: build the config with use_cache=False", "split/capture.py"),
    ("cannot be recorded. Alternatives: make the branch depend on a plain argument fixed in "
     "example_inputs", "split/capture.py"),
    ("ranks) differs from one process beyond", "verify.py"),
    ("DOES NOT FIT on ranks ", "cli.py"),
    ("cannot parse action", "schedules/action.py"),
]


# -- reading the source ------------------------------------------------------------------------


@cache
def modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed, by dotted name."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def _base_name(node: ast.expr) -> str:
    """``Exception``, ``errors.PipelineError`` -> the class name alone."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def exception_classes() -> dict[str, list[str]]:
    """Class name -> the modules defining it, for every class that derives from an exception
    (a built-in one, or one of these), nested classes included."""
    classes = [(module, node) for module, tree in modules().items() for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef)]
    known = {n for n in dir(builtins)
             if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n),
                                                                      BaseException)}
    found: dict[str, list[str]] = {}
    grew = True
    while grew:  # a subclass of a subclass: until nothing new is found
        grew = False
        for module, node in classes:
            if module in found.get(node.name, []):
                continue
            if any(_base_name(b) in known for b in node.bases):
                found.setdefault(node.name, []).append(module)
                known.add(node.name)
                grew = True
    return found


def _int_constants(node: ast.expr) -> list[int] | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value]
    if isinstance(node, ast.Tuple):
        values = [_int_constants(e) for e in node.elts]
        if all(v is not None and len(v) == 1 for v in values):
            return [v[0] for v in values if v is not None]
    return None


def exit_codes() -> dict[str, dict[str, int]]:
    """Module -> its module-level ``EXIT_*`` constants (``EXIT_OK, EXIT_X = 0, 3`` too); for a
    command's module, also the numbers its ``run`` function returns as literals (``return 1``)."""
    codes: dict[str, dict[str, int]] = {}
    for module, tree in modules().items():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    names = ([target] if isinstance(target, ast.Name) else
                             list(target.elts) if isinstance(target, ast.Tuple) else [])
                    values = _int_constants(node.value)
                    if values is None or len(values) != len(names):
                        continue
                    for name, value in zip(names, values, strict=True):
                        if isinstance(name, ast.Name) and name.id.startswith("EXIT_"):
                            codes.setdefault(module, {})[name.id] = value
            elif (isinstance(node, ast.FunctionDef) and node.name == "run"
                  and module in COMMANDS):
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        value = _int_constants(ret.value)
                        if value is not None and len(value) == 1:
                            codes.setdefault(module, {})[f"return {value[0]}"] = value[0]
    return codes


def subcommand_names() -> list[str]:
    """The keys of the dict ``pipetrain.cli.subcommands()`` returns."""
    for node in ast.walk(modules()["pipetrain.cli"]):
        if isinstance(node, ast.FunctionDef) and node.name == "subcommands":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                    return [k.value for k in ret.value.keys if isinstance(k, ast.Constant)]
    raise AssertionError("pipetrain.cli.subcommands() returns no dict literal")


def strings(path: Path) -> list[str]:
    """Every string literal of a file, implicit concatenation joined, with ``{}`` for each
    value an f-string formats."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            found.append("".join(v.value if isinstance(v, ast.Constant) else "{}"
                                 for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append(node.value)
    return found


# -- reading the page --------------------------------------------------------------------------


def page() -> str:
    return PAGE.read_text()


def exit_table() -> dict[str, set[int]]:
    """Command -> the exit codes of its rows in the section "Exit codes"."""
    section = page().split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[int]] = {}
    for command, code in re.findall(r"^\| `pipetrain ([\w-]+)` \| (\d+) \|", section, re.M):
        table.setdefault(command, set()).add(int(code))
    return table


# -- the tests ---------------------------------------------------------------------------------


def test_the_finder_sees_every_kind_of_exception() -> None:
    found = exception_classes()
    for name in ("PipelineError", "ScheduleError", "PartitionError", "StageError", "CommError",
                 "CheckpointError", "PeerFailed", "RankFailed", "VerificationFailed",
                 "InjectedFault"):
        assert name in found, f"the finder missed {name}: {sorted(found)}"
    assert len(found["JobFailed"]) == 1  # elastic.JobFailed; the news' is RankFailed


def test_every_exception_class_is_named_on_the_page() -> None:
    text = page()
    missing = [name for name in exception_classes()
               if not re.search(rf"`(?:[\w.]+\.)?{re.escape(name)}`", text)]
    assert not missing, f"docs/troubleshooting.md does not name {missing}: say what each means"
    ambiguous = [f"{module}.{name}" for name, where in exception_classes().items()
                 if len(where) > 1 for module in where if f"{module}.{name}" not in text]
    assert not ambiguous, f"name these by their module on the page: {ambiguous}"


def test_every_exit_code_is_in_its_commands_table() -> None:
    table, codes = exit_table(), exit_codes()
    unknown = sorted(set(codes) - set(COMMANDS))
    assert not unknown, (f"{unknown} define exit codes: add them to COMMANDS here and to the "
                         "page's exit-code table")
    absent = [f"pipetrain {command}: {name} = {value} ({module})"
              for module, names in codes.items() for name, value in names.items()
              for command in COMMANDS[module] if value not in table.get(command, set())]
    assert not absent, f"exit codes missing from docs/troubleshooting.md: {absent}"


def test_the_exit_table_covers_exactly_the_commands() -> None:
    table = exit_table()
    assert set(table) == set(subcommand_names()), (sorted(table), subcommand_names())
    assert all(2 in codes or command == "schedules" for command, codes in table.items())


def test_quoted_messages_still_occur_in_the_source() -> None:
    text = page()
    for fragment, name in QUOTED:
        assert fragment in text, f"the page no longer quotes {fragment!r}: drop it from QUOTED"
        said = strings(SRC / name)
        assert any(fragment in s for s in said), (
            f"src/pipetrain/{name} no longer says {fragment!r}: run it again and update "
            "docs/troubleshooting.md")
