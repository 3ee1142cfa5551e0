"""The package is a ladder of subpackages: a module imports only from its own rung or below.

    errors  <  schedules  <  runtime  <  split  <  models  <  parallel  <  checkpoint
            <  pipeline (its config, args, result, kinds, stepper), testing, verify
            <  hf  <  generation  <  train  <  plan
            <  cli, __init__, __main__, examples

Every import counts, those inside functions too (a lazy import is still a dependency). A
module that needs something from a higher rung is in the wrong place, or the thing is."""

from __future__ import annotations

import ast
from pathlib import Path

import pipetrain

ROOT = Path(pipetrain.__file__).parent
LADDER = [["errors", "_version"], ["schedules"], ["runtime"], ["split"], ["models"],
          ["parallel"], ["checkpoint"],
          ["pipeline_args", "pipeline_config", "result", "step_kinds", "stepper", "engine",
           "pipeline", "testing", "verify"],
          ["hf"], ["generation"], ["train"],
          ["plan"], ["cli", "__init__", "__main__", "examples"]]
RUNG = {name: i for i, names in enumerate(LADDER) for name in names}


def _part(module: str) -> str:
    """``pipetrain.runtime.stage`` -> ``runtime``: the top-level part a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    package = ".".join(("pipetrain", *path.relative_to(ROOT).with_suffix("").parts))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "pipetrain":
            names = [node.module] if node.module != "pipetrain" else [
                f"pipetrain.{a.name}" for a in node.names]
            found += [(n, node.lineno) for n in names]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package.rsplit(".", node.level)[0]
            found.append((f"{base}.{node.module or ''}".rstrip("."), node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names
                      if a.name.split(".")[0] == "pipetrain"]
    return found


def _top_names() -> set[str]:
    """Names ``from pipetrain import X`` may take that are not modules (the public API)."""
    return set(pipetrain.__all__) | {"__version__"}


def test_no_import_runs_up_the_ladder() -> None:
    every = {p.relative_to(ROOT).parts[0].removesuffix(".py") for p in ROOT.iterdir()
             if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())}
    assert every <= set(RUNG), f"place {sorted(every - set(RUNG))} on the ladder"
    against = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _part(".".join(("pipetrain", *path.relative_to(ROOT).with_suffix("").parts)))
        for module, line in _imports(path):
            there = _part(module)
            if there not in RUNG and there in _top_names():  # pt.Pipeline, pt.launch
                there = "__init__"
            if RUNG[there] > RUNG[here]:
                against.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {module} "
                               f"({there})")
    assert against == []


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The pipetrain modules ``path`` imports, anywhere in it (inside functions too)."""
    found = {m for m, _ in _imports(path)}
    found |= {f"{m}.{n}" for m in list(found) for n in _from_names(path, m)}
    return {m for m in found if m in modules}


def _from_names(path: Path, module: str) -> list[str]:
    return [a.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module == module for a in node.names]


def test_modules_import_each_other_without_a_cycle() -> None:
    """Not even through an import inside a function, nor through a package's ``__init__``
    (``from pipetrain.schedules import dataflow`` runs the package's, which imports what it
    re-exports): a cycle means a piece both need is in one of them; move it where both can
    import it."""
    name = {p: ".".join(("pipetrain", *p.relative_to(ROOT).with_suffix("").parts))
            .removesuffix(".__init__") for p in ROOT.rglob("*.py")}
    modules = set(name.values())
    graph = {name[p]: _imported(p, modules) - {name[p]} for p in name}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, "import cycle: " + " -> ".join([*path[path.index(m):], m])
        if m in done:
            return
        for n in sorted(graph.get(m, ())):
            visit(n, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


RUNTIME = [["lifetime", "torch_private", "torch_distributed"], ["transport"], ["failure"]]
"""runtime's own rungs: a part imports only from its own rung or below; every other module of
runtime (the executor, the stages, the end of a step) stands above them all. At the bottom:
the interpreter's exit, and the two modules that hold pipetrain's private torch."""


def test_runtime_parts_import_only_down() -> None:
    """transport (the messages) and failure (a failed or stuck peer as an error everywhere)
    run below what runs a step: neither imports the executor, a stage or the end of a step."""
    rung = {part: i for i, parts in enumerate(RUNTIME) for part in parts}
    top = len(RUNTIME)

    def part(module: str) -> int:
        parts = module.split(".")
        return rung.get(parts[2], top) if len(parts) > 2 and parts[1] == "runtime" else -1

    against = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        module = ".".join(("pipetrain", *path.relative_to(ROOT).with_suffix("").parts))
        if path.name == "__init__.py" and path.parent.name == "runtime":
            continue
        for imported, line in _imports(path):
            if part(imported) > part(module):
                against.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert against == []
