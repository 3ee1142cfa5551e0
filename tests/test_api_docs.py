"""The API reference builds with pdoc as docs/api.md says: every public name and part, no warning.

The build runs once per file, in this process, through pdoc's Python API with the options and
modules of the page's own ``$ python3 -m pdoc`` command, but for the pages of highlighted
source (about half the time on 2 cores; their rendering is pygments', with no docstring in it).
"""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pdoc
import pdoc.render
import pytest
from pdoc.__main__ import parser

import pipetrain

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
PACKAGE = Path(pipetrain.__file__).parent
LEFT_OUT = {"cli", "examples"}  # the command line (docs/cli.md) and the runnable examples
PDOC = Path(pdoc.__file__).parent


def _command() -> list[str]:
    """The arguments of the page's ``$ python3 -m pdoc`` command, continuation lines joined."""
    text = PAGE.read_text().replace("\\\n", " ")
    line = next(x for x in text.splitlines() if x.startswith("$ python3 -m pdoc "))
    return shlex.split(line)[4:]


def _build(out: Path, modules: list[str], docformat: str) -> list[str]:
    """Write the pages of ``modules`` into ``out``; the warnings pdoc gave, one line each."""
    pdoc.render.configure(docformat=docformat, show_source=False)  # type: ignore[arg-type]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pdoc.pdoc(*modules, output_directory=out)
    finally:
        pdoc.render.configure()
    # pdoc's own, from its code or its templates; not those of a library it imports
    return [f"{w.category.__name__}: {w.message}" for w in caught
            if Path(w.filename).resolve().is_relative_to(PDOC.resolve())]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    opts = parser.parse_args(_command())
    assert opts.output_directory == Path("site/api"), "the page's command writes site/api"
    out = tmp_path_factory.mktemp("api")
    return out, _build(out, opts.modules, opts.docformat)


def test_pdoc_gives_no_warning(built: tuple[Path, list[str]]) -> None:
    assert built[1] == []


def test_every_public_name_is_documented_on_the_package_page(
        built: tuple[Path, list[str]]) -> None:
    html = (built[0] / "pipetrain.html").read_text()
    for name in pipetrain.__all__:
        assert f'<section id="{name}">' in html, f"{name} has no entry"
        assert re.search(rf'<a class="(class|function)" href="#{name}">', html), (
            f"{name} is listed without its documentation")


def test_every_part_has_a_page(built: tuple[Path, list[str]]) -> None:
    parts = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    assert {"schedules", "runtime", "split", "parallel", "checkpoint", "hf", "train",
            "plan"} <= parts
    missing = [name for name in sorted((parts | modules) - LEFT_OUT)
               if not (built[0] / "pipetrain" / f"{name}.html").is_file()]
    assert missing == [], f"no page for {missing}: name them in docs/api.md's command"
    assert (built[0] / "pipetrain" / "runtime" / "stage.html").is_file()  # a part's modules


def test_the_page_lists_every_public_name() -> None:
    text = PAGE.read_text()
    table = text[text.index("gives what a user calls"):text.index("The toolkits are")]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert sorted(listed) == sorted(pipetrain.__all__)


def test_a_warning_of_pdoc_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_api.py").write_text('"""Names a member it lacks."""\n\n'
                                            '__all__ = ["missing"]\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    found = _build(tmp_path / "out", ["broken_api"], "google")
    assert len(found) == 1 and "'missing' in broken_api.__all__" in found[0], found


@pytest.mark.parametrize("name, where", [("make_schedule", "pipetrain.schedules"),
                                         ("ShardedStages", "pipetrain.parallel"),
                                         ("plan_module", "pipetrain.plan")])
def test_a_toolkit_name_at_the_top_still_works_for_a_release_with_a_warning(
        name: str, where: str) -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match=f"pipetrain.{name} is {where}.{name} now"):
        old = getattr(pipetrain, name)
    assert old is getattr(importlib.import_module(where), name)
    assert name not in pipetrain.__all__ and name not in dir(pipetrain)


def test_the_first_screen_of_dir_is_the_user_api() -> None:
    shown = [n for n in dir(pipetrain) if not n.startswith("_")]  # (verify: the function)
    assert sorted(set(shown) - {"errors", "generation", "pipeline", "result", "runtime",
                                "schedules", "split", "stepper", "pipeline_args",
                                "pipeline_config", "step_kinds", "engine",
                                "models", "parallel", "checkpoint", "testing", "hf", "train",
                                "plan", "cli", "examples"}) == sorted(pipetrain.__all__)
