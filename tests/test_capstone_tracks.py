"""Exercise 10's last group on the guided track: the learner's step loop over the package's components, with the
learner's parts of exercises 03-08 plugged in, found by the grader in the notebooks beside the one it grades.

The solution notebooks give full marks on SmolLM2 (about a minute on 2 cores); under the grader's call tracer, on the
tiny model, the check exempts the components it hands over and nothing else; a wrong part (exercise 05's head
mapping) is caught by the tokens; a part that is the package's own, imported, is refused as not the learner's. The
counts exercise 14 scores against are the solution's loop measured again.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import tempfile
import textwrap
from pathlib import Path

import mutants
import pytest

from minipaged.classroom.grading import capstone, ex10, ownership
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


@functools.cache
def _engine() -> type:
    """The solution's ``Engine``, compiled from its notebook's cells under their names, as the grader's worker does:
    its imports and the cells that define the loop (not the cells that load the model and time it)."""
    nb = json.loads((SOLUTIONS / "ex10_your_engine.ipynb").read_text())
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    imports = "\n".join(ln for ln in code[0].splitlines() if ln.startswith(("import ", "from ")))
    loop = [src for src in code if "class Engine" in src]
    nb["cells"] = [dict(cell_type="code", id=f"c{i}", metadata={}, execution_count=None, outputs=[], source=src)
                   for i, src in enumerate([imports, *loop])]  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="ex10-engine-"))
    (folder / "ex10_your_engine.ipynb").write_text(json.dumps(nb))
    namespace, errors = run_code_cells(folder / "ex10_your_engine.ipynb", "learner_ex10")
    shutil.rmtree(folder)
    assert not errors, errors
    return namespace["Engine"]


def _grade(
    folder: Path, monkeypatch: pytest.MonkeyPatch, own: tuple[str, ...] = (), tiny: bool = False
) -> tuple[list, str | None]:
    """The group on ``folder`` (on the tiny model if ``tiny``), under the call tracer when ``own`` names what it
    watches, as the grader's worker runs it. The outcomes, and the first call the tracer found (None: none)."""
    Engine = _engine()
    monkeypatch.setattr(ex10, "notebook_folder", lambda: folder)
    if tiny:
        _on_the_tiny_model(monkeypatch)
    with Tracer(targets(own), "ex10_your_engine.ipynb") as tracer:
        outcomes = ex10.check_engine_smollm2(Engine)
    return outcomes, tracer.found


def _on_the_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's own code, on exercise 10's tiny random Llama instead of SmolLM2: seconds, not minutes, under the
    tracer's profile hook (8 query heads over 2 KV heads also tell a head mapping SmolLM2 hides)."""
    monkeypatch.setattr(ex10, "smollm2", ex10.tiny)
    monkeypatch.setattr(ex10, "SMOLLM2_SETTINGS", ex10.TINY_SETTINGS)
    monkeypatch.setattr(capstone, "prompt_ids", ex10.tiny_prompts)
    monkeypatch.setattr(capstone, "MAX_TOKENS", ex10.TINY_MAX_TOKENS)
    monkeypatch.setattr(capstone, "reference_outputs", lambda p: ex10._tiny_reference(p, ex10.TINY_MAX_TOKENS))


ENGINE_SMOLLM2 = next(g for g in EXERCISES["ex10"].groups if g.name == "engine_smollm2")


def test_the_guided_track_meets_the_learners_engine_on_smollm2(tmp_path, monkeypatch):
    """Full marks on SmolLM2, with all eleven guided parts plugged in and each given work."""
    folder = _guided_folder(tmp_path)
    pieces = ex10.your_pieces(folder)
    assert pieces.track == "guided" and set(pieces.plugged) == set(ex10.GUIDED_PARTS)
    assert len(pieces.plugged) == 11 and "slot_mapping" not in pieces.plugged  # the loop computes its own slots
    outcomes, _ = _grade(folder, monkeypatch)
    assert [o.passed for o in outcomes] == [True, True, True], [o.got for o in outcomes]


def test_the_tracer_looks_away_from_the_components_the_grader_hands_over(tmp_path, monkeypatch):
    """Under the tracer the worker runs the group in: the package's components, which it watches on the build track,
    are handed to the learner's loop on purpose on the guided track, and the check exempts them; without that
    exemption the tracer would call the learner's loop a delegation."""
    folder = _guided_folder(tmp_path)
    outcomes, found = _grade(folder, monkeypatch, ENGINE_SMOLLM2.own, tiny=True)
    assert found is None and outcomes[1].got == "token-exact", (found, outcomes[1].got)
    monkeypatch.setattr(ownership, "exempt", lambda own: None)
    _outcomes, found = _grade(folder, monkeypatch, ENGINE_SMOLLM2.own, tiny=True)
    assert found and "your Engine" in found, found


def test_a_wrong_guided_part_is_caught_by_the_tokens(tmp_path, monkeypatch):
    (m,) = [m for m in mutants.all_mutants() if m.exercise == "ex05" and m.name == "gqa_modulo"]
    source = textwrap.dedent(inspect.getsource(m.fn)).split("\n", 1)[1]  # without its @mutant line
    cell = "import torch\n\n\n" + source.replace("def gqa_modulo(", "def paged_decode_attention(")
    outcomes, _ = _grade(_guided_folder(tmp_path, cell), monkeypatch, tiny=True)
    assert outcomes[0].passed, outcomes[0].got  # defined in its notebook: the learner's own
    assert not outcomes[1].passed and "differs" in str(outcomes[1].got), outcomes[1].got


def test_the_packages_part_imported_into_a_notebook_is_not_the_learners(tmp_path, monkeypatch):
    cell = "from minipaged.kernels.reference import paged_decode_attention\n"
    folder = _guided_folder(tmp_path, cell)
    got = ex10._yours(ex10.your_pieces(folder))
    assert got.startswith("paged_decode_attention was not defined in your ex05 notebook"), got


@pytest.mark.slow
def test_exercise_14s_reference_counts_are_exercise_10s_loop_measured_again():
    """Exercise 14 scores against counts it keeps as numbers (its reference loop is exercise 10's answer): they must
    be what that loop, over the package's decoder layer, does on exercise 14's workload today."""
    from minipaged.classroom.grading import ex14

    model, prompts, max_tokens, settings = ex14.workload()
    m = ex14.measure(_engine(), model, ex10.package_parts(), settings, prompts, max_tokens)
    assert m.outputs == capstone.reference_outputs(prompts)
    assert m.tokens == ex14.BASELINE_TOKENS and ex14.shortfall(m, prompts) is None
    assert m.ops == pytest.approx(ex14.BASELINE_OPS, rel=0.01), m.ops
    assert m.bytes == pytest.approx(ex14.BASELINE_BYTES, rel=0.01), m.bytes
