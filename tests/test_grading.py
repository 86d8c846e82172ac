"""The grading machinery every exercise reuses."""

import contextlib
import io

import pytest

from minipaged.classroom.grading import Check, close, format_table, parse_summaries, report
from minipaged.classroom.grading.runner import GroupScore


def test_report_prints_one_summary_line_when_all_pass(capsys):
    outcomes = report("demo", [Check("1+1", lambda: 2, 2), Check("2*3", lambda: 6, 6)])
    assert capsys.readouterr().out == "demo: 2/2 checks passed\n"
    assert all(o.passed for o in outcomes)


def test_report_explains_each_failure(capsys):
    def broken():
        raise NotImplementedError

    report(
        "demo", [Check("f(1)", lambda: 3, 2, hint="add one"), Check("g()", broken, 5), Check("h()", lambda: 1 / 0, 1)]
    )
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
    assert lines[0].split() == ["notebook", "check", "group", "score", "note"]
    assert lines[-1].split() == ["TOTAL", "3/6"]


# ---- the folder grader: it runs the learner's code and trusts nothing a notebook prints (issue 24) ------------
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import nbformat  # noqa: E402

from minipaged.classroom.grading import format_details, grade_folder, grade_notebook  # noqa: E402
from minipaged.classroom.grading.exercises import EXERCISES, exercise_for  # noqa: E402
from minipaged.classroom.grading.runner import CHECK_MARK, stored_groups  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = ROOT / "exercises" / "solutions"


def _notebook(cells: list[str]):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])


def _write(path: Path, cells: list[str]) -> Path:
    nbformat.write(_notebook(cells), path)
    return path


def _code_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and CHECK_MARK not in c.source]


def _scores(rows) -> dict[str, tuple[int, int, str]]:
    return {r.group: (r.passed, r.total, r.note) for r in rows}


EX01_RIGHT = SOLUTIONS / "ex01_kv_bytes.ipynb"


def test_registry_is_what_each_exercise_checks():
    """Every starter's check cells call exactly the registry's groups, with its arguments, and store its totals."""
    starters = sorted((ROOT / "exercises").glob("ex*.ipynb"))
    assert sorted(exercise_for(p.name).key for p in starters) == sorted(EXERCISES)
    for path in starters:
        exercise = exercise_for(path.name)
        assert path.stem == exercise.stem
        nb = nbformat.read(path, as_version=4)
        calls = [
            (check, tuple(a.strip() for a in args.split(",")))
            for c in nb.cells
            if CHECK_MARK in c.source
            for check, args in re.findall(r"ex\d\d[a-z]?\.(check_\w+)\(([^)]*)\)", c.source)
        ]
        assert calls == [(g.check, g.args) for g in exercise.groups], path.name
        assert stored_groups(path) == [(g.name, g.total) for g in exercise.groups], path.name
    assert exercise_for("ex03_mine.ipynb").key == "ex03" and exercise_for("ex3_x.ipynb") is None
    assert exercise_for("notes.ipynb") is None and exercise_for("ex99_x.ipynb") is None


def test_printed_lines_score_nothing(tmp_path):
    """Item 2: each check cell replaced by a print of its expected line, plus an invented group: 0 points each."""
    fake = [f'print("{g}: {n}/{n} checks passed")' for g, n in stored_groups(EX01_RIGHT)]
    path = _write(
        tmp_path / "ex01_kv_bytes.ipynb",
        [
            "def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):\n    raise NotImplementedError",
            *fake,
            'print("bonus_points: 1000/1000 checks passed")',
        ],
    )
    rows = grade_notebook(path, timeout=120)
    assert [(r.group, r.passed, r.total) for r in rows] == [("bytes_per_token", 0, 6), ("block_capacity", 0, 6)]
    assert rows[1].note == "`block_capacity` not defined"


def test_right_functions_without_check_cells_score_full_marks(tmp_path):
    path = _write(tmp_path / "ex01_kv_bytes.ipynb", _code_cells(EX01_RIGHT))
    assert _scores(grade_notebook(path, timeout=120)) == {"bytes_per_token": (6, 6, ""), "block_capacity": (6, 6, "")}


def test_the_exercise_comes_from_the_file_name_and_errors_are_shown(tmp_path):
    """ex01's solution handed in as ex03 scores 0 on ex03's groups; a renamed function is named, with the
    NameError of the cell that used it."""
    as_ex03 = _write(tmp_path / "ex03_free_queue.ipynb", _code_cells(EX01_RIGHT))
    rows = grade_notebook(as_ex03, timeout=120)
    assert [(r.group, r.passed, r.total, r.note) for r in rows] == [
        (g.name, 0, g.total, "`remove` not defined") for g in EXERCISES["ex03"].groups
    ]
    renamed = [c.replace("def bytes_per_token(", "def bytes_per_tok(") for c in _code_cells(EX01_RIGHT)]
    renamed.append("print(bytes_per_token(1, 1, 1, 1))")
    rows = grade_notebook(_write(tmp_path / "ex01_kv_bytes.ipynb", renamed), timeout=120)
    assert _scores(rows)["bytes_per_token"] == (0, 6, "`bytes_per_token` not defined")
    assert _scores(rows)["block_capacity"] == (6, 6, "")
    details = format_details(rows)
    assert "NameError: name 'bytes_per_token' is not defined" in details and "ex01_kv_bytes.ipynb" in details


def test_one_bad_notebook_never_sinks_the_folder(tmp_path):
    """A loop cut at the time limit, a dead process, a corrupt file, a JSON file that is no notebook, a name that
    is no exercise, a second notebook of one exercise: each gets named rows, and every good notebook is graded."""
    good = _code_cells(EX01_RIGHT)
    _write(tmp_path / "ex01_kv_bytes.ipynb", good)
    _write(tmp_path / "ex01_again.ipynb", good)
    _write(tmp_path / "ex02_fragmentation.ipynb", ["x = 1", "while True:\n    pass"])
    _write(tmp_path / "ex03_free_queue.ipynb", ["import os", "os._exit(1)"])
    (tmp_path / "ex04_slots_and_admission.ipynb").write_text('{"cells": [')
    (tmp_path / "ex05b_scatter_write.ipynb").write_text(json.dumps({"hello": "world"}))
    _write(tmp_path / "ex99_mine.ipynb", ["x = 1"])
    _write(tmp_path / "zz_last.ipynb", ["x = 1"])
    # 25 s: the loop in ex02 is cut there; a loaded machine (make test runs two workers) may take 10 s to start one
    rows = grade_folder(tmp_path, timeout=25)
    by_nb: dict[str, list] = {}
    for r in rows:
        by_nb.setdefault(r.notebook, []).append(r)
    assert sorted(by_nb) == sorted(p.name for p in tmp_path.glob("*.ipynb"))
    assert [(r.passed, r.total) for r in by_nb["ex01_kv_bytes.ipynb"]] == [(6, 6), (6, 6)]
    again = by_nb["ex01_again.ipynb"]
    assert [(r.passed, r.counted) for r in again] == [(6, False), (6, False)]
    assert "not in TOTAL" in again[0].note
    assert {r.note for r in by_nb["ex02_fragmentation.ipynb"]} == {"timed out after 25 s in cell 1"}
    assert {r.note for r in by_nb["ex03_free_queue.ipynb"]} == {"the notebook's process died (exit code 1) in cell 1"}
    for name in ("ex04_slots_and_admission.ipynb", "ex05b_scatter_write.ipynb"):
        assert {r.note for r in by_nb[name]} == {"not a readable notebook"}
        assert all(r.passed == 0 and r.total > 0 for r in by_nb[name])
        assert all(r.detail.startswith(f"{name}: not a readable notebook: ") for r in by_nb[name])
    for name in ("ex99_mine.ipynb", "zz_last.ipynb"):
        assert [(r.group, r.passed, r.total, r.note) for r in by_nb[name]] == [
            ("-", 0, 0, "not an exercise of this course")
        ]
    table = format_table(rows)
    expected_total = 12 + sum(EXERCISES[k].total for k in ("ex02", "ex03", "ex04", "ex05b"))
    assert table.splitlines()[-1].split() == ["TOTAL", f"12/{expected_total}"]


def test_the_command_line(tmp_path):
    """Paths with spaces, a single notebook, a missing folder, an empty folder, a bad --timeout."""
    folder = tmp_path / "alice smith"
    folder.mkdir()
    _write(folder / "ex01_kv_bytes.ipynb", _code_cells(EX01_RIGHT))

    def grade(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "minipaged", "grade", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
        )

    done = grade(str(folder), "--timeout", "120")  # the real command, once, as a shell runs it
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].split() == ["TOTAL", "12/12"]
    # the rest through the same entry point in this process (each notebook is still graded in a fresh one)
    from minipaged.__main__ import main

    def run(*args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["grade", *args])
            except SystemExit as exc:  # argparse refuses a bad option by exiting
                code = int(exc.code or 0)
        return code, out.getvalue(), err.getvalue()

    code, out, err = run(str(folder / "ex01_kv_bytes.ipynb"), "--timeout", "120")
    assert code == 0 and out.splitlines()[-1].split() == ["TOTAL", "12/12"], err
    code, _, err = run(str(tmp_path / "nowhere"))
    assert code == 2 and f"no such file or folder: {tmp_path / 'nowhere'}" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(str(empty))
    assert code == 2 and f"no notebooks to grade in {empty}" in err
    code, _, err = run(str(folder), "--timeout", "0")
    assert code == 2 and "must be a positive number" in err
    make = (ROOT / "Makefile").read_text()
    assert 'grade "$(DIR)"' in make


# ---- the capstone on a GPU: float32, and a reference computed where and how the engine runs ------------------------
def test_the_capstone_engine_serves_float32_on_any_device(monkeypatch):
    """On a GPU dtype="auto" is bfloat16, which a right engine and transformers do not round alike: the capstone
    serves float32 there too (on a CPU "auto" is float32 already: nothing changes)."""
    from minipaged.classroom.grading import capstone
    from minipaged.engine import llm as engine_module

    built: list[dict] = []
    monkeypatch.setattr(engine_module, "LLM", lambda **kw: built.append(kw))
    monkeypatch.setattr(capstone, "prompt_ids", lambda: [[1] * 40])
    for settings in ({}, {"dtype": "auto", "block_size": 32}, {"dtype": "float32"}, {"dtype": "bfloat16"}):
        capstone.engine(settings)
    assert [b["dtype"] for b in built] == ["float32", "float32", "float32", "bfloat16"]  # the check cell refuses bf16
    assert [b["max_model_len"] for b in built] == [64, 64, 64, 64]


def test_the_capstone_reference_runs_on_the_engines_device_in_its_dtype(monkeypatch, tmp_path):
    import hashlib
    import json

    import torch

    from minipaged import model_loader
    from minipaged.classroom.grading import capstone

    loads: list[tuple] = []
    monkeypatch.setattr(model_loader, "ensure_converted", lambda progress=True: tmp_path)
    monkeypatch.setattr(model_loader, "load_hf_model", lambda dtype=None, device="cpu": loads.append((dtype, device)))
    monkeypatch.setattr(
        model_loader, "hf_greedy_token_ids", lambda model, prompts, n: [[len(loads)] * n] * len(prompts)
    )
    prompts = [[1, 2, 3]]
    cpu = capstone.reference_outputs(prompts, 2)
    assert capstone.reference_outputs(prompts, 2, device=torch.device("cpu"), dtype=torch.float32) == cpu  # read back
    assert loads == [(torch.float32, "cpu")]
    cuda = capstone.reference_outputs(prompts, 2, device=torch.device("cuda", 0))
    assert loads[-1] == (torch.float32, "cuda:0") and cuda != cpu
    capstone.reference_outputs(prompts, 2, device="cuda", dtype=torch.bfloat16)
    assert loads[-1] == (torch.bfloat16, "cuda") and len(loads) == 3
    # A CPU reference keeps the key it had before devices entered it: references already computed stay valid.
    key = hashlib.sha256(json.dumps([prompts, 2]).encode()).hexdigest()[:16]
    assert json.loads((tmp_path / "greedy_reference.json").read_text())[key] == cpu

    class Stop(Exception):
        pass

    def reference(prompts, max_tokens=capstone.MAX_TOKENS, device="cpu", dtype=None):
        loads.append((dtype, device))
        raise Stop

    monkeypatch.setattr(capstone, "reference_outputs", reference)
    monkeypatch.setattr(capstone, "prompt_ids", lambda: prompts)
    llm = type("GPUEngine", (), dict(device=torch.device("cuda", 0), dtype=torch.float32))()
    with pytest.raises(Stop):
        capstone.report_card({}, llm=llm)
    assert loads[-1] == (torch.float32, torch.device("cuda", 0))
