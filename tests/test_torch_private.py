"""Private torch in one place: each dependency resolves on the installed torch, has its row in
its module's table, and no other module of pipetrain reaches torch privately.

The dependencies are the ``DEPENDENCIES`` of :mod:`pipetrain.runtime.torch_private` and
:mod:`pipetrain.runtime.torch_distributed`. A release that moves one fails here, naming the
symbol, the torch version and the module to change. Attributes that FSDP2 and export set on
instances (no instance without a process group or an export) are checked on their class: a
class attribute, an annotation, or an assignment ``self.<name>`` in the class's source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import pipetrain
from pipetrain.runtime import torch_distributed, torch_private
from pipetrain.runtime.torch_private import Dependency

ROOT = Path(pipetrain.__file__).parent
REPO = ROOT.parents[1]
PRIVATE = {ROOT / "runtime" / "torch_private.py": torch_private,
           ROOT / "runtime" / "torch_distributed.py": torch_distributed}
DEPENDENCIES = [(d, m) for m in PRIVATE.values() for d in m.DEPENDENCIES]


def _where(module: ModuleType) -> str:
    return str(Path(inspect.getfile(module)).relative_to(REPO))


def _declares(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` get attribute ``name``: annotated, or assigned in the
    source of ``cls`` or a base."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # a builtin, or no source
            continue
        if re.search(rf"\bself\.{re.escape(name)}\b\s*(:[^=\n]*)?=", source):
            return True
    return False


def _resolve(dep: Dependency) -> None:
    """Import ``dep`` on this torch; raise (ImportError, AttributeError) where it moved."""
    module = importlib.import_module(dep.module)
    if dep.in_source:
        if not re.search(rf"[\"']{re.escape(dep.name)}[\"']", inspect.getsource(module)):
            raise AttributeError(f"{dep.module} no longer writes {dep.name!r}")
        return
    value: Any = module
    parts = dep.name.split(".") if dep.name else []
    for i, part in enumerate(parts):
        if hasattr(value, part):
            value = getattr(value, part)
        elif i == len(parts) - 1 and isinstance(value, type) and _declares(value, part):
            return
        else:
            raise AttributeError(f"{'.'.join([dep.module, *parts[:i]])} has no {part!r}")


@pytest.mark.parametrize(("dep", "module"), DEPENDENCIES,
                         ids=[d.symbol for d, _ in DEPENDENCIES])
def test_each_private_dependency_resolves(dep: Dependency, module: ModuleType) -> None:
    try:
        _resolve(dep)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"torch {torch.__version__} moved {dep.symbol}: see {_where(module)} ({e})")


@pytest.mark.parametrize("module", list(PRIVATE.values()), ids=lambda m: m.__name__)
def test_each_dependency_has_a_row_in_its_table(module: ModuleType) -> None:
    doc = module.__doc__ or ""
    missing = [d.symbol for d in module.DEPENDENCIES if f"``{d.symbol}``" not in doc
               or d.in_source and f"``{d.module}``" not in doc]
    assert missing == [], f"{_where(module)}'s table has no row for {missing}"
    rows = re.findall(r"^- ``", doc, re.MULTILINE)
    checked = re.findall(r"Checked:\s+2\.13", doc)
    assert len(rows) == len(checked), "each row says the torch it was checked on"


def test_the_resolver_fails_on_a_moved_symbol() -> None:
    with pytest.raises(AttributeError, match="_no_such_store"):
        _resolve(Dependency("torch.distributed.distributed_c10d", "_no_such_store"))
    with pytest.raises(ImportError):
        _resolve(Dependency("torch._no_such_module"))
    with pytest.raises(AttributeError):
        _resolve(Dependency("torch.nn", "Module._no_such_dict"))
    with pytest.raises(AttributeError):
        _resolve(Dependency("torch.export._unlift", "_no_such_fn", in_source=True))


# -- no other module reaches torch privately ---------------------------------------------------
def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
               for p in parts)


INSTANCE_NAMES = {part for d, _ in DEPENDENCIES if not d.in_source
                  for part in d.name.split(".")[-1:] if _private([part])}
"""Private attributes of torch's objects, by name: ``state._fsdp_param_groups``,
``module._parameters`` reach torch without naming it."""
NAMES = {d.name for d, _ in DEPENDENCIES if d.in_source} | {
    *torch_private.EXPORT_ASSERTS, *torch_private.BATCH_NORM_LEGIT}
"""Strings that name torch's private parts: ``"_guards_fn"``, ``"aten._assert_scalar.default"``."""


def _reaches(path: Path, base: Path = REPO) -> list[str]:
    """``file:line what`` for each private reach into torch in ``path`` (named from
    ``base``)."""
    nodes = list(ast.walk(ast.parse(path.read_text())))
    bound: dict[str, str] = {}  # a local name -> the torch path it was imported as
    own = {n.attr for n in nodes if isinstance(n, ast.Attribute)
           and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
           and n.value.id == "self"}  # pipetrain's own attributes (self._buffers)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
                    if _private(a.name.split(".")):
                        found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "torch":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                if _private([*node.module.split("."), a.name]):
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
    for node in nodes:
        if isinstance(node, ast.Attribute) and _private([node.attr]):
            chain, root = [node.attr], node.value  # the path down to this private part
            while isinstance(root, ast.Attribute):
                chain, root = [root.attr, *chain], root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append((node.lineno, ".".join([bound[root.id], *chain])))
            elif node.attr in INSTANCE_NAMES and not (
                    isinstance(root, ast.Name) and root.id == "self" and node.attr in own):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text in NAMES or text in INSTANCE_NAMES or text.startswith("torch.") \
                    and re.fullmatch(r"torch(\.\w+)+", text) and _private(text.split(".")):
                found.append((node.lineno, repr(text)))
    rel = path.relative_to(base)
    return [f"{rel}:{line} {what}" for line, what in sorted(set(found))]


def test_no_other_module_reaches_torch_privately() -> None:
    reached = [hit for path in sorted(ROOT.rglob("*.py")) if path not in PRIVATE
               for hit in _reaches(path)]
    assert reached == [], "reach torch's private parts through pipetrain.runtime." \
        "torch_private or torch_distributed (a new one: add it there, with its row):\n" \
        + "\n".join(reached)


def test_the_scan_finds_each_kind_of_reach(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("import torch\nimport torch.distributed as dist\n"
                   "import torch.utils._pytree as pytree\n"
                   "from torch._C._profiler import _EventType\n"
                   "a = dist.distributed_c10d._get_default_store()\n"
                   "b = torch._foreach_norm\n"
                   "c = state._fsdp_param_groups\n"
                   "d = ('torch._dynamo', '_guards_fn', 'aten._assert_scalar.default')\n"
                   "e = torch.__version__, torch.nn.Module, 'torch.nn'\n")
    hits = _reaches(src, tmp_path)
    lines = [int(h.split(" ")[0].rsplit(":", 1)[1]) for h in hits]
    assert sorted(set(lines)) == [3, 4, 5, 6, 7, 8], hits
    assert sum(line == 8 for line in lines) == 3, hits
