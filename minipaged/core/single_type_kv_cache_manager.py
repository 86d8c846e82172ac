"""One attention type's blocks: full attention keeps every block, a sliding window gives old ones back.

A model whose layers all see their whole context needs one block table per request. A model that mixes
full-attention layers with sliding-window layers (Gemma 3, Qwen2 with ``use_sliding_window``, Mistral-7B-v0.1)
needs one per *KV cache group* (``kv_cache_coordinator.py``): a sliding-window layer never reads a position more
than ``sliding_window - 1`` behind the token it computes, so the blocks behind that are garbage to it, while a
full-attention layer still reads them. One manager per group keeps that group's tables (vLLM v1:
``vllm/v1/core/single_type_kv_cache_manager.py``); all groups draw on the one ``BlockPool``.

Sliding window 8, block size 4, 14 tokens computed; the next token (position 14) reads positions 7..14::

    positions     0-3    4-7    8-11   12-15
    full          [b3]   [b8]   [b2]   [b6: 2/4]     every block kept
    window 8      [null] [b9]   [b4]   [b1: 2/4]     0-3 lie behind the window: their block went back to the pool

``remove_skipped_blocks`` does that swap to the null block before each allocation, so a sliding-window group holds
at most about ``sliding_window / block_size + 1`` blocks per request however long it runs. A prefix-cache hit
follows the same rule from the other side (``find_longest_cache_hit``): a full-attention group needs *every*
block of the prefix, left to right, while a sliding-window group needs only the last ``cdiv(sliding_window - 1,
block_size)`` blocks before the first token it will compute, so it searches from the right.
"""

from __future__ import annotations

from collections.abc import Sequence

from .. import hooks
from ..utils import cdiv
from .block_pool import BlockHash, BlockPool, KVCacheBlock, group_block_hash
from .request import Request

SEAM = hooks.Seam(
    "single_type_kv_cache_manager",
    find_prefix_hits="KVCacheManager.get_computed_blocks: the longest cached prefix",
)


def find_prefix_hits(pool: BlockPool, block_hashes: Sequence[BlockHash], num_tokens: int, block_size: int) -> list[int]:
    """Ids of the cached blocks that hold a prompt's longest cached prefix (see ``get_computed_blocks``)."""
    hits: list[int] = []
    for block_hash in block_hashes[: (num_tokens - 1) // block_size]:
        block = pool.get_cached_block(block_hash)
        if block is None:  # chained hashes: the first miss ends the prefix
            break
        hits.append(block.block_id)
    return hits


class SingleTypeKVCacheManager:
    """The block tables of one KV cache group: full attention (``sliding_window`` None) keeps every block."""

    sliding_window: int | None = None

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int = 0) -> None:
        self.block_pool, self.block_size, self.group_id = block_pool, block_size, group_id
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}  # request_id -> its blocks in logical order
        self.num_cached_block: dict[str, int] = {}  # request_id -> how many of them are in the prefix cache
        # request_id -> how many of its first block ids the runner holds as they are now (``take_block_updates``):
        # every change at index i lowers it to i at most, and the next step sends the ids from there on.
        self.num_sent: dict[str, int] = {}

    def hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The prefix-cache keys of the request's first ``num_blocks`` full blocks, for this group."""
        return [group_block_hash(h, self.group_id) for h in request.block_hashes[:num_blocks]]

    # ---- what an allocation would take ---------------------------------------------------
    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks no layer of this group reads again once ``num_computed_tokens`` are computed."""
        return 0

    def num_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue now (those no other request holds)."""
        blocks = self.req_to_blocks.get(request_id, [])[: self.num_skipped_blocks(num_computed_tokens)]
        return sum(1 for b in blocks if not b.is_null and b.ref_cnt == 1)

    def max_num_blocks(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computing up to ``max_new_tokens``
        tokens per step."""
        return cdiv(num_tokens, self.block_size)

    # ---- changes ---------------------------------------------------------------------------
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks this group's layers will never read again (none, for full attention)."""

    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest prefix hit of at most ``max_num_blocks`` blocks: every block, from the left. A learner's
        ``find_prefix_hits`` (exercise 08) answers instead when one is plugged in."""
        # The prompt's own length when the cap is the prompt's (a learner's lookup is graded on the real call).
        num_tokens = request.num_tokens
        if max_num_blocks != (num_tokens - 1) // self.block_size:
            num_tokens = max_num_blocks * self.block_size + 1
        hashes = request.block_hashes if self.group_id == 0 else self.hashes(request, max_num_blocks)
        args = (self.block_pool, hashes, num_tokens, self.block_size)
        hit_ids = SEAM.pick("find_prefix_hits", find_prefix_hits)(*args)
        if len(hit_ids) > max_num_blocks:  # a request left with nothing to compute could never be scheduled
            raise ValueError(
                f"find_prefix_hits returned {len(hit_ids)} blocks for a {num_tokens}-token prompt in blocks of "
                f"{self.block_size}: at most (num_tokens - 1) // block_size = {max_num_blocks}. The prompt's last "
                "token is always computed, to give the logits of the first output token"
            )
        return [self.block_pool.blocks[i] for i in hit_ids]

    def cache_blocks(self, request: Request, num_cached: int, num_full_blocks: int) -> list[KVCacheBlock]:
        """Hash the request's blocks ``num_cached .. num_full_blocks - 1`` into the prefix cache; returns them."""
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full_blocks, self.block_size, self.group_id)
        self.num_cached_block[request.request_id] = max(num_cached, num_full_blocks)
        return [b for b in blocks[num_cached:num_full_blocks] if not b.is_null]

    def fork(self, parent_id: str, child_id: str) -> None:
        blocks = self.req_to_blocks.get(parent_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child_id] = list(blocks)
        self.num_cached_block[child_id] = self.num_cached_block.get(parent_id, 0)

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Give back the blocks past the first ``cdiv(num_tokens, block_size)``, tail first; returns how many."""
        blocks = self.req_to_blocks.get(request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) <= keep:
            return 0
        spare = blocks[keep:]
        self.block_pool.free_blocks(reversed(spare))  # checks first: raises with nothing changed
        del blocks[keep:]
        self.changed(request_id, keep)
        return len(spare)

    def free(self, request_id: str) -> None:
        """Give back every block, last first: a prefix's first blocks, shared the most, are evicted last."""
        self.block_pool.free_blocks(reversed(self.req_to_blocks.get(request_id, [])))  # raises, changing nothing
        self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        self.num_sent.pop(request_id, None)

    def changed(self, request_id: str, index: int) -> None:
        """The request's block ``index`` (or the tail from it) changed: the runner's copy is right before it."""
        if self.num_sent.get(request_id, 0) > index:
            self.num_sent[request_id] = index

    def take_block_updates(self, request_id: str, resend: bool = False) -> tuple[int, list[int]]:
        """What the runner lacks of the request's block table: (the first index it lacks, the ids from there
        on); the runner then holds the whole table. ``resend``: from the first block."""
        blocks = self.req_to_blocks.get(request_id, ())
        num = len(blocks)
        start = 0 if resend else min(self.num_sent.get(request_id, 0), num)
        if start == num:  # the runner has it all (most steps of a decode)
            return num, []
        self.num_sent[request_id] = num
        return start, [b.block_id for b in blocks[start:]]


class FullAttentionManager(SingleTypeKVCacheManager):
    """Layers that read their whole context: every block stays until the request leaves."""


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Layers that read only the last ``sliding_window`` positions (the token itself included)."""

    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, sliding_window: int) -> None:
        super().__init__(block_pool, block_size, group_id)
        self.sliding_window = self.window = sliding_window
        # A hit must hold the window before the first computed token: sliding_window - 1 positions.
        self.num_contiguous_blocks = cdiv(sliding_window - 1, block_size)

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) reads back to num_computed_tokens - sliding_window + 1.
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def max_num_blocks(self, num_tokens: int, max_new_tokens: int) -> int:
        # A step computing k tokens after c reads from c - window + 1 to c + k - 1: at most
        # cdiv(k + window - 1, block_size) + 1 blocks (the span may straddle one more boundary).
        bound = cdiv(max_new_tokens + self.window - 1, self.block_size) + 1
        return min(cdiv(num_tokens, self.block_size), bound)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Swap the blocks that fell out of the window for the null block and free them (right to left, stopping
        at the first null block: everything before it went in earlier calls)."""
        blocks = self.req_to_blocks.get(request_id, [])
        removed: list[KVCacheBlock] = []
        for i in range(min(self.num_skipped_blocks(num_computed_tokens), len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = self.block_pool.null_block
            self.changed(request_id, i)
        self.block_pool.free_blocks(removed)

    def find_longest_cache_hit(self, request: Request, max_num_blocks: int) -> list[KVCacheBlock]:
        """Search from the right for ``num_contiguous_blocks`` cached blocks in a row; the blocks before them are
        null (never read). A run that reaches the first block is a hit however short (block size 4, window 8)::

            cached?      no   no   yes  yes  no   yes        -> [null, null, b7, b8]   (positions 0..15 computed)
        """
        hashes = self.hashes(request, max_num_blocks)
        hits = [self.block_pool.null_block] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self.num_contiguous_blocks:
                return hits[: i + run]
        return hits[:run]  # the leading run only


def make_manager(
    block_pool: BlockPool, block_size: int, group_id: int, sliding_window: int | None
) -> SingleTypeKVCacheManager:
    if sliding_window is None:
        return FullAttentionManager(block_pool, block_size, group_id)
    return SlidingWindowManager(block_pool, block_size, group_id, sliding_window)
