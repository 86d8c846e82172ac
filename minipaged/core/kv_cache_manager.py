"""``KVCacheManager``: the scheduler's one door to the block pool.

The scheduler never handles blocks itself. For each request it asks two questions:

* ``get_computed_blocks(request)``: how much of this prompt is already in the
  prefix cache? (blocks to reuse, and how many tokens they cover)
* ``allocate_slots(request, num_new_tokens, ...)``: give me room for the tokens
  I am about to compute this step, or tell me there is none (``None``).

and says ``free(request)`` when a request finishes or is preempted. The manager
keeps each request's block list (``req_to_blocks``), turns token counts into
block counts, applies the admission rule, and records newly full blocks in the
prefix cache. Names and layout follow vLLM v1's ``kv_cache_manager.py``. A model
that mixes full-attention and sliding-window layers has several KV cache groups,
each with its own block tables; the manager asks the coordinator
(``kv_cache_coordinator.py``), which asks each group's manager, and hands the
scheduler ``KVCacheBlocks``, one block list per group. With one group (every
model of one attention type) the scheduler sees a plain block list.

The token layout ``allocate_slots`` reasons about (vLLM draws the same)::

    |<- comp ->|<- new_comp ->|<- ext_comp ->|<--- new --->|<- lookahead ->|
    |  already |  prefix-cache|   external   |  computed   |  speculative  |
    | computed |  hits, free  |  hits, free  |  this step  |  draft slots  |
                              |<------------ to be computed (or loaded) -------->|
               |<---------------------- to be allocated ----------------------->|

    comp      = request.num_computed_tokens   (blocks already in req_to_blocks)
    new_comp  = num_new_computed_tokens       (blocks in new_computed_blocks: touched, not allocated)
    ext_comp  = num_external_computed_tokens  (a KV connector holds them: blocks allocated, then loaded)
    new       = num_new_tokens
    lookahead = num_lookahead_tokens          (slots for drafts a drafter proposes during the step; prompt
                                               lookup's drafts are known before it, so they are part of new)

Every allocation, whatever the mix, answers one inequality (``block_budget.py``)::

    blocks to allocate + evictable hits + watermark (new requests only)  <=  free blocks - reserved blocks

``reserved_blocks`` holds capacity back from every allocation. vLLM keeps such a reserve for K/V in flight in
asynchronous transfers, which must find room when they land. This engine's transfers land in a CPU store first
(``kv_connector.py``) and are copied into the pool when their request is admitted, inside the step that
allocated them, so nothing is in flight in the pool: the default is 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .. import hooks
from ..utils import cdiv, check_int
from .block_budget import BlockNeed, block_need
from .block_pool import BlockPool, KVCacheBlock, get_request_block_hasher
from .kv_cache_coordinator import KVCacheBlocks, KVCacheCoordinator, KVCacheGroupSpec
from .kv_connector import KVConnector, KVConnectorMetadata
from .request import Request
from .single_type_kv_cache_manager import SingleTypeKVCacheManager, find_prefix_hits
from .step_commit import RolledBack, StepCommit
from .swap_space import SwapSpace

__all__ = ["KVCacheBlocks", "KVCacheManager", "RolledBack", "find_prefix_hits"]

SEAM = hooks.Seam(
    "kv_cache_manager",
    would_allocate="KVCacheManager.allocate_slots: are there blocks now? (requests without prefix hits or a shared "
    "block)",
)


class KVCacheManager:
    """Block bookkeeping for all running requests over one ``BlockPool``.

    Args:
        block_size: tokens per block.
        num_blocks: blocks in the pool, null block included (``num_blocks - 1`` usable).
        enable_caching: automatic prefix caching.
        watermark: fraction of the pool kept free against *new admissions*
            (vLLM v0's default 0.01). ``watermark_blocks = int(watermark * num_blocks)``.
        watermark_blocks: the same reserve as a block count; overrides ``watermark``.
        reserved_blocks: blocks held back from every allocation (vLLM keeps such a
            reserve for KV transfers in flight); 0 here unless asked for.
        num_cpu_blocks: the CPU swap space, in blocks (block 0 unused, as on the device).
        connector: a KV connector (``kv_connector.py``): K/V outside the pool, loaded back as external hits.
        kv_cache_groups: the model's KV cache groups (``kv_cache_coordinator.kv_cache_groups``); default one
            full-attention group. Swap space and a connector serve one full-attention group only (vLLM v1 has no
            swap, and turns its hybrid manager off when a connector is set).

    Why the watermark applies to new admissions only, and the rest of the admission rule: ``block_budget.py``.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        watermark: float = 0.01,
        watermark_blocks: int | None = None,
        reserved_blocks: int = 0,
        num_cpu_blocks: int = 0,
        connector: KVConnector | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        check_int("block_size", block_size, 1)
        self.block_size, self.num_blocks, self.enable_caching = block_size, num_blocks, enable_caching
        self.watermark_blocks = _reserves(num_blocks, watermark, watermark_blocks, reserved_blocks)
        self.reserved_blocks = reserved_blocks
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.block_hasher = get_request_block_hasher(block_size)
        groups = [KVCacheGroupSpec((0,))] if kv_cache_groups is None else list(kv_cache_groups)
        self.coordinator = KVCacheCoordinator(groups, self.block_pool, block_size)
        self.kv_cache_groups = self.coordinator.groups
        self.managers = self.coordinator.managers
        self.single_type = len(groups) == 1 and groups[0].sliding_window is None  # what swap and connectors serve
        self.no_hits = KVCacheBlocks(tuple([] for _ in groups))  # shared, never changed: read only
        if not self.single_type and (num_cpu_blocks or connector is not None):
            raise ValueError(_ONE_GROUP_ONLY.format([g.sliding_window for g in groups]))
        # Copy-on-write copies (source block, destination block) for the cache engine to perform.
        self.pending_copies: list[tuple[int, int]] = []
        self.step = StepCommit()  # what scheduling the step wrote ahead of the device: kept or rolled back
        self.prefix_cache_queries = 0  # prompt tokens of every admission (readmissions too) ...
        self.prefix_cache_hits = 0  # ... and how many of them the prefix cache held
        self.swap = SwapSpace(self, num_cpu_blocks)  # chapter 07's swap preemption
        self.connector = connector
        if connector is not None and enable_caching:  # it hears of every eviction, to save the block first
            self.block_pool.evicted = []
        self.external_hits = 0  # tokens loaded from the connector instead of computed

    # ---- prefix cache lookup -----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of the prompt's leading full blocks found in the prefix cache.

        Returns ``(blocks, num_computed_tokens)``: ``KVCacheBlocks``, a list per KV cache group, which reads as
        group 0's list (the only one for a model of one attention type). Never the whole prompt: the last
        prompt token must go through the model to produce the logits of the first
        output token, so the hit is capped at ``num_tokens - 1`` tokens. Since hits
        are whole blocks, a fully cached, block-aligned prompt gives up its last
        block (up to ``block_size`` tokens recomputed)::

            prompt 8 tokens, block 4, both blocks cached:  hit = [b0] -> 4 tokens
            prompt 9 tokens, block 4, both blocks cached:  hit = [b0, b1] -> 8 tokens

        The blocks are not touched yet: ``allocate_slots`` does that if the request
        is admitted.
        """
        if not self.enable_caching:
            return KVCacheBlocks(tuple([] for _ in self.managers)), 0
        self.attach_hasher(request)
        # Each group's rule (a learner's own lookup, exercise 08, for full attention), agreed by the coordinator.
        hits = self.coordinator.find_longest_cache_hit(request, (request.num_tokens - 1) // self.block_size)
        return hits, len(hits) * self.block_size

    def get_num_external_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens after the first ``num_computed_tokens`` that the connector can load (0 without one)."""
        if self.connector is None or not self.enable_caching:
            return 0
        self.attach_hasher(request)
        return self.connector.get_num_new_matched_tokens(request, num_computed_tokens)

    # ---- allocation --------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``; return the new blocks (per group).

        Returns ``None``, changing nothing, when the pool cannot supply them::

            required  = blocks to allocate (+ cached-but-free hit blocks, which
                        leave the free queue when touched) + watermark (new requests only)
            available = free blocks - reserved blocks
            required > available  ->  None   (the scheduler waits or preempts)

        Raises ``ValueError`` for a request that could never fit, however empty
        the pool: waiting for it would wait forever.

        Only ``num_new_tokens`` are checked: admitting a long prompt in chunks checks
        its first chunk, not the whole prompt (chapter 07). vLLM v1 works the same way;
        its later ``scheduler_reserve_full_isl`` option (``vllm/config/scheduler.py``)
        passes ``full_sequence_must_fit`` to require room for the whole input.
        """
        if not (num_new_computed_tokens or new_computed_blocks or num_lookahead_tokens or num_external_computed_tokens):
            in_place = self._allocate_in_place(request, num_new_tokens)
            if in_place is not None:
                return in_place
        need = block_need(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens,
        )  # fmt: skip
        if not self._fits(need, request, num_new_tokens, num_lookahead_tokens, num_external_computed_tokens):
            return None
        # From here on nothing can fail: the pool has the blocks.
        new_per_group = self._take_blocks(request, need, num_new_tokens + num_lookahead_tokens)
        if self.connector is not None:
            external, num_local = new_per_group[0][: need.num_external_blocks], need.num_computed_tokens
            self.connector.after_allocation(
                request, external, num_local - num_external_computed_tokens, self.block_pool.evicted
            )
            self.external_hits += num_external_computed_tokens
        if self.enable_caching:
            admission_hits = need.new_computed if need.is_new_admission else None
            self._cache_full_blocks(request, need.num_computed_tokens, num_new_tokens, admission_hits)
        return KVCacheBlocks(tuple(new_per_group))

    def _fits(self, need: BlockNeed, request: Request, num_new_tokens: int, num_lookahead: int, num_ext: int) -> bool:
        """Whether the pool gives ``need`` now. A rule plugged in for ``would_allocate`` (exercise 04) decides
        instead where it can: it knows computed and new tokens only, not hits, copies, drafts or windows."""
        would = SEAM.plugged("would_allocate")
        if would is None or need.new_computed or need.cow or num_lookahead or num_ext or not self.single_type:
            return need.fits
        return bool(would(self, request, num_new_tokens))

    def _take_blocks(self, request: Request, need: BlockNeed, num_new_slots: int) -> list[list[KVCacheBlock]]:
        """Hits first (every group's, touched before any fresh block could evict one of them), then a private
        copy of a shared block about to be written, then fresh blocks up to ``num_new_slots`` more slots; the
        fresh blocks per group."""
        rid, write_idx = request.request_id, need.write_idx
        num_required = cdiv(need.num_computed_tokens + num_new_slots, self.block_size)
        for manager, hits in zip(self.managers, need.new_computed.blocks):
            manager.remove_skipped_blocks(rid, need.num_computed_tokens)  # a window's old blocks go back first
            self.block_pool.touch(hits)
            manager.req_to_blocks.setdefault(rid, []).extend(hits)
        new_per_group: list[list[KVCacheBlock]] = []
        for g, manager in enumerate(self.managers):
            blocks = manager.req_to_blocks[rid]
            if g in need.cow:
                shared, private = blocks[write_idx], self.block_pool.get_new_blocks(1)[0]
                blocks[write_idx] = private
                manager.changed(rid, write_idx)
                self.block_pool.free_blocks([shared])  # one owner fewer; the sibling keeps it
                self.pending_copies.append((shared.block_id, private.block_id))
            fresh = self.block_pool.get_new_blocks(max(0, num_required - len(blocks)))
            blocks.extend(fresh)
            new_per_group.append(fresh)
        return new_per_group

    def _cache_full_blocks(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, admission_hits: KVCacheBlocks | None
    ) -> None:
        """Count an admission's prefix-cache lookup (vLLM's stats: tokens asked for, tokens found; None: not an
        admission), then hash into the cache the blocks that are full once this step's tokens are written:
        lookahead slots hold no real tokens, and tokens not yet in the request have no hash. Their K/V come in
        this step: uncommitted until it ends."""
        rid = request.request_id
        if admission_hits is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(admission_hits) * self.block_size
        known = request.num_tokens - request.num_output_placeholders  # a placeholder's block waits for its token
        num_full_blocks = min(num_computed_tokens + num_new_tokens, known) // self.block_size
        for g, manager in enumerate(self.managers):
            # Prefix hits are cached already; so are the blocks cached in earlier steps.
            num_cached = manager.num_cached_block[rid] if admission_hits is None else len(admission_hits.blocks[g])
            self.step.uncommitted_blocks.extend(manager.cache_blocks(request, num_cached, num_full_blocks))

    def _allocate_in_place(self, request: Request, num_new_tokens: int) -> KVCacheBlocks | None:
        """``allocate_slots`` for the usual step of a running request, most decode steps: its blocks already
        have room for the new tokens, so nothing comes from the pool; only the blocks they fill are cached.
        None (and nothing changed) when the full path is needed: a new admission, a block to add or copy, a
        sliding window, a connector, reserved blocks, or a learner's admission rule to ask."""
        blocks = self.req_to_blocks.get(request.request_id)
        start, bs = request.num_computed_tokens, self.block_size
        if (
            not blocks
            or type(num_new_tokens) is not int  # block_need names a bad value
            or not 0 <= num_new_tokens <= len(blocks) * bs - start
            or not self.single_type
            or self.connector is not None
            or self.reserved_blocks
            or (start % bs and blocks[start // bs].ref_cnt > 1)  # a forked sibling shares it: copy-on-write
            or SEAM.replaced()
        ):
            return None
        if self.enable_caching:
            self.attach_hasher(request)
            self._cache_full_blocks(request, start, num_new_tokens, None)
        return KVCacheBlocks(([],))

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | Sequence[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Would ``allocate_slots`` with these arguments give blocks now? Changes nothing."""
        return block_need(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens
        ).fits

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` share every block of ``parent`` (parallel sampling, n > 1).

        Nothing is copied: ref counts rise by one. The first write into a shared,
        partly filled block copies it (``allocate_slots`` records the copy in
        ``pending_copies`` for the cache engine)::

            parent  [b3][b8][b5: 2/4]          child  [b3][b8][b5: 2/4]    ref(b5) = 2
            parent writes its next token   →   parent [b3][b8][b9: 3/4]    copy b5 → b9
                                               child  [b3][b8][b5: 2/4]    ref(b5) = 1
        """
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        if self.enable_caching:
            self.attach_hasher(child)
        self.coordinator.fork(parent.request_id, child.request_id)

    def trim(self, request: Request, num_tokens: int) -> int:
        """Give back the request's blocks past the first ``cdiv(num_tokens, block_size)``, tail first; returns
        how many. Speculative decoding allocates slots for drafts; when the model rejects some, the blocks that
        held only rejected drafts go back to the free queue at once (block_size 4, 6 tokens, 5 drafts)::

            before the step   [b3: t0-t3][b8: t4 x . .]             6 tokens; x, the last, has no K/V yet
            the step          [b3][b8: t4 x d0 d1][b5: d2 d3 d4 .]   writes x and five drafts' K/V
            d0 accepted       t0 ... t4 x d0 y                       8 tokens (y: the model's, not d1)
            trim(req, 8)      [b3][b8]                               b5 held only rejected drafts: freed

        None of those blocks is in the prefix cache: only blocks full of real tokens are hashed. Every KV cache
        group gives back its own (the count is over all groups)."""
        return self.coordinator.trim(request.request_id, num_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (source, destination) decided since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        self.step.uncommitted_copies += [dst for _, dst in copies]
        return copies

    def free(self, request: Request | str) -> None:
        """Give back all blocks of a finished or preempted request, last block first.

        Tail first, so that under prefix caching a request's *last* blocks are
        evicted before its *first* ones (shared prefixes live at the front).
        """
        self.coordinator.free(request if isinstance(request, str) else request.request_id)

    # ---- a step's hashes: kept once the step ran, dropped if it failed ----------------------
    def commit_step(self) -> None:
        """The step ran: what scheduling it wrote ahead holds (``step_commit.py``), and what the connector saved
        is in its store."""
        self.step.commit()
        if self.connector is not None:
            self.connector.commit_step()

    def hold_step(self) -> None:
        """Async scheduling: the step goes to the device while the next one is scheduled (``StepCommit.hold``)."""
        self.step.hold()

    def commit_in_flight(self) -> None:
        """The step that was in flight ran."""
        self.step.commit_in_flight()

    def rollback_step(self) -> RolledBack:
        """The step failed, maybe halfway (and, with async scheduling, the step scheduled after it): no block
        hashed for it may be found by a prefix lookup (it would hand garbage to the next request with that
        prefix), nor any block its connector saved. The scheduler has the requests that held what it was to write
        compute them again (``Scheduler.rollback_step``, with ``step_commit.forget_computed``)."""
        rolled = self.step.rollback(self.block_pool)
        if self.connector is not None:
            self.connector.rollback_step()
        self.resend_block_tables()  # the runner may or may not hold what the failed step sent
        return rolled

    # ---- what the runner holds of the block tables ------------------------------------------
    def take_block_updates(self, request_id: str, resend: bool = False) -> list[tuple[int, list[int]]]:
        """Per KV cache group, what the runner lacks of the request's block table: (the first index it lacks,
        the ids from there on); then it holds them all (vLLM sends a new request's whole table once,
        ``NewRequestData``, and only new block ids after, ``CachedRequestData``)::

            step 1  blocks [7, 2]      ->  (0, [7, 2])     a new request: the whole table
            step 2  blocks [7, 2]      ->  (2, [])         nothing new
            step 3  blocks [7, 2, 9]   ->  (2, [9])        a block added
            fork    blocks [7, 5, 9]   ->  (1, [5, 9])     a copy-on-write replaced block 1

        ``resend``: every group's whole table (the runner's copy is rebuilt from the first block)."""
        if self.single_type:
            return [self.managers[0].take_block_updates(request_id, resend)]
        return [m.take_block_updates(request_id, resend) for m in self.managers]

    def resend_block_tables(self) -> None:
        """The next step sends every request's whole table: the runner's copy is not known to be right."""
        for manager in self.managers:
            manager.num_sent.clear()

    def take_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's copies between the pool and the connector's store (None without a connector)."""
        return None if self.connector is None else self.connector.build_connector_meta(self.step.uncommitted_blocks)

    def bookkeeping(self) -> Iterator[Any]:
        """Every object whose state allocation changes: the manager and its pools (see ``snapshot``)."""
        yield from (self, self.step, self.swap, *self.managers)
        yield from self.block_pool.bookkeeping()
        if self.swap.cpu_pool is not None:
            yield from self.swap.cpu_pool.bookkeeping()
        if self.connector is not None:
            yield self.connector

    # ---- queries -----------------------------------------------------------------------
    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """request_id -> its blocks in logical order (its block table), of KV cache group 0."""
        return self.managers[0].req_to_blocks

    @property
    def num_cached_block(self) -> dict[str, int]:
        """request_id -> how many of its blocks (group 0) are already in the prefix cache."""
        return self.managers[0].num_cached_block

    def held_blocks(self) -> Iterator[tuple[SingleTypeKVCacheManager, str, list[KVCacheBlock]]]:
        """Every (group manager, request id, block list), all groups (null blocks included)."""
        for manager in self.managers:
            for rid, blocks in manager.req_to_blocks.items():
                yield manager, rid, blocks

    def max_num_blocks(self, num_tokens: int, max_new_tokens: int) -> int:
        """The most blocks, all groups together, a request of ``num_tokens`` tokens ever holds at once when each
        step computes at most ``max_new_tokens`` of them (a sliding window's count stays bounded)."""
        return self.coordinator.max_num_blocks(num_tokens, max_new_tokens)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, []))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids, in logical order."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, []))

    @property
    def num_blocks_per_request(self) -> dict[str, int]:
        return {rid: len(blocks) for rid, blocks in self.req_to_blocks.items()}

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (cached-but-free blocks count as free)."""
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, and the connector's store, when no block is in use (returns whether it did)."""
        done = self.block_pool.reset_prefix_cache()
        if done and self.connector is not None:
            self.connector.reset()
        return done

    def forget_prefix_cache(self) -> None:
        """Forget every cached hash now, in use or not (see ``BlockPool.forget_cached_blocks``), and what the
        connector stored. The running requests keep their blocks; its uncommitted blocks have nothing left to
        roll back."""
        self.step.uncommitted_blocks.clear()
        self.block_pool.forget_cached_blocks()
        if self.connector is not None:
            self.connector.reset()

    def attach_hasher(self, request: Request) -> None:
        if request.block_hasher is None or getattr(request.block_hasher, "block_size", None) != self.block_size:
            request.set_block_hasher(self.block_hasher)  # raises on a different block size


_ONE_GROUP_ONLY = (
    "swap space and KV connectors serve models of one full-attention KV cache group; this one's groups have "
    "windows {}: use preemption_mode='recompute' and no kv_offloading_size (vLLM v1 has no swap either)"
)


def _reserves(num_blocks: int, watermark: float, watermark_blocks: int | None, reserved_blocks: int) -> int:
    """The watermark in blocks, after checking that it and the reserve leave room to admit anything."""
    check_int("num_blocks (block 0 is the null block)", num_blocks, 2)
    if not 0.0 <= watermark < 1.0:
        raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
    if watermark_blocks is None:
        watermark_blocks = int(watermark * num_blocks)
    if not isinstance(watermark_blocks, int) or watermark_blocks < 0:
        raise ValueError(f"watermark_blocks must be a non-negative integer, got {watermark_blocks!r}")
    if not isinstance(reserved_blocks, int) or reserved_blocks < 0:
        raise ValueError(f"reserved_blocks must be a non-negative integer, got {reserved_blocks!r}")
    if watermark_blocks + reserved_blocks >= num_blocks - 1:
        raise ValueError(
            f"watermark ({watermark_blocks}) + reserved ({reserved_blocks}) blocks leave nothing "
            f"to admit a request with in a pool of {num_blocks - 1} usable blocks"
        )
    return watermark_blocks
