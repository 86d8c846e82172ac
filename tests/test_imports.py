"""The package's import structure, read from its source: no import circle, and no import from a layer above.

Three layers, bottom up (README, "The layout"):

* the engine: what vLLM has (block pool, KV cache manager, scheduler, runner, model, kernels, the engine itself),
  and the seam a learner's part plugs into (``hooks``), which imports nothing from the package;
* the lab: what the course adds to experiment (workloads, the contiguous allocator, the simulator, test drivers);
* the classroom: parts, grading, show, sources, widgets and the command line.

Every import counts, also one inside a function; only imports under ``if TYPE_CHECKING:`` (never executed) do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "minipaged"

LAB = {"workloads", "contiguous", "simulator", "testing"}
CLASSROOM = {"parts", "puzzles", "glossary", "selfcheck", "grading", "show", "sources", "viz", "__main__"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return 2 if top in CLASSROOM else 1 if top in LAB else 0


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports, wherever in the file."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
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
    """The graph is read right: known edges are there, a TYPE_CHECKING import is not."""
    assert "minipaged.block_pool" in GRAPH["minipaged.kv_cache_manager"]
    assert "minipaged.kernels.reference" in GRAPH["minipaged.parts"]
    assert "minipaged.request" not in GRAPH["minipaged.block_pool"]  # only for type hints there
    assert len(MODULES) > 40


def test_no_import_circle():
    assert _cycles() == []


def test_no_import_from_a_layer_above():
    upward = sorted(
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if layer(t) > layer(m)
    )
    assert upward == []


def test_the_seam_imports_nothing_from_the_package():
    assert GRAPH["minipaged.hooks"] == set()
    engine = [m for m in GRAPH if layer(m) == 0]
    assert not any("minipaged.parts" in GRAPH[m] for m in engine)


def test_the_readme_names_every_module_in_its_layer():
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    rows = {
        m[1]: set(re.findall(r"`([\w_]+)/?`", m[2]))
        for m in re.finditer(r"^\| (engine|lab|classroom) \| [^|]+ \| (.+) \|$", readme, re.M)
    }
    tops = {m.split(".")[1] for m in MODULES if "." in m}
    assert rows["lab"] == LAB and rows["classroom"] == CLASSROOM
    assert rows["engine"] == tops - LAB - CLASSROOM
