"""The package's old import paths, each the same module at its new home (issue 43 moved modules into layers).

``import minipaged.block_pool`` and ``from minipaged import block_pool`` give ``minipaged.core.block_pool``
itself, not a copy: a test that patches an attribute through either name patches the one module, and a
learner's notebook saved before the move runs unchanged. Nothing is imported until an old path is: a finder
first on ``sys.meta_path`` answers only for the names in ``MOVED`` and ``MOVED_PACKAGES``, and hands the
import to the module's new name. New code imports the new names; ``tests/test_old_paths.py`` walks every old path
the notebooks, the exercises and the README use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

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


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
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
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=False)


FINDER = _Finder()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)
