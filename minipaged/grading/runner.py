"""Grade exercise notebooks: run each one in a fresh kernel and read its check lines.

``grade_folder("exercises")`` runs every notebook in the folder (not its
``solutions/``) top to bottom, errors allowed so one broken cell does not hide
the other checks, and collects the ``group: k/n checks passed`` lines printed by
the check cells. The result is a score table: one row per notebook and group.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .core import parse_summaries

CHECK_MARK = "NBVAL_CHECK_OUTPUT"


@dataclass(frozen=True)
class GroupScore:
    notebook: str
    group: str
    passed: int
    total: int


def run_code_cells(path: str | os.PathLike, name: str) -> tuple[dict[str, Any], list[str]]:
    """Run a notebook's code cells in this process, in its folder, skipping its check cells, in a fresh
    namespace called ``name``; return the namespace and the errors of the cells that failed (the rest still ran). What the
    cells print is swallowed. Used to take a learner's functions out of their notebook."""
    import nbformat

    namespace: dict[str, Any] = {"__name__": name}
    errors: list[str] = []
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or CHECK_MARK in cell.source:
            continue
        filename = f"<{Path(path).name} cell {i}>"
        source = cell.source + "\n"
        # @triton.jit reads its function's source back: make the cell findable, as IPython does.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:   # in the notebook's folder, as Jupyter runs it
            with contextlib.redirect_stdout(io.StringIO()), contextlib.chdir(Path(path).resolve().parent):
                exec(compile(source, filename, "exec"), namespace)
        except Exception as exc:   # a stub's NotImplementedError in a try-it cell, say
            errors.append(f"cell {i}: {type(exc).__name__}: {exc}")
    return namespace, errors


def _cell_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out and "text/plain" in out["data"]:
            parts.append(out["data"]["text/plain"])
    return "".join(parts)


def expected_groups(path: str | os.PathLike) -> list[tuple[str, int]]:
    """(group, number of checks) from the stored outputs of a notebook's check cells."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    return [(g, total) for cell in nb.cells if CHECK_MARK in cell.get("source", "")
            for g, _, total in parse_summaries(_cell_text(cell))]


def execute(path: str | os.PathLike, timeout: int = 600):
    """Run a notebook top to bottom in a fresh kernel, in its own folder; return the executed copy."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    client.execute()
    return nb


def grade_notebook(path: str | os.PathLike, timeout: int = 600) -> list[GroupScore]:
    """Scores of one notebook. A group whose check cell crashed before printing scores 0."""
    nb = execute(path, timeout)
    found: dict[str, GroupScore] = {}
    for cell in nb.cells:
        for group, passed, total in parse_summaries(_cell_text(cell)):
            found[group] = GroupScore(Path(path).name, group, passed, total)
    for group, total in expected_groups(path):
        found.setdefault(group, GroupScore(Path(path).name, group, 0, total))
    return list(found.values())


def grade_folder(folder: str | os.PathLike = "exercises", timeout: int = 600) -> list[GroupScore]:
    notebooks = sorted(Path(folder).glob("*.ipynb"))
    if not notebooks:
        raise ValueError(f"no notebooks to grade in {folder!s}")
    return [score for nb in notebooks for score in grade_notebook(nb, timeout)]


def format_table(scores: list[GroupScore]) -> str:
    """A plain-text score table with a total line."""
    rows = [("notebook", "check group", "score")]
    rows += [(s.notebook, s.group, f"{s.passed}/{s.total}") for s in scores]
    passed, total = sum(s.passed for s in scores), sum(s.total for s in scores)
    rows.append(("TOTAL", "", f"{passed}/{total}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
