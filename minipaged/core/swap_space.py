"""``SwapSpace``: a preempted request's K/V parked in CPU blocks (chapter 07; vLLM v0's swap preemption).

The PagedAttention paper (§4.5) offers two ways to make room when the pool runs dry: recompute (drop a victim's
K/V and compute it again later) and swap (copy its blocks to CPU memory and back). vLLM v1 keeps recompute only;
this engine keeps both so that chapter 07 can measure them against each other. The swap space is a second
``BlockPool``, on the CPU, whose block 0 is unused as on the device::

    swap_out   device [b7 b2 b9]  (9 tokens computed, block_size 4)   ->   CPU [c3 c1 c4], device blocks freed
    swap_in    CPU [c3 c1 c4]  ->  device [b4 b11 b6 (+ blocks for this step's new tokens)], CPU blocks freed

Only the block ids move here; the cache engine (``worker/cache_engine.py``) copies the K/V, before anything
else runs in the step.
"""

from __future__ import annotations

from typing import Protocol

from ..utils import cdiv, check_int
from .block_pool import BlockPool
from .kv_cache_coordinator import KVCacheBlocks
from .request import Request
from .step_commit import StepCommit


class KVCacheManager(Protocol):
    """What the swap space uses of a ``kv_cache_manager.KVCacheManager`` (named here, not imported: it imports
    this)."""

    block_size: int
    step: StepCommit

    def get_block_ids(self, request_id: str) -> list[int]: ...

    def free(self, request: Request | str) -> None: ...

    def allocate_slots(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None: ...


class SwapSpace:
    """The CPU blocks of swapped-out requests, for one ``KVCacheManager`` (one full-attention group)."""

    def __init__(self, manager: KVCacheManager, num_cpu_blocks: int) -> None:
        self.manager = manager
        self.num_cpu_blocks = check_int("num_cpu_blocks", num_cpu_blocks, 0)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks >= 2 else None
        self.swapped_blocks: dict[str, list[int]] = {}  # request id -> its CPU blocks, in logical order

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a preempted request's computed blocks to CPU blocks: the (device, CPU) copies to make, or None
        when the swap space cannot take them (then the caller recomputes instead). Only blocks that hold computed
        K/V move; the device blocks are freed at once."""
        kv = self.manager
        num = cdiv(request.num_computed_tokens, kv.block_size)
        if self.cpu_pool is None or num == 0 or self.cpu_pool.get_num_free_blocks() < num:
            return None
        cpu_blocks = [b.block_id for b in self.cpu_pool.get_new_blocks(num)]
        device_blocks = kv.get_block_ids(request.request_id)
        kv.free(request)
        self.swapped_blocks[request.request_id] = cpu_blocks
        kv.step.uncommitted_swap_outs.append(request.request_id)
        return list(zip(device_blocks, cpu_blocks))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Device blocks for a swapped request and this step's new tokens: the (CPU, device) copies to make, or
        None when the pool cannot give them yet (the request keeps its CPU blocks)."""
        kv, computed = self.manager, request.num_computed_tokens
        request.num_computed_tokens = 0  # allocate as if new: every block, old and new, is fresh on the device
        try:
            blocks = kv.allocate_slots(request, computed + num_new_tokens)
        finally:
            request.num_computed_tokens = computed
        if blocks is None:
            return None
        cpu_blocks = self.swapped_blocks.pop(request.request_id)
        self._free_cpu(cpu_blocks)
        copies = list(zip(cpu_blocks, (b.block_id for b in blocks)))
        kv.step.uncommitted_copies += [dst for _, dst in copies]
        return copies

    def free_swapped(self, request_id: str) -> None:
        """Give back a swapped request's CPU blocks (it was aborted, or its swap space held garbage)."""
        self._free_cpu(self.swapped_blocks.pop(request_id, []))

    def num_free_blocks(self) -> int:
        return 0 if self.cpu_pool is None else self.cpu_pool.get_num_free_blocks()

    def _free_cpu(self, cpu_blocks: list[int]) -> None:
        if cpu_blocks and self.cpu_pool is not None:
            self.cpu_pool.free_blocks(self.cpu_pool.blocks[b] for b in reversed(cpu_blocks))
