"""Exercise 08 — chained block hashes and the prefix-cache lookup: wrong solutions a learner writes."""

from __future__ import annotations

from minipaged.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens

from . import mutant

CHECKS = {
    "chain_block_hashes": ["check_chain_block_hashes"],
    "find_prefix_hits": ["check_find_prefix_hits"],
    "free_blocks": ["check_free_blocks"],
    "get_new_blocks": ["check_get_new_blocks"],
}
HELPERS: dict = {}


# ---- part 1: chain_block_hashes ---------------------------------------------------------------
@mutant("chain_block_hashes", "no chain: every block is hashed with parent None, so equal blocks collide")
def no_chain(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        hashes.append(hash_block_tokens(None, token_ids[start : start + block_size], extra))  # MISTAKE
    return hashes


@mutant("chain_block_hashes", "salts every block, not only the first")
def salts_every_block(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if cache_salt else None  # MISTAKE
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


@mutant("chain_block_hashes", "hashes the partial last block too")
def hashes_partial_block(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids), block_size):  # MISTAKE: only full blocks get a hash
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


@mutant("chain_block_hashes", "ignores the cache salt")
def ignores_salt(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], None)  # MISTAKE
        hashes.append(parent)
    return hashes


# ---- part 2: find_prefix_hits -----------------------------------------------------------------
@mutant("find_prefix_hits", "does not stop at the first miss: keeps hits after a gap in the chain")
def skips_misses(pool: BlockPool, block_hashes: list[bytes], num_tokens: int, block_size: int) -> list[int]:
    hits = []
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        block = pool.get_cached_block(h)
        if block is None:
            continue  # MISTAKE
        hits.append(block.block_id)
    return hits


@mutant("find_prefix_hits", "no cap: a fully cached prompt hits every block, leaving nothing to compute")
def no_cap(pool: BlockPool, block_hashes: list[bytes], num_tokens: int, block_size: int) -> list[int]:
    hits = []
    for h in block_hashes:  # MISTAKE: at most (num_tokens - 1) // block_size blocks
        block = pool.get_cached_block(h)
        if block is None:
            break
        hits.append(block.block_id)
    return hits


@mutant("find_prefix_hits", "always leaves the last full block out, even when a token follows it")
def cap_one_block_short(pool: BlockPool, block_hashes: list[bytes], num_tokens: int, block_size: int) -> list[int]:
    hits = []
    for h in block_hashes[: num_tokens // block_size - 1]:  # MISTAKE
        block = pool.get_cached_block(h)
        if block is None:
            break
        hits.append(block.block_id)
    return hits


@mutant("find_prefix_hits", "claims the hits while looking (pool.touch): blocks leave the free queue")
def touches_the_pool(pool: BlockPool, block_hashes: list[bytes], num_tokens: int, block_size: int) -> list[int]:
    hits = []
    for h in block_hashes[: (num_tokens - 1) // block_size]:
        block = pool.get_cached_block(h)
        if block is None:
            break
        pool.touch([block])  # MISTAKE: only look; admission takes the blocks later
        hits.append(block.block_id)
    return hits


# ---- part 3: LRU eviction ----------------------------------------------------------------------
def _evict(pool: BlockPool, block: KVCacheBlock) -> None:
    same = pool.cached_block_hash_to_block.get(block.block_hash, {})  # type: ignore[arg-type]
    same.pop(block.block_id, None)
    if not same:
        pool.cached_block_hash_to_block.pop(block.block_hash, None)  # type: ignore[arg-type]
    block.reset_hash()


def _push_front(pool: BlockPool, block: KVCacheBlock) -> None:
    q = pool.free_block_queue
    first = q.fake_free_list_head.next_free_block
    assert first is not None
    block.prev_free_block, block.next_free_block = q.fake_free_list_head, first
    q.fake_free_list_head.next_free_block = first.prev_free_block = block
    q.num_free_blocks += 1


@mutant("free_blocks", "queues every block it is given, even one another request still uses")
def frees_shared(pool: BlockPool, ordered_blocks: list[KVCacheBlock]) -> None:
    for block in ordered_blocks:
        block.ref_cnt -= 1
        pool.free_block_queue.append(block)  # MISTAKE: only a block whose count reached 0 is free


@mutant("free_blocks", "puts freed blocks at the front: the most recently used is evicted first")
def frees_to_front(pool: BlockPool, ordered_blocks: list[KVCacheBlock]) -> None:
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            _push_front(pool, block)  # MISTAKE: the back, so it is reused last


@mutant("free_blocks", "evicts on free: a finished prompt's blocks lose their hashes, nothing stays cached")
def evicts_on_free(pool: BlockPool, ordered_blocks: list[KVCacheBlock]) -> None:
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                _evict(pool, block)  # MISTAKE: a free block keeps its hash until it is handed out
            pool.free_block_queue.append(block)


@mutant("free_blocks", "queues the blocks in the reverse of the order given: a prefix's first block goes first")
def frees_reversed(pool: BlockPool, ordered_blocks: list[KVCacheBlock]) -> None:
    released = []
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            released.append(block)
    for block in reversed(released):  # MISTAKE: the order given is the eviction order
        pool.free_block_queue.append(block)


@mutant("get_new_blocks", "never evicts: a handed-out block is still found under its old hash")
def never_evicts(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.popleft()
        block.ref_cnt = 1  # MISTAKE: its hash must go first
        blocks.append(block)
    return blocks


@mutant("get_new_blocks", "clears the block's hash but leaves it in the cache map")
def forgets_the_map(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.popleft()
        block.reset_hash()  # MISTAKE: pool.cached_block_hash_to_block still finds it
        block.ref_cnt = 1
        blocks.append(block)
    return blocks


@mutant("get_new_blocks", "takes from the back: the most recently freed block is evicted first")
def takes_most_recent(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.fake_free_list_tail.prev_free_block
        assert block is not None
        pool.free_block_queue.remove(block)  # MISTAKE: the front is the least recently used
        if block.block_hash is not None:
            _evict(pool, block)
        block.ref_cnt = 1
        blocks.append(block)
    return blocks


@mutant("get_new_blocks", "leaves ref_cnt at 0: the block looks free while a request holds it")
def no_reference(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    blocks = []
    for _ in range(num_blocks):
        block = pool.free_block_queue.popleft()
        if block.block_hash is not None:
            _evict(pool, block)
        blocks.append(block)  # MISTAKE: ref_cnt = 1
    return blocks
