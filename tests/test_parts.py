"""Learner's parts in the real engine (minipaged.parts): right ones change nothing, wrong ones are named.

The right parts are the solution notebooks' own functions; the wrong ones are the mutants of
``tests/mutants`` (each a mistake a learner makes), run in a tiny Llama with prefix caching on and a
pool small enough to preempt, so that every part has work. A few mutants are invisible to the
engine by design (``INVISIBLE``, each with the reason); the exercise's checks catch those.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minipaged import LLM, SamplingParams
from minipaged.classroom import parts
from minipaged.classroom.grading import capstone
from minipaged.classroom.parts import PARTS, PartError

sys.path.insert(0, str(Path(__file__).parent))
import mutants
from conftest import save_tiny_llama

SOLUTIONS = Path(__file__).resolve().parents[1] / "exercises" / "solutions"
SHARED = list(range(1, 13))  # a 12-token prefix every prompt starts with: 3 blocks of 4
LONG = SHARED + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
# A long head of the queue, a block-aligned fully cached prompt, a prompt one token past the cached blocks,
# a repeat, and two more: with a 16-token budget, 3 seats and 11 blocks, prompts are chunked, the head
# blocks the queue, requests are preempted and readmitted, and every part has its edge cases to meet.
PROMPTS = [
    LONG,
    list(SHARED),
    SHARED + [30],
    list(range(60, 78)),
    list(LONG),
    SHARED + [31, 32, 33, 34, 35],
    SHARED + [36] * 9,
]
GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
FUNCTION_TO_PART = {fn: part for part, fn in capstone.FUNCTION_NAMES.items()}

# Mutants whose mistake never shows in how the engine calls the part; their exercise's checks catch them.
INVISIBLE = {
    "ex03-no_guard": "raises the wrong error for a block that is not free: the engine never asks that",
    "ex03-walks_the_list": "right answer, O(n) time: check_remove_is_O1 catches it",
    "ex04-pads_with_zero": "the engine never pads the slot mapping (pad_to=None)",
    "ex04-ignores_reserved": "the engine reserves no blocks (reserved_blocks=0)",
    "ex05b-writes_padding": "the engine's slot mapping has no padding slots (-1)",
    "ex05b-shape_addresses": "the engine's new K/V rows and its caches are contiguous: strides are what shapes give",
    "ex05b-flat_slot_index": "the engine's caches are contiguous: slot x slot stride is block x block stride + offset",
    "ex08-salts_every_block": "LLM sets no cache salt",
    "ex08-ignores_salt": "LLM sets no cache salt",
    "ex08-skips_misses": "a chain of cached blocks never has a gap in the engine: a block is freed no later "
    "than its prefix (fewer owners; tail first in one request), so it is evicted first",
    "ex05-ignores_scale": "the engine's scale is head_dim ** -0.5, the very value this mutant assumes",
    "ex05-no_float32": "in a float32 engine there is nothing to upcast",
    "ex05-whole_table_row": "the engine fills the null block with finite numbers, so reading it is harmless here",
}

# Invisible in the engine's calls, caught by the probes that ``use(check=True)`` runs first.
PROBED = {
    "ex04-ignores_reserved",
    "ex05b-shape_addresses",
    "ex08-salts_every_block",
    "ex08-ignores_salt",
    "ex08-skips_misses",
    "ex05-ignores_scale",
    "ex05-no_float32",
}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny random Llama with 3 KV heads (like SmolLM2: not a power of two) shared by 6 query heads."""
    return save_tiny_llama(
        tmp_path_factory.mktemp("gqa"),
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=96,
        intermediate_size=128,
    )


def engine(model) -> LLM:
    return LLM(
        model,
        block_size=4,
        num_gpu_blocks_override=11,
        max_model_len=40,
        max_num_batched_tokens=8,
        max_num_seqs=3,
        enable_prefix_caching=True,
        watermark=0.1,
        dtype="float32",
    )


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(gqa_model):
    return engine(gqa_model)


@pytest.fixture(scope="module")
def expected(llm):
    llm.reset()
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions > 0 and llm.kv_cache_manager.prefix_cache_hits > 0
    return token_ids(outs)


@pytest.fixture(scope="module")
def solution_parts():
    mine = capstone.load_exercises(SOLUTIONS)
    assert not any(ns.errors for ns in mine.values())
    return capstone.guided_parts(mine)


def run(llm, plugged, check=True):
    llm.reset()
    with parts.use(check=check, **plugged) as wrappers:
        outs = llm.generate(PROMPTS, GREEDY)
    return token_ids(outs), {n: w.calls for n, w in wrappers.items()}


def test_all_solution_parts_together_give_the_package_output_and_all_are_called(llm, expected, solution_parts):
    got, calls = run(llm, solution_parts)
    assert got == expected
    assert all(n > 0 for n in calls.values()), calls
    assert not parts._plugged, "use() must restore the package's pieces"


@pytest.mark.parametrize("exercise", capstone.EXERCISES)
def test_each_exercise_alone_gives_the_package_output(llm, expected, solution_parts, exercise):
    alone = {n: fn for n, fn in solution_parts.items() if PARTS[n].exercise == exercise}
    got, calls = run(llm, alone, check=False)
    assert got == expected
    assert all(n > 0 for n in calls.values()), calls


ENGINE_MUTANTS = [m for m in mutants.all_mutants() if m.exercise in capstone.EXERCISES]


@pytest.mark.parametrize("m", ENGINE_MUTANTS, ids=lambda m: f"{m.exercise}-{m.name}")
def test_a_wrong_part_is_caught_and_named(llm, expected, solution_parts, m, monkeypatch):
    """Checked, every mutant but the invisible ones is caught: by a probe when the block is entered (most), or in
    the engine's own calls. With probes off, the engine's calls alone catch every mutant the engine can show."""
    name = FUNCTION_TO_PART.get(m.target, m.target)
    helpers = mutants.module(m.exercise).HELPERS
    # the exercise's other part (the solution's, or the mutants' own correct helper) and the mutant
    plugged = {n: helpers.get(n, fn) for n, fn in solution_parts.items() if PARTS[n].exercise == m.exercise}
    plugged[name] = m.fn
    key = f"{m.exercise}-{m.name}"
    for probes in (True, False):
        monkeypatch.setattr(parts, "_PROBES", probes)
        if key in INVISIBLE and (not probes or key not in PROBED):
            got, _ = run(llm, plugged)
            assert got == expected, f"{key} is listed as invisible to the engine, but it changed the output"
            continue
        with pytest.raises(PartError) as caught:
            run(llm, plugged)
        err = caught.value
        assert err.part == name and f"part {name!r} (exercise {m.exercise[2:]})" in str(err), str(err)
        if err.probe is not None:
            assert probes and f"on probe {err.probe!r}" in str(err) and err.step is None, str(err)
        else:
            assert err.step is not None and err.call >= 1 and f"on call {err.call}" in str(err), str(err)
        assert llm.scheduler.requests == {} and not llm.scheduler.waiting and not llm.scheduler.running


def test_unchecked_a_wrong_part_changes_the_output(llm, expected, solution_parts):
    wrong = next(m for m in ENGINE_MUTANTS if m.name == "gqa_modulo")
    got, _ = run(llm, {"paged_decode_attention": wrong.fn}, check=False)
    assert got != expected


def test_use_refuses_unknown_parts_and_wrong_signatures():
    with pytest.raises(ValueError, match="unknown part"):
        with parts.use(slot_mapings=lambda *a: None):
            pass
    with pytest.raises(TypeError, match="'slot_mapping' must take 4 arguments"):
        with parts.use(slot_mapping=lambda tables, positions: []):
            pass
    with pytest.raises(TypeError, match="must be a function"):
        with parts.use(slot_mapping=3):
            pass
    assert not parts._plugged


def test_a_part_that_raises_or_returns_the_wrong_kind_is_named(llm):
    def broken(*args):
        raise KeyError("oops")

    for fn, message in (
        (broken, "raised KeyError"),
        (lambda *a: "slots", "expected a list of slot numbers"),
        (lambda t, p, bs, pad=None: [0], "returned 1 slots for"),
    ):
        llm.reset()
        with pytest.raises(PartError, match=message) as caught:
            with parts.use(check=False, slot_mapping=fn):
                llm.generate(PROMPTS, GREEDY)
        assert "part 'slot_mapping' (exercise 04)" in str(caught.value)
        assert llm.scheduler.requests == {}


def test_nested_use_restores_the_outer_parts(solution_parts):
    with parts.use(slot_mapping=solution_parts["slot_mapping"]) as outer:
        with parts.use(
            check=False,
            slot_mapping=solution_parts["slot_mapping"],
            find_prefix_hits=solution_parts["find_prefix_hits"],
        ):
            assert parts.plugged("find_prefix_hits") is not None
        assert parts.plugged("slot_mapping") is outer["slot_mapping"]
        assert parts.plugged("find_prefix_hits") is None
    assert parts.plugged("slot_mapping") is None


# ---- issue 24, item 3: checks by meaning, everything a part must leave alone, probes on telling shapes ---------
import numpy as np  # noqa: E402
import torch  # noqa: E402

from minipaged.core.kv_cache_manager import find_prefix_hits  # noqa: E402
from minipaged.kernels import reference  # noqa: E402
from minipaged.worker.block_table import slot_mapping as package_slot_mapping  # noqa: E402


def newest_duplicate_hits(pool, block_hashes, num_tokens, block_size):
    """Right: of several blocks cached under one hash, the newest (vLLM keeps duplicates too)."""
    hits = []
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        same = pool.cached_block_hash_to_block.get(h)
        if not same:
            break
        hits.append(list(same)[-1])
    return hits


def numpy_slots(block_tables, positions, block_size, pad_to=None):
    return np.array(package_slot_mapping(block_tables, positions, block_size, pad_to).tolist())


def numpy_bool(manager, request, num_new_tokens):
    return np.bool_(manager.can_allocate(request, num_new_tokens))


def float64_decode(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Right, computed in float64 and returned as float64 (the engine casts it back)."""
    num_seqs, num_heads, d = query.shape
    bs, num_kv = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(num_seqs, num_heads, d, dtype=torch.float64)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // bs)].long()
        k = key_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(num_heads // num_kv, dim=1)
        v = value_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(num_heads // num_kv, dim=1)
        w = (torch.einsum("hd,thd->ht", query[i].double(), k) * scale).softmax(-1)
        out[i] = torch.einsum("ht,thd->hd", w, v)
    return out


def test_right_answers_written_differently_are_accepted(llm, expected):
    got, calls = run(
        llm,
        {
            "find_prefix_hits": newest_duplicate_hits,
            "slot_mapping": numpy_slots,
            "would_allocate": numpy_bool,
            "paged_decode_attention": float64_decode,
        },
    )
    assert got == expected and all(n > 0 for n in calls.values()), calls
    # the duplicate case itself: the probes hold a hash cached under two blocks, and the newest one is right
    _label, args = next(p for p in parts._hit_probes() if "twice" in p[0])
    assert newest_duplicate_hits(*args) != find_prefix_hits(*args)


def clears_hash(queue, block):
    """Unlinks right, then also forgets the block's hash."""
    prev, nxt = block.prev_free_block, block.next_free_block
    prev.next_free_block, nxt.prev_free_block = nxt, prev
    block.prev_free_block = block.next_free_block = None
    queue.num_free_blocks -= 1
    block.reset_hash()  # MISTAKE: a cached block keeps its hash while it is used


def borrows_blocks(manager, request, num_new_tokens):
    """Answers right, but takes blocks from the pool (and evicts what they cached) while it answers."""
    pool = manager.block_pool
    n = min(2, pool.get_num_free_blocks())
    pool.free_blocks(pool.get_new_blocks(n))  # MISTAKE: the free queue's order and the evicted hashes change
    return manager.can_allocate(request, num_new_tokens)


def gqa_by_num_kv_heads(query, key_cache, value_cache, block_tables, seq_lens, scale):
    """Query head h reads KV head h // num_kv_heads: the same as h // (9 // 3) on SmolLM2, wrong elsewhere."""
    num_seqs, num_heads, _ = query.shape
    bs, num_kv = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // bs)].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float()
        v = value_cache[blocks].flatten(0, 1)[:n].float()
        for h in range(num_heads):
            kv = min(h // num_kv, num_kv - 1)  # MISTAKE: should be h // (num_heads // num_kv)
            w = (k[:, kv] @ query[i, h].float() * scale).softmax(0)
            out[i, h] = (w @ v[:, kv]).to(query.dtype)
    return out


def last_table_block_for_decodes(block_tables, positions, block_size, pad_to=None):
    """Right for prefills; a decode in a part-full block goes to the table's last block (true in SmolLM2's
    engine, whose tables have no spare column)."""
    out = []
    for table, pos in zip(block_tables, positions):
        table = list(table)
        for p in pos:
            block = table[-1] if len(pos) == 1 and p % block_size else table[p // block_size]  # MISTAKE
            out.append(block * block_size + p % block_size)
    return out


@pytest.mark.parametrize(
    "name, fn, where",
    [
        ("free_queue_remove", clears_hash, "hash was cleared"),
        ("would_allocate", borrows_blocks, "it changed the pool"),
        ("paged_decode_attention", gqa_by_num_kv_heads, "8 query heads over 2 KV heads"),
        ("slot_mapping", last_table_block_for_decodes, "not the table's last"),
    ],
)
def test_mistakes_that_smollm2_hides_are_named(llm, name, fn, where, monkeypatch):
    with pytest.raises(PartError) as caught:
        run(llm, {name: fn})
    err = caught.value
    assert err.part == name and err.probe and where in str(err), str(err)
    if name in ("free_queue_remove", "would_allocate"):  # and the engine's own calls catch them too
        monkeypatch.setattr(parts, "_PROBES", False)
        with pytest.raises(PartError) as caught:
            run(llm, {name: fn})
        assert caught.value.call >= 1 and caught.value.step is not None, str(caught.value)
        assert f"part {name!r}" in str(caught.value) and "on call" in str(caught.value)


# ---- issue 24, item 5: a faulty part leaves the engine as a fresh one ------------------------------------------
def pool_is_sound(llm) -> None:
    """Between runs: every block free with ref count 0, the free queue walks to its count, the cache map agrees."""
    pool = llm.kv_cache_manager.block_pool
    q = pool.free_block_queue
    walked, b = [], q.fake_free_list_head.next_free_block
    while b is not q.fake_free_list_tail:
        walked.append(b.block_id)
        assert b.next_free_block.prev_free_block is b
        b = b.next_free_block
    assert len(walked) == q.num_free_blocks == pool.num_blocks - 1 and sorted(walked) == list(range(1, pool.num_blocks))
    assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:])
    for h, same in pool.cached_block_hash_to_block.items():
        assert all(blk.block_hash == h for blk in same.values())
    assert llm.kv_cache_manager.req_to_blocks == {} and not llm.scheduler.requests


def unlink_then_typo(queue, block):
    prev, nxt = block.prev_free_block, block.next_free_block
    prev.next_free_block, nxt.prev_free_block = nxt, prev
    block.prev_free_block = block.next_free_block = None
    raise NameError("name 'num_fre_blocks' is not defined")  # the typo, one line before the count


def forgets_count(queue, block):
    prev, nxt = block.prev_free_block, block.next_free_block
    prev.next_free_block, nxt.prev_free_block = nxt, prev
    block.prev_free_block = block.next_free_block = None


def raises_on_second_call():
    calls = []

    def remove(queue, block):
        calls.append(block.block_id)
        if len(calls) == 2:
            raise RuntimeError("second call")
        queue.remove(block)

    return remove


def writes_one_slot_early(key, value, key_cache, value_cache, slot_mapping):
    reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping - 1)


@pytest.mark.parametrize(
    "case",
    [
        "unlink_then_typo",
        "forgets_count",
        "raises_on_second_call",
        "writes_one_slot_early",
        "writes_one_slot_early_unchecked",
    ],
)
def test_after_a_faulty_part_the_same_llm_gives_a_fresh_engines_tokens(llm, expected, case, monkeypatch):
    monkeypatch.setattr(parts, "_PROBES", False)  # the faults must reach the engine's own calls
    fn = {
        "unlink_then_typo": unlink_then_typo,
        "forgets_count": forgets_count,
        "raises_on_second_call": raises_on_second_call(),
        "writes_one_slot_early": writes_one_slot_early,
        "writes_one_slot_early_unchecked": writes_one_slot_early,
    }[case]
    name = "reshape_and_cache" if case.startswith("writes") else "free_queue_remove"
    check = not case.endswith("unchecked")
    llm.reset()
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected  # the prefix cache now holds the prompts
    caches = [(k.clone(), v.clone()) for k, v in llm.cache.gpu_cache]
    if check:
        with pytest.raises(PartError) as caught:
            with parts.use(check=True, **{name: fn}):
                llm.generate(PROMPTS, GREEDY)
        assert caught.value.part == name and caught.value.step is not None
        if name == "reshape_and_cache":  # verified on a scratch copy: the real cache never saw the wrong write
            for (k, v), (k0, v0) in zip(llm.cache.gpu_cache, caches):
                assert torch.equal(k, k0) and torch.equal(v, v0)
    else:
        with parts.use(check=False, **{name: fn}):
            llm.generate(PROMPTS, GREEDY)
    assert llm.kv_cache_manager.block_pool.cached_block_hash_to_block == {}, "leaving use() forgets the cache"
    pool_is_sound(llm)
    assert llm.kv_cache_manager.reset_prefix_cache()
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected  # and again, from the prefix cache
    pool_is_sound(llm)


def test_use_takes_a_bool_and_is_entered_once_at_a_time(solution_parts):
    for bad in ("no", 0, None):
        with pytest.raises(TypeError, match="check must be True or False"):
            parts.use(check=bad, slot_mapping=solution_parts["slot_mapping"])
    block = parts.use(slot_mapping=solution_parts["slot_mapping"])
    with block:
        with pytest.raises(RuntimeError, match="already active"):
            with block:
                pass
        assert parts.plugged("slot_mapping") is not None
    assert parts.plugged("slot_mapping") is None
    with block as again:  # once left, it can be entered again
        assert parts.plugged("slot_mapping") is again["slot_mapping"]
    assert not parts._plugged


# ---- the scheduler's parts: what they must leave alone ---------------------------------------------------------
from minipaged.core.request import RequestStatus  # noqa: E402
from minipaged.core.scheduler import admit_waiting, preempt_recompute, schedule_running  # noqa: E402


def preempt_frees_a_bystander(victim, kv, waiting):
    """Preempts the victim right, then also frees another running request's blocks."""
    bystander = next((rid for rid in kv.num_blocks_per_request if rid != victim.request_id), None)
    preempt_recompute(victim, kv, waiting)
    if bystander is not None:
        kv.free(bystander)  # MISTAKE: only the victim gives its blocks back


def admit_marks_the_rest_waiting(waiting, kv, token_budget, free_seats):
    """Admits right, then touches the requests it did not admit."""
    admitted = admit_waiting(waiting, kv, token_budget, free_seats)
    for req in waiting:
        req.status = RequestStatus.PREEMPTED  # MISTAKE: a request it did not admit is not its business
    return admitted


def schedule_reorders_waiting(running, waiting, kv, token_budget, preempt):
    """Serves the running requests right, then sorts the waiting queue by length."""
    result = schedule_running(running, waiting, kv, token_budget, preempt)
    ordered = sorted(waiting, key=lambda r: r.num_tokens)  # MISTAKE: the waiting queue is step 2's, in order
    waiting.clear()
    waiting.extend(ordered)
    return result


def admit_forgets_a_cached_block(waiting, kv, token_budget, free_seats):
    """Admits right, then clears the hash of a cached block that none of the admitted requests holds."""
    admitted = admit_waiting(waiting, kv, token_budget, free_seats)
    mine = {b for rid, _ in admitted for b in kv.get_block_ids(rid)}
    for block in kv.block_pool.blocks:
        if block.block_hash is not None and block.block_id not in mine and block.ref_cnt == 0:
            kv.block_pool.evict_cached_block(block)  # MISTAKE: the prefix cache is not admission's to prune
            break
    return admitted


@pytest.mark.parametrize(
    "name, fn, says",
    [
        (
            "preempt_recompute",
            preempt_frees_a_bystander,
            "ref count went from 1 to 0, and it is not a block of the victim",
        ),
        ("admit_waiting", admit_forgets_a_cached_block, "hash was cleared"),
        ("admit_waiting", admit_marks_the_rest_waiting, "a request it did not admit"),
        ("schedule_running", schedule_reorders_waiting, "waiting queue"),
    ],
)
def test_a_scheduler_part_must_leave_the_other_requests_alone(llm, expected, name, fn, says):
    with pytest.raises(PartError, match=says) as caught:
        run(llm, {name: fn})
    assert caught.value.part == name and caught.value.step is not None, str(caught.value)
    pool_is_sound(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
