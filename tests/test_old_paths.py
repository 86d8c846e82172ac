"""Every module's old import path still works after the move into layers (``minipaged/old_paths.py``), gives the
very object it names now (the module itself, not a copy: patching it through either name patches the one module),
and says once where the module lives now; and the course itself uses the new names only.

The learner material walked: every import statement in the notebooks, the exercises and their solutions, the
example policies and the README's code blocks. The package, the tests, the tools and the benchmarks use the new
names too. The old names stay for notebooks saved before the move.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from minipaged import old_paths

ROOT = Path(__file__).resolve().parent.parent
OLD_NAMES = sorted({*old_paths.MOVED, *old_paths.MOVED_PACKAGES})
# each module under a moved package, by its old name: minipaged.grading.ex05b, minipaged.viz.block_viz, ...
OLD_PACKAGE_MODULES = sorted(
    f"{old}.{info.name}"
    for old, new in old_paths.MOVED_PACKAGES.items()
    for info in pkgutil.iter_modules(importlib.import_module(new).__path__)
)
# the tests here import old names on purpose: their warnings are the subject of some tests, noise in the others
pytestmark = pytest.mark.filterwarnings("ignore:minipaged.* moved to minipaged:FutureWarning")


def _python(text: str) -> ast.Module | None:
    """A cell's code as Python: IPython's ``%magic`` and ``!shell`` lines dropped; None if it still does not parse."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    try:
        return ast.parse("\n".join(lines))
    except SyntaxError:
        return None


def _learner_sources() -> dict[str, ast.Module]:
    """The code a learner reads and runs: notebooks, exercises, solutions, example policies, README blocks."""
    found: dict[str, ast.Module] = {}
    notebooks = [*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/*.ipynb"), *ROOT.glob("exercises/*/*.ipynb")]
    for nb in sorted(notebooks):
        for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            tree = _python("".join(cell["source"])) if cell["cell_type"] == "code" else None
            if tree is not None:
                found[f"{nb.relative_to(ROOT)} cell {i}"] = tree
    for py in sorted(ROOT.glob("exercises/policies/*.py")):
        found[str(py.relative_to(ROOT))] = ast.parse(py.read_text(encoding="utf-8"))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
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


LEARNER_SOURCES = _learner_sources()
USES = sorted({use for tree in LEARNER_SOURCES.values() for use in _imports(tree)}, key=str)


def _old(module: str, name: str | None) -> str | None:
    """The old path an import uses (``minipaged.block_pool``, or ``minipaged.parts`` in ``from minipaged import
    parts``), None if it uses new names only."""
    if old_paths.new_name(module) is not None:
        return module
    if name is not None and old_paths.new_name(f"{module}.{name}") is not None:
        return f"{module}.{name}"
    return None


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


@contextlib.contextmanager
def _forgotten(old: str) -> Iterator[None]:
    """As if this process had never imported the old name ``old``: out of ``sys.modules`` (with the modules under
    it), off its parent package, not yet warned about. Everything is put back after."""
    saved = {k: m for k, m in sys.modules.items() if k == old or k.startswith(old + ".")}
    parent_name, _, leaf = old.rpartition(".")
    parent = importlib.import_module(parent_name)
    missing = object()
    bound = parent.__dict__.get(leaf, missing)
    warned = set(old_paths.WARNED)
    for k in saved:
        del sys.modules[k]
    if bound is not missing:
        delattr(parent, leaf)
    old_paths.WARNED.clear()
    try:
        yield
    finally:
        for k in [k for k in sys.modules if k == old or k.startswith(old + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)
        if bound is not missing:
            setattr(parent, leaf, bound)
        elif leaf in parent.__dict__:
            delattr(parent, leaf)
        old_paths.WARNED.clear()
        old_paths.WARNED.update(warned)


@contextlib.contextmanager
def _recorded() -> Iterator[list[warnings.WarningMessage]]:
    """The FutureWarnings raised inside, every one of them (``always``: only old_paths' own once may stop one)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    caught[:] = [w for w in caught if issubclass(w.category, FutureWarning)]


def _run(code: str, filename: str = "<learner cell>") -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__learner__"}
    exec(compile(code, filename, "exec"), namespace)
    return namespace


# ---- the old names resolve to the one module --------------------------------------------------------------------------
@pytest.mark.parametrize("old", sorted(old_paths.MOVED))
def test_every_moved_module_is_its_new_module(old):
    mod = importlib.import_module(old)
    assert mod is importlib.import_module(old_paths.MOVED[old])
    assert mod.__spec__ is not None and mod.__spec__.name == old_paths.MOVED[old]  # its own spec, not the alias's
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is mod
    assert _run(f"from {parent} import {leaf}")[leaf] is mod  # ``from minipaged import block_pool``
    assert _run(f"import {old}\nfound = {old}")["found"] is mod


@pytest.mark.parametrize("old", OLD_PACKAGE_MODULES)
def test_a_moved_package_brings_each_of_its_modules(old):
    new = old_paths.new_name(old)
    assert new is not None and importlib.import_module(old) is importlib.import_module(new)
    package, _, leaf = old.rpartition(".")
    assert _run(f"from {package} import {leaf}")[leaf] is sys.modules[new]
    assert importlib.import_module(package) is importlib.import_module(old_paths.MOVED_PACKAGES[package])


def test_a_moved_package_and_what_did_not_move():
    from minipaged.classroom.grading import ex05b as new

    old = _run("from minipaged.grading import ex05b")["ex05b"]
    assert (
        old is new
        and importlib.import_module("minipaged.viz.block_viz").__name__ == "minipaged.classroom.viz.block_viz"
    )
    assert old_paths.new_name("minipaged.config") is None and old_paths.new_name("minipaged.gradingx") is None
    assert len(OLD_PACKAGE_MODULES) > 20


# ---- the first import of an old name warns, once ----------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _not_quiet(monkeypatch):
    """The nbval plugin quiets the warning for the notebooks' kernels (this process's environment, under
    ``make test``); these tests hear it."""
    monkeypatch.delenv(old_paths.QUIET_ENV, raising=False)


def test_under_nbval_an_old_path_does_not_warn():
    """A notebook saved before the move, run by ``pytest --nbval-lax``: its checked cells' stderr stays as recorded."""
    env = {**os.environ, old_paths.QUIET_ENV: "1"}
    code = "import minipaged.block_pool\nfrom minipaged.grading import ex05b\nprint('ran')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "ran\n", "")


@pytest.mark.parametrize("old", OLD_NAMES)
def test_the_first_import_of_an_old_name_warns_once_naming_its_new_home(old):
    new = old_paths.new_name(old)
    with _forgotten(old):
        with _recorded() as first:
            module = importlib.import_module(old)
        with _recorded() as again:
            assert importlib.import_module(old) is module  # from sys.modules
            del sys.modules[old]
            assert importlib.import_module(old) is module  # through the finder again: still once a process
    assert [str(w.message) for w in first] == [f"{old} moved to {new}; import it from there (the old name still works)"]
    assert first[0].filename == __file__  # the line that imported it, not importlib's
    assert again == []


@pytest.mark.parametrize(
    "statement",
    ["import minipaged.block_pool", "from minipaged import block_pool", "from minipaged.block_pool import BlockPool"],
)
def test_the_warning_points_at_the_importing_line(statement):
    with _forgotten("minipaged.block_pool"), _recorded() as caught:
        _run(f"x = 1\n\n{statement}\n", "cell.py")
    assert [(w.filename, w.lineno) for w in caught] == [("cell.py", 3)]
    assert "minipaged.block_pool moved to minipaged.core.block_pool" in str(caught[0].message)


def test_a_module_of_a_moved_package_warns_as_its_package_once():
    with _forgotten("minipaged.grading"), _recorded() as caught:
        _run("from minipaged.grading import ex05b\nfrom minipaged.grading.ex03 import _reference\n")
        _run("import minipaged.grading.ex07\n")
    assert [str(w.message) for w in caught] == [
        "minipaged.grading moved to minipaged.classroom.grading; import it from there (the old name still works)"
    ]


def test_a_fresh_process_warns_once_at_the_importing_line():
    """``python -c``, where ``__main__`` has no source to show: one warning per old name, the program runs on."""
    code = (
        "from minipaged import block_pool\nimport minipaged.block_pool\nfrom minipaged.block_pool import BlockPool\n"
        "from minipaged.viz import block_viz\nimport minipaged.viz.batching_viz\nprint(block_pool.BlockPool is BlockPool)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout == "True\n", out.stderr
    assert out.stderr.splitlines() == [
        "<string>:1: FutureWarning: minipaged.block_pool moved to minipaged.core.block_pool; import it from there "
        "(the old name still works)",
        "<string>:4: FutureWarning: minipaged.viz moved to minipaged.classroom.viz; import it from there "
        "(the old name still works)",
    ]


def test_a_new_name_never_warns():
    with _forgotten("minipaged.block_pool"), _recorded() as caught:
        _run("import minipaged.core.block_pool\nfrom minipaged.core import block_pool\nfrom minipaged import kv_math\n")
    assert caught == []


# ---- the course uses the new names ----------------------------------------------------------------------------------
def test_the_walk_finds_the_learners_imports():
    """The walk reads what it must (or the tests below would pass on nothing)."""
    assert len(USES) > 100 and len(LEARNER_SOURCES) > 300
    modules = {m for m, _ in USES}
    assert {"minipaged.core.block_pool", "minipaged.classroom.grading", "minipaged.classroom.viz"} <= modules | {
        f"{m}.{n}" for m, n in USES if n
    }
    assert any(k.startswith("exercises/solutions/") for k in LEARNER_SOURCES)
    assert any(k.startswith("exercises/policies/") for k in LEARNER_SOURCES)
    assert _old("minipaged.block_pool", "BlockPool") == "minipaged.block_pool"
    assert _old("minipaged", "parts") == "minipaged.parts" and _old("minipaged", "LLM") is None


@pytest.mark.parametrize("use", USES, ids=lambda u: f"{u[0]}:{u[1]}" if u[1] else u[0])
def test_each_import_a_learner_uses_is_the_one_object(use):
    module_name, name = use
    module = importlib.import_module(module_name)
    if name is None:
        return
    obj = getattr(module, name) if hasattr(module, name) else importlib.import_module(f"{module_name}.{name}")
    if isinstance(obj, ModuleType):
        assert obj is sys.modules[obj.__name__] and obj.__name__ == f"{module_name}.{name}"
    else:
        assert _home(obj) is obj, f"{module_name}.{name} is a copy of {obj.__module__}.{obj.__qualname__}"


def test_the_package_and_its_tools_use_the_new_names():
    """One name for each module in the course and in our own code: the old ones are for notebooks saved before the
    move. Read: the package, the tests, the tools, the benchmarks, and the learner material (notebooks, exercises,
    solutions, example policies, the README's python blocks)."""
    sources = dict(LEARNER_SOURCES)
    files = [
        *ROOT.glob("minipaged/**/*.py"),
        *ROOT.glob("tests/*.py"),
        *ROOT.glob("tools/*.py"),
        *ROOT.glob("benchmarks/*.py"),
    ]
    for path in files:
        if path.name not in ("test_old_paths.py", "old_paths.py"):
            sources[str(path.relative_to(ROOT))] = ast.parse(path.read_text(encoding="utf-8"))
    wrong = []
    for where, tree in sorted(sources.items()):
        for module, name in _imports(tree):
            old = _old(module, name)
            if old is not None:
                wrong.append(f"{where}: {module}{'.' + name if name else ''} (now {old_paths.new_name(old)})")
    assert wrong == [], f"{len(wrong)} imports of an old path:\n" + "\n".join(wrong)
