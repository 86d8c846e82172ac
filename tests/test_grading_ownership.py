"""An answer that runs the package's implementation, at any depth, is not the learner's own (issue 55): the
grader's worker finds code that was not compiled from the notebook's cells (an assignment, a copied method, a
subclass, the solution ``exec``'d) and, while the checks run, a call into the implementation the exercise is
about made from the notebook's code (a wrapper, a delegate held in a tuple). The solutions pass: ``make grade
DIR=exercises/solutions`` scores full marks with these checks on."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch

from minipaged.classroom.grading import grade_notebook
from minipaged.classroom.grading.ownership import Tracer, foreign_code, targets
from minipaged.classroom.grading.runner import CHECK_MARK

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "exercises" / "solutions"
pytestmark = pytest.mark.slow  # each grades a notebook in a worker process: about 4 minutes on 2 cores (make test-slow)


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
    rows = _grade(tmp_path, "ex05_paged_decode.ipynb", [wrapper])
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


def test_only_the_grader_may_exempt_components_from_the_tracer():
    """Exercise 10's guided track hands the learner's loop the package's components on purpose: the grader exempts
    them for that group. Code of the notebook (a frame of its cells below the call) cannot."""
    from minipaged.classroom.grading import ownership
    from minipaged.core.block_pool import BlockPool

    ns: dict = {}
    exec(compile("def look_away(exempt):\n    exempt(['minipaged.core.block_pool:BlockPool'])\n\n"
                 "def use():\n    BlockPool(4).get_new_blocks(1)", "<ex10_your_engine.ipynb cell 3>", "exec"),
         {**ns, "BlockPool": BlockPool}, ns)  # fmt: skip
    with Tracer(targets(["minipaged.core.block_pool:BlockPool"]), "ex10_your_engine.ipynb") as t:
        assert ownership.Tracer.active is t
        with pytest.raises(PermissionError, match="look away"):
            ns["look_away"](ownership.exempt)
        ns["use"]()
    assert t.found and "BlockPool" in t.found and ownership.Tracer.active is None
    with Tracer(targets(["minipaged.core.block_pool:BlockPool"]), "ex10_your_engine.ipynb") as t:
        ownership.exempt(["minipaged.core.block_pool:BlockPool"])  # the grader's own call
        ns["use"]()
    assert t.found is None
    ownership.exempt(["minipaged.core.block_pool:BlockPool"])  # no tracer watching (a check cell in Jupyter): nothing


# ---- every build-track exercise: its graded functions as thin wrappers around the package's own ----------------------
# Each wrapper is a function of the notebook's cells (foreign_code passes it) that calls the package's
# implementation of what the exercise asks for, or the grading module's reference: only the Tracer can find it. The
# solution's cells run first; the wrapper cell redefines the graded functions after them. The plain solutions' full
# marks are proved by test_grading_integrity.py::test_every_solution_scores_full_through_the_grader (every solution
# through the grader, ownership checks on); here a group the wrappers leave alone keeps the solution's full marks.
WRAPPERS: dict[str, tuple[str, set[str]]] = {
    "ex01_kv_bytes.ipynb": (
        "from minipaged.classroom.grading import ex01 as grading\n"
        "from minipaged.kv_math import KVSpec\n\n"
        "def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):\n"
        "    return KVSpec(num_layers, num_kv_heads, head_dim, dtype_bytes).bytes_per_token\n\n"
        "def block_capacity(budget_bytes, bytes_per_token, block_size, request_tokens):\n"
        "    return grading._capacity(budget_bytes, bytes_per_token, block_size, request_tokens)",
        {"bytes_per_token", "block_capacity"},
    ),
    "ex02_fragmentation.ipynb": (
        "from minipaged.lab.contiguous import ContiguousAllocator\n"
        "from minipaged.classroom.grading import ex02 as grading\n\n"
        "def arena_of(num_slots, reservations):\n"
        "    arena, position, gaps = ContiguousAllocator(num_slots), 0, []\n"
        "    for start, length in sorted(reservations.values()):  # a fresh arena fills first fit, left to right\n"
        "        if start > position:\n"
        "            gaps.append(f'gap{position}')\n"
        "            arena.allocate(gaps[-1], start - position)\n"
        "        arena.allocate(f'at{start}', length)\n"
        "        position = start + length\n"
        "    for gap in gaps:\n"
        "        arena.free(gap)  # the package's coalescing finds the holes\n"
        "    return arena\n\n"
        "def free_extents(num_slots, reservations):\n"
        "    return list(arena_of(num_slots, reservations).free_extents)\n\n"
        "def fragmentation(num_slots, reservations, live_tokens, next_request_size):\n"
        "    return grading._expected(arena_of(num_slots, reservations), live_tokens, next_request_size)",
        {"free_extents", "fragmentation"},
    ),
    "ex03_free_queue.ipynb": (
        "from minipaged.core.block_pool import FreeKVCacheBlockQueue\n\n"
        "def remove(queue, block):\n"
        "    if block.prev_free_block is None or block.next_free_block is None:\n"
        "        raise ValueError('not in the queue')\n"
        "    FreeKVCacheBlockQueue._unlink(queue, block)  # the base class's: the checks' queue guards its own",
        {"remove_links", "remove_is_O1", "remove_in_pool"},
    ),
    "ex04_slots_and_admission.ipynb": (
        "from minipaged.worker.block_table import slot_mapping as package_slots\n\n"
        "def slot_mapping(block_tables, positions, block_size, pad_to=None):\n"
        "    return package_slots(block_tables, positions, block_size, pad_to=pad_to).tolist()\n\n"
        "def would_allocate(manager, request, num_new_tokens):\n"
        "    return manager.can_allocate(request, num_new_tokens)  # the manager's own answer, one method away",
        {"slot_mapping", "would_allocate"},
    ),
    "ex05b_scatter_write.ipynb": (
        "from minipaged.kernels.cache_write import reshape_and_cache as package_write\n\n"
        "def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):\n"
        "    package_write(key, value, key_cache, value_cache, slot_mapping)  # a Triton kernel runs: the package's",
        {"scatter_write", "scatter_edges"},
    ),
    "ex06_admission.ipynb": (
        "from minipaged.core.scheduler import admit_waiting as package_admit\n\n"
        "def admit_waiting(waiting, kv, token_budget, free_seats):\n"
        "    return package_admit(waiting, kv, token_budget, free_seats)",
        {"admit_waiting", "admission_state"},
    ),
    "ex07_preemption.ipynb": (
        "from minipaged.core.scheduler import preempt_recompute as package_preempt, schedule_running as package_running\n\n"
        "def preempt_recompute(victim, kv, waiting):\n"
        "    package_preempt(victim, kv, waiting)\n\n"
        "def schedule_running(running, waiting, kv, token_budget, preempt):\n"
        "    return package_running(running, waiting, kv, token_budget, preempt)",
        {"preempt_recompute", "schedule_running"},
    ),
    "ex08_prefix_hashing.ipynb": (
        "from minipaged.core.block_pool import chain_block_hashes as package_chain\n"
        "from minipaged.core.block_pool import free_blocks as package_free, get_new_blocks as package_get\n"
        "from minipaged.kv_cache_manager import find_prefix_hits as package_hits\n\n"
        "def chain_block_hashes(token_ids, block_size, cache_salt=None):\n"
        "    return package_chain(token_ids, block_size, cache_salt)\n\n"
        "def find_prefix_hits(pool, block_hashes, num_tokens, block_size):\n"
        "    return package_hits(pool, block_hashes, num_tokens, block_size)\n\n"
        "def free_blocks(pool, ordered_blocks):\n"
        "    package_free(pool, ordered_blocks)\n\n"
        "def get_new_blocks(pool, num_blocks):\n"
        "    return package_get(pool, num_blocks)",
        {"chain_block_hashes", "find_prefix_hits", "free_blocks", "get_new_blocks"},
    ),
    "ex09_step_inputs.ipynb": (
        "from minipaged.worker.step_inputs import step_inputs as package_inputs\n\n"
        "def step_inputs(scheduled):\n"
        "    return package_inputs(scheduled)",
        {"step_inputs"},
    ),
    "ex11_streaming.ipynb": (
        "from types import SimpleNamespace\n"
        "from minipaged.serving import serving_completion, serving_engine\n\n"
        "async def merged(engine, prompts, params, base_id):\n"
        "    async with aclosing(serving_engine.merged(engine, prompts, params, base_id)) as outputs:\n"
        "        async for item in outputs:\n"
        "            yield item\n\n"
        "async def completion_events(engine, prompts, params, head):\n"
        "    req = SimpleNamespace(n=params[0].n if params else 1, include_usage=False)\n"
        "    async with aclosing(serving_completion._stream(req, engine, prompts, params, head['id'], head)) as events:\n"
        "        async for event in events:\n"
        "            yield event\n\n"
        "async def unless_disconnected(receive, work):\n"
        "    return await serving_engine.unless_disconnected(SimpleNamespace(receive=receive), work)",
        {"merged", "events", "disconnect", "served"},
    ),
    "ex12_tensor_parallel_mlp.ipynb": (
        "from minipaged.classroom.grading import ex12 as grading\n\n"
        "def all_reduce(tensors, send):\n"
        "    return grading.sum_all_reduce(tensors, send)\n\n"
        "def shard_mlp(weights, rank, world_size):\n"
        "    return grading.reference_shard(weights, rank, world_size)\n\n"
        "def mlp_partial(x, shard):\n"
        "    return grading.reference_partial(x, shard)",
        {"ring", "shards", "partial", "tp_mlp"},
    ),
}
# ex05c: Triton kernels. The solution's cells draw traces and compile every kernel for two GPUs, so only its imports
# run here, and one kernel: the package's scatter kernel called from a @triton.jit function of the notebook.
PUZZLES = "ex05c_triton_puzzles.ipynb"
PUZZLE_WRAPPER = (
    "from minipaged.kernels.cache_write import _reshape_and_cache_kernel\n\n"
    "@triton.jit\n"
    "def scatter_kernel(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):\n"
    "    # one head: K and V are the same rows, written to the same cache\n"
    "    _reshape_and_cache_kernel(key, key, cache, cache, slot_mapping, HEAD_DIM, HEAD_DIM, HEAD_DIM, HEAD_DIM,\n"
    "                              BLOCK_SIZE * HEAD_DIM, HEAD_DIM, HEAD_DIM, BLOCK_SIZE * HEAD_DIM, HEAD_DIM, HEAD_DIM,\n"
    "                              1, HEAD_DIM, 1, HEAD_DIM, BLOCK_SIZE)"
)


def _total(name: str, group: str) -> int:
    from minipaged.classroom.grading.exercises import exercise_for

    return next(g.total for g in exercise_for(name).groups if g.name == group)


@pytest.mark.parametrize("name", list(WRAPPERS), ids=[n.split("_")[0] for n in WRAPPERS])
def test_a_wrapper_around_the_package_scores_nothing(tmp_path, name):
    code, wrapped = WRAPPERS[name]
    rows = _grade(tmp_path, name, [*_cells(name), code])
    delegated = {g: r[:2] for g, r in rows.items() if g in wrapped}
    assert delegated == {g: (0, "runs the package's implementation") for g in wrapped}, rows
    assert all(rows[g][2].startswith("this exercise is to write it, and your ") for g in wrapped), rows
    kept = {g: r[0] for g, r in rows.items() if g not in wrapped}
    assert kept == {g: _total(name, g) for g in kept}, rows  # the solution's own functions keep full marks


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a compiled kernel's callees run as GPU code: no Python call to see"
)
def test_a_triton_kernel_calling_the_packages_kernel_scores_nothing(tmp_path):
    imports = next(c for c in _cells(PUZZLES) if "import triton" in c)
    rows = _grade(tmp_path, PUZZLES, [imports.split("\nprint(")[0], PUZZLE_WRAPPER])
    assert rows["scatter"][:2] == (0, "runs the package's implementation"), rows
    # Triton's interpreter compiles the called kernel afresh, from its file: the first code of cache_write.py to run
    assert "your scatter_kernel" in rows["scatter"][2] and "of minipaged/kernels/cache_write.py" in rows["scatter"][2]


def _defined(found: object, module: str, name: str) -> bool:
    """``name`` (``Class`` or ``Class.method``) is defined in ``module`` itself."""
    top, _, method = name.partition(".")
    obj = getattr(found, top, None)
    if getattr(obj, "__module__", "") != module:
        return False
    return not method or callable(vars(obj).get(method))


def test_every_own_entry_names_code_that_exists():
    """A misspelt module or name in ``Group.own`` would switch its check off without a word: each must be found."""
    import importlib

    from minipaged.classroom.grading.exercises import EXERCISES

    for exercise in EXERCISES.values():
        for group in exercise.groups:
            assert len(targets(group.own)) == len(group.own), (exercise.key, group.name)
            for entry in group.own:
                module, _, names = entry.partition(":")
                found = importlib.import_module(module)
                # defined there: the tracer knows code by the file it was compiled from, not by where it is imported
                missing = [n for n in names.split(",") if names and not _defined(found, module, n)]
                assert not missing, f"{exercise.key} {group.name}: {module} defines no {missing}"
