"""The manual runs or parses as written: its snippets, commands, links, files and tests.

Every page (README.md and docs/*.md) is checked here without running anything heavy:

- every ```python block compiles, and every pipetrain name it imports or reaches through
  ``pt.`` exists, with the keyword arguments it passes;
- every ``$ ...`` line that runs ``pipetrain`` (directly, ``python3 -m pipetrain`` or under
  torchrun) parses with the real command-line parser; a ``benchmarks/*.py`` line names a script
  that exists and takes each flag given; a pytest line names test files that exist;
- every file (``tests/...``, ``benchmarks/...``, ``src/pipetrain/...``) and test function named
  in backticks exists, and every relative link reaches a page and one of its headings;
- every ``name.py`` in README.md, CONTRIBUTING.md, docs/*.md and src/pipetrain's docstrings,
  bare or with a path, backticked or not, is the end of a file's path in the repository (a
  package's docstring: of a file in that package), but for a short list of placeholders;
- every docs page opens with the command or snippet to run, before its second section.

The snippets that make sense to run at a tiny size run below (and in tests/test_readme.py,
tests/test_verify.py, tests/test_zoo.py and the planner's tests).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import json
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import build_parser

pytestmark = pytest.mark.slow  # the full suite's tier (CONTRIBUTING.md: tests)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [str(p.relative_to(ROOT)) for p in PAGES]


def python_blocks(page: Path) -> list[str]:
    """The page's ```python blocks, dedented (a block may sit inside a list item)."""
    found = re.findall(r"^[ \t]*```python\n(.*?)^[ \t]*```", page.read_text(), re.S | re.M)
    return [textwrap.dedent(code) for code in found]


def command_lines(page: Path) -> list[str]:
    """Every ``$ `` line of the page's console blocks, continuation lines joined."""
    lines, out, pending = page.read_text().splitlines(), [], ""
    for line in lines:
        text = line.strip()
        if pending:
            pending += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                out.append(pending)
                pending = ""
        elif text.startswith("$ "):
            if text.endswith("\\"):
                pending = text[2:].rstrip("\\").strip()
            else:
                out.append(text[2:])
    return out


def console_line(page: Path, containing: str) -> str:
    """The page's first ``$`` command that contains ``containing``."""
    for line in command_lines(page):
        if containing in line:
            return line
    raise AssertionError(f"no command of {page.name} contains {containing!r}")


# -- snippets -----------------------------------------------------------------------------------


def _resolve(path: str) -> Any:
    """``pipetrain.a.b`` -> the module or attribute it names."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise AttributeError(path)


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the pipetrain path it stands for, from the block's imports."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pipetrain":
                    names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipetrain"):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def pipetrain_uses(code: str) -> Iterator[tuple[str, list[str]]]:
    """(pipetrain path, keyword names) for every name the block reaches and every call of it."""
    tree = ast.parse(code)
    aliases = _aliases(tree)
    yield from ((path, []) for path in aliases.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = _dotted(node, aliases)
            if path:
                yield path, []
        elif isinstance(node, ast.Call):
            path = _dotted(node.func, aliases)
            if path:
                yield path, [k.arg for k in node.keywords if k.arg]


def _keywords_accepted(obj: Any, keywords: list[str]) -> list[str]:
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [k for k in keywords if k not in params]


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_python_blocks_compile_and_name_what_exists(page: Path) -> None:
    for code in python_blocks(page):
        compile(code, str(page), "exec")
        for path, keywords in pipetrain_uses(code):
            try:
                obj = _resolve(path)
            except AttributeError:
                pytest.fail(f"{page.name}: `{path}` does not exist, in:\n{code}")
            unknown = _keywords_accepted(obj, keywords)
            assert not unknown, f"{page.name}: {path} takes no {unknown}, in:\n{code}"


def test_the_checker_catches_a_wrong_name_and_a_wrong_keyword() -> None:
    bad = "import pipetrain as pt\npt.Pipeline(m, 'zbv', 8, f, split_pionts='auto')\npt.nothing"
    uses = list(pipetrain_uses(bad))
    assert ("pipetrain.Pipeline", ["split_pionts"]) in uses
    assert _keywords_accepted(_resolve("pipetrain.Pipeline"), ["split_pionts"]) == ["split_pionts"]
    with pytest.raises(AttributeError):
        _resolve("pipetrain.nothing")


# -- commands -----------------------------------------------------------------------------------


def _pipetrain_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``pipetrain`` / ``-m pipetrain`` in one command, or None."""
    for i, word in enumerate(words):
        if word == "pipetrain" and (i == 0 or words[i - 1] == "-m"):
            return words[i + 1:]
    return None


def _with_local_imports(script: Path) -> str:
    """The script's source and that of the modules beside it that it imports (shared flags)."""
    source = script.read_text()
    for name in re.findall(r"^(?:import|from) (\w+)", source, re.M):
        if (script.parent / f"{name}.py").exists():
            source += (script.parent / f"{name}.py").read_text()
    return source


def _check_command(words: list[str]) -> None:
    argv = _pipetrain_argv(words)
    if argv is not None:
        if not {"--help", "-h"} & set(argv):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                try:
                    build_parser().parse_args(argv)
                except SystemExit as exit_:
                    raise AssertionError(f"pipetrain {' '.join(argv)}: {err.getvalue()}") from exit_
        return
    scripts = [w for w in words if w.endswith(".py") and "/" in w]
    for script in scripts:
        assert (ROOT / script).exists(), f"{script} does not exist"
        source = _with_local_imports(ROOT / script)
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert f'"{flag}"' in source, f"{script} takes no {flag}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_commands_parse(page: Path) -> None:
    for line in command_lines(page):
        for command in line.split(" && "):
            words = shlex.split(command.split(" | ")[0].split(" > ")[0], comments=True)
            if words[:1] in (["python3"], ["python"], ["pipetrain"], ["torchrun"]):
                _check_command(words)


def test_the_command_check_catches_a_wrong_flag() -> None:
    with pytest.raises(AssertionError, match="--stepz"):
        _check_command(["python3", "-m", "pipetrain", "train", "--stepz", "3"])
    with pytest.raises(AssertionError, match="--nope"):
        _check_command(["python3", "benchmarks/soak.py", "--nope"])


# -- references ---------------------------------------------------------------------------------

FILE = re.compile(r"`((?:tests|benchmarks|src/pipetrain|docs)/[\w/.-]+?\.(?:py|md|png|json|csv))"
                  r"(?:::(\w+))?")
TEST = re.compile(r"`(test_\w+)`")
LINK = re.compile(r"\]\(((?!https?:)[^)#\s]*)(?:#([^)\s]+))?\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _test_names() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").glob("*.py"):
        names.update(re.findall(r"^def (test_\w+)", path.read_text(), re.M))
    return names


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_files_tests_and_links_exist(page: Path) -> None:
    text = page.read_text()
    tests = _test_names()
    for path, name in FILE.findall(text):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"
        if name:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{path} has no {name}"
    for name in TEST.findall(text):
        assert name in tests, f"{page.name} names {name}, which no test file defines"
    for target, anchor in LINK.findall(text):
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.name}: {target}#{anchor} is no heading"


# -- file names in prose -------------------------------------------------------------------------

PY_NAME = re.compile(r"(?<![\w./~-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w/])")  # x.py, a/b/x.py
URL = re.compile(r"https?://\S+")
# Names a reader writes, not files of this repository (each matched whole, as written):
PLACEHOLDERS = {
    "my.py",             # README's table: the reader's own module for `plan --module my.py:build`
    "train.py",          # plan_command.py and module_command.py: the user's own training script
    "path/to/file.py",   # planning.md and module_command.py: the form of `--module SPEC`
    "make_tiny.py",      # hf.md's snippet that saves a tiny Llama, as the reader names it
    "make_chat.py",      # hf.md's snippet that adds a chat template, as the reader names it
    "tests/test_x.py",   # CONTRIBUTING.md: "one file" in `pytest -n 0 tests/test_x.py`
}


def repository_files() -> list[str]:
    """Every file of the repository a page may name, as a path from the root."""
    found = [p.name for p in ROOT.iterdir() if p.is_file()]
    for top in ("src", "tests", "benchmarks", "docs", ".ci"):
        found += [p.relative_to(ROOT).as_posix() for p in (ROOT / top).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts]
    return found


def prose() -> Iterator[tuple[str, str, Path]]:
    """(where, text, the folder its names must lie under) for README.md, CONTRIBUTING.md,
    docs/*.md (not CHANGELOG.md, which names old files on purpose, nor docs/notes/, records of
    past runs) and every docstring of src/pipetrain: a package's own (its ``__init__.py``'s)
    maps the package's files, so what it names must lie in that package."""
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(ROOT.glob("docs/*.md"))]:
        yield str(page.relative_to(ROOT)), page.read_text(), ROOT
    for source in sorted((ROOT / "src" / "pipetrain").rglob("*.py")):
        where = source.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                package = (source.parent if isinstance(node, ast.Module)
                           and source.name == "__init__.py" else ROOT)
                if doc:
                    yield f"{where}:{getattr(node, 'name', 'docstring')}", doc, package


def unknown_file_names(text: str, files: list[str], under: str = "") -> list[str]:
    """The ``name.py`` (bare or with a path) in ``text`` that no file of ``files`` under
    ``under`` ends with (``runtime/executor.py`` and ``executor.py`` both name
    src/pipetrain/runtime/executor.py), placeholders aside."""
    names = PY_NAME.findall(URL.sub("", text))
    inside = [f for f in files if f.startswith(under)]
    return [name for name in names if name not in PLACEHOLDERS and not any(
        f == name.removeprefix("./") or f.endswith("/" + name.removeprefix("./"))
        for f in inside)]


def test_prose_names_only_files_that_exist() -> None:
    files = repository_files()
    stale = []
    for where, text, package in prose():
        under = "" if package == ROOT else package.relative_to(ROOT).as_posix() + "/"
        stale += [f"{where}: {name}" + (f" (not in {under})" if under else "")
                  for name in unknown_file_names(text, files, under)]
    assert not stale, "names of files that do not exist (CHANGELOG.md: was -> is):\n" + (
        "\n".join(stale))


def test_the_file_name_check_catches_an_old_name() -> None:
    files = ["src/pipetrain/runtime/executor.py", "src/pipetrain/cli.py", "benchmarks/soak.py"]
    text = ("`executor.py`, runtime/executor.py, `benchmarks/soak.py`, news.py, `my.py:build`, "
            "see https://example.org/gone.py, not a .pyc or pipetrain.cli")
    assert unknown_file_names(text, files) == ["news.py"]
    assert unknown_file_names("``cli.py``", files, "src/pipetrain/plan/") == ["cli.py"]
    assert unknown_file_names("``executor.py``", files, "src/pipetrain/runtime/") == []


def test_the_reference_check_knows_a_heading() -> None:
    assert _slug("Fine-tune a stored checkpoint on GPU nodes") == (
        "fine-tune-a-stored-checkpoint-on-gpu-nodes")
    assert _slug("`pipetrain verify`") == "pipetrain-verify"
    assert "rank-placement" in _anchors(ROOT / "docs" / "cluster.md")


@pytest.mark.parametrize("page", PAGES[1:], ids=IDS[1:])
def test_each_page_opens_with_what_to_run(page: Path) -> None:
    text = page.read_text()
    sections = [m.start() for m in re.finditer(r"^## ", text, re.M)]
    first_code = text.find("```")
    assert first_code != -1, f"{page.name} has no command or snippet"
    assert len(sections) < 2 or first_code < sections[1], (
        f"{page.name}: its first command or snippet comes after its second section")


def test_readme_links_every_page() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README's table does not link docs/{page.name}"


# -- snippets that run --------------------------------------------------------------------------


def _printed(page: Path, after: str) -> str:
    """The text in backticks after ``prints`` that follows the snippet containing ``after``."""
    text = page.read_text()
    found = re.search(r"prints `([^`]*)`", text[text.index(after):])
    assert found is not None, f"{page.name}: no 'prints `...`' after {after!r}"
    return found.group(1)


def test_the_schedules_snippet_prints_what_the_page_says(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    page = ROOT / "docs" / "schedules.md"
    code = python_blocks(page)[0]
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out.splitlines()
    text = page.read_text()
    said = re.findall(r"`([^`]+)`", text[text.index("prints `"):].split("\n\n")[0])
    assert out == said[:2], (out, said)


def _launch(code: str, tmp_path: Path, name: str) -> Any:
    """A snippet that ends ``print(pt.launch(train, nprocs=2))``, run in this process: imported
    as a module, its ``train`` launched as its main block would (the ranks start from this
    session's forkserver, which has imported torch and transformers)."""
    main = code.split('if __name__ == "__main__":')[1].split("#")[0].strip()
    assert main == "print(pt.launch(train, nprocs=2))", main
    (tmp_path / f"{name}.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module(name)
        return module.pt.launch(module.train, nprocs=2)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def test_the_own_model_snippet_trains_on_two_processes(tmp_path: Path) -> None:
    page = ROOT / "docs" / "own-model.md"
    losses = _launch(python_blocks(page)[0], tmp_path, "own_snippet")
    assert str(losses) == _printed(page, "def train(ctx)"), losses


def test_the_own_model_hf_snippet_trains_a_llama(tmp_path: Path) -> None:
    page = ROOT / "docs" / "own-model.md"
    code = next(b for b in python_blocks(page) if "LlamaForCausalLM" in b)
    losses = _launch(code, tmp_path, "hf_snippet")
    assert len(losses) == 2 and losses[0] == losses[1] and 0 < losses[0] < 6


def test_the_hf_page_runs_at_a_tiny_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    """docs/hf.md's snippet that saves a tiny Llama, its ``--hf`` training command (the
    command's ``main``, in this process), and loading ``OUT/hf`` back with transformers."""
    from pipetrain.cli import main

    page = ROOT / "docs" / "hf.md"
    code = next(b for b in python_blocks(page) if 'save_pretrained("tiny-llama")' in b)
    monkeypatch.chdir(tmp_path)  # the snippets run here, in this process, as written
    exec(compile(code, "make_tiny.py", "exec"), {"__name__": "__main__"})
    command = console_line(page, "--hf tiny-llama").split()
    assert command[:4] == ["python3", "-m", "pipetrain", "train"], command
    tiny = ["--steps", "2", "--batch-size", "8", "--microbatches", "4", "--eval-batches", "1",
            "--sample-tokens", "4", "--token-cache", str(tmp_path / "tokens"), "--data",
            str(ROOT / "README.md"), "--no-progress"]
    for key in [k for k in os.environ if k.startswith("PIPETRAIN_")]:
        monkeypatch.delenv(key)
    assert main([*command[3:], *tiny]) == 0
    out = Path(command[command.index("--out") + 1])
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["kind"] == "start")
    assert [load["weights"] for load in start["load"]] == ["stored", "stored"], start
    assert any(r["kind"] == "hf" and r["step"] == 2 for r in records), records
    capfd.readouterr()
    load = console_line(page, "from_pretrained").split(" -c ")[1].strip("'\"")
    exec(compile(load, "load.py", "exec"), {"__name__": "__main__"})
    assert "LlamaForCausalLM" in capfd.readouterr().out


def test_readme_schedule_table_is_what_the_simulator_says() -> None:
    """README's table of schedules: p = 4, m = 8, F = I = W = 1, no delay; every figure."""
    import pipetrain as pt

    rows = re.findall(r"^\| `([\w-]+)` \| (.*) \|$", (ROOT / "README.md").read_text(), re.M)
    assert len(rows) >= 12, rows
    for name, rest in rows:
        per_rank, makespan, fraction, rate, peaks, minimum = rest.split(" | ")
        sim = pt.schedules.simulate(pt.schedules.make_schedule(name, 4, 8))
        got = [str(sim.schedule.n_stages // 4), f"{sim.makespan:g}",
               f"{sim.bubble_fraction:.3f}", f"{sim.bubble_rate:.3f}",
               ", ".join(f"{x:g}" for x in sim.peak_activations)]
        assert got == [per_rank, makespan, fraction, rate, peaks], (name, got)
        pt.schedules.make_schedule(name, 4, int(minimum))  # the smallest m it accepts builds


def test_the_generate_snippet_gives_transformers_tokens(tmp_path: Path) -> None:
    """docs/generate.md's snippet on two processes: transformers' own greedy tokens."""
    from helpers.hf import hf_generate

    page = ROOT / "docs" / "generate.md"
    code = next(b for b in python_blocks(page) if "def generate(ctx)" in b)
    (tmp_path / "gen_snippet.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("gen_snippet")
        got = module.pt.launch(module.generate, nprocs=2)
        tf = module.tf
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("gen_snippet", None)
    module.torch.manual_seed(0)  # the snippet's model, in this process
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    prompts = [[1, 5, 9, 4], [1, 7], [1, 3, 3], [1, 8, 2, 6, 5]]
    assert got[0] == got[1] == hf_generate(model, prompts, 8)


def test_the_decode_schedule_prints_what_the_page_says(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    page = ROOT / "docs" / "generate.md"
    code = next(b for b in python_blocks(page) if "decode_schedule" in b)
    exec(compile(code, str(page), "exec"), {"__name__": "__main__"})
    text = page.read_text()
    shown = text[text.index("prints\n\n```\n") + len("prints\n\n```\n"):]
    assert capsys.readouterr().out.strip() == shown[:shown.index("```")].strip()


def test_the_asynchronous_rows_are_what_the_simulator_says() -> None:
    """README's PipeDream-2BW row (p = 4, m = 8) and schedules.md's steady-state table."""
    from pipetrain.schedules import Costs, make_schedule, simulate
    from pipetrain.schedules.steady_state import steady_state

    def figures(p: int, m: int) -> tuple[str, ...]:
        got = steady_state(make_schedule("pipedream-2bw", p, m), Costs(F=1, B=2))
        flushed = simulate(make_schedule("1f1b", p, m), Costs(F=1, B=2))
        return (f"{got.period:g}", f"{flushed.makespan:g}", f"{got.bubble_fraction:.3f}",
                ", ".join(f"{x:g}" for x in got.peak_activations),
                ", ".join(str(v) for v in got.peak_versions))

    for title, name in (("PipeDream-2BW", "pipedream-2bw"), ("PipeDream", "pipedream")):
        row = re.search(rf"^\| {title}, `{name}` \| 1 \| (\S+) \| (\S+) \| ([\d, ]+) \| "
                        r"([\d, ]+) \| p \|$", (ROOT / "README.md").read_text(), re.M)
        assert row is not None, name
        got = steady_state(make_schedule(name, 4, 8), Costs(F=1, B=2))
        assert row.groups() == (f"{got.period:g}", f"{got.bubble_fraction:.3f}",
                                ", ".join(f"{x:g}" for x in got.peak_activations),
                                ", ".join(str(v) for v in got.peak_versions)), name
    page = (ROOT / "docs" / "schedules.md").read_text()
    for p, m in ((4, 8), (4, 16)):
        period, makespan, bubble, peaks, versions = figures(p, m)
        line = (f"| {p}, {m} | {period} | {makespan} | {bubble} | {peaks}"
                f"{' (1F1B' + chr(39) + 's)' if m == 8 else ''} | {versions} |")
        assert line in page, line


def test_cli_page_lists_the_schedules_the_command_prints(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli import main

    assert main(["schedules"]) == 0
    printed = capsys.readouterr().out.strip()
    block = (ROOT / "docs" / "cli.md").read_text().split("$ pipetrain schedules\n", 1)[1]
    assert block.split("```", 1)[0].strip() == printed
