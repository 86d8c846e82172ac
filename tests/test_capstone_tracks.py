"""Exercise 10's last group on the guided track: the learner's step loop over the package's components, with the
learner's parts of exercises 03-08 plugged in, found by the grader in the notebooks beside the one it grades.

The solution notebooks give full marks; a wrong part (exercise 05's head mapping) is caught by the tokens, not by
the part's own check; a part that is the package's own, imported, is refused as not the learner's. Slow: each
serves SmolLM2 with eleven parts plugged in (about a minute on 2 cores).
"""

from __future__ import annotations

import inspect
import json
import shutil
import textwrap
from pathlib import Path

import mutants
import pytest

from minipaged.classroom.grading import capstone, ex10
from minipaged.classroom.grading.exercises import EXERCISES
from minipaged.classroom.grading.ownership import Tracer, targets
from minipaged.classroom.grading.runner import run_code_cells

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
pytestmark = pytest.mark.slow


def _guided_folder(tmp_path: Path, ex05_cell: str | None = None) -> Path:
    """The guided track's solutions (03 to 08) and exercise 10's, nothing of the build track; ``ex05_cell`` is
    appended to exercise 05's notebook as a learner's last cell."""
    for ex in (*capstone.EXERCISES, "ex10"):
        (src,) = SOLUTIONS.glob(f"{ex}_*.ipynb")
        shutil.copy(src, tmp_path / src.name)
    if ex05_cell is not None:
        (path,) = tmp_path.glob("ex05_*.ipynb")
        nb = json.loads(path.read_text())
        nb["cells"].append(
            dict(
                cell_type="code",
                id="learners-last-cell",
                metadata={},
                execution_count=None,
                outputs=[],
                source=ex05_cell,
            )
        )
        path.write_text(json.dumps(nb))
    return tmp_path


def _grade(folder: Path, monkeypatch: pytest.MonkeyPatch, own: tuple[str, ...] = ()) -> list:
    """The group on ``folder``, its cells run first and the check then (as the grader's worker does), under the call
    tracer when ``own`` names what it watches; a call the tracer found fails the test."""
    namespace, errors = run_code_cells(SOLUTIONS / "ex10_your_engine.ipynb", "learner_ex10")
    assert not errors
    monkeypatch.setattr(ex10, "notebook_folder", lambda: folder)
    with Tracer(targets(own), "ex10_your_engine.ipynb") as tracer:
        outcomes = ex10.check_engine_smollm2(namespace["Engine"])
    assert tracer.found is None, tracer.found
    return outcomes


def test_the_guided_track_meets_the_learners_engine(tmp_path, monkeypatch):
    """Full marks, under the call tracer the grader's worker runs the group in: the package's components, which the
    tracer watches on the build track, are handed over on purpose here, and the check exempts them."""
    folder = _guided_folder(tmp_path)
    pieces = ex10.your_pieces(folder)
    assert pieces.track == "guided" and set(pieces.plugged) == set(ex10.GUIDED_PARTS)
    assert len(pieces.plugged) == 11 and "slot_mapping" not in pieces.plugged  # the loop computes its own slots
    (group,) = [g for g in EXERCISES["ex10"].groups if g.name == "engine_smollm2"]
    outcomes = _grade(folder, monkeypatch, group.own)
    assert [o.passed for o in outcomes] == [True, True, True], [o.got for o in outcomes]


def test_a_wrong_guided_part_is_caught_by_the_tokens(tmp_path, monkeypatch):
    (m,) = [m for m in mutants.all_mutants() if m.exercise == "ex05" and m.name == "gqa_modulo"]
    source = textwrap.dedent(inspect.getsource(m.fn)).split("\n", 1)[1]  # without its @mutant line
    cell = "import torch\n\n\n" + source.replace("def gqa_modulo(", "def paged_decode_attention(")
    outcomes = _grade(_guided_folder(tmp_path, cell), monkeypatch)
    assert outcomes[0].passed, outcomes[0].got  # defined in its notebook: the learner's own
    assert not outcomes[1].passed and "differs" in str(outcomes[1].got), outcomes[1].got


def test_the_packages_part_imported_into_a_notebook_is_not_the_learners(tmp_path, monkeypatch):
    cell = "from minipaged.kernels.reference import paged_decode_attention\n"
    folder = _guided_folder(tmp_path, cell)
    got = ex10._yours(ex10.your_pieces(folder))
    assert got.startswith("paged_decode_attention was not defined in your ex05 notebook"), got
