"""Every exercise: its starter fails every check, and it expects exactly what its solution prints.

nbval runs each solution notebook (it is under `testpaths`) and compares the
printed check lines with the stored ones, which must all read "n/n checks
passed"; here we run each starter and prove no check passes on the stub. A
starter stores no check output (a learner must not read "n/n checks passed"
before writing anything): what each check cell must print is in its metadata,
and the package's pytest plugin (minipaged/classroom/grading/nbval_plugin.py) gives it to nbval, proven here on ex01.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minipaged.classroom.grading import worker
from minipaged.classroom.grading.exercises import exercise_for
from minipaged.classroom.grading.runner import (
    CHECK_MARK,
    METADATA_KEY,
    _scores_from_events,
    expected_outputs,
    stored_groups,
)

EXERCISES = Path(__file__).resolve().parent.parent / "exercises"
STARTERS = sorted(EXERCISES.glob("ex*.ipynb"))
STUB = "raise NotImplementedError  # YOUR CODE HERE"


def _check_cells(path):
    nb = nbformat.read(path, as_version=4)
    return [c for c in nb.cells if c.cell_type == "code" and CHECK_MARK in c.source]


def test_every_exercise_has_a_solution():
    assert STARTERS, "no exercises found"
    for starter in STARTERS:
        assert (EXERCISES / "solutions" / starter.name).exists(), f"{starter.name} has no solution"


@pytest.mark.parametrize("starter", STARTERS, ids=lambda p: p.stem)
def test_starter_expects_what_the_solution_prints(starter):
    """Its check cells expect (in their metadata) what the solution's print, and show no output: nothing in the
    stored starter says "checks passed"; each check cell keeps an execution count, so nbval compares it."""
    solution = EXERCISES / "solutions" / starter.name
    checks = _check_cells(starter)
    assert [c.metadata[METADATA_KEY]["expected"] for c in checks] == [c.outputs for c in _check_cells(solution)]
    assert all(c.outputs == [] and c.execution_count is not None for c in checks)
    assert [expected_outputs(c) for c in checks] == [c.outputs for c in _check_cells(solution)]
    nb = nbformat.read(starter, as_version=4)
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not any("checks passed" in str(o) for o in shown)
    assert not any(METADATA_KEY in c.metadata for c in nbformat.read(solution, as_version=4).cells)
    groups = stored_groups(starter)
    assert groups, "no check cells with expected results"
    for group, total in groups:
        assert total > 0, group
    stubs = sum(STUB in c.source for c in nb.cells)
    assert stubs >= 1


def _nbval(notebook: Path, *options: str) -> dict[int, str]:
    """``pytest --nbval-lax NOTEBOOK`` in a fresh process, from the notebook's folder: each code cell's outcome."""
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-rA",
           "-q", *options, notebook.name]  # fmt: skip
    proc = subprocess.run(cmd, cwd=notebook.parent, capture_output=True, text=True, timeout=600)
    found = re.findall(r"^(PASSED|FAILED|ERROR) \S+::Cell (\d+)", proc.stdout, re.M)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {int(cell): outcome for outcome, cell in found}


def test_nbval_grades_a_starter_against_its_hidden_expected_lines(tmp_path):
    """ex01 under nbval, in a folder of its own (the package's pytest plugin, grading/nbval_plugin.py, loaded by its
    entry point): the starter fails every check cell; the same notebook with the solution's code in its stubs
    passes every cell, the check cells compared with the lines their metadata keeps; without the plugin, a right
    answer still fails (never a false pass)."""
    starter = EXERCISES / "ex01_kv_bytes.ipynb"
    solution = nbformat.read(EXERCISES / "solutions" / starter.name, as_version=4)
    nb = nbformat.read(starter, as_version=4)
    code = list(range(sum(c.cell_type == "code" for c in nb.cells)))
    checks = [i for i, c in enumerate(c for c in nb.cells if c.cell_type == "code") if CHECK_MARK in c.source]
    for cell, right in zip(nb.cells, solution.cells):
        if STUB in cell.source:
            cell.source = right.source
    for folder in ("with", "without"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "pytest.ini").write_text("[pytest]\n")  # its own rootdir: no repository addopts
        shutil.copy(starter, tmp_path / folder / starter.name)
        nbformat.write(nb, tmp_path / folder / "solved.ipynb")

    as_given = _nbval(tmp_path / "with" / starter.name)
    assert checks and all(as_given[i] == "FAILED" for i in checks), as_given
    assert _nbval(tmp_path / "with" / "solved.ipynb") == {i: "PASSED" for i in code}
    without = _nbval(tmp_path / "without" / "solved.ipynb", "-p", "no:minipaged")
    assert all(without[i] == "FAILED" for i in checks), without


def _grade_here(path: Path) -> list:
    """What the grader's worker reports for a notebook, run in this process (the worker's own process, time
    limit and crash handling are tested in test_grading.py; here, every starter, quickly)."""
    exercise = exercise_for(path.name)
    events: list[dict] = []
    worker.grade(str(path), exercise.key, lambda event, **fields: events.append({"event": event, **fields}))
    return _scores_from_events(path.name, exercise, events, 0, 0, "")


def test_every_starter_fails_every_check():
    """The grader on the starters: every group of every exercise, all 0."""
    scores = [s for p in STARTERS for s in _grade_here(p)]
    assert [s.notebook for s in scores] == [p.name for p in STARTERS for _ in stored_groups(p)]
    assert [(s.group, s.total) for s in scores] == [g for p in STARTERS for g in stored_groups(p)]
    for s in scores:
        assert s.passed == 0, f"{s.notebook}: {s.group} passes {s.passed}/{s.total} checks on the stub"
        assert s.note == "", f"{s.notebook}: {s.note}"


def test_the_course_map_says_what_each_exercise_has_you_write():
    """00's table: every function in "you write" is a stub of that exercise, every part in "it runs in the
    engine as" is a part of that exercise (minipaged.parts), and every part is there; every chapter has an
    exercise. A chapter may have several (05: ex05 to ex05e; the build track's 03b, 04b, 06b, 09b, 09c), all of its
    own number, each tagged with its time and difficulty."""
    from minipaged.classroom.grading.exercises import EXERCISES as EXERCISE_TABLE
    from minipaged.classroom.parts import PARTS

    ENGINE_PARTS = {"paged_decode_attention", "paged_prefill_attention"}  # puzzles.decode_part, prefill_part

    welcome = nbformat.read(EXERCISES.parent / "notebooks" / "00_welcome.ipynb", as_version=4)
    (table,) = [c.source for c in welcome.cells if c.source.startswith("## The course map")]
    rows = [
        [col.strip() for col in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith("| 0") or line.startswith("| 1")
    ]
    graded = [row for row in rows if row[2] != "—"]
    assert len(graded) == len(rows) == 15, [
        row[0] for row in rows if row not in graded
    ]  # every chapter has one (09 in two parts), and the last rung after chapter 13 its own row
    seen_parts = set()
    for chapter, _, you_write, runs_as, _ in graded:
        tags = re.findall(r"\((ex\d\d[a-z]?) · ([^)]*)\)", you_write)  # "... (ex05 · 40 min · ★★☆☆☆ steady); ..."
        assert all(label == EXERCISE_TABLE[ex].label for ex, label in tags), (chapter, tags)
        exercises = [ex for ex, _ in tags]
        assert exercises and all(ex[:4] == "ex" + chapter[:2] for ex in exercises), (chapter, you_write)
        for ex, names in zip(exercises, re.split(r"\(ex\d\d[a-z]? · [^)]*\)", you_write)):  # the names before each tag
            (starter,) = EXERCISES.glob(f"{ex}_*.ipynb")
            stubs = "\n".join(
                c.source
                for c in nbformat.read(starter, as_version=4).cells
                if c.cell_type == "code" and "raise NotImplementedError  # YOUR CODE HERE" in c.source
            )
            for name in re.findall(r"`(\w+)`", names):
                assert re.search(rf"(def {name}\(|class {name}\b)", stubs), f"{starter.name} has no stub {name}"
        for part in re.findall(r"`(\w+)`", runs_as):
            # a part of the row's exercise, or one the Triton puzzles (ex05d) plug in through puzzles.*_part
            assert PARTS[part].exercise in exercises or (part in ENGINE_PARTS and "ex05d" in exercises), (part, chapter)
            seen_parts.add(part)
    assert seen_parts == set(PARTS)


# ---- exercise 05b on a GPU: the learner's wrapper gets tensors on the kernel's device --------------------------------
def test_ex05b_hands_the_wrapper_every_tensor_on_the_kernel_device(monkeypatch, capsys):
    """On a GPU (``kernel_device()`` says cuda) every tensor a check passes is there, views kept as views (a fused
    qkv slice, a heads-major cache); the meta device stands in for cuda here. The reference runs on the CPU."""
    import torch

    from minipaged.classroom.grading import ex05b
    from minipaged.kernels import launch

    monkeypatch.setattr(launch, "kernel_device", lambda: torch.device("meta"))
    seen: list[tuple[torch.Tensor, ...]] = []

    def wrapper(key, value, key_cache, value_cache, slot_mapping):
        seen.append((key, value, key_cache, value_cache, slot_mapping))
        raise RuntimeError("stop")  # a meta tensor has no data to launch with

    ex05b.check_scatter_write(wrapper)
    ex05b.check_scatter_edges(wrapper)
    cases = ex05b._write_cases() + ex05b._edge_cases()
    assert len(seen) == len(cases) == 14
    for case, tensors in zip(cases, seen):
        assert [t.device.type for t in tensors] == ["meta"] * 5, case.label
        key, _, key_cache, _, slots = tensors
        assert slots.dtype == case.slot_dtype and key.dtype == case.dtype
        if case.fused_q_heads:
            assert key.stride(0) == (case.fused_q_heads + 2 * case.num_kv_heads) * case.head_dim
        if case.heads_major_cache:
            assert key_cache.stride(1) == case.head_dim and key_cache.stride(2) == case.block_size * case.head_dim
    assert "RuntimeError: stop" in capsys.readouterr().out


def test_ex05b_reports_a_cpu_tensor_at_a_compiled_kernel_as_such_without_hints(capsys):
    """Triton's compiled launcher refuses a CPU tensor; that is said, not followed by hints about padding or
    strides that would send a learner with a right kernel looking for a bug."""
    from minipaged.classroom.grading import ex05b
    from minipaged.kernels.launch import DEVICE_PROBLEM

    def wrapper(*args):
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    outcomes = ex05b.check_scatter_edges(wrapper)
    assert outcomes and all(not o.passed and o.got.startswith(DEVICE_PROBLEM) for o in outcomes)
    printed = capsys.readouterr().out
    assert "hint" not in printed and ex05b._HINT_EDGES not in printed


def test_kernel_device_is_cuda_only_where_kernels_compile(monkeypatch):
    import torch

    from minipaged.kernels.launch import kernel_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel_device() == torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert kernel_device() == torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernel_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernel_device() == torch.device("cpu")
