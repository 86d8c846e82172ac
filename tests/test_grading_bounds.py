"""Bounded grading runs (issue 55): a notebook is graded in a throwaway copy of its folder, under a memory limit
named in its row when it is passed, and every process it starts ends with it, however it detached."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest

from minipaged.classroom.grading import grade_notebook
from minipaged.classroom.grading.runner import CHECK_MARK
from minipaged.classroom.grading.sandbox import become_subreaper, children

SOLUTION = Path(__file__).resolve().parents[1] / "exercises" / "solutions" / "ex01_kv_bytes.ipynb"
pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads processes from /proc (Linux)"),
    pytest.mark.slow,  # each grades a notebook in a worker process (make test-slow)
]


def _notebook(path: Path, extra: list[str]) -> Path:
    cells = [c.source for c in nbformat.read(SOLUTION, as_version=4).cells if c.cell_type == "code"]
    cells = [c for c in cells if CHECK_MARK not in c]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells + extra]), path)
    return path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


DOUBLE_FORK = """
import os, time
if os.fork() == 0:          # the child: a new session, then a grandchild, and the child leaves
    os.setsid()
    if os.fork() == 0:
        open({where!r}, "w").write(str(os.getpid()))
        time.sleep(300)
    os._exit(0)
time.sleep(0.5)
"""
NEW_SESSION = """
import subprocess, sys
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open({where!r}, "w").write(str(p.pid))
"""


@pytest.mark.parametrize("cell", [DOUBLE_FORK, NEW_SESSION], ids=["double fork and setsid", "start_new_session"])
def test_every_process_a_notebook_starts_ends_with_its_grading(tmp_path, cell):
    where = tmp_path / "pid"
    rows = grade_notebook(_notebook(tmp_path / "ex01_kv_bytes.ipynb", [cell.format(where=str(where))]), timeout=120)
    assert [r.passed for r in rows] == [6, 6]  # graded as usual
    deadline = time.monotonic() + 10
    while not where.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(where.read_text())
    assert not _alive(pid), f"process {pid}, started by the notebook, outlived its grading"


def test_a_notebook_that_deletes_its_folder_deletes_a_copy(tmp_path):
    folder = tmp_path / "class"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    nb = _notebook(folder / "ex01_kv_bytes.ipynb", ["import os, shutil\nshutil.rmtree(os.getcwd())"])
    rows = grade_notebook(nb, timeout=120)
    assert [r.passed for r in rows] == [6, 6]
    assert (folder / "notes.txt").read_text() == "keep me" and nb.exists()


def test_a_notebook_over_the_memory_limit_is_named_so(tmp_path):
    nb = _notebook(tmp_path / "ex01_kv_bytes.ipynb", ["hog = bytearray(9_500_000_000)  # 9.5 GB"])
    rows = grade_notebook(nb, timeout=120)
    assert all(r.note.startswith("over the memory limit of 6 GiB") for r in rows), [r.note for r in rows]
    assert any("MemoryError" in e for e in rows[0].cell_errors)
    assert [r.passed for r in rows] == [6, 6]  # what it wrote is still graded


def test_children_reads_the_process_tree():
    assert os.getpid() in children(os.getppid())
    assert isinstance(become_subreaper, type(children))
