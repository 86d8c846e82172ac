"""Every file and module the course names exists: a reader who looks for ``minipaged/engine/llm.py`` or
``minipaged.core.scheduler.Scheduler`` finds it under that name (issue 56; the move into layers left old names in
the text).

Read: the cells of the notebooks, the exercises and their solutions (markdown and code, comments included; not
the stored outputs), README.md and site/**/*.md, and the docstrings and comments of every module of the package
and of the example policies. Not read: ``minipaged/old_paths.py`` and ``tests/test_old_paths.py``, which name the
old paths on purpose, and the URLs (a link names another project's tree, not ours).

The rule, for each name found (``names`` finds them, ``missing`` judges them):

* A file path starts with one of the repository's folders (``minipaged/``, ``tests/``, ``tools/``,
  ``benchmarks/``, ``notebooks/``, ``exercises/``, ``site/``, ``assets/``), optionally behind ``../`` (then it is
  read from the text's own folder): it must exist, as a file or, written with a trailing ``/``, as a folder.
  Outside ``minipaged/`` a path is only taken when it ends in ``/`` or a file extension (``tests/benchmarks`` in
  prose is not a path); a pattern, a path with ``*``, ``?`` or ``NN`` (two digits: ``exercises/exNN_*.ipynb``),
  must match at least one file; a path that runs into a placeholder (``exercises/ex<NN>_<name>.ipynb``,
  ``{name}``) is skipped.
* A short path starts with the name of one of the package's folders (``core/``, ``worker/``, ``engine/``,
  ``classroom/``, ``grading/``, ``viz/``, ...) and ends in a file extension or ``/``: it is read from ``minipaged/``
  and must exist there. ``grading/worker.py`` is missing (it is ``classroom/grading/worker.py``).
  A path inside another one (``vllm/v1/core/sched/scheduler.py``: vLLM's own tree) is not ours and not read.
* A dotted name starts with ``minipaged.``: its longest prefix that is a module file of the package
  (``minipaged/a/b.py`` or ``minipaged/a/b/__init__.py``) is the module; the rest, if any, are attributes: the
  first must be a module-level name of that module (imported to look) and not a module (a module is named by its
  file, so an old alias like ``minipaged.kernels.report`` is missing even after it was imported); each further one
  an attribute of the one before, or, on a class, a field it declares or sets on ``self``.

A failure lists each ``file:line: name`` missing; a notebook's line is the line of its .ipynb file.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minipaged"
TOP_FOLDERS = ("minipaged", "tests", "tools", "benchmarks", "notebooks", "exercises", "site", "assets")
# the package's folders at any depth (core, worker, ..., grading, viz): a path starting with one is read from minipaged/
SUB_FOLDERS = sorted({p.name for p in PACKAGE.rglob("*") if p.is_dir() and not p.name.startswith(("_", "."))})
ON_PURPOSE = {"minipaged/old_paths.py", "tests/test_old_paths.py"}

_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
_CHARS = r"[\w./*?-]"
_PATH = re.compile(
    rf"(?<![\w./:-])((?:\.\./)*)((?:{'|'.join(TOP_FOLDERS)})/{_CHARS}*|(?:{'|'.join(SUB_FOLDERS)})/{_CHARS}*)"
)
_DOTTED = re.compile(r"(?<![\w./-])minipaged(?:\.\w+)+(?![\w-])")
_EXTENSION = re.compile(r"\.[A-Za-z0-9]+$")


# ---- finding the names ------------------------------------------------------------------------------------------
def names(text: str, first_line: int = 1) -> Iterator[tuple[int, str, str]]:
    """(line, what, name) for each file path (what: ``path`` or ``../`` prefixes + ``path``, as written) and each
    dotted module name (what: ``module``) in ``text``, whose first line is ``first_line``."""
    for i, line in enumerate(text.splitlines()):
        line = _URL.sub(lambda m: " " * len(m.group()), line)
        for m in _PATH.finditer(line):
            path, after = m.group(2).rstrip(".-"), line[m.end() :]
            if after.startswith("{") or (after.startswith("<") and not after.startswith("</")):
                continue  # a placeholder: exercises/ex<NN>_name.ipynb
            looks_like_one = path.endswith("/") or _EXTENSION.search(path) or _is_pattern(path)
            if path.startswith("minipaged/") or looks_like_one:  # "tests/benchmarks" in prose is not a path
                yield first_line + i, "path", m.group(1) + path
        for m in _DOTTED.finditer(line):
            yield first_line + i, "module", m.group().rstrip(".")


def missing(what: str, name: str, where: Path) -> str | None:
    """Why ``name`` (found by ``names`` in the file ``where``) names nothing; None if it exists."""
    if what == "module":
        return _missing_module(name)
    ups = len(re.match(r"(?:\.\./)*", name).group()) // 3  # type: ignore[union-attr]
    rest = name[ups * 3 :]
    if ups:
        base = where.parent
        for _ in range(ups):
            base = base.parent
    else:
        base = ROOT if rest.split("/", 1)[0] in TOP_FOLDERS else PACKAGE
    target = base / rest
    if _is_pattern(rest):
        return None if any(base.glob(rest.replace("NN", "[0-9][0-9]"))) else "matches no file"
    if rest.endswith("/"):
        return None if target.is_dir() else "no such folder"
    return None if target.exists() else "no such file"


def _is_pattern(path: str) -> bool:
    return any(c in path for c in "*?") or "NN" in path


def _module_file(dotted: str) -> Path | None:
    path = ROOT.joinpath(*dotted.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _missing_module(name: str) -> str | None:
    parts = name.split(".")
    n = len(parts)
    while n > 1 and _module_file(".".join(parts[:n])) is None:
        n -= 1
    if _module_file(".".join(parts[:n])) is None:
        return "no such module"
    module_name, attributes = ".".join(parts[:n]), parts[n:]
    if not attributes:
        return None
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as e:  # any failure to import is the finding
        return f"{module_name} does not import: {e!r}"
    for depth, attribute in enumerate(attributes):
        try:
            found = hasattr(obj, attribute)
        except Exception as e:  # a lazy attribute (minipaged.LLM) imports when looked up
            return f"{'.'.join([module_name, *attributes[: depth + 1]])} does not import: {e!r}"
        if found:
            obj = getattr(obj, attribute)
            if depth == 0 and isinstance(obj, ModuleType):
                return f"{module_name}.{attribute} is a module: name it by its file ({obj.__name__})"
            continue
        if isinstance(obj, type) and _declared(obj, attribute):
            return None  # an instance attribute: nothing further to look into
        return f"{'.'.join([module_name, *attributes[:depth]])} has no attribute {attribute!r}"
    return None


def _declared(cls: type, attribute: str) -> bool:
    """A field of ``cls`` (annotated, a dataclass field, a slot) or an attribute one of its methods sets on self."""
    for klass in cls.__mro__:
        if attribute in getattr(klass, "__annotations__", {}) or attribute in getattr(klass, "__slots__", ()):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(attribute)}\s*(?::[^=\n]*)?=(?!=)", source):
            return True
    return False


# ---- the texts ------------------------------------------------------------------------------------------------------
def _notebook_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(the line of the .ipynb file its source starts on, source) for each cell. The course writes a notebook one
    source line to a file line (``json.dumps(nb, indent=1)``); a notebook written otherwise gets line 1 for all."""
    raw = path.read_text(encoding="utf-8")
    cells = json.loads(raw)["cells"]
    starts = [i + 2 for i, ln in enumerate(raw.splitlines()) if re.fullmatch(r'\s*"source": \[', ln)]
    for index, cell in enumerate(cells):
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        if len(starts) == len(cells) and isinstance(cell["source"], list):
            yield starts[index], source
        else:
            yield 1, source


def _python_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) for each comment and docstring of a module."""
    source = path.read_text(encoding="utf-8")
    docstrings: set[tuple[int, int]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    docstrings.add((first.lineno, first.col_offset))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT or (token.type == tokenize.STRING and token.start in docstrings):
            yield token.start[0], token.string


def learner_texts() -> Iterator[tuple[Path, int, str]]:
    """(file, first line, text) for everything a reader of the course reads."""
    notebooks = sorted({*ROOT.glob("notebooks/*.ipynb"), *ROOT.glob("exercises/**/*.ipynb")})
    for path in notebooks:
        for line, text in _notebook_texts(path):
            yield path, line, text
    for path in sorted([ROOT / "README.md", *ROOT.glob("site/**/*.md")]):
        if path.is_file():
            yield path, 1, path.read_text(encoding="utf-8")
    for path in sorted([*PACKAGE.rglob("*.py"), *ROOT.glob("exercises/policies/*.py")]):
        if str(path.relative_to(ROOT)) not in ON_PURPOSE:
            for line, text in _python_texts(path):
                yield path, line, text


def missing_names(texts: Iterator[tuple[Path, int, str]]) -> list[str]:
    """``file:line: name (why)`` for each name in ``texts`` that names nothing."""
    found = []
    for path, first_line, text in texts:
        for line, what, name in names(text, first_line):
            why = missing(what, name, path)
            if why is not None:
                found.append(f"{path.relative_to(ROOT)}:{line}: {name} ({why})")
    return found


# ---- the tests ------------------------------------------------------------------------------------------------------
def test_the_finder_reports_a_missing_path():
    """The rule on a made-up text: each kind of name is found, and the ones that name nothing are reported."""
    text = "\n".join(
        [
            "The pool is `minipaged/core/block_pool.py`; the engine was `minipaged/engine.py`.",  # 1: one missing
            "See grading/worker.py and classroom/grading/worker.py, and tests/test_nothing_here.py.",  # 2: two
            "vLLM's vllm/v1/core/sched/scheduler.py, https://github.com/x/y/blob/main/minipaged/gone.py",  # 3: none
            "minipaged.core.scheduler.Scheduler and minipaged.core.scheduler.NoSuchThing,",  # 4: one
            "minipaged.block_pool (an old name), minipaged.kernels.report, minipaged.lab.simulator.",  # 5: two
            "notebooks/*.ipynb, exercises/ex*_nothing.ipynb, ../notebooks/03_block_pool.ipynb, core/",  # 6: one
            "exercises/exNN_*.ipynb, notebooks/NN_nothing.ipynb, exercises/ex<NN>_<name>.ipynb, viz/",  # 7: two
        ]
    )
    where = ROOT / "site" / "page.md"
    got = [(line, name) for line, what, name in names(text, 10) if missing(what, name, where)]
    assert got == [
        (10, "minipaged/engine.py"),
        (11, "grading/worker.py"),
        (11, "tests/test_nothing_here.py"),
        (13, "minipaged.core.scheduler.NoSuchThing"),
        (14, "minipaged.block_pool"),
        (14, "minipaged.kernels.report"),
        (15, "exercises/ex*_nothing.ipynb"),
        (16, "notebooks/NN_nothing.ipynb"),
        (16, "viz/"),
    ]
    found = [name for _, _, name in names(text)]
    for present in ("minipaged/core/block_pool.py", "classroom/grading/worker.py", "minipaged.lab.simulator"):
        assert present in found  # found, and judged present
    assert "exercises/exNN_*.ipynb" in found and "../notebooks/03_block_pool.ipynb" in found
    assert not any("vllm" in n or "gone" in n or "sched/" in n or "<" in n or n == "exercises/ex" for n in found)


def test_a_failure_names_the_file_and_line():
    text = "one\nsee minipaged/nowhere.py and minipaged.core.nowhere\n"  # as if README.md's lines 7 and 8
    assert missing_names(iter([(ROOT / "README.md", 7, text)])) == [
        "README.md:8: minipaged/nowhere.py (no such file)",
        "README.md:8: minipaged.core.nowhere (minipaged.core has no attribute 'nowhere')",
    ]


def test_a_notebook_line_is_the_line_of_its_file():
    nb = ROOT / "notebooks" / "03_block_pool.ipynb"
    lines = nb.read_text(encoding="utf-8").splitlines()
    for first, text in _notebook_texts(nb):
        for i, source_line in enumerate(text.splitlines()):
            assert json.loads(lines[first - 1 + i].rstrip().rstrip(",")).rstrip("\n") == source_line


def test_every_path_the_course_names_exists():
    found = missing_names(learner_texts())
    assert found == [], f"{len(found)} names that name nothing:\n" + "\n".join(found)
