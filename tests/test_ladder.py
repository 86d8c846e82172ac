"""The exercises as a ladder: numbered without holes, rising within each chapter, each labelled with its time and
difficulty on its first line and in every course map, from one table (``grading/exercises.py``).

The maps are the README's course table, the site's course page and chapter 00's course map; each names every
exercise with the same label as the exercise's own first line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from minipaged.classroom.grading.exercises import EXERCISES, LEVELS, RENAMED, exercise_for

ROOT = Path(__file__).resolve().parent.parent
KEY = re.compile(r"^ex(\d\d)([a-z]?)$")


def _first_line(path: Path) -> str:
    return "".join(json.loads(path.read_text())["cells"][0]["source"]).split("\n")[0]


def _chapters() -> dict[str, list[str]]:
    chapters: dict[str, list[str]] = {}
    for key in EXERCISES:
        m = KEY.match(key)
        assert m, key
        chapters.setdefault(m[1], []).append(key)
    return chapters


def test_each_chapter_numbers_its_exercises_without_holes_and_in_rising_order():
    for chapter, keys in _chapters().items():
        # exNN, exNNb, exNNc, ...: the first has no letter, then b, c, d with none skipped, in the table's order
        want = [f"ex{chapter}"] + [f"ex{chapter}{chr(ord('b') + i)}" for i in range(len(keys) - 1)]
        assert keys == want, f"chapter {chapter}: {keys}, expected {want}"
        levels = [EXERCISES[k].level for k in keys]
        assert levels == sorted(levels), f"chapter {chapter} does not rise: {dict(zip(keys, levels))}"


def test_every_exercise_has_a_time_and_a_level_on_the_scale():
    for key, ex in EXERCISES.items():
        assert ex.level in LEVELS and 10 <= ex.minutes <= 240, (key, ex.minutes, ex.level)


@pytest.mark.parametrize("folder", ["exercises", "exercises/solutions"])
def test_each_notebook_says_its_time_and_difficulty_on_its_first_line(folder):
    paths = sorted((ROOT / folder).glob("ex*.ipynb"))
    assert {exercise_for(p.name).key for p in paths} == set(EXERCISES)
    for path in paths:
        ex = exercise_for(path.name)
        assert path.stem == ex.stem, f"{path.name}: named {ex.stem}.ipynb in the table"
        first = _first_line(path)
        number = ex.key.removeprefix("ex")
        assert re.match(rf"# Exercise {number} — .+ · {re.escape(ex.label)}$", first), f"{path.name}: {first!r}"


def _map_labels(text: str) -> dict[str, str]:
    """Every exercise a map names, with the label written beside it: `ex05_paged_decode` (label) or (ex05 · label)."""
    found = {m[1].split("_")[0]: m[3] for m in re.finditer(r"`((ex\d\d[a-z]?)_\w+)`(?: †)? \(([^)]*)\)", text)}
    found.update({m[1]: m[2] for m in re.finditer(r"\((ex\d\d[a-z]?) · ([^)]*)\)", text)})
    return found


def _welcome_map() -> str:
    cells = json.loads((ROOT / "notebooks" / "00_welcome.ipynb").read_text())["cells"]
    return next("".join(c["source"]) for c in cells if "".join(c["source"]).startswith("## The course map"))


@pytest.mark.parametrize("where", ["README.md", "site/guide/course.md", "notebooks/00_welcome.ipynb"])
def test_each_course_map_labels_every_exercise_as_its_notebook_does(where):
    text = _welcome_map() if where.endswith(".ipynb") else (ROOT / where).read_text()
    labels = _map_labels(text)
    assert set(labels) == set(EXERCISES), f"{where}: missing {sorted(set(EXERCISES) - set(labels))}"
    wrong = {k: v for k, v in labels.items() if v != EXERCISES[k].label}
    assert not wrong, f"{where}: labels that are not the table's: {wrong}"


def test_the_map_checker_catches_a_wrong_or_missing_label():
    assert _map_labels("`ex05_paged_decode` (40 min · ★★☆☆☆ steady), (ex05b · 1 min · ★ warm-up)") == {
        "ex05": "40 min · ★★☆☆☆ steady",
        "ex05b": "1 min · ★ warm-up",
    }
    assert _map_labels("`ex05_paged_decode`, ex05b") == {}


def test_a_notebook_saved_under_an_old_name_is_graded_as_the_exercise_it_is():
    current = {ex.stem for ex in EXERCISES.values()}
    for old, key in RENAMED.items():
        assert old not in current and key in EXERCISES, old
        assert exercise_for(f"{old}.ipynb") is EXERCISES[key]
        assert exercise_for(f"{old}-alice.ipynb") is EXERCISES[key]
    # a name that only shares the old one's number is the exercise that has that number now
    assert exercise_for("ex05_mine.ipynb") is EXERCISES["ex05"]
    assert exercise_for("ex05_scatter_writes.ipynb") is EXERCISES["ex05"]


def test_the_last_rung_is_the_hardest_and_the_only_one_that_hard():
    top = max(LEVELS)
    assert [k for k, ex in EXERCISES.items() if ex.level == top] == ["ex14"]
    assert list(EXERCISES)[-1] == "ex14"
