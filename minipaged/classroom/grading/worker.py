"""The grader's worker: one notebook, in a process of its own.

``python -m minipaged.classroom.grading.worker NOTEBOOK EXERCISE`` reads one line on stdin first, ``{"events":
PATH, "key": HEX}``, then runs the notebook's code cells (not its check cells) in a fresh namespace, in the
notebook's folder, then calls every check group of the exercise itself on the functions those cells defined.
It reports as it goes, one event a line, to the file PATH, each line signed with the key (``integrity.Signer``)::

    {"event": "cell", "index": 3}                       about to run code cell 3
    {"event": "cells", "errors": ["cell 3: ..."]}        every code cell has run
    {"event": "tampered", "why": "..."}                  the grader's code is not what it was (integrity.py)
    {"event": "group", "group": "remove_links", "passed": 7, "total": 8, "detail": "..."}
    {"event": "done"}

The parent (``runner.grade_notebook``) reads that file after the process ends, however it ends: a notebook
that loops is killed at its time limit, one that calls ``os._exit`` just stops, and the events written so far
say where it was. Nothing the notebook prints is read: the scores are what the check functions return here, in
lines the notebook could not have written (the key), from checks that are still the grader's own (``Integrity``).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import types
from collections.abc import Callable

DETAIL_LINES = 9  # lines of a failing group's explanation kept for the details below the table (two failed checks)


def _missing(name: str, errors: list[str]) -> str:
    why = f"; cells that failed: {'; '.join(errors)}" if errors else " (was it renamed?)"
    return f"`{name}` is not defined by the notebook's code cells{why}"


def grade(path: str, exercise_key: str, emit: Callable[..., None]) -> None:
    """Run the notebook's code cells, then every check group of the exercise; report each through ``emit``."""
    from .core import describe_error
    from .exercises import EXERCISES
    from .integrity import Integrity
    from .ownership import Tracer, foreign_code, targets
    from .runner import run_code_cells

    exercise = EXERCISES[exercise_key]
    notebook = os.path.basename(path)
    # The checks are imported before any cell, so that Integrity takes them as they were.
    module = importlib.import_module(f"minipaged.classroom.grading.{exercise_key}")
    integrity = Integrity()  # what the checks must still be after the cells and after the checks
    own: dict[int, types.CodeType] = {}
    namespace, errors = run_code_cells(
        path, f"learner_{exercise_key}", on_cell=lambda i: emit("cell", index=i), compiled=own
    )
    emit("cells", errors=errors)
    if (changed := integrity.problem()) is not None:
        emit("tampered", why=f"after its cells, {changed}")
        emit("done")
        return
    for group in exercise.groups:
        absent = [a for a in group.args if not callable(namespace.get(a))]
        if absent:
            emit(
                "group",
                group=group.name,
                passed=0,
                total=group.total,
                note=f"`{absent[0]}` not defined",
                detail=_missing(absent[0], errors),
            )
            continue
        foreign = next(
            (f"`{a}`: {why}" for a in group.args if (why := foreign_code(namespace[a], notebook, own))), None
        )
        if foreign is not None:
            emit("group", group=group.name, passed=0, total=group.total, note="not code of this notebook",
                 detail=f"not code of this notebook: {foreign}")  # fmt: skip
            continue
        emit("checking", group=group.name)
        printed = io.StringIO()
        tracer = Tracer(targets(group.own), notebook)
        try:
            with contextlib.redirect_stdout(printed), tracer if group.own else contextlib.nullcontext():
                outcomes = getattr(module, group.check)(*(namespace[a] for a in group.args))
        except Exception as exc:  # the checks catch a learner's errors; this is what got past them
            emit(
                "group",
                group=group.name,
                passed=0,
                total=group.total,
                note="the checks stopped",
                detail=f"the checks stopped: {describe_error(exc)}",
            )
            continue
        if tracer.found is not None:
            emit("group", group=group.name, passed=0, total=group.total, note="runs the package's implementation",
                 detail=f"this exercise is to write it, and {tracer.found}")  # fmt: skip
            continue
        passed = sum(bool(o.passed) for o in outcomes)
        lines = printed.getvalue().splitlines()[1:]  # the summary line is ours to print
        detail = "\n".join(lines[:DETAIL_LINES] + (["  ..."] if len(lines) > DETAIL_LINES else []))
        emit("group", group=group.name, passed=passed, total=len(outcomes), note="", detail=detail)
    if (changed := integrity.problem()) is not None:  # the learner's functions ran in the checks
        emit("tampered", why=f"while it was checked, {changed}")
    emit("done")


def main(argv: list[str]) -> int:
    path, exercise_key = argv
    # Where to report and the key to sign with come on stdin, before any learner code, and never in argv (which
    # /proc/self/cmdline shows); stdin is then the null device.
    order = json.loads(sys.stdin.readline())
    events_path, key = order["events"], bytes.fromhex(order["key"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.setdefault("MPLBACKEND", "Agg")  # a learner's plt.show() must not wait for a window
    from .exercises import EXERCISES

    if EXERCISES[exercise_key].triton:  # first: without a GPU, Triton's interpreter must be on before triton
        import minipaged.kernels  # noqa: F401

    sys.argv = [sys.argv[0], path]
    from .integrity import Signer

    with open(events_path, "a", encoding="utf-8") as stream:
        grade(path, exercise_key, Signer(stream, key))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
