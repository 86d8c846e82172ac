"""The grading machinery every exercise reuses."""
import pytest

from minipaged.grading import Check, close, format_table, parse_summaries, report
from minipaged.grading.runner import GroupScore


def test_report_prints_one_summary_line_when_all_pass(capsys):
    outcomes = report("demo", [Check("1+1", lambda: 2, 2), Check("2*3", lambda: 6, 6)])
    assert capsys.readouterr().out == "demo: 2/2 checks passed\n"
    assert all(o.passed for o in outcomes)


def test_report_explains_each_failure(capsys):
    def broken():
        raise NotImplementedError

    report("demo", [Check("f(1)", lambda: 3, 2, hint="add one"), Check("g()", broken, 5),
                    Check("h()", lambda: 1 / 0, 1)])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "demo: 0/3 checks passed"
    assert "  ✗ tried    f(1)" in out and "    expected 2" in out and "    got      3" in out
    assert "    hint     add one" in out
    assert any("stub is still there" in line for line in out)
    assert any("ZeroDivisionError" in line for line in out)
    assert parse_summaries("\n".join(out)) == [("demo", 0, 3)]


def test_close_comparison_and_bad_group_name(capsys):
    report("floats", [Check("0.1+0.2", lambda: 0.1 + 0.2, 0.3, same=close())])
    assert capsys.readouterr().out == "floats: 1/1 checks passed\n"
    with pytest.raises(ValueError, match="check group name"):
        report("two words", [])


def test_score_table():
    table = format_table([GroupScore("ex01.ipynb", "a", 3, 4), GroupScore("ex01.ipynb", "b", 0, 2)])
    lines = table.splitlines()
    assert lines[0].split() == ["notebook", "check", "group", "score"]
    assert lines[-1].split() == ["TOTAL", "3/6"]
