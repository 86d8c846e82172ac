"""A pytest plugin: nbval grades an exercise starter against what its check cells must print, kept out of sight.

A starter's check cell stores no output: a learner opening ``exNN_*.ipynb`` must not read "8/8 checks passed"
before writing anything. What the cell must print, the solution's output, is in the cell's metadata
(``metadata["minipaged"]["expected"]``, written by ``tools/nbtool.py refresh``); here it becomes nbval's expected
output, so ``pytest --nbval-lax exercises/exNN_*.ipynb`` passes exactly when every check passes. Installing the
package registers it (``pyproject.toml``: the ``pytest11`` entry point), so it works from any folder. Without it
(``-p no:minipaged``) a check cell is compared with no output at all, and fails: never a false pass.

Not a ``conftest.py`` in ``exercises/``: the test suite imports helpers ``from conftest``, and a second module of that
name would take the place of ``tests/conftest.py`` in whichever process collected both. Loading it costs
nothing: ``minipaged.classroom.grading`` imports neither torch nor Triton.
"""

from __future__ import annotations

import os
from typing import Any

import nbformat

from ...old_paths import QUIET_ENV


def pytest_configure(config: Any) -> None:
    """When nbval runs, the kernels it starts inherit this: an old import path in a notebook saved before the package's
    move into layers does not warn (``old_paths.py``), since nbval would compare the warning with the cell's recorded
    output."""
    if getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False):
        os.environ[QUIET_ENV] = "1"


def pytest_collection_modifyitems(items: list[Any]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)  # nbval's IPyNbCell: the notebook cell it runs and compares
        if cell is None or not hasattr(cell, "get"):
            continue
        expected = cell.get("metadata", {}).get("minipaged", {}).get("expected")
        if expected is not None and not cell.get("outputs"):
            cell.outputs = [nbformat.from_dict(out) for out in expected]
