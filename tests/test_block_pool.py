"""BlockPool, FreeKVCacheBlockQueue, KVCacheBlock and the block hashes."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minipaged.core.block_pool import (
    NONE_HASH,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
)
from minipaged.core.request import Request


def ids(blocks):
    return [b.block_id for b in blocks]


def free_ids(pool):
    return ids(pool.free_block_queue.get_all_free_blocks())


# ---- the free queue ------------------------------------------------------------------------
def test_queue_starts_in_id_order_and_pops_from_the_front():
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(5)])
    assert q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(3)) == [1, 2, 3]
    assert ids(q.get_all_free_blocks()) == [4]
    assert q.num_free_blocks == 1


def test_queue_popped_blocks_are_unlinked():
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(4)])
    for b in q.popleft_n(2) + [q.popleft()]:
        assert b.prev_free_block is None and b.next_free_block is None


def test_queue_remove_from_the_middle_links_the_neighbours():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    assert q.num_free_blocks == 4
    q.remove(blocks[0])  # the first and the last real blocks neighbour a sentinel
    q.remove(blocks[4])
    assert ids(q.get_all_free_blocks()) == [1, 3]


def test_queue_remove_is_O1_it_never_walks_the_list():
    """remove() may only touch the block and its two neighbours. Cut the list far away
    from the block (the head no longer leads anywhere): a remove that walked from the
    head would fail or miss; an O(1) unlink does not notice."""
    blocks = [KVCacheBlock(i) for i in range(10_000)]
    q = FreeKVCacheBlockQueue(blocks)
    saved = q.fake_free_list_head.next_free_block
    q.fake_free_list_head.next_free_block = None
    blocks[0].prev_free_block = None
    q.remove(blocks[5000])
    q.fake_free_list_head.next_free_block = saved
    blocks[0].prev_free_block = q.fake_free_list_head
    assert blocks[4999].next_free_block is blocks[5001]
    assert q.num_free_blocks == 9999
    assert 5000 not in ids(q.get_all_free_blocks())


def test_queue_append_goes_to_the_back_in_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.append(blocks[5])
    q.append_n([blocks[3], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [0, 1, 5, 3, 2]
    assert q.num_free_blocks == 5
    assert ids(q.popleft_n(5)) == [0, 1, 5, 3, 2]
    assert q.get_all_free_blocks() == []


def test_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(3)]
    q = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append_n([blocks[2], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [0, 1]  # a refused append_n changed nothing
    with pytest.raises(ValueError):
        q.popleft_n(3)
    with pytest.raises(ValueError):
        q.popleft_n(-1)
    q.popleft_n(2)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()


def test_empty_queue():
    q = FreeKVCacheBlockQueue([])
    assert q.num_free_blocks == 0 and q.get_all_free_blocks() == []
    assert q.popleft_n(0) == []


def test_block_repr_does_not_recurse():
    q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])
    r = repr(q.get_all_free_blocks()[1])
    assert "prev_free_block=0" in r and "next_free_block=2" in r


# ---- the pool --------------------------------------------------------------------------------
def test_null_block_is_block_0_and_out_of_the_queue():
    pool = BlockPool(10)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert 0 not in free_ids(pool)
    assert pool.get_num_free_blocks() == 9
    assert pool.num_gpu_blocks == 10


@pytest.mark.parametrize("bad", [1, 0, -3, 2.0, True, "8"])
def test_pool_rejects_bad_num_blocks(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_get_new_blocks_hands_out_from_the_front_with_ref_cnt_1():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_num_free_blocks() == 4
    assert pool.get_new_blocks(0) == []


def test_get_new_blocks_raises_when_short_and_changes_nothing():
    pool = BlockPool(5)
    with pytest.raises(ValueError, match="only 4 are free"):
        pool.get_new_blocks(5)
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError, match="non-negative"):
        pool.get_new_blocks(-1)


def test_null_block_never_handed_out_even_when_draining_the_pool():
    pool = BlockPool(6)
    got = pool.get_new_blocks(5)
    assert 0 not in ids(got)
    pool.free_blocks(got)
    assert sorted(free_ids(pool)) == [1, 2, 3, 4, 5]


def test_free_blocks_reference_counts():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second user
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0
    assert free_ids(pool)[-1] == b.block_id and a.block_id not in free_ids(pool)
    pool.free_blocks([a])
    assert free_ids(pool)[-1] == a.block_id
    assert pool.get_num_free_blocks() == 5


def test_double_free_raises_and_null_block_free_is_ignored():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and 0 not in free_ids(pool)
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0


def test_free_blocks_appends_in_the_given_order():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(reversed(blocks))  # tail first, as KVCacheManager.free does
    assert free_ids(pool) == [4, 5, 3, 2, 1]


def test_usage():
    pool = BlockPool(11)
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.get_usage() == pytest.approx(0.4)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


def test_ab_trace_of_the_capacity_article():
    """The A/B trace of the KV-cache capacity article (chapter 03): block_size 4, a pool of 20 blocks. A takes one block, writes 5 tokens
    (the fifth opens a second block), B arrives (one block), A finishes: 19 blocks free.

    Our pool reserves block 0 as the null block, so the article's 20 usable blocks are
    BlockPool(21). The article's free list is a stack popped from the end (blocks 19, 18, 17);
    ours is a queue popped from the front (blocks 1, 2, 3): same counts, other ids."""
    block_size = 4
    pool = BlockPool(21, enable_caching=False)
    assert pool.get_num_free_blocks() == 20
    table = {"A": pool.get_new_blocks(1)}
    writes = []
    for token_idx in range(5):
        if token_idx > 0 and token_idx % block_size == 0:
            table["A"] += pool.get_new_blocks(1)
        writes.append((table["A"][-1].block_id, token_idx % block_size))
    assert writes == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]  # the article: (19,0) ... (19,3), (18,0)
    table["B"] = pool.get_new_blocks(1)
    assert ids(table["B"]) == [3]  # the article: 17
    assert pool.get_num_free_blocks() == 17
    pool.free_blocks(reversed(table.pop("A")))
    assert pool.get_num_free_blocks() == 19  # the article's "free blocks: 19"


# ---- hashing --------------------------------------------------------------------------------
def test_hash_is_chained_and_sensitive_to_everything():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h0
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) == h0  # None means NONE_HASH
    assert hash_block_tokens(None, [1, 2, 3, 5]) != h0
    assert hash_block_tokens(None, [1, 2, 3, 4], (("cache_salt", "x"),)) != h0
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    other_parent = hash_block_tokens(None, [9, 9, 9, 9])
    assert hash_block_tokens(other_parent, [5, 6, 7, 8]) != h1  # same tokens, other history
    assert hash_block_tokens(None, np.array([1, 2, 3, 4], dtype=np.int32)) == h0


def test_hash_is_the_same_in_another_process():
    code = (
        "from minipaged.core.block_pool import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3, 4], (('cache_salt', 's'),)), [5, 6, 7, 8]).hex())"
    )
    out = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    }
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], (("cache_salt", "s"),)), [5, 6, 7, 8]).hex()
    assert out == {here}


def test_request_block_hasher_hashes_full_blocks_incrementally():
    req = Request("r", [1, 2, 3, 4, 5, 6], block_hasher=get_request_block_hasher(4))
    assert len(req.block_hashes) == 1
    assert req.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4])
    req.append_output_token_ids([7])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(8)
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [5, 6, 7, 8])
    salted = Request("s", [1, 2, 3, 4, 5, 6, 7, 8], cache_salt="tenant", block_hasher=get_request_block_hasher(4))
    assert salted.block_hashes[0] == hash_block_tokens(None, [1, 2, 3, 4], (("cache_salt", "tenant"),))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], [5, 6, 7, 8])  # salt only once
    assert salted.block_hashes[1] != req.block_hashes[1]


# ---- prefix cache in the pool ---------------------------------------------------------------
def cached_request(pool, request_id, tokens, block_size=4):
    req = Request(request_id, tokens, block_hasher=get_request_block_hasher(block_size))
    blocks = pool.get_new_blocks(-(-len(tokens) // block_size))
    pool.cache_full_blocks(req, blocks, 0, len(tokens) // block_size, block_size)
    return req, blocks


def test_cache_full_blocks_and_get_cached_block():
    pool = BlockPool(10)
    req, blocks = cached_request(pool, "a", list(range(10)))  # 2 full blocks + 2 tokens
    assert [b.block_hash for b in blocks[:2]] == req.block_hashes
    assert blocks[2].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert pool.get_cached_block(hash_block_tokens(None, [9, 9, 9, 9])) is None
    with pytest.raises(ValueError, match="block hashes"):
        pool.cache_full_blocks(req, blocks, 2, 3, 4)  # the third block is not full: no hash


def test_cache_full_blocks_skips_null_blocks_and_refuses_to_rehash():
    pool = BlockPool(6)
    req = Request("a", list(range(8)), block_hasher=get_request_block_hasher(4))
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [pool.null_block, b], 0, 2, 4)
    assert pool.null_block.block_hash is None and b.block_hash == req.block_hashes[1]
    with pytest.raises(ValueError, match="already has a hash"):
        pool.cache_full_blocks(req, [b, b], 0, 1, 4)


def test_cached_blocks_stay_findable_while_free_and_are_evicted_lazily():
    pool = BlockPool(6)  # 5 usable
    req, blocks = cached_request(pool, "a", list(range(8)))  # blocks 1, 2 cached
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 2, 1]
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]  # free, still a hit
    pool.get_new_blocks(3)  # 3, 4, 5: never cached, nothing evicted
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    (evicted,) = pool.get_new_blocks(1)  # the tail block of the chain goes first
    assert evicted is blocks[1] and evicted.block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]


def test_touch_takes_a_cached_free_block_out_of_the_middle_of_the_queue():
    pool = BlockPool(8)
    _req, blocks = cached_request(pool, "a", list(range(8)))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]
    pool.touch([blocks[1]])
    assert free_ids(pool) == [3, 4, 5, 6, 7, 1]
    assert blocks[1].ref_cnt == 1 and pool.get_num_free_blocks() == 6
    pool.touch([blocks[1]])  # in use already: only the count moves
    assert blocks[1].ref_cnt == 2 and pool.get_num_free_blocks() == 6


def test_lru_eviction_order_across_requests():
    pool = BlockPool(7)  # 6 usable
    _, a = cached_request(pool, "a", [1] * 8)  # blocks 1, 2
    _, b = cached_request(pool, "b", [2] * 8)  # blocks 3, 4
    pool.free_blocks(reversed(a))  # a finishes first: least recently used
    pool.free_blocks(reversed(b))
    evict_order = ids(pool.get_new_blocks(6))
    assert evict_order == [5, 6, 2, 1, 4, 3]  # never-cached first, then a's tail, a's head, b's tail, b's head
    assert pool.cached_block_hash_to_block == {}


def test_duplicate_blocks_under_one_hash():
    pool = BlockPool(6)
    r1, b1 = cached_request(pool, "a", [7] * 4)
    r2, b2 = cached_request(pool, "b", [7] * 4)
    assert r1.block_hashes == r2.block_hashes
    assert set(pool.cached_block_hash_to_block[r1.block_hashes[0]]) == {b1[0].block_id, b2[0].block_id}
    pool.free_blocks(b1)
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts b1's block
    assert pool.get_cached_block(r1.block_hashes[0]) is b2[0]


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(6)
    req, blocks = cached_request(pool, "a", [3] * 8)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(req.block_hashes[0]) is None and all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_reuses_freed_blocks_fifo():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    assert pool.get_new_blocks(3) == blocks  # FIFO reuse
