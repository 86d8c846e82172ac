"""Exercise 04b — the KV cache manager from its spec: managers a learner gets wrong, each one mistake from a right one.

``TableManager`` is a right answer written differently from the solution notebook's: each request's state (its
blocks and how many of them are cached) lives in one small record, the prefix lookup is a ``while`` loop, and the
block count is worked out per region. It is graded for full marks as the mutants' helper. Each mutant below changes
one method of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import mutant

CHECKS = {"KVCacheManager": ["check_manager_spec", "check_manager_twin"]}


@dataclass
class _Held:
    blocks: list[Any] = field(default_factory=list)
    num_cached: int = 0


class TableManager:
    def __init__(self, block_pool: Any, block_size: int, watermark_blocks: int = 0) -> None:
        self.block_pool, self.block_size, self.watermark_blocks = block_pool, block_size, watermark_blocks
        self.held: dict[str, _Held] = {}

    def get_computed_blocks(self, request: Any) -> tuple[list[Any], int]:
        limit = (request.num_tokens - 1) // self.block_size
        hits: list[Any] = []
        while len(hits) < min(limit, len(request.block_hashes)):
            block = self.lookup(request.block_hashes[len(hits)])
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def lookup(self, h: Any) -> Any:
        return self.block_pool.get_cached_block(h)

    def blocks_needed(self, request: Any, held: _Held, hits: list[Any], num_tokens: int) -> int:
        """Fresh blocks: slots past those the request holds and the hits bring."""
        have_slots = (len(held.blocks) + len(hits)) * self.block_size
        return -(-max(0, num_tokens - have_slots) // self.block_size)

    def watermark(self, held: _Held) -> int:
        return 0 if held.blocks else self.watermark_blocks

    def capacity(self, held: _Held) -> int:
        return len(self.block_pool.blocks) - 1 - self.watermark(held)

    def evictable(self, hits: list[Any]) -> int:
        return len([b for b in hits if not b.ref_cnt])

    def take(self, held: _Held, hits: list[Any], n: int) -> list[Any]:
        self.block_pool.touch(hits)
        held.blocks += hits
        fresh = self.block_pool.get_new_blocks(n)
        held.blocks += fresh
        return fresh

    def num_full(self, request: Any, num_computed: int, num_new: int, num_lookahead: int) -> int:
        return min(num_computed + num_new, request.num_tokens) // self.block_size

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> list[Any] | None:
        held = self.held.get(request.request_id, _Held())
        hits = list(new_computed_blocks) if new_computed_blocks else []
        computed = self.num_computed(request, num_new_computed_tokens, num_external_computed_tokens)
        total = computed + num_new_tokens + num_lookahead_tokens
        n = self.blocks_needed(request, held, hits, total)
        if len(held.blocks) + len(hits) + n > self.capacity(held):
            raise ValueError(f"{request.request_id!r} needs more blocks than this pool can ever give")
        if n + self.evictable(hits) + self.watermark(held) > self.block_pool.get_num_free_blocks():
            return None
        if hits:
            held.num_cached = len(hits)
        fresh = self.take(held, hits, n)
        self.held[request.request_id] = held
        full = self.num_full(request, computed, num_new_tokens, num_lookahead_tokens)
        if full > held.num_cached:
            self.block_pool.cache_full_blocks(request, held.blocks, held.num_cached, full, self.block_size)
            held.num_cached = full
        return fresh

    def num_computed(self, request: Any, num_hit_tokens: int, num_external: int) -> int:
        return request.num_computed_tokens + num_hit_tokens + num_external

    def free(self, request: Any) -> None:
        held = self.held.pop(request.request_id, None)
        if held is not None:
            self.block_pool.free_blocks(held.blocks[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        held = self.held.get(request_id)
        return [] if held is None else [b.block_id for b in held.blocks]


HELPERS: dict = {"KVCacheManager": TableManager}


@mutant("KVCacheManager", "free cached hits are not counted: the pool runs dry halfway through an allocation")
class HitsCostNothing(TableManager):
    def evictable(self, hits: list[Any]) -> int:
        return 0  # MISTAKE: a hit with ref_cnt 0 leaves the free blocks when touched


@mutant("KVCacheManager", "the watermark held back from every allocation: running requests are starved near full")
class WatermarkForAll(TableManager):
    def watermark(self, held: _Held) -> int:
        return self.watermark_blocks  # MISTAKE: only for a request that holds no blocks yet


@mutant("KVCacheManager", "no watermark: a new request takes the last free blocks")
class NoWatermark(TableManager):
    def watermark(self, held: _Held) -> int:
        return 0  # MISTAKE: a new request must leave watermark_blocks free


@mutant("KVCacheManager", "fresh blocks taken before the hits are touched: a fresh block can be a hit, its hash lost")
class FreshBeforeHits(TableManager):
    def take(self, held: _Held, hits: list[Any], n: int) -> list[Any]:
        fresh = self.block_pool.get_new_blocks(n)  # MISTAKE: touch the hits first
        self.block_pool.touch(hits)
        held.blocks += hits + fresh
        return fresh


@mutant("KVCacheManager", "the prefix hit may cover the whole prompt: no token is left to give the first logits")
class WholePromptHit(TableManager):
    def get_computed_blocks(self, request: Any) -> tuple[list[Any], int]:
        hits: list[Any] = []
        for h in request.block_hashes:  # MISTAKE: at most (num_tokens - 1) // block_size blocks
            block = self.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size


@mutant("KVCacheManager", "the lookup touches what it finds: a request that is then refused keeps them")
class LookupTouches(TableManager):
    def get_computed_blocks(self, request: Any) -> tuple[list[Any], int]:
        hits, n = super().get_computed_blocks(request)
        self.block_pool.touch(hits)  # MISTAKE: only allocate_slots touches, once it knows the request fits
        return hits, n


@mutant("KVCacheManager", "blocks freed first to last: a prompt's shared first blocks are evicted first")
class FreesHeadFirst(TableManager):
    def free(self, request: Any) -> None:
        held = self.held.pop(request.request_id, None)
        if held is not None:
            self.block_pool.free_blocks(held.blocks)  # MISTAKE: last block first


@mutant("KVCacheManager", "lookahead slots counted as full of tokens: blocks of drafts not yet made are cached")
class CachesLookahead(TableManager):
    def num_full(self, request: Any, num_computed: int, num_new: int, num_lookahead: int) -> int:
        return (num_computed + num_new + num_lookahead) // self.block_size  # MISTAKE: real tokens only


@mutant("KVCacheManager", "external hits left out of the computed tokens: no blocks are allocated to load them into")
class ForgetsExternalHits(TableManager):
    def num_computed(self, request: Any, num_hit_tokens: int, num_external: int) -> int:
        return request.num_computed_tokens + num_hit_tokens  # MISTAKE: + num_external


@mutant("KVCacheManager", "a request that can never fit gets None: the scheduler waits for it forever")
class WaitsForever(TableManager):
    def capacity(self, held: _Held) -> int:
        return 1 << 30  # MISTAKE: more blocks than the pool minus the watermark can never come: ValueError


@mutant("KVCacheManager", "a new chunk's blocks counted from its own tokens, not from where the request stands")
class BlocksPerChunk(TableManager):
    def blocks_needed(self, request: Any, held: _Held, hits: list[Any], num_tokens: int) -> int:
        chunk = num_tokens - request.num_computed_tokens  # MISTAKE: slots up to num_tokens, past those held
        return -(-chunk // self.block_size) if held.blocks else super().blocks_needed(request, held, hits, num_tokens)
