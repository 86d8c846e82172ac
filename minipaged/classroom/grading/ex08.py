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

from ...core.block_pool import BlockHash, BlockPool, get_request_block_hasher
from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request
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


# ---- part 3: LRU eviction -----------------------------------------------------------------------
def example_pool() -> BlockPool:
    """Eight blocks: 5, 2 and 7 full, cached and free, then 1 and 4 free (the queue's LRU order 5, 2, 7, 1, 4);
    3 in use by two requests, 6 by one. Chapter 08, section 3's picture in miniature."""
    pool = BlockPool(8)
    used = pool.get_new_blocks(7)  # 1..7
    for block, h in zip((used[4], used[1], used[6]), map(BlockHash, reference_hashes(_tokens(12), 4))):
        block.set_block_hash(h)
        pool.cached_block_hash_to_block[h] = {block.block_id: block}
    pool.touch([used[2]])  # block 3: a second user
    pool.free_blocks([used[4], used[1], used[6], used[0], used[3]])
    return pool


def _twice_cached() -> BlockPool:
    """Blocks 1 and 2 hold the same tokens (two requests computed them at once), both cached and free."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    (h,) = map(BlockHash, reference_hashes(_tokens(4), 4))
    for block in (a, b):
        block.set_block_hash(h)
    pool.cached_block_hash_to_block[h] = {a.block_id: a, b.block_id: b}
    pool.free_blocks([a, b, c])  # the queue: 1, 2, 3
    return pool


def _in_use_cached() -> tuple[BlockPool, list[Any]]:
    """A request's three full blocks, cached while it runs: 1, 2, 3 with hashes, in use."""
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)
    for block, h in zip(blocks, map(BlockHash, reference_hashes(_tokens(12, 3), 4))):
        block.set_block_hash(h)
        pool.cached_block_hash_to_block[h] = {block.block_id: block}
    return pool, blocks


def view(pool: BlockPool) -> tuple[list[int], list[int], dict[int, int]]:
    """What LRU eviction decides, in ids: the free queue front to back, the blocks the prefix cache can still
    find, and every block's ref count that is not 0."""
    queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    cached = sorted(i for same in pool.cached_block_hash_to_block.values() for i in same)
    return queue, cached, {blk.block_id: blk.ref_cnt for blk in pool.blocks if blk.ref_cnt and not blk.is_null}


@dataclass(frozen=True)
class Eviction:
    label: str
    pool: Callable[[], tuple[BlockPool, list[Any]]]  # a fresh pool and the blocks the call frees (if any)
    count: int = 0  # blocks asked of get_new_blocks
    free: Callable[[list[Any]], list[Any]] = lambda blocks: blocks  # which blocks, in which order


def _plain(pool: BlockPool) -> tuple[BlockPool, list[Any]]:
    return pool, pool.blocks


def _held() -> tuple[BlockPool, list[Any]]:
    """Blocks 1, 2 and 3 held by one request, no hashes."""
    pool = BlockPool(8)
    pool.get_new_blocks(3)
    return pool, pool.blocks


GET_CASES = [
    Eviction("a fresh pool: the blocks in id order", lambda: _plain(BlockPool(8)), 3),
    Eviction("the front holds cached-but-free blocks 5 and 2: both evicted", lambda: _plain(example_pool()), 2),
    Eviction("every free block, the uncached ones too", lambda: _plain(example_pool()), 5),
    Eviction("no block asked for: nothing changes", lambda: _plain(example_pool()), 0),
    Eviction(
        "two blocks cached under one hash: evicting block 1 keeps block 2 findable", lambda: _plain(_twice_cached()), 1
    ),
]
FREE_CASES = [
    Eviction(
        "a request's blocks 1, 2, 3, freed tail first as KVCacheManager.free does",
        _held,
        free=lambda b: [b[3], b[2], b[1]],
    ),
    Eviction(
        "block 6, then block 3, which another request still uses",
        lambda: _plain(example_pool()),
        free=lambda b: [b[6], b[3]],
    ),
    Eviction(
        "cached blocks keep their hashes when freed: a later prompt can still hit them",
        _in_use_cached,
        free=lambda b: b[::-1],
    ),
    Eviction("an empty list: nothing changes", lambda: _plain(example_pool()), free=lambda b: []),
]


def _run_get(get_new_blocks: Callable[..., Any], c: Eviction) -> Any:
    pool, _ = c.pool()
    got = get_new_blocks(pool, c.count)
    return [int(getattr(b, "block_id", b)) for b in got], *view(pool)


def _run_free(free_blocks: Callable[..., Any], c: Eviction) -> Any:
    pool, blocks = c.pool()
    free_blocks(pool, c.free(blocks))
    return view(pool)


def _workload(parts_in: dict[str, Callable[..., Any]]) -> Any:
    """A prefix-caching workload in a 12-block pool, served by the real scheduler with the parts plugged in
    unchecked: the driver reads every context back through its block table, so a block still findable after
    it was handed out (a stale hit) fails there. Returns the hits and the pool at the end."""
    import random

    from ...lab.checking_driver import Driver
    from .. import parts

    rng = random.Random(8)
    base = [rng.randrange(1, 40) for _ in range(12)]
    with parts.use(check=False, **parts_in):
        d = Driver(block_size=4, num_blocks=12, caching=True, budget=16, max_num_seqs=4)
        for i in range(14):
            prompt = base[: rng.randrange(5, 12)] + [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
            d.add(f"r{i}", prompt, max_tokens=rng.randrange(1, 6), ignore_eos=True)
        d.run()
        return d.kv_cache_manager.prefix_cache_hits, *view(
            d.kv_cache_manager.block_pool
        )  # inside: leaving parts.use resets the cache


def _safe(run: Callable[[], Any]) -> Any:
    """The workload's outcome, or the first error in words (a broken pool fails the driver's own checks)."""
    try:
        return run()
    except AssertionError as e:
        return f"the driver found the cache wrong: {str(e).splitlines()[0][:200] or 'a read-back check failed'}"


def _lru_report(
    name: str,
    fn: Callable[..., Any],
    package: Callable[..., Any],
    cases: list[Eviction],
    run: Callable[[Callable[..., Any], Eviction], Any],
    tried: Callable[[Eviction], str],
    hint: str,
) -> list[CheckOutcome]:
    """Each case against the package's own function on a fresh pool, then the workload with ``fn`` in the pool."""
    checks = [Check(tried(c), lambda c=c: run(fn, c), run(package, c), hint=hint) for c in cases]
    workload = (
        "14 prompts sharing prefixes through a 12-block pool, your part in the engine's pool; then (prefix hits, "
        "free queue, cached blocks, ref counts)"
    )
    checks.append(Check(workload, lambda: _safe(lambda: _workload({name: fn})), _workload({name: package}), hint=hint))
    return report(name, checks)


def check_get_new_blocks(get_new_blocks: Callable[..., Any]) -> list[CheckOutcome]:
    """``get_new_blocks(pool, num_blocks) -> [KVCacheBlock]``: the least recently freed, hashes evicted."""
    from ...core.block_pool import get_new_blocks as package

    return _lru_report(
        "get_new_blocks",
        get_new_blocks,
        package,
        GET_CASES,
        _run_get,
        lambda c: (
            f"get_new_blocks(pool, {c.count})  # {c.label}; then (handed out, free queue front to back, "
            "cached blocks, ref counts)"
        ),
        "take blocks from the front of pool.free_block_queue (the least recently freed), set each one's "
        "ref_cnt to 1, and evict its hash: remove it from pool.cached_block_hash_to_block[h] (and the entry once "
        "empty) and call block.reset_hash(), or a later prompt would hit a block that now holds other tokens "
        "(chapter 08, section 3)",
    )


def check_free_blocks(free_blocks: Callable[..., Any]) -> list[CheckOutcome]:
    """``free_blocks(pool, ordered_blocks) -> None``: a reference dropped; blocks at 0 join the back, in order."""
    from ...core.block_pool import free_blocks as package

    return _lru_report(
        "free_blocks",
        free_blocks,
        package,
        FREE_CASES,
        _run_free,
        lambda c: f"free_blocks(pool, blocks)  # {c.label}; then (free queue front to back, cached blocks, ref counts)",
        "for each block in the order given: ref_cnt -= 1; only a block reaching 0 joins the back of "
        "pool.free_block_queue (most recently used), in that order; keep its hash, so a later prompt can still "
        "hit it until it reaches the front (chapter 08, section 3)",
    )
