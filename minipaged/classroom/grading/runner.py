"""Grade exercise notebooks by running the learner's code, never by reading what a notebook prints.

``grade_folder("submissions/alice")`` grades every ``exNN_*.ipynb`` in the folder (not its ``solutions/``), one
at a time, each in a process of its own (``worker.py``) with a time limit:

1. the exercise comes from the file name; its groups and totals from ``exercises.EXERCISES``;
2. the worker runs the notebook's code cells, except the check cells, in a fresh namespace;
3. the worker calls each group's check function on the learner's functions and reports what it returned.

Whatever happens to one notebook (a loop cut at the time limit, a process that dies, a file that is not a
notebook, a name that matches no exercise), it gets its rows, named in the row, and the folder goes on::

    notebook              check group      score  note
    --------------------  ---------------  -----  ---------------------------------
    ex01_kv_bytes.ipynb   bytes_per_token  6/6
    ex01_kv_bytes.ipynb   block_capacity   0/6    `block_capacity` not defined
    ex05b_scatter.ipynb   scatter_write    0/8    timed out after 300 s in cell 7
    --------------------  ---------------  -----  ---------------------------------
    TOTAL                                  6/20

``format_details`` explains every lost point below the table: the failing checks, the cells that raised.
Each notebook runs in a throwaway copy of its folder, under a memory and a time limit, with every process it
starts ended with it (``sandbox.py``); the worker refuses code that is not the notebook's own
(``ownership.py``), and a report the notebook wrote into or checks it changed (``integrity.py``;
``site/guide/grading.md``, "What the grader defends against", says what is left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import linecache
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

from .exercises import EXERCISES, Exercise, exercise_for
from .integrity import _codes, read_signed
from .sandbox import MEMORY_WORDS, TIME_UP

if sys.version_info >= (3, 11):
    from contextlib import chdir as _chdir
else:  # Python 3.10 has no contextlib.chdir

    @contextlib.contextmanager
    def _chdir(path: str | os.PathLike) -> Iterator[None]:
        before = os.getcwd()
        os.chdir(path)
        try:
            yield
        finally:
            os.chdir(before)


CHECK_MARK = "NBVAL_CHECK_OUTPUT"
# A starter's check cell stores no output (a learner opening it must not read "8/8 checks passed" before writing
# anything): what it must print is kept in its metadata, cell.metadata["minipaged"]["expected"], and
# classroom/grading/nbval_plugin.py (a pytest plugin) hands that to nbval as the cell's expected output. A
# solution stores it as its output.
METADATA_KEY = "minipaged"
DEFAULT_TIMEOUT_S = 300  # per notebook; the slowest solution (ex10) takes about 40 s on 2 cores
# Per notebook: private writable memory (sandbox.py). The hungriest solution (ex10: SmolLM2 served, transformers'
# reference beside it) maps about 3 GiB.
DEFAULT_MEMORY_BYTES = 6 * 2**30
# A check cell calls one of the grading modules' check functions; such a cell is never run as the learner's code,
# even when its NBVAL mark was deleted.
_CHECK_CALL = re.compile(r"\bex\d\d\.check_\w+\s*\(")


@dataclass(frozen=True)
class GroupScore:
    notebook: str
    group: str
    passed: int
    total: int
    note: str = ""  # short, shown in the table: why a group scored 0, or why a notebook has no scores
    detail: str = ""  # longer, shown below the table: failed checks, errors
    counted: bool = True  # False for a second notebook of the same exercise in one folder
    cell_errors: tuple[str, ...] = ()  # the notebook's code cells that raised (the same on each of its rows)


# ---- the learner's code, out of their notebook ----------------------------------------------------------------
def _is_check_cell(source: str) -> bool:
    return CHECK_MARK in source or bool(_CHECK_CALL.search(source))


def _python_source(source: str) -> str:
    """IPython's own translation of a cell (``%time f()``, ``!ls``) into Python, as a kernel runs it."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return source
    try:
        return TransformerManager().transform_cell(source)
    except Exception:  # leave it to compile(), which names the line
        return source


def _ipython_names() -> dict[str, Any]:
    """``display`` and ``get_ipython`` as a notebook's cells expect them (a shell is made only when asked for)."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
    except ImportError:
        return {}
    return {"display": display, "get_ipython": InteractiveShell.instance}


def run_code_cells(
    path: str | os.PathLike,
    name: str,
    on_cell: Callable[[int], None] | None = None,
    compiled: dict[int, CodeType] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """Run a notebook's code cells in this process, in its folder, skipping its check cells, in a fresh namespace
    called ``name``; return the namespace and the errors of the cells that failed (the rest still ran). What the
    cells print is swallowed. Used to take a learner's functions out of their notebook. ``on_cell(i)`` is
    called before code cell ``i`` runs. ``compiled``, if given, receives every code object compiled from the
    cells (``id`` -> code), all of them before the first cell runs: the code that is the notebook's own
    (``ownership.foreign_code``), which no cell can add to by compiling other text under a cell's name."""
    import nbformat

    namespace: dict[str, Any] = {"__name__": name, **_ipython_names()}
    errors: list[str] = []
    nb = nbformat.read(path, as_version=4)
    cells: list[tuple[int, CodeType | None, str]] = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or _is_check_cell(cell.source):
            continue
        filename = f"<{Path(path).name} cell {i}>"
        source = _python_source(cell.source) + "\n"
        # @triton.jit reads its function's source back: make the cell findable, as IPython does.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            code = compile(source, filename, "exec")
        except (SyntaxError, ValueError) as exc:
            cells.append((i, None, f"cell {i}: {type(exc).__name__}: {exc}"))
            continue
        if compiled is not None:
            compiled.update((id(c), c) for c in (code, *(inner for _, inner in _codes(code))))
        cells.append((i, code, ""))
    for i, cell_code, error in cells:
        if on_cell is not None:
            on_cell(i)
        if cell_code is None:
            errors.append(error)
            continue
        try:  # in the notebook's folder, as Jupyter runs it
            with contextlib.redirect_stdout(io.StringIO()), _chdir(Path(path).resolve().parent):
                exec(cell_code, namespace)
        except Exception as exc:  # a stub's NotImplementedError in a try-it cell, say
            errors.append(f"cell {i}: {type(exc).__name__}: {exc}")
    return namespace, errors


def expected_outputs(cell: Any) -> list[Any]:
    """What a check cell must print to pass nbval: its metadata's ``expected`` (a starter), else its outputs."""
    expected = cell.get("metadata", {}).get(METADATA_KEY, {}).get("expected")
    return list(cell.get("outputs", [])) if expected is None else list(expected)


def stored_groups(path: str | os.PathLike) -> list[tuple[str, int]]:
    """(group, number of checks) from what a notebook's check cells expect (``expected_outputs``). The grader
    never reads them; the course's tests use them to prove each starter expects what ``exercises.EXERCISES``
    grades."""
    import nbformat

    from .core import parse_summaries

    nb = nbformat.read(path, as_version=4)
    found = []
    for cell in nb.cells:
        if cell.cell_type == "code" and CHECK_MARK in cell.source:
            outputs = expected_outputs(cell)
            text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
            found += [(g, total) for g, _, total in parse_summaries(text)]
    return found


def execute(path: str | os.PathLike, timeout: int = 600):
    """Run a notebook top to bottom in a fresh Jupyter kernel, in its own folder; return the executed copy (for
    ``tools/nbtool.py``, which stores the outputs nbval compares; grading does not use it)."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute()
    return nb


# ---- one notebook, in its own process ---------------------------------------------------------------------------
def _rows(name: str, exercise: Exercise, note: str, detail: str = "") -> list[GroupScore]:
    return [GroupScore(name, g.name, 0, g.total, note, detail) for g in exercise.groups]


def _read_notebook_error(path: Path) -> str | None:
    """None if ``path`` is a notebook nbformat can read, else what is wrong with it, in one line."""
    import nbformat

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as exc:
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]
    if not isinstance(nb.get("cells"), list):
        return "no list of cells"
    return None


def _tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    return "\n".join(text[-lines:])


def grade_notebook(
    path: str | os.PathLike, timeout: float = DEFAULT_TIMEOUT_S, memory: int = DEFAULT_MEMORY_BYTES
) -> list[GroupScore]:
    """Every group of the notebook's exercise, scored by running the learner's code in a fresh process, in a
    throwaway copy of the notebook's folder, under a time limit (``timeout`` seconds) and a memory limit
    (``memory`` bytes); every process it starts is ended with it (``sandbox.py``). Never raises for what is in the
    notebook: each problem is a row's note."""
    path = Path(path)
    name = path.name
    exercise = exercise_for(name)
    if exercise is None:
        keys = ", ".join(EXERCISES)
        return [
            GroupScore(
                name,
                "-",
                0,
                0,
                "not an exercise of this course",
                f"{name}: an exercise notebook is named exNN_<topic>.ipynb with NN one of {keys.replace('ex', '')}",
            )
        ]
    problem = _read_notebook_error(path)
    if problem is not None:
        return _rows(name, exercise, "not a readable notebook", f"{name}: not a readable notebook: {problem}")

    with tempfile.TemporaryDirectory(prefix="minipaged-grade-") as tmp:
        events_path, err_path = Path(tmp, "events.jsonl"), Path(tmp, "stderr.txt")
        events_path.touch()
        work = _throwaway_copy(path.resolve().parent, Path(tmp, "work"))
        worker = [sys.executable, "-m", "minipaged.classroom.grading.worker", str(work / name), exercise.key]
        cmd = [sys.executable, "-m", "minipaged.classroom.grading.sandbox", str(timeout), str(memory), "--", *worker]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
        key = secrets.token_bytes(32)  # signs the report (integrity.Signer); reaches the worker on its stdin only
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                    env=env, start_new_session=True)  # fmt: skip
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # a worker that died at once: its rows say so
                proc.stdin.write((json.dumps({"events": str(events_path), "key": key.hex()}) + "\n").encode())
                proc.stdin.close()
            try:
                code = proc.wait(timeout=timeout + 60)  # the supervisor keeps the time; this is its own bound
            except BaseException as exc:  # Ctrl-C, or a supervisor that hangs: it ends the worker and descendants
                _stop_supervisor(proc)
                if not isinstance(exc, subprocess.TimeoutExpired):
                    raise
                code = TIME_UP
        rc = None if code == TIME_UP else (128 - code if code > 128 else code)
        events, forged = read_signed(events_path.read_text(encoding="utf-8", errors="replace"), key)
        if forged is not None:
            return _rows(name, exercise, "the grader's report was written to", f"{name}: {forged}; nothing in it "
                         "counts (a cell wrote into the file the grader reports through)")  # fmt: skip
        tampered = next((ev["why"] for ev in events if ev["event"] == "tampered"), None)
        if tampered is not None:
            return _rows(name, exercise, "the notebook changed the grader's code", f"{name}: {tampered}; nothing "
                         "counts (the checks cannot be trusted after that)")  # fmt: skip
        scores = _scores_from_events(name, exercise, events, rc, timeout, _tail(err_path))
        return _with_memory_note(scores, memory)


def _stop_supervisor(proc: subprocess.Popen) -> None:
    """SIGTERM: the supervisor ends everything it watches, then itself; SIGKILL to its group if it does not."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _throwaway_copy(folder: Path, work: Path) -> Path:
    """The notebook's folder as the worker sees it, copied, so that whatever the notebook deletes or writes is
    thrown away with the copy: its files and subfolders (ex10b's ``policies/``), not ``solutions/``, not links."""
    shutil.copytree(folder, work, symlinks=True, ignore=lambda _, names: [n for n in names if n == "solutions"])
    for link in [p for p in work.rglob("*") if p.is_symlink()]:
        link.unlink()
    return work


def _with_memory_note(scores: list[GroupScore], memory: int) -> list[GroupScore]:
    """Name the memory limit in every row of a notebook whose code ran out of it (a cell, or the checks)."""
    texts = [e for s in scores for e in s.cell_errors] + [s.detail for s in scores] + [s.note for s in scores]
    if not any(word in t for t in texts for word in MEMORY_WORDS):
        return scores
    note = f"over the memory limit of {memory / 2**30:g} GiB"
    return [dataclasses.replace(s, note=f"{note}; {s.note}" if s.note else note) for s in scores]


def _where(events: list[dict[str, Any]]) -> str:
    for ev in reversed(events):
        if ev["event"] == "cell":
            return f"in cell {ev['index']}"
        if ev["event"] == "checking":
            return f"in the checks of {ev['group']}"
        if ev["event"] == "group":
            return f"after the checks of {ev['group']}"
        if ev["event"] == "cells":
            return "after its last cell"
    return "before its first cell"


def _scores_from_events(
    name: str, exercise: Exercise, events: list[dict[str, Any]], rc: int | None, timeout: float, stderr_tail: str
) -> list[GroupScore]:
    cell_errors: list[str] = next((ev["errors"] for ev in events if ev["event"] == "cells"), [])
    got: dict[str, GroupScore] = {}
    for ev in events:
        if ev["event"] != "group":
            continue
        group = next((g for g in exercise.groups if g.name == ev["group"]), None)
        if group is None or group.name in got or ev["total"] != group.total:
            continue  # only the exercise's own groups, once each, with their own number of checks
        detail = ev.get("detail", "")
        got[group.name] = GroupScore(
            name, group.name, min(int(ev["passed"]), group.total), group.total, ev.get("note", ""), detail
        )
    finished = any(ev["event"] == "done" for ev in events)
    if finished and rc == 0:
        note, why = "", ""
    elif rc is None:
        note = f"timed out after {timeout:g} s {_where(events)}"
        why = (
            f"{name}: stopped at the time limit ({timeout:g} s) {_where(events)}; grade it alone with a "
            f"longer --timeout if it only needs more time"
        )
    else:
        code = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
        note = f"the notebook's process died ({code}) {_where(events)}"
        why = f"{name}: its process ended ({code}) {_where(events)}" + (f":\n{stderr_tail}" if stderr_tail else "")
    errors = tuple(cell_errors)
    return [
        GroupScore(name, g.name, got[g.name].passed, g.total, got[g.name].note, got[g.name].detail, cell_errors=errors)
        if g.name in got
        else GroupScore(name, g.name, 0, g.total, note or "not graded", why, cell_errors=errors)
        for g in exercise.groups
    ]


# ---- a folder -------------------------------------------------------------------------------------------------
def notebooks_in(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """The notebooks to grade: each path a notebook, or a folder whose ``*.ipynb`` are (not its subfolders)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(p.glob("*.ipynb"))
        elif p.is_file():
            if p.suffix != ".ipynb":
                raise ValueError(f"{p} is not a notebook (.ipynb)")
            found.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return found


def grade_folder(
    folder: str | os.PathLike | Iterable[str | os.PathLike] = "exercises",
    timeout: float = DEFAULT_TIMEOUT_S,
    progress: Callable[[Path], None] | None = None,
    memory: int = DEFAULT_MEMORY_BYTES,
) -> list[GroupScore]:
    """Scores of every notebook in ``folder`` (or of each path in a list of folders and notebooks). One notebook
    of each exercise counts in the total (the one named like the starter, else the first by name); another one of
    the same exercise is graded, and marked as not counted."""
    paths = [folder] if isinstance(folder, (str, os.PathLike)) else list(folder)
    notebooks = notebooks_in(paths)
    if not notebooks:
        raise ValueError(f"no notebooks to grade in {', '.join(map(str, paths))}")
    # One notebook per exercise counts: the one with the starter's name, else the first by name.
    counted: dict[str, Path] = {}

    def starter_named_first(p: Path) -> tuple[bool, str]:
        exercise = exercise_for(p.name)
        return (exercise is None or p.stem != exercise.stem, p.name)

    for nb in sorted(notebooks, key=starter_named_first):
        exercise = exercise_for(nb.name)
        if exercise is not None:
            counted.setdefault(exercise.key, nb)
    scores: list[GroupScore] = []
    for nb in notebooks:
        if progress is not None:
            progress(nb)
        rows = grade_notebook(nb, timeout, memory)
        exercise = exercise_for(nb.name)
        if exercise is not None and counted[exercise.key] != nb:
            first = counted[exercise.key].name
            rows = [
                dataclasses.replace(r, note=f"{exercise.key} again (counted: {first}): not in TOTAL", counted=False)
                for r in rows
            ]
        scores += rows
    return scores


def format_table(scores: list[GroupScore]) -> str:
    """A plain-text score table: one row per notebook and group, a note where something went wrong, a total."""
    rows = [("notebook", "check group", "score", "note")]
    rows += [(s.notebook, s.group, f"{s.passed}/{s.total}", s.note) for s in scores]
    counted = [s for s in scores if s.counted]
    rows.append(("TOTAL", "", f"{sum(s.passed for s in counted)}/{sum(s.total for s in counted)}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    rule = "  ".join("-" * w for w in widths)
    lines.insert(1, rule)
    lines.insert(len(lines) - 1, rule)
    return "\n".join(lines)


def format_details(scores: list[GroupScore]) -> str:
    """Why each lost point was lost, notebook by notebook: the cells that raised, the failed checks."""
    out: list[str] = []
    for notebook in dict.fromkeys(s.notebook for s in scores):
        rows = [s for s in scores if s.notebook == notebook]
        if all(s.passed == s.total for s in rows):
            continue
        lines = [f"cells that raised: {e}" for e in rows[0].cell_errors]
        shown: set[str] = set()
        for s in rows:
            if s.passed < s.total and s.detail and s.detail not in shown:
                shown.add(s.detail)
                lines += [f"{s.group} {s.passed}/{s.total}:"] + ["  " + ln for ln in s.detail.splitlines()]
        if lines:
            out.append(notebook + "\n" + "\n".join("  " + ln for ln in lines))
    return "\n\n".join(out)
