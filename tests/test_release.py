"""``make release``: a copy of the course without its solutions, that grades on its own (issue 55, item 2)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import release  # noqa: E402


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("release") / "course"
    release.release(dest)
    return dest


def test_the_copy_has_the_course_and_no_solution(copy: Path) -> None:
    assert not (copy / "exercises" / "solutions").exists() and not (copy / "tests").exists()
    starters = sorted(p.name for p in (ROOT / "exercises").glob("ex*.ipynb"))
    assert sorted(p.name for p in (copy / "exercises").glob("ex*.ipynb")) == starters
    assert (copy / "notebooks").is_dir() and (copy / "minipaged" / "classroom" / "grading" / "worker.py").is_file()
    assert "exercises/solutions/" in (copy / "RELEASE.md").read_text()
    assert release.leaks(copy, release.answer_lines(ROOT)) == []


def test_an_answer_that_gets_into_the_copy_is_found(copy: Path, tmp_path: Path) -> None:
    answers = release.answer_lines(ROOT)
    assert set(answers) >= {"ex03_free_queue.ipynb", "ex06b_scheduler.ipynb", "ex10_your_engine.ipynb"}
    leaked = tmp_path / "leaked"
    shutil.copytree(copy / "notebooks", leaked / "notebooks")
    line = sorted(answers["ex03_free_queue.ipynb"])[0]
    (leaked / "notebooks" / "notes.md").write_text(f"A hint:\n\n    {line}\n")
    found = release.leaks(leaked, answers)
    assert len(found) == 1 and found[0].startswith("notebooks/notes.md: a line of the solution ex03_free_queue")
    with pytest.raises(SystemExit, match="not empty"):
        release.release(copy)  # never over a folder that has something in it


@pytest.mark.slow  # grades a notebook in a worker process
def test_the_copy_grades_with_its_own_package(copy: Path, tmp_path: Path) -> None:
    submitted = tmp_path / "alice"
    submitted.mkdir()
    shutil.copy(ROOT / "exercises" / "solutions" / "ex01_kv_bytes.ipynb", submitted)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run([sys.executable, "-c", "import minipaged; print(minipaged.__file__)"], cwd=copy, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert where.startswith(str(copy))
    out = subprocess.run([sys.executable, "-m", "minipaged", "grade", str(submitted)], cwd=copy, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "TOTAL" in out.stdout and "12/12" in out.stdout, out.stdout
