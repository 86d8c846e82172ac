"""Checks out of the notebook's reach (issue 55, item 2): a cell that writes into the grader's report, replaces the
grader's code or a library function the checks use, or runs the solution's code under its own cell's name, scores
nothing, and the row says why; the solution written plainly still scores full."""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from minipaged.classroom.grading import grade_notebook
from minipaged.classroom.grading.integrity import Signer, read_signed
from minipaged.classroom.grading.runner import CHECK_MARK

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "exercises" / "solutions" / "ex01_kv_bytes.ipynb"
STARTER = ROOT / "exercises" / "ex01_kv_bytes.ipynb"
FULL = [6, 6]


def _code(path: Path) -> list[str]:
    cells = nbformat.read(path, as_version=4).cells
    return [c.source for c in cells if c.cell_type == "code" and CHECK_MARK not in c.source]


def _write(folder: Path, cells: list[str]) -> Path:
    path = folder / "ex01_kv_bytes.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return path


def _grade(folder: Path, cells: list[str]) -> list:
    return grade_notebook(_write(folder, cells), timeout=120)


FORGE_REPORT = """
import glob, json, os
for fd in glob.glob("/proc/self/fd/*"):
    target = os.path.realpath(fd)
    if target.endswith(".jsonl"):
        with open(target, "a") as f:
            for g, n in (("bytes_per_token", 6), ("block_capacity", 6)):
                f.write(json.dumps({"event": "group", "group": g, "passed": n, "total": n, "note": "", "detail": ""}) + "\\n")
            f.write(json.dumps({"event": "done"}) + "\\n")
"""

REPLACE_CHECK = """
from minipaged.classroom.grading import ex01
from minipaged.classroom.grading.core import CheckOutcome
ex01.check_bytes_per_token = lambda f: [CheckOutcome("forged", True)] * 6
ex01.check_block_capacity = lambda f: [CheckOutcome("forged", True)] * 6
"""

PATCH_LIBRARY = """
import torch
torch.equal = lambda a, b: True
"""


@pytest.mark.slow  # each grades a notebook in a worker process (make test-slow)
def test_the_solution_scores_full_and_the_starter_does_not(tmp_path: Path) -> None:
    assert [r.passed for r in _grade(tmp_path, _code(SOLUTION))] == FULL
    assert [r.passed for r in _grade(tmp_path, _code(STARTER))] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize(
    "attack, note",
    [
        (FORGE_REPORT, "the grader's report was written to"),
        (REPLACE_CHECK, "the notebook changed the grader's code"),
        (PATCH_LIBRARY, "the notebook changed the grader's code"),
    ],
    ids=["appends to the report", "replaces the checks", "patches torch"],
)
def test_an_empty_notebook_that_reaches_for_the_grader_scores_nothing(tmp_path: Path, attack: str, note: str) -> None:
    rows = _grade(tmp_path, _code(STARTER) + [attack])
    assert [r.passed for r in rows] == [0, 0] and all(r.note == note for r in rows), rows


@pytest.mark.slow
def test_the_solution_compiled_under_a_cell_name_is_not_the_notebooks_own(tmp_path: Path) -> None:
    (tmp_path / "answers.ipynb").write_text(SOLUTION.read_text())  # a copy of the solution beside the starter
    exec_solution = """
import nbformat
for cell in nbformat.read("answers.ipynb", as_version=4).cells:
    if cell.cell_type == "code" and "check_" not in cell.source:  # (a cell naming the mark is not run)
        exec(compile(cell.source, "<ex01_kv_bytes.ipynb cell 2>", "exec"), globals())
"""
    rows = _grade(tmp_path, _code(STARTER) + [exec_solution])
    assert [r.passed for r in rows] == [0, 0], rows
    assert all("not in that cell" in r.detail for r in rows), rows


def test_the_report_takes_only_lines_signed_with_its_key(tmp_path: Path) -> None:
    key = b"k" * 32
    path = tmp_path / "events.jsonl"
    with open(path, "w") as f:
        emit = Signer(f, key)
        emit("cells", errors=[])
        emit("group", group="g", passed=1, total=2, note="", detail="")
    text = path.read_text()
    events, forged = read_signed(text, key)
    assert forged is None and [e["event"] for e in events] == ["cells", "group"]
    assert read_signed(text + text.splitlines()[1] + "\n", key)[1] is not None  # a signed line replayed
    assert read_signed(text, b"x" * 32)[1] is not None  # another key
    assert read_signed(text + '{"event": "done"}\n', key)[1] is not None  # an unsigned line
    cut = text + text.splitlines()[1][:20]  # a last line cut short by a kill: what came before stands
    assert read_signed(cut, key) == (events, None)


@pytest.mark.slow  # grades all 23 solutions in worker processes, two at a time (about six minutes on 2 cores)
def test_every_solution_scores_full_through_the_grader(tmp_path: Path) -> None:
    """The grader's own checks on itself (integrity, ownership, the signed report) never cost a right answer a
    point: the whole solutions folder, graded as an instructor grades a learner's folder."""
    from concurrent.futures import ThreadPoolExecutor

    folder = tmp_path / "solutions"
    shutil.copytree(ROOT / "exercises" / "solutions", folder)
    shutil.copytree(ROOT / "exercises" / "policies", folder / "policies")  # ex10b's notebook reads them
    notebooks = sorted(folder.glob("ex*.ipynb"))
    with ThreadPoolExecutor(2) as pool:  # one worker process per core
        rows = [r for found in pool.map(grade_notebook, notebooks) for r in found]
    lost = [
        f"{r.notebook} {r.group} {r.passed}/{r.total}: {r.note} {r.detail[:300]}" for r in rows if r.passed < r.total
    ]
    assert not lost, "\n".join(lost)
    assert len({r.notebook for r in rows}) == len(list((ROOT / "exercises").glob("ex*.ipynb")))
