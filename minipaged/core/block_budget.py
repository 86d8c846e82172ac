"""What one ``allocate_slots`` call would take from the pool, and whether the pool gives it: one inequality.

::

    blocks to allocate + evictable hits + watermark (new requests only)  <=  free blocks - reserved blocks
                                                                           (+ blocks a sliding window gives back)

``block_need`` answers it without changing anything, so ``KVCacheManager.can_allocate`` and ``allocate_slots`` ask
the same question the same way (vLLM v1 splits it the same: ``get_num_blocks_to_allocate`` in
``vllm/v1/core/kv_cache_coordinator.py``, then the free-block check in ``KVCacheManager.allocate_slots``). Each term,
per KV cache group:

* **blocks to allocate**: the blocks the request must hold after this step (computed + hits + new + lookahead
  tokens, rounded up) minus those it holds and the hits it is handed;
* **evictable hits**: a prefix-cache hit on a block whose ref count is 0 sits in the free queue, so touching it
  uses up a free block too;
* **copy-on-write**: the first new token lands in a partly filled block that a forked sibling (n > 1) shares:
  one more block, for its private copy;
* **watermark**: kept free against new admissions only (a running request that cannot grow must be preempted,
  throwing work away; a newcomer can wait).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ..utils import cdiv, check_int
from .block_pool import BlockPool, KVCacheBlock
from .kv_cache_coordinator import KVCacheBlocks
from .kv_connector import KVConnector
from .request import Request
from .single_type_kv_cache_manager import SingleTypeKVCacheManager

Hits = KVCacheBlocks | Sequence[KVCacheBlock] | None


class KVCacheManager(Protocol):
    """What the count reads of a ``kv_cache_manager.KVCacheManager`` (named here, not imported: it imports this)."""

    block_size: int
    num_blocks: int
    enable_caching: bool
    watermark_blocks: int
    reserved_blocks: int
    block_pool: BlockPool
    managers: list[SingleTypeKVCacheManager]
    connector: KVConnector | None
    no_hits: KVCacheBlocks

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]: ...

    def attach_hasher(self, request: Request) -> None: ...


@dataclass
class BlockNeed:
    """What one ``allocate_slots`` call would take (``block_need``)."""

    fits: bool
    new_computed: KVCacheBlocks  # prefix-cache hits to touch, per group
    num_new_blocks: int  # fresh blocks, all groups, the copy-on-write blocks included
    cow: list[int]  # the groups whose block the first new token goes to is shared: copy it first
    write_idx: int  # which of the request's blocks that is
    is_new_admission: bool
    num_computed_tokens: int  # computed + prefix-hit + external-hit tokens
    num_external_blocks: int  # of the fresh blocks, those the connector fills


@dataclass
class _Count:
    new_blocks: int = 0  # fresh blocks to take, all groups
    evictable_hits: int = 0  # hits sitting in the free queue
    freed: int = 0  # blocks behind a sliding window that go back first
    held: int = 0  # blocks the request holds once the step is scheduled


def block_need(
    kv: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: Hits = None,
    num_lookahead_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> BlockNeed:
    """The arguments of ``allocate_slots`` checked (``ValueError`` naming the bad one, or a request the pool could
    never hold), and what it would take from the pool. Changes nothing but the request's hasher."""
    new_computed = check_allocate_args(
        kv, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
        num_external_computed_tokens,
    )  # fmt: skip
    if kv.enable_caching:
        kv.attach_hasher(request)  # before any change: it refuses a hasher of another block size
    num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
    num_slots = num_computed + num_new_tokens + num_lookahead_tokens
    count, cow = _count(kv, request, new_computed, num_computed, cdiv(num_slots, kv.block_size), num_new_tokens)
    is_new_admission = not kv.req_to_blocks.get(request.request_id)
    watermark = kv.watermark_blocks if is_new_admission else 0
    capacity = kv.num_blocks - 1 - kv.reserved_blocks - watermark
    if count.held > capacity:
        raise ValueError(
            f"request {request.request_id!r} needs {count.held} blocks for {num_slots} tokens; the pool can never "
            f"give it more than {capacity} ({kv.num_blocks - 1} usable - {kv.reserved_blocks} reserved - "
            f"{watermark} watermark)"
        )
    available = kv.block_pool.get_num_free_blocks() + count.freed - kv.reserved_blocks
    fits = count.new_blocks + count.evictable_hits + watermark <= available
    return BlockNeed(
        fits, new_computed, count.new_blocks, cow, request.num_computed_tokens // kv.block_size, is_new_admission,
        num_computed, num_external_computed_tokens // kv.block_size,
    )  # fmt: skip


def _count(
    kv: KVCacheManager, request: Request, hits: KVCacheBlocks, num_computed: int, num_required: int, num_new: int
) -> tuple[_Count, list[int]]:
    """The terms of the inequality, summed over the KV cache groups; and the groups that must copy on write."""
    rid, bs = request.request_id, kv.block_size
    write_idx = request.num_computed_tokens // bs
    count, cow = _Count(), []
    for g, (manager, group_hits) in enumerate(zip(kv.managers, hits.blocks)):
        blocks = manager.req_to_blocks.get(rid, [])
        count.new_blocks += max(0, num_required - len(blocks) - len(group_hits))
        count.evictable_hits += sum(1 for b in group_hits if b.ref_cnt == 0 and not b.is_null)
        count.held += num_required
        if manager.sliding_window is not None:  # its blocks behind the window go back before new ones are taken
            count.freed += manager.num_freed_by_skip(rid, num_computed)
            count.held -= min(num_required, manager.num_skipped_blocks(num_computed))
        shared = write_idx < len(blocks) and blocks[write_idx].ref_cnt > 1
        if num_new > 0 and request.num_computed_tokens % bs != 0 and shared:
            cow.append(g)
    count.new_blocks += len(cow)
    return count, cow


def check_allocate_args(
    kv: KVCacheManager,
    request: Request,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: Hits,
    num_lookahead_tokens: int,
    num_external_computed_tokens: int,
) -> KVCacheBlocks:
    """``allocate_slots``'s arguments, each refused with a sentence that names it; the hits, per group."""
    for name, v in (
        ("num_new_tokens", num_new_tokens),
        ("num_new_computed_tokens", num_new_computed_tokens),
        ("num_lookahead_tokens", num_lookahead_tokens),
        ("num_external_computed_tokens", num_external_computed_tokens),
    ):
        check_int(name, v, 0)
    new_computed = as_blocks(kv, new_computed_blocks)
    if num_new_computed_tokens != len(new_computed) * kv.block_size:
        raise ValueError(
            f"num_new_computed_tokens={num_new_computed_tokens} must equal "
            f"{len(new_computed)} computed blocks x block_size {kv.block_size}"
        )
    req_blocks = kv.req_to_blocks.get(request.request_id, [])
    if new_computed and (req_blocks or not kv.enable_caching):
        raise ValueError(
            "new_computed_blocks are prefix-cache hits: only for a request that holds no "
            "blocks yet, and only with enable_caching=True"
        )
    if num_external_computed_tokens and (
        kv.connector is None
        or req_blocks
        or request.num_computed_tokens
        or num_external_computed_tokens % kv.block_size
    ):
        raise ValueError(
            f"num_external_computed_tokens={num_external_computed_tokens}: external hits come from a KV "
            "connector, in whole blocks, for a request that holds no blocks yet"
        )
    return new_computed


def as_blocks(kv: KVCacheManager, blocks: Hits) -> KVCacheBlocks:
    """Prefix hits as ``KVCacheBlocks``: a plain list is group 0's, for a manager of one group."""
    if type(blocks) is KVCacheBlocks:  # not isinstance: an ABC check, and this runs per request per step
        if len(blocks.blocks) != len(kv.managers) or len({len(b) for b in blocks.blocks}) > 1:
            raise ValueError(
                f"new_computed_blocks has {len(blocks.blocks)} groups of {[len(b) for b in blocks.blocks]} "
                f"blocks; this manager has {len(kv.managers)} KV cache groups, all hits of one length"
            )
        return blocks
    if not blocks:
        return kv.no_hits
    if len(kv.managers) > 1:
        raise ValueError("a model with several KV cache groups takes its prefix hits as KVCacheBlocks")
    return KVCacheBlocks((list(blocks),))
