"""KV connectors: K/V that lives outside the pool, found by block hash and loaded back as *external hits*.

A request's prompt may be computed already even when the local prefix cache has lost it. It may sit in CPU
memory, where this engine put the blocks it evicted, or in another engine that ran the prompt's prefill. vLLM v1
reaches such K/V through a *KV connector* (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) with two
halves:

* the **scheduler side** decides: how many of a waiting request's next tokens the connector holds
  (``get_num_new_matched_tokens``), which device blocks receive them once ``allocate_slots`` gave the request
  its blocks (``update_state_after_alloc``), and what this step copies (``build_connector_meta``: plain data,
  sent with the ``SchedulerOutput``);
* the **worker side** copies: the runner performs the metadata's saves and loads on the cache tensors before the
  forward pass (``CacheEngine.offload`` / ``onload``), so the attention reads the loaded K/V as if computed.

In ``allocate_slots`` the external tokens are the third region of a request's layout::

    | computed | new prefix-cache hits | external hits | new | lookahead |
                                       ^ blocks allocated now, filled by the connector's load this step

``OffloadingConnector`` is vLLM v1's answer to swapping, in this package's small shape. Prefix caching keeps a
freed request's blocks findable until the pool needs them for other tokens. With the offloader, a cached block
evicted then is first copied to a CPU store (an LRU over ``num_slots`` block-sized slots, keyed by the block's
hash). A later prompt with the same prefix loads it back instead of recomputing it::

    device pool  [b7 #h1][b2 #h2] ... evicted for new tokens   ->  store: h1 -> slot 0, h2 -> slot 1
    later, a prompt whose blocks hash to h1 h2 h3 (h3 new):
        local prefix cache: no hit;  connector: h1, h2 in the store  ->  2 external blocks
        allocate_slots: 3 blocks [b4 b9 b5];  loads (slot 0 -> b4), (slot 1 -> b9);  only h3's tokens computed

A step happens or it does not (``step.py``): what a step's saves put in the store becomes findable only once the
next step starts (``commit_step``); a failed step's saves are forgotten (``rollback_step``), and a slot that a
step loads from is never overwritten by a save of the same step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..utils import check_int
from .block_pool import BlockHash, KVCacheBlock
from .request import Request


@dataclass
class KVConnectorMetadata:
    """One step's copies between the pool and a connector's store (plain data, as the rest of the step)."""

    saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, store slot): before any write
    loads: list[tuple[int, int]] = field(default_factory=list)  # (store slot, device block): before the forward
    sends: list[tuple[int, BlockHash]] = field(default_factory=list)  # (device block, hash): after the forward

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.sends)


class KVConnector:
    """The scheduler side of a connector (vLLM's ``KVConnectorBase_V1``); this base holds nothing outside."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` (the local hits) that the connector can load, in whole
        blocks, never the prompt's last token (its logits are needed). Changes nothing."""
        return 0

    def update_state_after_alloc(
        self, request: Request, blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """``allocate_slots`` gave ``request`` the device ``blocks`` that receive its external hits, the tokens
        after its first ``num_computed_tokens`` (those it had and its local hits)."""

    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        """A cached block is about to hold other tokens; this step may copy it out first."""

    def after_allocation(
        self,
        request: Request,
        external: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        evicted: list[tuple[int, BlockHash]] | None,
    ) -> None:
        """The connector's share of one ``allocate_slots``: the fresh blocks that receive its external hits (their
        slots pinned first: no save of this step may take them), and ``evicted``, the cached blocks evicted to make
        room (it may copy them out before the step writes over them), emptied once heard."""
        if external:
            self.update_state_after_alloc(request, external, num_computed_tokens)
        for block_id, block_hash in evicted or ():
            self.on_evict(block_id, block_hash)
        if evicted:
            evicted.clear()

    def build_connector_meta(self, hashed: Sequence[KVCacheBlock] = ()) -> KVConnectorMetadata:
        """This step's copies, handed to the runner with the ``SchedulerOutput``; ``hashed``: the blocks this
        step fills with their last tokens (full blocks of real tokens, their hashes set)."""
        return KVConnectorMetadata()

    def commit_step(self) -> None:
        """The last step ran: what it saved is in the store now."""

    def rollback_step(self) -> None:
        """The last step failed: forget its saves, release its loads."""

    def reset(self) -> None:
        """Forget everything stored (``reset_prefix_cache``, or after a learner's part may have written it)."""


class OffloadingConnector(KVConnector):
    """Evicted prefix blocks kept in a CPU store of ``num_slots`` blocks (LRU), loaded back as external hits.

    ``index`` maps a block hash to its slot, least recently used first. The step being scheduled adds
    ``pending`` saves (their slots are taken but not findable yet) and ``pinned`` slots (read by its loads).
    """

    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = check_int("num_slots", num_slots, 1)
        self.block_size = check_int("block_size", block_size, 1)
        self.index: OrderedDict[BlockHash, int] = OrderedDict()
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self.pending: dict[BlockHash, tuple[int, int]] = {}  # hash -> (device block, slot), this step's saves
        self.loads: list[tuple[int, int]] = []  # (slot, device block), this step's
        self.pinned: set[int] = set()
        self.num_saved = 0  # blocks copied to the store so far (committed steps)
        self.num_loaded = 0  # blocks loaded back so far (committed steps)

    # ---- the lookups ----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # hits never cover the last token
        found = 0
        for block_hash in request.block_hashes[first:last]:
            if block_hash not in self.index:  # chained hashes: the first miss ends the prefix
                break
            found += 1
        return found * self.block_size

    def update_state_after_alloc(
        self, request: Request, blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        first = num_computed_tokens // self.block_size
        for i, block in enumerate(blocks):
            slot = self.index[request.block_hashes[first + i]]
            self.index.move_to_end(request.block_hashes[first + i])  # used: the last to be overwritten
            self.loads.append((slot, block.block_id))
            self.pinned.add(slot)

    # ---- the saves --------------------------------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: BlockHash) -> None:
        if block_hash in self.index:  # stored already (it was evicted before, then computed again)
            self.index.move_to_end(block_hash)
            return
        if block_hash in self.pending:
            return
        slot = self._take_slot()
        if slot is not None:
            self.pending[block_hash] = (block_id, slot)

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used one that no load of this step reads; None if none."""
        if self.free_slots:
            return self.free_slots.pop()
        for block_hash, slot in self.index.items():
            if slot not in self.pinned:
                del self.index[block_hash]
                return slot
        return None

    # ---- the step -----------------------------------------------------------------------------------------
    def build_connector_meta(self, hashed: Sequence[KVCacheBlock] = ()) -> KVConnectorMetadata:
        return KVConnectorMetadata(saves=list(self.pending.values()), loads=list(self.loads))

    def commit_step(self) -> None:
        for block_hash, (_, slot) in self.pending.items():
            self.index[block_hash] = slot
        self.num_saved += len(self.pending)
        self.num_loaded += len(self.loads)
        self.pending.clear()
        self.loads.clear()
        self.pinned.clear()

    def rollback_step(self) -> None:
        # A failed step's saves never happened, or happened half: their slots hold nothing findable. (An entry
        # a save pushed out of the index stays out: its slot may have been written.)
        self.free_slots.extend(slot for _, slot in self.pending.values())
        self.pending.clear()
        self.loads.clear()
        self.pinned.clear()

    def reset(self) -> None:
        self.index.clear()
        self.pending.clear()
        self.loads.clear()
        self.pinned.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_stored(self) -> int:
        return len(self.index)
