"""Exercise 03 — the free queue's O(1) remove: wrong solutions a learner writes."""

from __future__ import annotations

from minipaged.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock

from . import mutant

CHECKS = {"remove": ["check_remove_links", "check_remove_is_O1", "check_remove_in_pool"]}
HELPERS: dict = {}


@mutant("remove", "forgets to decrease queue.num_free_blocks", checks=["check_remove_links", "check_remove_in_pool"])
def forgets_count(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    prev_block, next_block = block.prev_free_block, block.next_free_block
    if prev_block is None or next_block is None:
        raise ValueError(f"block {block.block_id} is not in the free queue")
    prev_block.next_free_block = next_block
    next_block.prev_free_block = prev_block
    block.prev_free_block = block.next_free_block = None
    # MISTAKE: queue.num_free_blocks is left as it was


@mutant(
    "remove",
    "unlinks the neighbours but leaves the removed block's own links pointing into the queue",
    checks=["check_remove_links", "check_remove_in_pool"],
)
def keeps_own_links(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    prev_block, next_block = block.prev_free_block, block.next_free_block
    if prev_block is None or next_block is None:
        raise ValueError(f"block {block.block_id} is not in the free queue")
    prev_block.next_free_block = next_block
    next_block.prev_free_block = prev_block
    # MISTAKE: block.prev_free_block and block.next_free_block are not reset to None
    queue.num_free_blocks -= 1


@mutant(
    "remove",
    "fixes only the forward link (prev.next), not the backward one (next.prev)",
    checks=["check_remove_links", "check_remove_in_pool"],
)
def one_direction_only(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    prev_block, next_block = block.prev_free_block, block.next_free_block
    if prev_block is None or next_block is None:
        raise ValueError(f"block {block.block_id} is not in the free queue")
    prev_block.next_free_block = next_block  # MISTAKE: next_block.prev_free_block still points at block
    block.prev_free_block = block.next_free_block = None
    queue.num_free_blocks -= 1


@mutant(
    "remove",
    "searches the list for the block from the head before unlinking it: O(n), not O(1)",
    checks=["check_remove_is_O1"],
)
def walks_the_list(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    prev_block = queue.fake_free_list_head
    while prev_block.next_free_block is not None and prev_block.next_free_block is not block:  # MISTAKE
        prev_block = prev_block.next_free_block
    if prev_block.next_free_block is None:
        raise ValueError(f"block {block.block_id} is not in the free queue")
    next_block = block.next_free_block
    prev_block.next_free_block = next_block
    next_block.prev_free_block = prev_block
    block.prev_free_block = block.next_free_block = None
    queue.num_free_blocks -= 1


@mutant(
    "remove",
    "no guard: removing a block that is not in the queue fails with AttributeError, not ValueError",
    checks=["check_remove_links", "check_remove_in_pool"],
)
def no_guard(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    prev_block, next_block = block.prev_free_block, block.next_free_block  # MISTAKE: None is not checked
    prev_block.next_free_block = next_block
    next_block.prev_free_block = prev_block
    block.prev_free_block = block.next_free_block = None
    queue.num_free_blocks -= 1
