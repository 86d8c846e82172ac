"""No hint is the answer: a hint may point at the idea, the trap, the shape or a formula in words, but the code the
learner writes never appears in it.

The learner's lines are the code lines of an exercise's solution that its starter does not have (comments, blank
lines, short lines and lines such as ``return out`` left out), each with the expressions it is built around when they
are more than a name (an assignment's value, a ``return``'s, an ``if``'s test, what a ``for`` walks, a call's
arguments). None may appear in a hint of the starter (its cells tagged ``hints``, its "Stuck?" cells and its
``<details>`` hint blocks, prose and code alike), nor in the hints its grading module prints when a check fails.
Whitespace is ignored, so ``a+b`` in a hint matches ``a + b`` in the solution; and an expression with two operators or
more is found with its variables renamed too (``-(-a // b)`` gives away ``-(-request_tokens // block_size)``).

What no test can see is a hint that spells the whole algorithm out in words, step after step, until transcribing it
is the answer: that stays for a reviewer's eye."""

from __future__ import annotations

import ast
import io
import json
import keyword
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = ROOT / "exercises"
GRADING = ROOT / "minipaged" / "classroom" / "grading"

MIN_CHARS = 12  # a learner line shorter than this, spaces left out, is too generic to give anything away
GENERIC = {"returnout", "returnresult", "returnNone", "raiseNotImplementedError"}
MIN_OPERATORS = 2  # an expression with fewer is not matched with its variables renamed: `a + b` is everywhere

_DETAILS = re.compile(r"<details>\s*<summary>(.*?)</summary>(.*?)</details>", re.S)
_SPACE = re.compile(r"\s+")
_TOKEN = re.compile(r"[A-Za-z_]\w*|\d[\w.]*|//|\*\*|<<|>>|[<>=!]=|->|\S")
_OPERATORS = {"+", "-", "*", "/", "//", "%", "**", "<", ">", "<=", ">=", "==", "!=", "&", "|", "^", "~", "<<", ">>"}
_OPERATORS |= {"and", "or", "not", "is", "in"}


def _squash(text: str) -> str:
    return _SPACE.sub("", text)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _shape(code: str) -> list[str]:
    """The tokens of some code with each plain variable renamed ``_``; keywords, numbers, operators, attribute and
    called names stay (``-(-a // b)`` -> ``- ( - _ // _ )``, ``x.sum(dim=1)`` -> ``_ . sum ( dim = 1 )``)."""
    tokens = _TOKEN.findall(code)
    out = []
    for i, tok in enumerate(tokens):
        plain = tok[0].isalpha() or tok[0] == "_"
        named = (i and tokens[i - 1] == ".") or tokens[i + 1 : i + 2] in (["("], ["="])
        out.append("_" if plain and not keyword.iskeyword(tok) and not named else tok)
    return out


def _code_lines(source: str) -> list[str]:
    """The lines of a code cell, each without its comment, stripped; blank and comment-only lines left out."""
    lines = source.splitlines()
    try:  # drop comments where the cell tokenizes (a cell with %magic or !shell may not: then keep lines whole)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                row, col = tok.start
                lines[row - 1] = lines[row - 1][:col]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        lines = [line for line in lines if not line.lstrip().startswith("#")]
    return [line.strip() for line in lines if line.strip()]


def _pieces(line: str) -> list[str]:
    """A line, and the expressions it is built around when they are more than a name: an assignment's value, a
    ``return``'s, the test of an ``if``, ``while`` or ``assert``, what a ``for`` walks, the arguments of a call made
    for its effect, and the value of a line inside a bracket (``"key": value,`` or ``name=value,``)."""
    text = line[2:] if line.startswith("elif ") else line
    text += " pass" if text.endswith(":") else ""
    try:
        stmt = ast.parse(text).body[0]
    except (SyntaxError, IndexError):
        m = re.fullmatch(r"(?:\w+\s*=|(?:\"[^\"]*\"|'[^']*'|\w+)\s*:)?\s*(.+?),?", line)
        try:
            stmt = ast.parse(m[1] if m else "", mode="eval")  # an Expression: its body is the value
        except SyntaxError:
            return [line]
        text = m[1] if m else ""
    values: list[ast.expr] = []
    if isinstance(stmt, ast.Expression | ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Return):
        values = [stmt.body if isinstance(stmt, ast.Expression) else stmt.value]
    elif isinstance(stmt, ast.If | ast.While | ast.Assert):
        values = [stmt.test]
    elif isinstance(stmt, ast.For):
        values = [stmt.iter]
    elif isinstance(stmt, ast.Expr):
        call = stmt.value.value if isinstance(stmt.value, ast.Await | ast.Yield) else stmt.value
        values = [call] if call is not stmt.value else []
        if isinstance(call, ast.Call):
            values += [*call.args, *(k.value for k in call.keywords)]
    named = (ast.Name, ast.Attribute, ast.Constant)  # naming a thing is no answer
    return [line] + [ast.get_source_segment(text, v) or line for v in values if not isinstance(v, named)]


def learner_lines(starter: dict, solution: dict) -> list[str]:
    """The lines the learner writes, and the expressions they are built around: what the solution's code cells hold
    and the starter's do not (whitespace ignored)."""
    given = {
        _squash(line) for cell in starter["cells"] if cell["cell_type"] == "code" for line in _code_lines(_source(cell))
    }
    found: list[str] = []
    for cell in solution["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in _code_lines(_source(cell)):
            if _squash(line) in given:
                continue
            for piece in _pieces(line):
                squashed = _squash(piece)
                if len(squashed) >= MIN_CHARS and squashed not in GENERIC and piece not in found:
                    found.append(piece)
    return found


def notebook_hints(nb: dict) -> list[tuple[str, str]]:
    """``(name, text)`` for every hint of a notebook: each ``<details>`` block of a hint cell, named by its summary,
    and the rest of the cell. A hint cell is tagged ``hints``, says "Stuck", or has a summary that says "Hint" or
    "Stuck"; a cell tagged ``answer`` (the answers to "Think, then check") is no hint."""
    hints = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        text, tags = _source(cell), cell.get("metadata", {}).get("tags", [])
        summaries = [summary for summary, _ in _DETAILS.findall(text)]
        hinted = "hints" in tags or "Stuck" in text or any(re.search(r"hint|stuck", s, re.I) for s in summaries)
        if "answer" in tags or not hinted:
            continue
        where = f"cell {i} ({cell.get('id', '?')})"
        hints += [(f"{where}, {_SPACE.sub(' ', s).strip()!r}", body) for s, body in _DETAILS.findall(text)]
        if _DETAILS.sub("", text).strip():
            hints.append((f"{where}, outside its <details> blocks", _DETAILS.sub("", text)))
    return hints


def grading_hints(source: str) -> list[tuple[str, str]]:
    """``(name, text)`` for every hint string of a grading module: what a ``hint=`` argument holds, and the strings
    assigned to a name with "hint" in it or written in a function with "hint" in its name. An f-string's literal
    parts count; its ``{...}`` parts are not hint text."""

    def strings(node: ast.AST) -> list[str]:
        out, parts = [], set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.JoinedStr):
                out.append("{}".join(v.value for v in sub.values if isinstance(v, ast.Constant)))
                parts |= {id(v) for v in sub.values}
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and id(sub) not in parts:
                out.append(sub.value)
        return out

    hints = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg and "hint" in node.arg.lower():
            hints += [(f"line {node.value.lineno}, {node.arg}=", s) for s in strings(node.value)]
        elif isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any("hint" in ast.unparse(t).lower() for t in targets):
                hints += [(f"line {node.lineno}, {ast.unparse(targets[0])}", s) for s in strings(node.value)]
        elif isinstance(node, ast.FunctionDef) and "hint" in node.name.lower():
            hints += [(f"line {node.lineno}, {node.name}()", s) for s in strings(node)]
    return hints


def _renamed_in(piece: str, text: str) -> bool:
    """Whether ``piece``, an expression with two operators or more, is in ``text`` with its variables renamed."""
    shape = _shape(piece)
    if sum(tok in _OPERATORS for tok in shape) < MIN_OPERATORS:
        return False
    return "\0" + "\0".join(shape) + "\0" in "\0" + "\0".join(_shape(text)) + "\0"


def answers_in_hints(lines: list[str], hints: list[tuple[str, str]], where: str) -> list[str]:
    """One message per learner line that a hint gives: which file, which hint, which line."""
    problems = []
    for name, text in hints:
        for line in lines:
            if _squash(line) in _squash(text):
                problems.append(f"{where}: hint {name} gives the learner's line `{line}`")
            elif _renamed_in(line, text):
                problems.append(f"{where}: hint {name} gives the learner's line `{line}`, its variables renamed")
    return problems


def _pairs() -> list[Path]:
    return sorted(p for p in EXERCISES.glob("ex*.ipynb") if (EXERCISES / "solutions" / p.name).exists())


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("starter", _pairs(), ids=lambda p: p.stem)
def test_no_hint_in_the_notebook_gives_a_line_of_the_solution(starter):
    nb = _load(starter)
    lines = learner_lines(nb, _load(EXERCISES / "solutions" / starter.name))
    assert lines, f"{starter.name}: found no line the learner writes"
    problems = answers_in_hints(lines, notebook_hints(nb), f"exercises/{starter.name}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("starter", _pairs(), ids=lambda p: p.stem)
def test_no_hint_of_the_grader_gives_a_line_of_the_solution(starter):
    module = GRADING / f"{starter.name.split('_')[0]}.py"
    assert module.exists(), f"{starter.name}: no grading module {module.name}"  # every exercise has its checks
    lines = learner_lines(_load(starter), _load(EXERCISES / "solutions" / starter.name))
    hints = grading_hints(module.read_text(encoding="utf-8"))
    problems = answers_in_hints(lines, hints, str(module.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


def test_every_exercise_has_hints_to_check():
    assert _pairs()
    for starter in _pairs():
        assert notebook_hints(_load(starter)), f"{starter.name} has no hint this test can read"


# ---- the checks can fail ------------------------------------------------------------------------------------------


def _nb(*cells: tuple[str, str, list[str]]) -> dict:
    return {
        "cells": [
            {"cell_type": kind, "id": f"c{i}", "metadata": {"tags": tags}, "source": source}
            for i, (kind, source, tags) in enumerate(cells)
        ]
    }


_STUB = "def blocks(tokens, block_size):\n    raise NotImplementedError  # YOUR CODE HERE\n"
_SOLUTION = _nb(("code", "def blocks(tokens, block_size):\n    return -(-tokens // block_size)  # round up\n", []))


def _starter(hint_2: str) -> dict:
    return _nb(
        ("code", _STUB, []),
        (
            "markdown",
            "**Stuck on `blocks`?**\n\n<details><summary>Hint 1 — round up</summary>\n\nA part-full block counts.\n"
            f"</details>\n\n<details><summary>Hint 2 — the traps</summary>\n\n{hint_2}\n</details>\n",
            ["hints"],
        ),
        ("markdown", "<details><summary>Answer</summary>\n\n`return -(-tokens // block_size)`\n</details>", ["answer"]),
    )


def test_the_learners_lines_are_the_solutions_new_code_lines_and_their_expressions():
    assert learner_lines(_starter(""), _SOLUTION) == ["return -(-tokens // block_size)", "-(-tokens // block_size)"]
    starter = _nb(("code", "x = compute_something(a, b)\n", []))
    solution = _nb(
        ("code", "x = compute_something(a, b)\n# the answer = counted(a, b)\ny = other.thing\nz = f(x)\n", [])
    )
    assert learner_lines(starter, solution) == ["y = other.thing"]  # given, comment, short: not the learner's


def test_a_hint_that_holds_a_line_of_the_solution_is_reported_with_its_notebook_hint_and_line():
    for hint in ("Round up: `-(-tokens//block_size)`.", "```python\nreturn -(-tokens // block_size)\n```"):
        starter = _starter(hint)
        problems = answers_in_hints(learner_lines(starter, _SOLUTION), notebook_hints(starter), "exercises/ex99.ipynb")
        assert problems, hint
        assert all(p.startswith("exercises/ex99.ipynb: hint cell 1 (c1), 'Hint 2 — the traps' gives") for p in problems)
        assert any(p.endswith("`-(-tokens // block_size)`") for p in problems)  # the answer cell is no hint


def test_a_hint_that_holds_the_solutions_expression_with_other_names_is_reported():
    starter = _starter("* For the round-up, `-(-a // b)` is exact.")
    problems = answers_in_hints(learner_lines(starter, _SOLUTION), notebook_hints(starter), "exercises/ex99.ipynb")
    assert problems == [
        "exercises/ex99.ipynb: hint cell 1 (c1), 'Hint 2 — the traps' gives the learner's line "
        "`-(-tokens // block_size)`, its variables renamed"
    ]


def test_a_hint_that_points_without_giving_the_code_passes():
    starter = _starter(
        "* Round **up**, in integers: a float loses exactness past 2**53. Try 50 tokens in blocks of 16."
    )
    assert answers_in_hints(learner_lines(starter, _SOLUTION), notebook_hints(starter), "exercises/ex99.ipynb") == []


def test_a_grader_hint_that_holds_a_line_of_the_solution_is_reported():
    source = (
        "HINTS = {'a': 'round up: -(-tokens // block_size)'}\n"
        "def check(f):\n"
        "    return Check('x', f, 1, hint=f'got {f()}, want blocks = -(-tokens//block_size)')\n"
    )
    problems = answers_in_hints(["-(-tokens // block_size)"], grading_hints(source), "grading/ex99.py")
    assert [p.split(" gives")[0] for p in problems] == [
        "grading/ex99.py: hint line 1, HINTS",
        "grading/ex99.py: hint line 3, hint=",
    ]
