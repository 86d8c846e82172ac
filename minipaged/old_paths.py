"""The package's old import paths, each the same module at its new home (issue 43 moved modules into layers).

``import minipaged.block_pool`` and ``from minipaged import block_pool`` give ``minipaged.core.block_pool``
itself, not a copy: a test that patches an attribute through either name patches the one module, and a
learner's notebook saved before the move runs unchanged. Nothing is imported until an old path is: a finder
first on ``sys.meta_path`` answers only for the names in ``MOVED`` and ``MOVED_PACKAGES``, and hands the
import to the module's new name.

The first import of an old name warns, once a process, with a ``FutureWarning`` (shown in a notebook, unlike a
``DeprecationWarning``) that names the new home and points at the importing line::

    FutureWarning: minipaged.block_pool moved to minipaged.core.block_pool; import it from there (the old name
    still works)

A module under a moved package (``minipaged.grading.ex05b``) is covered by its package's warning: importing it
imports the package by its old name first. The course, the package, its tests and tools import the new names
only (``tests/test_old_paths.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from types import FrameType, ModuleType

# old module -> new module
MOVED: dict[str, str] = {
    "minipaged.block_pool": "minipaged.core.block_pool",
    "minipaged.request": "minipaged.core.request",
    "minipaged.single_type_kv_cache_manager": "minipaged.core.single_type_kv_cache_manager",
    "minipaged.kv_cache_coordinator": "minipaged.core.kv_cache_coordinator",
    "minipaged.kv_cache_manager": "minipaged.core.kv_cache_manager",
    "minipaged.kv_connector": "minipaged.core.kv_connector",
    "minipaged.scheduler": "minipaged.core.scheduler",
    "minipaged.scheduler_output": "minipaged.core.scheduler_output",
    "minipaged.spec_decode": "minipaged.core.spec_decode",
    "minipaged.model_runner": "minipaged.worker.model_runner",
    "minipaged.block_table": "minipaged.worker.block_table",
    "minipaged.cache_engine": "minipaged.worker.cache_engine",
    "minipaged.sampler": "minipaged.worker.sampler",
    "minipaged.executor": "minipaged.worker.executor",
    "minipaged.step": "minipaged.engine.step",
    "minipaged.inputs": "minipaged.engine.inputs",
    "minipaged.outputs": "minipaged.engine.outputs",
    "minipaged.events": "minipaged.engine.events",
    "minipaged.snapshot": "minipaged.engine.snapshot",
    "minipaged.disagg": "minipaged.engine.disagg",
    "minipaged.workloads": "minipaged.lab.workloads",
    "minipaged.contiguous": "minipaged.lab.contiguous",
    "minipaged.simulator": "minipaged.lab.simulator",
    "minipaged.testing": "minipaged.lab.checking_driver",
    "minipaged.parts": "minipaged.classroom.parts",
    "minipaged.puzzles": "minipaged.classroom.puzzles",
    "minipaged.glossary": "minipaged.classroom.glossary",
    "minipaged.selfcheck": "minipaged.classroom.selfcheck",
    "minipaged.show": "minipaged.classroom.show",
    "minipaged.sources": "minipaged.classroom.sources",
    "minipaged.kernels.report": "minipaged.classroom.kernel_report",
    "minipaged.kernels.trace": "minipaged.classroom.kernel_trace",
}
# old package -> new package: every module under it moved with it
MOVED_PACKAGES: dict[str, str] = {
    "minipaged.grading": "minipaged.classroom.grading",
    "minipaged.viz": "minipaged.classroom.viz",
}


def new_name(old: str) -> str | None:
    """Where the module once named ``old`` lives now; None if it did not move."""
    if old in MOVED:
        return MOVED[old]
    for before, after in MOVED_PACKAGES.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


# Set to 1 by the nbval plugin (``classroom/grading/nbval_plugin.py``): nbval compares a checked cell's stderr, and a
# notebook saved before the move, right otherwise, would fail on the warning alone.
QUIET_ENV = "MINIPAGED_QUIET_MOVES"
# the old names that have warned in this process (a module under a moved package warns as its package)
WARNED: set[str] = set()
_IMPORT_MACHINERY = (os.path.dirname(importlib.__file__) + os.sep, "<frozen importlib.", __file__)


def _warn_moved(old: str) -> None:
    """Warn that ``old`` moved, once a process, at the line outside the import machinery that imported it."""
    for before in MOVED_PACKAGES:
        if old.startswith(before + "."):
            old = before
    if old in WARNED or os.environ.get(QUIET_ENV) == "1":
        return
    WARNED.add(old)
    message = f"{old} moved to {new_name(old)}; import it from there (the old name still works)"
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
        frame = frame.f_back  # importlib's frames (import_module, _bootstrap's) and this module's
    if frame is None:
        warnings.warn(message, FutureWarning, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(
        message,
        FutureWarning,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )  # no module_globals: for ``python -c`` the C warn_explicit would ask __main__'s loader for its source, and fail


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str, old: str) -> None:
        self.target = target
        self.old = old
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        _warn_moved(self.old)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old name's spec on the module: give it back its own (it ran already).
        module.__spec__ = self.own_spec


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("minipaged.") else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new, fullname), is_package=False)


FINDER = _Finder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)
