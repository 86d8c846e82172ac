"""A pytest plugin: nbval grades an exercise starter against what its check cells must print, kept out of sight.

A starter's check cell stores no output: a learner opening ``exNN_*.ipynb`` must not read "8/8 checks passed"
before writing anything. What the cell must print, the solution's output, is in the cell's metadata
(``metadata["minipaged"]["expected"]``, written by ``tools/nbtool.py refresh``); here it becomes nbval's expected
output, so ``pytest --nbval-lax exercises/exNN_*.ipynb`` passes exactly when every check passes. Installing the
package registers it (``pyproject.toml``: the ``pytest11`` entry point), so it works from any folder. Without it
(``-p no:minipaged``) a check cell is compared with no output at all, and fails: never a false pass.

Not an ``exercises/conftest.py``: the test suite imports helpers ``from conftest``, and a second module of that
name would take the place of ``tests/conftest.py`` in whichever process collected both. Loading it costs
nothing: ``minipaged.grading`` imports neither torch nor Triton.
"""

from __future__ import annotations

from typing import Any

import nbformat


def pytest_collection_modifyitems(items: list[Any]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's IPyNbCell: the notebook cell it runs and compares
        if cell is None or not hasattr(cell, "get"):
            continue
        expected = cell.get("metadata", {}).get("minipaged", {}).get("expected")
        if expected is not None and not cell.get("outputs"):
            cell.outputs = [nbformat.from_dict(out) for out in expected]
