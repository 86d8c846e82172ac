"""Exercise 08 — chained block hashes and the prefix-cache lookup: wrong solutions a learner writes."""

from __future__ import annotations

from minipaged.block_pool import BlockPool, hash_block_tokens

from . import mutant

CHECKS = {"chain_block_hashes": ["check_chain_block_hashes"], "find_prefix_hits": ["check_find_prefix_hits"]}
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
