"""A hint is printed only where its advice holds: "X passes but this fails" never when X fails too, and each rung of
a ladder of cases has its own hint (issue 55). ``Check.hint`` may be a function of what the check got."""

from __future__ import annotations

import pytest

from minipaged.classroom.grading import ex09b
from minipaged.classroom.grading.core import Check, report
from tests.mutants import ex09b as mutants09c


def test_a_hint_function_chooses_the_advice_or_none(capsys):
    report("g", [Check("a", lambda: 1, 2, hint=lambda got: f"got {got}, so this"),
                 Check("b", lambda: 1, 2, hint=lambda got: ""),
                 Check("c", lambda: 1, 2, hint=lambda got: 1 / 0)])  # fmt: skip
    out = capsys.readouterr().out
    assert "hint     got 1, so this" in out
    assert len(_hints(out)) == 2  # b printed none
    assert "(no hint: deciding which one fits raised ZeroDivisionError" in out  # c: the failure still shows


def _hints(out: str) -> list[str]:
    return [line.split("hint", 1)[1].strip() for line in out.splitlines() if line.strip().startswith("hint")]


@pytest.mark.slow  # ex09b's layer_spec twice: about 10 s
def test_each_rung_of_layer_spec_has_its_own_hint_and_points_back_when_the_first_fails(capsys):
    ex09b.check_layer_spec(mutants09c.layer_norm)  # wrong in every case, the first included
    hints = _hints(capsys.readouterr().out)
    assert hints[0] == ex09b.PLAN_HINTS[0]
    assert hints[1:] and all(h.startswith("the one-step case fails too") for h in hints[1:])
    ex09b.check_layer_spec(mutants09c.row_index_rope)  # right in one step, wrong once a chunk starts mid-sequence
    out = capsys.readouterr().out
    assert ex09b.PLAN_HINTS[1] in _hints(out) and ex09b.PLAN_HINTS[0] not in _hints(out)
    assert len(set(ex09b.PLAN_HINTS)) == len(ex09b.PLANS)


@pytest.mark.slow  # SmolLM2's 30 layers, twice per mutant
def test_layer_smollm2_says_layer_spec_passes_only_when_it_does(capsys):
    ex09b.check_layer_smollm2(mutants09c.norm_without_eps)  # passes layer_spec, fails on SmolLM2
    first = _hints(capsys.readouterr().out)[0]
    assert first.startswith("a first layer that differs while layer_spec passes")
    ex09b.check_layer_smollm2(mutants09c.layer_norm)  # fails layer_spec too
    hints = _hints(capsys.readouterr().out)
    assert hints[0].startswith("layer_spec fails too") and not any("while layer_spec passes" in h for h in hints)


def test_a_failed_trace_marks_its_first_wrong_item(capsys):
    report("g", [Check("trace", lambda: [[1, 2], [3, 4], [5, 6]], [[1, 2], [3, 9], [5, 7]]),
                 Check("short", lambda: [1, 2], [1, 2, 3]),
                 Check("scalar", lambda: 1, 2)])  # fmt: skip
    out = capsys.readouterr().out
    assert "first    item 1 differs: got [3, 4], expected [3, 9]; within it, item 1 differs: got 4, expected 9" in out
    assert "first    the first 2 items agree; got 2 items, expected 3" in out
    assert sum(line.strip().startswith("first") for line in out.splitlines()) == 2  # a scalar has none
