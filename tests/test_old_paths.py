"""Every import path the course's readers use still works after the move into layers (``minipaged/old_paths.py``),
and gives the very object it names now: a module by its old name is the module itself, not a copy, so patching it
through either name patches the one module.

Walked: every import statement in the notebooks, the exercises and their solutions, the example policies and the
README's code blocks. The package, the tests, the tools and the benchmarks themselves use the new names only.
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from minipaged import old_paths

ROOT = Path(__file__).resolve().parent.parent


def _python(text: str) -> ast.Module | None:
    """A cell's code as Python: IPython's ``%magic`` and ``!shell`` lines dropped; None if it still does not parse."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _sources() -> dict[str, ast.Module]:
    found: dict[str, ast.Module] = {}
    notebooks = [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"), *ROOT.glob("exercises/*/*.ipynb")]
    for nb in sorted(notebooks):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            tree = _python("".join(cell["source"])) if cell["cell_type"] == "code" else None
            if tree is not None:
                found[f"{nb.relative_to(ROOT)} cell {i}"] = tree
    for py in sorted(ROOT.glob("exercises/policies/*.py")):
        found[str(py.relative_to(ROOT))] = ast.parse(py.read_text())
    readme = (ROOT / "README.md").read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S)):
        tree = _python(block)
        if tree is not None:
            found[f"README.md python block {i}"] = tree
    return found


def _imports(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(module, name) for ``from module import name``, (module, None) for ``import module``: the package's only."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("minipaged"):
            out += [(node.module or "", a.name) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("minipaged")]
    return out


USES = sorted({use for tree in _sources().values() for use in _imports(tree)}, key=str)


def _home(obj: Any) -> Any:
    """What the name ``obj`` was defined under resolves to now: for a class or function, its module's attribute
    (``__module__`` + ``__qualname__``); anything else is its own home."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if (not isinstance(obj, type) and not callable(obj)) or module is None or qualname is None or "<" in qualname:
        return obj
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def test_the_walk_finds_the_old_paths():
    """The readers' imports are found, old paths among them (or this test would pass on nothing)."""
    modules = {m for m, _ in USES}
    assert len(USES) > 100
    assert {"minipaged.block_pool", "minipaged.grading", "minipaged.viz"} <= modules | {
        f"{m}.{n}" for m, n in USES if n
    }
    assert sum(old_paths.new_name(m) is not None for m in modules) > 20


@pytest.mark.parametrize("use", USES, ids=lambda u: f"{u[0]}:{u[1]}" if u[1] else u[0])
def test_each_import_a_reader_uses_resolves_to_the_one_object(use):
    module_name, name = use
    module = importlib.import_module(module_name)
    new = old_paths.new_name(module_name)
    if new is not None:
        assert module is importlib.import_module(new) and module.__name__ == new
    if name is None:
        return
    obj = getattr(module, name) if hasattr(module, name) else importlib.import_module(f"{module_name}.{name}")
    if isinstance(obj, ModuleType):
        moved = old_paths.new_name(f"{module_name}.{name}")
        assert obj is sys.modules[obj.__name__] and (moved is None or obj.__name__ == moved)
    else:
        assert _home(obj) is obj, f"{module_name}.{name} is a copy of {obj.__module__}.{obj.__qualname__}"


@pytest.mark.parametrize("old", sorted(old_paths.MOVED))
def test_every_moved_module_is_its_new_module(old):
    mod = importlib.import_module(old)
    assert mod is importlib.import_module(old_paths.MOVED[old])
    assert mod.__spec__ is not None and mod.__spec__.name == old_paths.MOVED[old]  # its own spec, not the alias's
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is mod  # ``from minipaged import block_pool``


def test_a_moved_package_brings_its_modules():
    from minipaged.classroom.grading import ex05 as new
    from minipaged.grading import ex05 as old

    assert (
        old is new
        and importlib.import_module("minipaged.viz.block_viz").__name__ == "minipaged.classroom.viz.block_viz"
    )
    assert old_paths.new_name("minipaged.config") is None and old_paths.new_name("minipaged.gradingx") is None


def test_the_package_and_its_tools_use_the_new_names():
    """One name for each module in our own code: the old ones are for readers' notebooks only."""
    olds = set(old_paths.MOVED) | set(old_paths.MOVED_PACKAGES)
    wrong = []
    files = [
        *ROOT.glob("minipaged/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("tools/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
    for path in files:
        if path.name in ("test_old_paths.py", "old_paths.py"):
            continue
        for module, name in _imports(ast.parse(path.read_text())):
            used = {module} | ({f"{module}.{name}"} if name else set())
            if any(u == o or u.startswith(o + ".") for u in used for o in olds):
                wrong.append(f"{path.relative_to(ROOT)}: {module}{'.' + name if name else ''}")
    assert wrong == []
