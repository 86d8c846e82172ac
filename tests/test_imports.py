"""The package's layers, read from its source: a module's layer is its folder, and no import goes up or round.

Bottom up (``site/guide/layout.md``, the README's "Layout" page)::

    base        minipaged/*.py: config, sampling_params, kv_math, hooks, utils, profiling, distributed, ...
    core        minipaged/core/       the scheduler's world in plain Python
    kernels     minipaged/kernels/    the engine's attention kernels
    model       minipaged/model/      the Llama and its layers
    worker      minipaged/worker/     the model runner, cache engine, executors
    engine      minipaged/engine/     LLM, the step driver
    serving     minipaged/serving/    } side by side: neither imports the other
    lab         minipaged/lab/        }
    classroom   minipaged/classroom/  parts, grading, widgets
    top         minipaged/__init__.py, minipaged/__main__.py

Every import counts: one inside a function, and one under ``if TYPE_CHECKING:`` too (a type hint is a
dependency a reader follows; a circle closed only by hints is still a circle).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minipaged"

# folder -> rank; folders of one rank may not import each other
RANKS = {
    "": 0,
    "core": 1,
    "kernels": 2,
    "model": 3,
    "worker": 4,
    "engine": 5,
    "serving": 6,
    "lab": 6,
    "classroom": 7,
}
TOP = {"minipaged", "minipaged.__main__"}  # the package's front door and its command line


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def folder(module: str) -> str:
    """The layer a module is in: the first folder under ``minipaged/`` ("" for the base modules)."""
    if module in TOP:
        return "top"
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or MODULES[module].name == "__init__.py" else ""


def rank(module: str) -> int:
    return len(RANKS) if module in TOP else RANKS[folder(module)]


def imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, wherever in the file, type-only imports included."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
    return {m for m in found if m in MODULES and m != module}


GRAPH = {m: imports(m) for m in MODULES}


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_reader_finds_the_imports():
    """The graph is read right: known edges are there, type-only imports included, and every module has a layer."""
    assert "minipaged.core.block_pool" in GRAPH["minipaged.core.kv_cache_manager"]
    assert "minipaged.kernels.reference" in GRAPH["minipaged.classroom.parts"]
    assert "minipaged.core.request" in GRAPH["minipaged.core.block_pool"]  # only for type hints there: counted
    assert "minipaged.engine.llm" in GRAPH["minipaged"]  # LLM, imported on first use
    assert len(MODULES) > 100
    assert {folder(m) for m in MODULES} == set(RANKS) | {"top"}


def test_no_import_circle():
    assert _cycles() == []


def test_no_import_from_a_layer_above_or_beside():
    wrong = sorted(
        f"{m} ({folder(m) or 'base'}) imports {t} ({folder(t) or 'base'})"
        for m, targets in GRAPH.items()
        for t in targets
        if rank(t) > rank(m) or (rank(t) == rank(m) and folder(t) != folder(m))
    )
    assert wrong == []


def test_the_seam_imports_nothing_from_the_package():
    assert GRAPH["minipaged.hooks"] == set()
    assert GRAPH["minipaged.old_paths"] == set()  # it must not import a module before an old path asks for it


def test_the_layout_page_draws_every_layer_and_base_module():
    page = (PACKAGE.parent / "site" / "guide" / "layout.md").read_text()
    assert "site/guide/layout.md" in (PACKAGE.parent / "README.md").read_text()  # the README links to it
    tree = page[page.index("## The package, in layers") :]
    tree = tree[: tree.index("\n## ", 1)]
    drawn = set(re.findall(r"^\s+(?:\w+/)*(\w+)/\s", tree, re.M))  # classroom/grading/: grading
    assert drawn == set(RANKS) - {""} | {"grading", "viz"}
    base = {m.split(".")[1] for m in MODULES if folder(m) == ""}
    assert base <= set(re.findall(r"(\w+)\.py", tree))
