"""Checks for exercise 08: chained block hashes and the prefix-cache lookup.

Part 1, ``chain_block_hashes(token_ids, block_size, cache_salt=None)``: the
expected hashes are the ones a ``Request`` computes with the package's
``RequestBlockHasher``. Part 2, ``find_prefix_hits(pool, block_hashes,
num_tokens, block_size)``: the expected blocks are the ones
``KVCacheManager.get_computed_blocks`` finds on the same pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..block_pool import get_request_block_hasher
from ..kv_cache_manager import KVCacheManager
from ..request import Request
from .core import Check, CheckOutcome, report


def reference_hashes(token_ids: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    req = Request("ref", list(token_ids), cache_salt=cache_salt, block_hasher=get_request_block_hasher(block_size))
    return list(req.block_hashes)


def _tokens(n: int, start: int = 1) -> list[int]:
    return [(start + 7 * i) % 50_000 for i in range(n)]


SYSTEM_1000 = _tokens(1000, 11)

# (label, tokens, block size, cache salt)
HASH_CASES = [
    ("8 tokens, block size 4: two full blocks", _tokens(8), 4, None),
    ("10 tokens, block size 4: the partial third block is not hashed", _tokens(10), 4, None),
    ("3 tokens, block size 4: no full block yet", _tokens(3), 4, None),
    ("block size 1: one hash per token", _tokens(5), 1, None),
    ("the same 4 tokens after a different first block: a different hash", [9, 9, 9, 9] + _tokens(4), 4, None),
    ("a cache salt goes into the first block, and through the chain into every block", _tokens(12), 4, "tenant-a"),
    (
        "chapter 08's 1000-token system prompt, block size 16: 62 full blocks (the 63rd is partial)",
        SYSTEM_1000,
        16,
        None,
    ),
]


def _as_bytes_list(got: Any) -> list[bytes]:
    return [bytes(h) for h in got]


def _short(hashes: list[bytes]) -> list[str]:
    return [h.hex()[:8] for h in hashes]


def check_chain_block_hashes(chain_block_hashes: Callable[..., Any]) -> list[CheckOutcome]:
    """``chain_block_hashes(token_ids, block_size, cache_salt=None) -> list of hashes``, one per full block."""
    hint = (
        "compare the lists hash by hash: how many there are, and where the first difference is. A block's "
        "hash must name its whole prefix (the chain), only full blocks are hashed, and the salt enters once, "
        "reaching every later block through the chain (chapter 08, sections 1 and 5)"
    )
    checks = []
    for label, tokens, bs, salt in HASH_CASES:
        shown = tokens if len(tokens) <= 12 else f"[{len(tokens)} tokens]"
        checks.append(
            Check(
                f"chain_block_hashes({shown}, {bs}, cache_salt={salt!r})  # {label}  "
                f"(hashes shown by their first 4 bytes)",
                lambda a=(tokens, bs, salt): _short(_as_bytes_list(chain_block_hashes(*a))),
                _short(reference_hashes(tokens, bs, salt)),
                hint=hint,
            )
        )
    return report("chain_block_hashes", checks)


# ---- part 2: the longest cached prefix --------------------------------------------------------
SYSTEM = _tokens(16, 500)  # 4 blocks of 4


@dataclass(frozen=True)
class Lookup:
    label: str
    prompt: Sequence[int]
    finished: Sequence[Sequence[int]] = ()  # prompts computed and finished before (their blocks stay cached)
    running: Sequence[Sequence[int]] = ()  # prompts still running (their blocks in use)
    evict: Sequence[int] = ()  # positions in the query's chain whose cached block is evicted afterwards
    salt: str | None = None
    num_blocks: int = 40


LOOKUPS = [
    Lookup("an empty cache", SYSTEM + [1, 2, 3]),
    Lookup(
        "a finished request's system prompt is still cached (free, ref_cnt 0)",
        SYSTEM + [1, 2, 3],
        finished=[SYSTEM + [7, 8, 9, 10, 11]],
    ),
    Lookup(
        "a running request holds the same prefix (shared, ref_cnt 1)",
        SYSTEM + _tokens(9, 900),
        running=[SYSTEM + [7, 8]],
    ),
    Lookup(
        "the prompts part ways in block 2: only blocks 0 and 1 match",
        SYSTEM[:8] + [5] * 8 + [1],
        finished=[SYSTEM + [7]],
    ),
    Lookup(
        "block 1 was evicted: the chain breaks there, block 2 does not count",
        SYSTEM + _tokens(6, 40),
        finished=[SYSTEM + [7]],
        evict=[1],
    ),
    Lookup(
        "a fully cached, block-aligned prompt: the last block is left to compute", list(SYSTEM), finished=[SYSTEM + [7]]
    ),
    Lookup("a prompt one token longer: every full block can hit", SYSTEM + [3], finished=[SYSTEM + [7]]),
    Lookup("another tenant's salt: the same tokens, no hit", SYSTEM + [1, 2], finished=[SYSTEM + [7]], salt="tenant-b"),
]


def build_lookup(c: Lookup) -> tuple[KVCacheManager, Request]:
    kv = KVCacheManager(block_size=4, num_blocks=c.num_blocks, enable_caching=True, watermark_blocks=0)
    for i, p in enumerate([*c.finished, *c.running]):
        r = Request(f"earlier{i}", list(p))
        if kv.allocate_slots(r, r.num_tokens) is None:
            raise RuntimeError(f"lookup {c.label!r} does not fit")
        r.num_computed_tokens = r.num_tokens
        if i < len(c.finished):
            kv.free(r)
    query = Request("query", list(c.prompt), cache_salt=c.salt, block_hasher=kv.block_hasher)
    pool = kv.block_pool
    for i in c.evict:  # drop one cached block from the cache map, as a reuse by someone else would
        block = pool.get_cached_block(query.block_hashes[i])
        if block is not None:
            pool.evict_cached_block(block)
    return kv, query


def expected_hits(c: Lookup) -> list[int]:
    kv, query = build_lookup(c)
    blocks, _ = kv.get_computed_blocks(query)
    return [b.block_id for b in blocks]


def _run_lookup(find_prefix_hits: Callable[..., Any], c: Lookup) -> tuple[list[int], int]:
    kv, query = build_lookup(c)
    free_before = kv.get_num_free_blocks()
    got = find_prefix_hits(kv.block_pool, list(query.block_hashes), query.num_tokens, kv.block_size)
    ids = [int(getattr(b, "block_id", b)) for b in got]
    return ids, kv.get_num_free_blocks() - free_before


def check_find_prefix_hits(find_prefix_hits: Callable[..., Any]) -> list[CheckOutcome]:
    """``find_prefix_hits(pool, block_hashes, num_tokens, block_size) -> list of block ids``, and it only looks."""
    hint = (
        "compare the block ids, then the change in free blocks: a hit after a miss cannot be used (the "
        "chain), the last prompt token must still run through the model so a fully cached prompt cannot hit "
        "every block, and a lookup must leave the pool as it was (chapter 08, section 2)"
    )
    checks = []
    for c in LOOKUPS:
        _kv, query = build_lookup(c)
        checks.append(
            Check(
                f"find_prefix_hits(pool, hashes of a {query.num_tokens}-token prompt, "
                f"{query.num_tokens}, 4)  # {c.label}; then (block ids, change in free blocks)",
                lambda c=c: _run_lookup(find_prefix_hits, c),
                (expected_hits(c), 0),
                hint=hint,
            )
        )
    return report("find_prefix_hits", checks)
