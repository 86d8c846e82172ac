"""Block hashes: the key of a full block of tokens in the prefix cache, chained so that it names the whole prefix.

Pure functions of token ids (no pool, no request): ``request.py`` keeps each request's hashes with them, and the
block pool (``block_pool.py``) finds cached blocks by them. vLLM keeps the same functions in
``vllm/v1/core/kv_cache_utils.py``.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any, NewType

# A block hash is the sha256 digest of (parent hash, token ids, extra keys): 32 bytes.
BlockHash = NewType("BlockHash", bytes)

# The "parent" of a request's first block. A fixed seed, not os.urandom, so hashes
# are the same in every process and every run (vLLM does the same for sha256).
NONE_HASH: BlockHash = BlockHash(hashlib.sha256(b"minipaged-none-hash").digest())


def hash_block_tokens(
    parent_block_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
) -> BlockHash:
    """Hash one full block, chained to the hash of the block before it.

    Chaining makes the hash name the whole prefix, not just this block: two blocks
    holding the same 16 tokens after different histories get different hashes, so
    a cache hit on block ``i`` implies hits on blocks ``0..i-1`` too::

        block 0: h0 = H(NONE_HASH, tokens[0:16],  extra_keys)   e.g. cache salt
        block 1: h1 = H(h0,        tokens[16:32], None)
        block 2: h2 = H(h1,        tokens[32:48], None)

    ``H`` is sha256 over a pickle of plain ints/bytes/str with a fixed protocol:
    deterministic across processes, unlike Python's ``hash()`` (salted per process
    for str/bytes), and collision resistant, which matters because a collision
    would hand one request another request's K/V.
    """
    parent = NONE_HASH if parent_block_hash is None else parent_block_hash
    # int() turns numpy/torch integers into plain ints, which pickle the same way everywhere.
    payload = (bytes(parent), tuple(int(t) for t in token_ids), extra_keys)
    return BlockHash(hashlib.sha256(pickle.dumps(payload, protocol=4)).digest())


def chain_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None, parent_block_hash: BlockHash | None = None
) -> list[BlockHash]:
    """The chained hash of every full block of ``token_ids`` (a partial last block has none).

    The chain continues from ``parent_block_hash`` (None: these are a request's first
    tokens, and then the cache salt goes into the first block's extra keys).
    """
    hashes: list[BlockHash] = []
    parent = parent_block_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if parent is None and cache_salt else None
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


def group_block_hash(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group ``group_id`` (``single_type_kv_cache_manager.py``). Group 0
    keeps the plain hash; the same tokens' block in another group holds other layers' K/V, so its key carries the
    group (vLLM: ``BlockHashWithGroupId``)."""
    return block_hash if group_id == 0 else BlockHash(block_hash + group_id.to_bytes(4, "little"))
