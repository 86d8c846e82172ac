"""``StepCommit``: what scheduling one step wrote ahead of the device, kept once the step ran, undone if it failed.

Scheduling a step changes the pool before the model writes anything: full blocks are hashed into the prefix cache
(a later request may find them), copy-on-write and swap-in copies are decided, requests are swapped out. Until the
step has run, those hashes promise K/V that is not there yet. So the manager notes them here::

    schedule step n       ->  uncommitted   (hashed blocks, copy destinations, swapped-out requests)
    step n ran            ->  commit()      forget them: they hold what they say
    step n failed         ->  rollback()    drop the hashes; say which blocks hold garbage

With asynchronous scheduling (``async_scheduler.py``) step n+1 is scheduled while step n runs: ``hold()`` moves
step n's notes to ``in_flight`` first, and a failure rolls back both. vLLM v1 has no such rollback (a failed step
ends its engine); here a step rolls back whole (``engine/step.py``), so a learner's wrong part or a dead worker
costs a recomputation, never a wrong token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..utils import cdiv
from .block_pool import BlockPool, KVCacheBlock
from .request import Request
from .single_type_kv_cache_manager import SingleTypeKVCacheManager


@dataclass
class RolledBack:
    """What a failed step leaves unknown: ``dropped``, the blocks whose hashes went (a request that found one in
    the prefix cache holds nothing there); ``copied``, the blocks its copies were to fill; ``swapped_out``, the
    requests whose swap space it was to fill."""

    dropped: set[int]
    copied: set[int]
    swapped_out: list[str]


@dataclass
class StepCommit:
    """The notes of the step being scheduled (``uncommitted_*``) and, with async scheduling, of the step running
    on the device (``in_flight_*``). Bounded: each list is emptied every step."""

    uncommitted_blocks: list[KVCacheBlock] = field(default_factory=list)  # hashed while scheduling the step
    uncommitted_copies: list[int] = field(default_factory=list)  # device blocks its copies fill
    uncommitted_swap_outs: list[str] = field(default_factory=list)  # requests it swaps out
    in_flight_blocks: list[KVCacheBlock] = field(default_factory=list)
    in_flight_copies: list[int] = field(default_factory=list)
    in_flight_swap_outs: list[str] = field(default_factory=list)

    def commit(self) -> None:
        """The step ran: its hashed blocks hold what their hashes say, its copies are made."""
        self.uncommitted_blocks, self.uncommitted_copies, self.uncommitted_swap_outs = [], [], []

    def hold(self) -> None:
        """The step is handed to the device while the next one is scheduled: its notes wait in ``in_flight``
        until its result is in (a prefix hit on its blocks is safe: the device runs the steps in order)."""
        assert not self.in_flight_blocks and not self.in_flight_copies, "one step in flight at a time"
        self.in_flight_blocks, self.uncommitted_blocks = self.uncommitted_blocks, []
        self.in_flight_copies, self.uncommitted_copies = self.uncommitted_copies, []
        self.in_flight_swap_outs, self.uncommitted_swap_outs = self.uncommitted_swap_outs, []

    def commit_in_flight(self) -> None:
        """The step that was in flight ran."""
        self.in_flight_blocks, self.in_flight_copies, self.in_flight_swap_outs = [], [], []

    def rollback(self, pool: BlockPool) -> RolledBack:
        """Both steps failed (or the one, without async scheduling): drop every hash they added to ``pool``'s
        prefix cache and say what they were to write."""
        blocks = (*self.in_flight_blocks, *self.uncommitted_blocks)
        rolled = RolledBack(
            {b.block_id for b in blocks if pool.drop_hash(b)},
            {*self.in_flight_copies, *self.uncommitted_copies},
            [*self.in_flight_swap_outs, *self.uncommitted_swap_outs],
        )
        self.commit_in_flight()
        self.commit()
        return rolled


def forget_computed(
    managers: list[SingleTypeKVCacheManager], request: Request, rolled: RolledBack, block_size: int
) -> int | None:
    """After a failed step: how many tokens of ``request`` still hold their K/V. From its first block the failed
    step was to fill on (a full block it found in the prefix cache but whose hash went, a block a copy was to fill),
    they count as not computed; a block whose hash went is hashed again once it is computed. (Its own block that the
    failed step was to complete keeps the tokens earlier steps wrote.) None: the request must start again from its
    first token (a sliding window already gave back blocks the tokens to compute again attend to: the step scheduled
    ahead moved its window on)."""
    rid, num_computed = request.request_id, request.num_computed_tokens
    for manager in managers:
        blocks = manager.req_to_blocks.get(rid, ())
        for i, block in enumerate(blocks[: cdiv(num_computed, block_size)]):
            full = (i + 1) * block_size <= num_computed
            if block.block_id in rolled.copied or (full and block.block_id in rolled.dropped):
                num_computed = min(num_computed, i * block_size)
                break
        for i, block in enumerate(blocks[: manager.num_cached_block.get(rid, 0)]):
            if block.block_id in rolled.dropped:
                manager.num_cached_block[rid] = i
                break
    for manager in managers:
        window = getattr(manager, "sliding_window", None)
        if window is not None and num_computed:
            first = max(0, num_computed - window + 1) // block_size
            if any(b.is_null for b in manager.req_to_blocks.get(rid, ())[first : cdiv(num_computed, block_size)]):
                return None
    return num_computed
