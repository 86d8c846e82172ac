"""An answer that runs the package's implementation, at any depth, is not the learner's own (issue 55): the
grader's worker finds code that was not compiled from the notebook's cells (an assignment, a copied method, a
subclass, the solution ``exec``'d) and, while the checks run, a call into the implementation the exercise is
about made from the notebook's code (a wrapper, a delegate held in a tuple). The solutions pass: ``make grade
DIR=exercises/solutions`` scores full marks with these checks on."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from minipaged.classroom.grading import grade_notebook
from minipaged.classroom.grading.ownership import Tracer, foreign_code, targets
from minipaged.classroom.grading.runner import CHECK_MARK

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
pytestmark = pytest.mark.slow  # each grades a notebook in a worker process: about 40 s in all (make test-slow)


def _cells(name: str) -> list[str]:
    nb = nbformat.read(SOLUTIONS / name, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code" and CHECK_MARK not in c.source]


def _grade(tmp_path: Path, name: str, cells: list[str]) -> dict[str, tuple[int, str, str]]:
    path = tmp_path / name
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return {r.group: (r.passed, r.note, r.detail) for r in grade_notebook(path, timeout=300)}


POOL = "ex03b_block_pool.ipynb"
PACKAGE_POOL = "from minipaged.core.block_pool import BlockPool as PackagePool, KVCacheBlock\n"
CHEATS = {
    "a subclass of the package's BlockPool": PACKAGE_POOL + "class BlockPool(PackagePool):\n    pass",
    "the package's methods copied onto a class of the notebook": PACKAGE_POOL
    + (
        "class BlockPool:\n"
        "    __init__ = PackagePool.__init__\n"
        "    get_num_free_blocks = PackagePool.get_num_free_blocks\n"
        "    get_new_blocks = PackagePool.get_new_blocks\n"
        "    free_blocks = PackagePool.free_blocks\n"
        "    touch = PackagePool.touch\n"
        "    cache_full_blocks = PackagePool.cache_full_blocks\n"
        "    get_cached_block = PackagePool.get_cached_block"
    ),
    "the solution notebook exec'd": (
        "import json\n"
        f"for c in json.load(open({str(SOLUTIONS / POOL)!r}))['cells']:\n"
        "    if c['cell_type'] == 'code' and '.check_' not in ''.join(c['source']):  # its code, not its checks\n"
        "        exec(''.join(c['source']))"
    ),
}
DELEGATE = (
    PACKAGE_POOL
    + '''
class BlockPool:
    """Every call forwarded to the package's pool, held in a tuple: no name of the package's is kept."""

    def __init__(self, num_blocks, enable_caching=True):
        self._held = (PackagePool(num_blocks, enable_caching),)
        self.blocks, self.null_block = self._held[0].blocks, self._held[0].null_block

    def get_num_free_blocks(self):
        return self._held[0].get_num_free_blocks()

    def get_new_blocks(self, n):
        return self._held[0].get_new_blocks(n)

    def free_blocks(self, blocks):
        self._held[0].free_blocks(blocks)

    def touch(self, blocks):
        self._held[0].touch(blocks)

    def cache_full_blocks(self, *args):
        self._held[0].cache_full_blocks(*args)

    def get_cached_block(self, h):
        return self._held[0].get_cached_block(h)
'''
)


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_code_that_is_not_the_notebooks_scores_nothing(tmp_path, cheat):
    rows = _grade(tmp_path, POOL, [CHEATS[cheat]])
    assert all(passed == 0 and note == "not code of this notebook" for passed, note, _ in rows.values()), rows
    assert "BlockPool" in rows["pool_spec"][2]


def test_a_delegate_held_in_a_tuple_is_found_running_the_package(tmp_path):
    rows = _grade(tmp_path, POOL, [DELEGATE])
    assert all(passed == 0 and note == "runs the package's implementation" for passed, note, _ in rows.values())
    assert "runs BlockPool." in rows["pool_spec"][2]


def test_a_wrapper_around_the_reference_is_found(tmp_path):
    wrapper = (
        "from minipaged.kernels import reference\n\n"
        "def paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale):\n"
        "    out = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)\n"
        "    return out"
    )
    rows = _grade(tmp_path, "ex05a_paged_decode.ipynb", [wrapper])
    assert rows["paged_decode"][:2] == (0, "runs the package's implementation")
    assert "paged_decode_attention of minipaged/kernels/reference.py" in rows["paged_decode"][2]


def test_the_solution_is_its_own(tmp_path):
    assert {g: p for g, (p, _, _) in _grade(tmp_path, POOL, _cells(POOL)).items()} == {
        "pool_spec": 12, "pool_twin": 4, "pool_O1": 5,
    }  # fmt: skip


def test_a_dataclass_of_the_notebook_is_its_own_and_the_tracer_sees_only_notebook_frames():
    ns: dict = {}
    exec(compile("from dataclasses import dataclass\n@dataclass\nclass P:\n    x: int = 0\n    def f(self):\n"
                 "        return self.x", "<ex03b_block_pool.ipynb cell 1>", "exec"), ns)  # fmt: skip
    assert foreign_code(ns["P"], "ex03b_block_pool.ipynb") is None
    exec(compile("def g():\n    return 1", "<string>", "exec"), ns)  # exec'd code is not the notebook's
    assert "comes from" in foreign_code(ns["g"], "ex03b_block_pool.ipynb")
    from minipaged.core.block_pool import BlockPool

    with Tracer(targets(["minipaged.core.block_pool:BlockPool"]), "ex03b_block_pool.ipynb") as t:
        BlockPool(4).get_new_blocks(1)  # the grader's own call: no notebook frame below it
    assert t.found is None
