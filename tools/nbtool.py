"""Maintainer tool for the course notebooks (not used by learners).

    python tools/nbtool.py from-py SRC.py OUT.ipynb   # build a notebook from a percent-format script
    python tools/nbtool.py refresh NB.ipynb ...        # re-run and store only the outputs nbval compares
    python tools/nbtool.py time NB.ipynb ...           # wall time of each, top to bottom in a fresh kernel

Conventions it enforces (see DESIGN.md): outputs are stored only for cells marked
``# NBVAL_CHECK_OUTPUT``; plot and widget outputs never enter the repo. An exercise
starter (``exercises/exNN_*.ipynb``) gets its check cells' expected outputs from
its solution (``exercises/solutions/exNN_*.ipynb``), run first: a starter is
expected to print what a correct solution prints. A starter keeps them out of sight,
in the check cell's metadata (``metadata["minipaged"]["expected"]``, no output stored:
a learner must not read "8/8 checks passed" before writing anything);
the package's pytest plugin (``minipaged/classroom/grading/nbval_plugin.py``) gives them to nbval.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from minipaged.classroom.grading.runner import CHECK_MARK, METADATA_KEY, execute  # noqa: E402

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def from_py(src: Path, out: Path) -> None:
    """``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell (its lines start with '# ').

    ``# %% [markdown] answer`` makes a collapsed markdown cell: the answer to a "think, then check".
    """
    cells = []
    kind, lines, answer = None, [], False

    def flush() -> None:
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(re.sub(r"^# ?", "", ln) for ln in text.splitlines())
            cell = nbformat.v4.new_markdown_cell(text)
            if answer:
                cell.metadata["jupyter"] = {"source_hidden": True}
                cell.metadata["tags"] = ["answer"]
            cells.append(cell)
        elif kind == "code" and text:
            cells.append(nbformat.v4.new_code_cell(text))

    for line in src.read_text().splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
            answer = line.rstrip().endswith("answer")
        else:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.write(nb, out)


def strip_unchecked(nb) -> None:
    """Keep outputs (and an execution count: nbval skips "unrun" cells) only where nbval compares them."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for count, cell in enumerate(code_cells, start=1):
        cell.metadata.pop("execution", None)
        if CHECK_MARK not in cell.source:
            cell.outputs, cell.execution_count = [], None
            continue
        cell.execution_count = count
        for out in cell.outputs:
            if "execution_count" in out:
                out["execution_count"] = count
    nb.metadata.pop("widgets", None)


def refresh(path: Path) -> None:
    solution = path.parent / "solutions" / path.name
    if solution.exists():  # a starter: take the expected outputs from the solution
        refresh(solution)
        sol = nbformat.read(solution, as_version=4)
        expected = [c.outputs for c in sol.cells if c.cell_type == "code" and CHECK_MARK in c.source]
        nb = nbformat.read(path, as_version=4)
        checks = [c for c in nb.cells if c.cell_type == "code" and CHECK_MARK in c.source]
        if len(checks) != len(expected):
            raise SystemExit(f"{path}: {len(checks)} check cells but the solution has {len(expected)}")
        for cell, outs in zip(checks, expected):
            cell.metadata[METADATA_KEY] = {"expected": outs}  # for nbval (grading/nbval_plugin.py), not on show
            cell.outputs = []
        strip_unchecked(nb)  # keeps the check cells' execution counts: nbval skips a cell it takes for unrun
    else:
        nb = execute(path)
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            raise SystemExit(f"{path}: a cell raised {errors[0]['ename']}: {errors[0]['evalue']}")
        strip_unchecked(nb)
        for cell in nb.cells:
            cell.metadata.pop(METADATA_KEY, None)  # a solution shows what it prints
    nbformat.write(nb, path)
    print(f"refreshed {path}")


def time_notebooks(paths: list[Path]) -> None:
    """Run each notebook as nbval would (fresh kernel, its own folder) and print its wall time; fail on an error."""
    import os
    import platform
    import time

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    for path in paths:
        t0 = time.perf_counter()
        nb = execute(path)
        seconds = time.perf_counter() - t0
        errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        print(f"{path.name:<40} {seconds:6.1f} s" + (f"  ERROR {errors[0]['ename']}" if errors else ""), flush=True)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "from-py":
        from_py(Path(args[0]), Path(args[1]))
    elif cmd == "refresh":
        for a in args:
            refresh(Path(a))
    elif cmd == "time":
        time_notebooks([Path(a) for a in args])
    else:
        raise SystemExit(__doc__)
