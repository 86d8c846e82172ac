"""KVCacheManager: allocate_slots (watermark, reserved blocks, None), prefix hits, free order."""

import pytest

from minipaged.core.block_pool import get_request_block_hasher
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.worker.block_table import BlockTable


def step(mgr, req, num_new_tokens, **kw):
    """Allocate like a scheduler would, and mark the tokens computed on success."""
    blocks = mgr.allocate_slots(req, num_new_tokens, **kw)
    if blocks is not None:
        req.num_computed_tokens += num_new_tokens + kw.get("num_new_computed_tokens", 0)
    return blocks


def admit(mgr, req):
    hits, n = mgr.get_computed_blocks(req)
    blocks = step(mgr, req, req.num_tokens - n, num_new_computed_tokens=n, new_computed_blocks=hits)
    return hits, blocks


# ---- construction ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_size=0, num_blocks=8), "block_size"),
        (dict(block_size=4.0, num_blocks=8), "block_size"),
        (dict(block_size=4, num_blocks=1), "num_blocks"),
        (dict(block_size=4, num_blocks=8, watermark=1.0), "watermark"),
        (dict(block_size=4, num_blocks=8, watermark_blocks=-1), "watermark_blocks"),
        (dict(block_size=4, num_blocks=8, reserved_blocks=-1), "reserved_blocks"),
        (dict(block_size=4, num_blocks=8, watermark_blocks=3, reserved_blocks=4), "leave nothing"),
    ],
)
def test_bad_configuration(kw, match):
    with pytest.raises(ValueError, match=match):
        KVCacheManager(**kw)


def test_watermark_fraction_like_vllm_v0():
    assert KVCacheManager(16, 1000).watermark_blocks == 10
    assert KVCacheManager(16, 1000, watermark=0.05).watermark_blocks == 50
    assert KVCacheManager(16, 1000, watermark_blocks=3).watermark_blocks == 3
    assert KVCacheManager(16, 50).watermark_blocks == 0


# ---- growth ----------------------------------------------------------------------------------
def test_ab_trace_through_the_manager():
    """The capacity article's A/B trace (block_size 4, 20 usable blocks = 21 with the null block):
    A decodes 5 tokens one at a time, B starts, A finishes -> 19 free."""
    mgr = KVCacheManager(4, 21, enable_caching=False, watermark_blocks=0)
    a = Request("A", [0])
    assert [b.block_id for b in step(mgr, a, 1)] == [1]
    for t in range(1, 5):
        a.append_output_token_ids(t)
        new = step(mgr, a, 1)
        assert [b.block_id for b in new] == ([2] if t == 4 else [])
    assert mgr.get_block_ids("A") == [1, 2]
    assert BlockTable(4, mgr.get_block_ids("A"), num_tokens=5).resolve(4) == (2, 0)
    b = Request("B", [0])
    step(mgr, b, 1)
    assert mgr.get_block_ids("B") == [3]
    assert mgr.get_num_free_blocks() == 17
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 19
    assert mgr.num_blocks_per_request == {"B": 1}


def test_fifty_tokens_take_four_blocks_of_16():
    mgr = KVCacheManager(16, 10, enable_caching=False)
    req = Request("r", list(range(50)))
    blocks = step(mgr, req, 50)
    assert len(blocks) == 4 and mgr.get_num_blocks("r") == 4
    table = BlockTable(16, mgr.get_block_ids("r"), num_tokens=50)
    assert table.resolve(49) == (blocks[3].block_id, 1)  # last block holds 2 tokens
    for t in range(50, 64):  # tokens 50..63 fill block 3 without a new block
        req.append_output_token_ids(t)
        assert step(mgr, req, 1) == []
    req.append_output_token_ids(64)
    assert len(step(mgr, req, 1)) == 1  # token 64 opens block 4


def test_lookahead_slots_allocate_but_do_not_cache():
    mgr = KVCacheManager(4, 10, watermark_blocks=0)
    req = Request("r", list(range(8)))
    blocks = mgr.allocate_slots(req, 8, num_lookahead_tokens=3)
    assert len(blocks) == 3
    assert [b.block_hash is not None for b in blocks] == [True, True, False]


def test_negative_counts_and_mismatched_computed_blocks():
    mgr = KVCacheManager(4, 10)
    req = Request("r", [1, 2, 3])
    for kw in (dict(num_new_tokens=-1), dict(num_new_tokens=1, num_lookahead_tokens=-2)):
        with pytest.raises(ValueError, match="non-negative"):
            mgr.allocate_slots(req, **kw)
    with pytest.raises(ValueError, match="must equal"):
        mgr.allocate_slots(req, 1, num_new_computed_tokens=4)


# ---- admission: None, watermark, reserved blocks ------------------------------------------------
def test_none_not_an_exception_when_the_pool_is_exhausted_and_nothing_changes():
    mgr = KVCacheManager(4, 6, enable_caching=False, watermark_blocks=0)  # 5 usable
    a = Request("a", list(range(16)))
    assert len(step(mgr, a, 16)) == 4
    b = Request("b", list(range(8)))
    assert mgr.allocate_slots(b, 8) is None
    assert mgr.get_num_free_blocks() == 1 and mgr.get_block_ids("b") == [] and "b" not in mgr.req_to_blocks
    assert len(step(mgr, Request("c", [1, 2]), 2)) == 1
    a.append_output_token_ids(0)
    assert mgr.allocate_slots(a, 1) is None  # running request, empty pool: None as well


def test_watermark_applies_to_new_admissions_only():
    mgr = KVCacheManager(4, 11, enable_caching=False, watermark_blocks=2)  # 10 usable
    x = Request("x", list(range(32)))
    assert len(step(mgr, x, 32)) == 8  # 8 + 2 watermark <= 10 free
    y = Request("y", [1])
    assert mgr.allocate_slots(y, 1) is None  # 1 + 2 > 2 free: newcomers must leave the watermark
    for _t in range(2):  # x is running: it may dig into the watermark
        x.append_output_token_ids(list(range(4)))
        assert len(step(mgr, x, 4)) == 1
    assert mgr.get_num_free_blocks() == 0 and mgr.get_num_blocks("x") == 10


def test_watermark_boundary_is_strict_inequality():
    mgr = KVCacheManager(4, 11, enable_caching=False, watermark_blocks=2)
    assert mgr.allocate_slots(Request("a", list(range(32))), 32) is not None  # 8 + 2 == 10: admitted
    mgr2 = KVCacheManager(4, 11, enable_caching=False, watermark_blocks=2)
    with pytest.raises(ValueError, match="never"):  # 9 + 2 > 10 even with an empty pool
        mgr2.allocate_slots(Request("b", list(range(33))), 33)


def test_reserved_blocks_are_held_back_from_everyone():
    mgr = KVCacheManager(4, 11, enable_caching=False, watermark_blocks=0, reserved_blocks=3)  # 10 usable
    a = Request("a", list(range(24)))
    assert len(step(mgr, a, 24)) == 6  # 4 free
    b = Request("b", list(range(4)))
    assert len(step(mgr, b, 4)) == 1  # 1 <= 4 free - 3 reserved
    assert mgr.allocate_slots(Request("c", [1]), 1) is None  # 1 > 3 free - 3 reserved
    b.append_output_token_ids([0])
    assert mgr.allocate_slots(b, 1) is None  # running requests cannot touch the reserve either
    assert mgr.get_num_free_blocks() == 3
    with pytest.raises(ValueError, match="3 reserved"):
        mgr.allocate_slots(Request("d", list(range(29))), 29)  # 8 blocks > 10 - 3: never


def test_request_that_could_never_fit_raises():
    mgr = KVCacheManager(16, 5, watermark_blocks=0)  # 4 usable = 64 tokens
    with pytest.raises(ValueError, match="can never"):
        mgr.allocate_slots(Request("big", list(range(65))), 65)
    ok = Request("ok", list(range(64)))
    assert len(mgr.allocate_slots(ok, 64)) == 4


# ---- prefix caching -------------------------------------------------------------------------------
def test_prefix_hit_and_never_the_last_token():
    mgr = KVCacheManager(4, 20, watermark_blocks=0)
    first = Request("a", list(range(10)))
    admit(mgr, first)
    mgr.free(first)
    aligned = Request("b", list(range(8)))  # both blocks cached, prompt ends on a block boundary
    hits, n = mgr.get_computed_blocks(aligned)
    assert n == 4 and len(hits) == 1  # the last block is recomputed so a token gets computed
    longer = Request("c", list(range(9)))
    hits, n = mgr.get_computed_blocks(longer)
    assert n == 8 and [h.block_id for h in hits] == [1, 2]  # first's blocks, found while free
    assert all(h.ref_cnt == 0 for h in hits)  # not touched until allocate_slots admits the request
    diverged = Request("d", [0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert mgr.get_computed_blocks(diverged)[1] == 4  # chained: the first miss ends the hit


def test_cache_hit_reuses_blocks_and_shares_them():
    mgr = KVCacheManager(4, 20, watermark_blocks=0)
    a = Request("a", list(range(10)))
    admit(mgr, a)
    b = Request("b", list(range(8)) + [50, 51, 52])
    hits, new = admit(mgr, b)
    assert [h.block_id for h in hits] == mgr.get_block_ids("a")[:2]
    assert mgr.get_block_ids("b")[:2] == mgr.get_block_ids("a")[:2]
    assert all(h.ref_cnt == 2 for h in hits)
    assert len(new) == 1
    mgr.free(a)
    assert all(h.ref_cnt == 1 for h in hits)


def test_hit_on_cached_free_blocks_counts_against_the_free_pool():
    """Touching a cached block that sits in the free queue takes a free block: the admission
    check must count it, or get_new_blocks would fail after the touch."""
    mgr = KVCacheManager(4, 5, watermark_blocks=0)  # 4 usable
    a = Request("a", list(range(8)))
    admit(mgr, a)
    mgr.free(a)  # 2 cached blocks, free
    filler = Request("f", [7] * 4)
    admit(mgr, filler)  # takes a never-cached block: 3 free, 2 of them cached
    assert mgr.get_num_free_blocks() == 3
    b = Request("b", list(range(8)) + [9] * 8)  # 2 hits + 2 new blocks = 4 > 3 free
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    assert mgr.allocate_slots(b, 8, num_new_computed_tokens=8, new_computed_blocks=hits) is None
    assert mgr.get_num_free_blocks() == 3 and all(h.ref_cnt == 0 for h in hits)


def test_cache_salt_isolates_tenants():
    mgr = KVCacheManager(4, 20, watermark_blocks=0)
    admit(mgr, Request("a", list(range(9)), cache_salt="alice"))
    assert mgr.get_computed_blocks(Request("b", list(range(9)), cache_salt="bob"))[1] == 0
    assert mgr.get_computed_blocks(Request("c", list(range(9))))[1] == 0
    assert mgr.get_computed_blocks(Request("d", list(range(9)), cache_salt="alice"))[1] == 8


def test_generated_tokens_are_cached_as_blocks_fill():
    mgr = KVCacheManager(4, 20, watermark_blocks=0)
    a = Request("a", [1, 2, 3])
    admit(mgr, a)
    assert mgr.num_cached_block["a"] == 0
    a.append_output_token_ids(4)
    step(mgr, a, 1)
    assert mgr.num_cached_block["a"] == 1
    follow_up = Request("b", [1, 2, 3, 4, 5])  # e.g. the next chat turn
    assert mgr.get_computed_blocks(follow_up)[1] == 4


def test_caching_disabled_finds_nothing_and_refuses_computed_blocks():
    mgr = KVCacheManager(4, 20, enable_caching=False)
    a = Request("a", list(range(9)))
    admit(mgr, a)
    assert mgr.get_computed_blocks(Request("b", list(range(9)))) == ([], 0)
    with pytest.raises(ValueError, match="enable_caching"):
        mgr.allocate_slots(Request("c", list(range(9))), 5, 4, mgr.get_blocks("a")[:1])


def test_free_is_tail_first_so_the_prefix_is_evicted_last():
    mgr = KVCacheManager(4, 8, watermark_blocks=0)
    a = Request("a", list(range(12)))
    admit(mgr, a)
    table = mgr.get_block_ids("a")
    mgr.free(a)
    free_order = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-3:] == table[::-1]
    assert mgr.get_block_ids("a") == [] and mgr.usage == 0.0


def test_thousand_token_system_prompt_shared():
    """The capacity article's example (chapter 08): a 1000-token system prompt is 63 blocks of 16 (62 full + 8 tokens).
    Requests sharing it reuse the 62 full blocks; each keeps its own partial tail."""
    mgr = KVCacheManager(16, 2000, watermark_blocks=0)
    system = list(range(1000))
    used = []
    for i in range(5):
        req = Request(f"r{i}", system + [5000 + i] * 20)
        hits, _ = admit(mgr, req)
        assert len(hits) == (0 if i == 0 else 62)
        used.append(mgr.get_block_ids(req.request_id))
    assert all(u[:62] == used[0][:62] for u in used)
    assert len({u[62] for u in used}) == 5
    distinct = len({b for u in used for b in u})
    assert distinct == 62 + 5 * 2  # shared prefix + per-request blocks 62 and 63


def test_block_hasher_block_size_mismatch_is_refused():
    mgr = KVCacheManager(4, 20)
    req = Request("r", list(range(9)), block_hasher=get_request_block_hasher(8))
    with pytest.raises(ValueError, match="block_size=8"):
        mgr.get_computed_blocks(req)


def test_queries():
    mgr = KVCacheManager(4, 11, watermark_blocks=0)
    a = Request("a", list(range(6)))
    admit(mgr, a)
    assert mgr.get_num_blocks("a") == 2 and mgr.get_num_blocks("nobody") == 0
    assert mgr.usage == pytest.approx(0.2)
    assert [b.block_id for b in mgr.get_blocks("a")] == mgr.get_block_ids("a")
    mgr.free("a")
    assert mgr.reset_prefix_cache()


# ---- the request the manager works on ---------------------------------------------------------
def test_request_tokens_and_validation():
    req = Request("r", [5, 6, 7], output_token_ids=[8])
    assert req.all_token_ids == [5, 6, 7, 8] and req.num_tokens == 4
    assert req.num_prompt_tokens == 3 and req.num_output_tokens == 1
    req.append_output_token_ids([9, 10])
    assert req.all_token_ids == [5, 6, 7, 8, 9, 10] and req.output_token_ids == [8, 9, 10]
    for kw in (
        dict(prompt_token_ids=[]),
        dict(prompt_token_ids=[1, -2]),
        dict(prompt_token_ids=[1], num_computed_tokens=2),
    ):
        with pytest.raises(ValueError):
            Request("bad", **kw)


def test_request_hashes_only_with_a_hasher_and_never_mixes_block_sizes():
    req = Request("r", list(range(9)))
    assert req.block_hashes == []
    req.set_block_hasher(get_request_block_hasher(4))
    assert len(req.block_hashes) == 2
    req.set_block_hasher(get_request_block_hasher(4))  # same size: a no-op
    assert len(req.block_hashes) == 2
    with pytest.raises(ValueError, match="block_size=4"):
        req.set_block_hasher(get_request_block_hasher(16))


def test_check_int_takes_ints_and_numpy_ints_not_bools_floats_or_strings():
    """``check_int`` guards every count ``allocate_slots`` takes; its fast path for plain ints keeps the rule."""
    import numpy as np

    from minipaged.utils import check_int

    assert check_int("n", 3, 0) == 3 and check_int("n", np.int64(4), 0) == 4 and check_int("n", 5, 1, 5) == 5
    for bad in (True, -1, 2.0, "3", 6):
        with pytest.raises(ValueError, match="n must be"):
            check_int("n", bad, 0, 5)


# ---- what the runner holds of the block tables ---------------------------------------------------------------
def test_block_updates_send_a_table_once_then_only_what_changed():
    """A new request's whole table, then nothing, then the one new block; a copy-on-write from its index on; a
    request freed and admitted again, or a failed step, sends the whole table again."""
    from minipaged.core.scheduler_output import SchedulerOutput, apply_block_updates

    mgr = KVCacheManager(block_size=4, num_blocks=16)
    a = Request("a", list(range(6)))
    step(mgr, a, 6)
    ids = mgr.get_block_ids("a")
    assert mgr.take_block_updates("a") == [(0, ids)]
    assert mgr.take_block_updates("a") == [(2, [])]
    for token in (100, 101, 102):  # positions 6 and 7 fit in block 1; position 8 takes a third block
        a.append_output_token_ids(token)
        step(mgr, a, 1)
    ids = mgr.get_block_ids("a")
    assert len(ids) == 3 and mgr.take_block_updates("a") == [(2, ids[2:])]
    b = Request("b", list(range(6)))
    b.append_output_token_ids([100, 101, 102])
    b.num_computed_tokens = a.num_computed_tokens
    mgr.fork(a, b)  # b shares a's partly filled last block: a's next write copies it
    assert mgr.take_block_updates("b") == [(0, ids)]
    a.append_output_token_ids(103)
    step(mgr, a, 1)
    assert mgr.pending_copies and mgr.get_block_ids("a")[2] != ids[2]
    assert mgr.take_block_updates("a") == [(2, mgr.get_block_ids("a")[2:])]
    mgr.free(a)
    a.num_computed_tokens = 0
    step(mgr, a, a.num_tokens)
    assert mgr.take_block_updates("a") == [(0, mgr.get_block_ids("a"))]
    mgr.rollback_step()
    assert mgr.take_block_updates("a") == [(0, mgr.get_block_ids("a"))]
    assert mgr.take_block_updates("a", resend=True) == [(0, mgr.get_block_ids("a"))]

    tables = {"gone": [[5]], "a": [[1, 2, 3]]}  # the runner's side: applying a step twice gives the same tables
    out = SchedulerOutput(finished_req_ids=["gone"])
    out.scheduled = [type("S", (), {"request_id": "a", "block_updates": [(1, [7, 8])]})()]  # type: ignore[list-item]
    apply_block_updates(tables, out)
    apply_block_updates(tables, out)
    assert tables == {"a": [[1, 7, 8]]}


def test_the_engine_keeps_the_tables_it_was_sent_and_forgets_them(tiny_model):
    """The runner's tables are the manager's after every step, through preemption by swap, and empty once
    every request has left."""
    from conftest import PREEMPTING_PROMPTS, small_engine

    from minipaged import SamplingParams

    llm = small_engine(tiny_model, preemption_mode="swap", num_cpu_blocks_override=32)
    for i, p in enumerate(PREEMPTING_PROMPTS):
        llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True), request_id=str(i))
    kv, seen = llm.kv_cache_manager, 0
    while llm.scheduler.has_unfinished():
        llm.step()
        for r in llm.scheduler.running:
            if r.request_id in llm.executor.runner.block_tables:
                assert llm.executor.runner.block_tables[r.request_id][0] == kv.get_block_ids(r.request_id)
                seen += 1
    assert seen > 0 and llm.scheduler.num_preemptions > 0 and llm.executor.runner.block_tables == {}
