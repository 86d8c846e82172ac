"""The block pool: fixed-size KV blocks, a free queue, reference counts and the prefix cache.

The KV cache on the device is carved, once at start-up, into ``num_blocks`` blocks
of ``block_size`` token slots each. Everything in this module is bookkeeping on
the CPU: a block is an integer id plus a few fields, and "allocating" a block
means taking its id off a free queue. No tensor is touched here (that is
``cache_engine.py`` and the kernels).

Three ideas, all named as in vLLM v1 (``vllm/v1/core/block_pool.py`` and
``kv_cache_utils.py``):

1. **Fixed-size blocks.** Every free block fits every request, so there are no
   holes of the wrong shape: external fragmentation is gone by construction, and
   the only waste is the unfilled tail of each request's last block.

2. **A free queue that is also an eviction queue.** With prefix caching, a block
   whose request has finished keeps its K/V and its hash. It is *free* (the pool
   may hand it out) but still *useful* (a later request with the same prefix can
   reuse it). Such a block sits in the free queue; a cache hit must pull it out
   of the *middle*, hence an intrusive doubly linked list with O(1) removal::

       fake_head <-> [7] <-> [3] <-> [12] <-> [5] <-> fake_tail
                      ^ popleft: next block handed out (least recently used)
                                     remove([12]): a cache hit, O(1)
                                                     append: freed blocks go here

3. **Reference counts.** A block shared by several requests (same prompt prefix)
   has ``ref_cnt`` equal to its number of users; it returns to the free queue
   only when the count reaches zero.

Block 0 is the **null block**: a placeholder id that block tables can point at
(for padding, or positions a sliding window has dropped). It is taken out of the
free queue at start-up and is never handed out, freed or cached, so a pool of
``num_blocks`` blocks has ``num_blocks - 1`` usable ones::

       block id:   0    1    2    3    4    5   ...   num_blocks-1
                 [nul][   usable, initially free in id order       ]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import hooks
from ..utils import check_int
from .block_hash import NONE_HASH, BlockHash, chain_block_hashes, group_block_hash, hash_block_tokens
from .request import Request

# The pieces a learner may write in the pool's place (``minipaged.classroom.parts`` plugs them in).
SEAM = hooks.Seam(
    "block_pool",
    free_queue_remove="BlockPool.touch: a cached block leaves the middle of the free queue",
    chain_block_hashes="Request.block_hashes: the chained hash of every full block",
    get_new_blocks="BlockPool.get_new_blocks: hand out the least recently freed blocks, evicting their hashes",
    free_blocks="BlockPool.free_blocks: drop a reference; blocks reaching 0 join the back of the free queue",
)

__all__ = [  # the block hashes too: chapter 03 and exercise 08 import them from here
    "NONE_HASH", "BlockHash", "BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock", "RequestBlockHasher",
    "chain_block_hashes", "free_blocks", "get_new_blocks", "get_request_block_hasher", "group_block_hash",
    "hash_block_tokens",
]  # fmt: skip


class RequestBlockHasher:
    """Computes the hashes of a request's *new* full blocks (vLLM: ``get_request_block_hasher``).

    Called whenever tokens are appended to a request; it starts after the blocks
    already hashed, so each block is hashed exactly once. The cache salt goes into
    the extra keys of the first block only: chaining carries it to every later
    block, and two tenants with different salts never share a single block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = check_int("block_size", block_size, 1)

    def __call__(self, request: Request) -> list[BlockHash]:
        done = len(request.block_hashes)
        learners = SEAM.plugged("chain_block_hashes")
        if learners is not None:  # a learner's part hashes the whole request again, from its first block
            return learners(request.all_token_ids, self.block_size, request.cache_salt)[done:]
        parent = request.block_hashes[-1] if request.block_hashes else None
        return chain_block_hashes(
            request.all_token_ids[done * self.block_size :], self.block_size, request.cache_salt, parent
        )


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """The hasher a ``Request`` uses to keep ``block_hashes`` up to date (same name as vLLM)."""
    return RequestBlockHasher(block_size)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical KV block.

    ``prev_free_block``/``next_free_block`` are the links of the free queue. They
    live in the block itself ("intrusive" list) so that moving a block in or out
    of the queue allocates no Python object, and a block can unlink itself in
    O(1) given only a reference to it. Only ``FreeKVCacheBlockQueue`` touches them.
    """

    block_id: int
    ref_cnt: int = 0
    # Set when the block is full and cached; kept while the block sits in the free queue.
    _block_hash: BlockHash | None = None
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHash | None:
        return self._block_hash

    def set_block_hash(self, block_hash: BlockHash) -> None:
        if self._block_hash is not None:
            raise ValueError(f"block {self.block_id} already has a hash; reset it before re-caching")
        self._block_hash = block_hash

    def reset_hash(self) -> None:
        """Forget the hash: the block is being evicted from the prefix cache."""
        self._block_hash = None

    def __repr__(self) -> str:
        # Print neighbour ids, not neighbours: following the links would recurse down the list.
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        h = self._block_hash.hex()[:8] if self._block_hash else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, block_hash={h}, "
            f"prev_free_block={prev_id}, next_free_block={next_id}, is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks as a doubly linked list threaded through the blocks themselves.

    Why not ``collections.deque``? A deque cannot remove an element from the
    middle in O(1), and a prefix-cache hit must do exactly that: take a cached
    block that is free back out of the queue. Two sentinel blocks (id -1) sit at
    the ends, so every real block always has a ``prev`` and a ``next`` and no
    operation needs an "is this the first/last block?" branch::

        fake_head <-> b1 <-> b2 <-> ... <-> bn <-> fake_tail

    Order is eviction order: the front is handed out first. Initially blocks are
    in id order; freed blocks are appended at the back, so the front is always
    the least recently freed block (LRU).
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_free_list_head, *blocks, self.fake_free_list_tail]
        for left, right in itertools.pairwise(chain):
            left.next_free_block, right.prev_free_block = right, left

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front (the next one to hand out)."""
        block = self.fake_free_list_head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise ValueError("no free blocks available")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first ``n`` blocks, relinking the head once rather than ``n`` times."""
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks from a queue of {self.num_free_blocks}")
        head = self.fake_free_list_head
        out: list[KVCacheBlock] = []
        block = head.next_free_block
        for _ in range(n):
            assert block is not None
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            out.append(block)
            block = nxt
        assert block is not None
        head.next_free_block, block.prev_free_block = block, head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue: O(1), thanks to its own links."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev_block, next_block = block.prev_free_block, block.next_free_block
        assert prev_block is not None and next_block is not None
        prev_block.next_free_block, next_block.prev_free_block = next_block, prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back: it becomes the *last* candidate for reuse."""
        self.append_n([block])

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the back, in the given order (the first one is reused first)."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        assert last is not None
        for block in blocks:  # check first, so a bad call leaves the list intact
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
        for block in blocks:
            last.next_free_block, block.prev_free_block = block, last
            last = block
        last.next_free_block, tail.prev_free_block = tail, last
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front to back (O(n): for tests, checks and pictures, not the hot path). Bounded by the
        free count, so a queue a learner's code broke into a loop still ends."""
        out: list[KVCacheBlock] = []
        block = self.fake_free_list_head.next_free_block
        while block is not None and block is not self.fake_free_list_tail and len(out) <= self.num_free_blocks + 1:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Hands out, frees and caches KV blocks (vLLM: ``BlockPool``).

    Args:
        num_blocks: blocks in the pool, the null block included (so ``num_blocks - 1``
            are usable). At least 2.
        enable_caching: keep hashes of full blocks so that later requests with the
            same prefix can reuse them (automatic prefix caching). Off, ``cache_full_blocks``
            records nothing and ``get_cached_block`` finds nothing (the swap pool; an engine
            without prefix caching).

    The life of a block (``ref_cnt`` in brackets)::

                  get_new_blocks                 cache_full_blocks
        free [0] ---------------> in use [>=1] -------------------> in use, cached [>=1]
          ^                           |                                  |        ^
          |    free_blocks, ref -> 0  |           free_blocks, ref -> 0  |        | touch
          +---------------------------+                                  v        | (cache hit)
          +------ get_new_blocks pops it: hash dropped ------------ free, cached [0]

    A cached block in the free queue is evicted *lazily*: nothing happens to it
    until ``get_new_blocks`` pops it from the front, and only then is its hash
    removed from ``cached_block_hash_to_block``. Until that moment a cache hit
    can still rescue it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = check_int("num_blocks (block 0 is the null block)", num_blocks, 2)
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> {block_id: block}. Several blocks can hold the same prefix (two
        # requests computed it at the same time); we do not merge them, because a
        # block id already in a request's block table must never change.
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        # Block 0 leaves the queue for good: never handed out, freed or cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # (block id, hash) of each cached block evicted to hold new tokens, while someone listens (a KV
        # offloading connector copies them to CPU memory before the step overwrites them; None: nobody).
        self.evicted: list[tuple[int, BlockHash]] | None = None

    @property
    def num_gpu_blocks(self) -> int:  # vLLM's name for the same number
        return self.num_blocks

    # ---- allocation --------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the front of the free queue, each with ``ref_cnt == 1``.

        Raises ``ValueError`` when fewer are free: callers (``KVCacheManager``)
        check ``get_num_free_blocks()`` first and turn a shortage into ``None``.
        A cached block handed out here loses its hash: this is the eviction
        (``get_new_blocks`` below, the module's function, does the work).
        """
        check_int("num_blocks", num_blocks, 0)
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.free_block_queue.num_free_blocks} are free")
        return SEAM.pick("get_new_blocks", get_new_blocks)(self, num_blocks)

    def evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s hash from the cache map: it is about to hold new tokens. Returns whether it had a
        hash (recorded in ``evicted`` when someone listens)."""
        return self._maybe_evict_cached_block(block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s hash from the cache map (it is about to hold new tokens)."""
        if self.evicted is not None and block.block_hash is not None:
            self.evicted.append((block.block_id, block.block_hash))
        return self.drop_hash(block)

    def drop_hash(self, block: KVCacheBlock) -> bool:
        """Forget ``block``'s hash without calling it an eviction: its contents were never written (a failed
        step), so nobody may keep them. Returns whether it had a hash."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        same_hash = self.cached_block_hash_to_block.get(block_hash)
        if same_hash is not None:
            same_hash.pop(block.block_id, None)
            if not same_hash:
                del self.cached_block_hash_to_block[block_hash]
        block.reset_hash()
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts using ``blocks`` (prefix-cache hits): ``ref_cnt += 1``.

        A block with ``ref_cnt == 0`` is a cached block waiting in the free queue;
        it leaves the queue here, from wherever it sits (the O(1) removal).
        """
        for block in blocks:
            if block.is_null:
                continue  # the null block has no owner and no count
            if block.ref_cnt == 0:
                SEAM.pick("free_queue_remove", _remove)(self.free_block_queue, block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 join the back of the free queue.

        Order matters: blocks are appended in the order given, and the front of the
        queue is evicted first. ``KVCacheManager.free`` passes a request's blocks
        *tail first*, so its last blocks are evicted before its first ones: a
        prefix's first block is shared by the most future requests and is the
        most valuable to keep::

            request blocks:  [b0 b1 b2 b3]  ->  free_blocks([b3, b2, b1, b0])
            free queue:      ... older ... b3 b2 b1 b0 <- fake_tail
                                           ^ evicted first among these

        (Recent vLLM, e.g. 0.32, refines this: a freed block *without* a hash goes
        to the *front*, since no request can ever hit it. We keep the plain rule.)
        """
        blocks = [b for b in ordered_blocks if not b.is_null]  # the null block is never freed
        # Check the whole list before touching anything: a bad call changes nothing.
        drops: dict[int, int] = {}
        for block in blocks:
            if not (0 <= block.block_id < len(self.blocks)) or self.blocks[block.block_id] is not block:
                raise ValueError(f"block {block.block_id} does not belong to this pool")
            drops[block.block_id] = drops.get(block.block_id, 0) + 1
            if drops[block.block_id] > block.ref_cnt:
                raise ValueError(
                    f"block {block.block_id} freed {drops[block.block_id]} time(s) with ref_cnt "
                    f"{block.ref_cnt} (double free?)"
                )
        SEAM.pick("free_blocks", free_blocks)(self, blocks)

    # ---- prefix cache ------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """Any block currently cached under ``block_hash`` (in use or free), or ``None``."""
        same_hash = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(same_hash.values())) if same_hash else None

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int = 0,
    ) -> None:
        """Record the hashes of blocks that have just become full (of KV cache group ``group_id``: a hybrid
        model's other groups key their blocks by ``group_block_hash``).

        ``blocks`` is the request's whole block list; ``blocks[:num_cached_blocks]``
        are cached already (earlier steps, or prefix hits) and
        ``blocks[num_cached_blocks:num_full_blocks]`` are the newly full ones. Their
        hashes come from ``request.block_hashes``, computed when tokens were
        appended to the request::

            tokens:  |<-- full -->|<-- full -->|<-- full -->|<- partial ->|
            blocks:  [    b0     ][    b1     ][    b2     ][     b3     ]
                      cached        cached     ^ new: hash h2   not cached (not full)
                      (num_cached_blocks = 2, num_full_blocks = 3)
        """
        if not self.enable_caching or num_cached_blocks >= num_full_blocks:
            return  # a pool without prefix caching keeps no hashes: nothing to find, nothing to evict
        if num_full_blocks > len(blocks):
            raise ValueError(f"num_full_blocks={num_full_blocks} but the request has {len(blocks)} blocks")
        if len(request.block_hashes) < num_full_blocks:
            raise ValueError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes, "
                f"{num_full_blocks} needed: are its tokens appended and hashed with "
                f"block_size={block_size}?"
            )
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            block_hash = group_block_hash(request.block_hashes[i], group_id)
            if block.block_hash == block_hash:  # cached already (a failed step's rollback recounts from before it)
                continue
            block.set_block_hash(block_hash)
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every hash (e.g. after new weights). Only when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.forget_cached_blocks()
        return True

    def forget_cached_blocks(self) -> None:
        """Drop every hash, of free and in-use blocks alike: nothing computed so far can be hit again. (Unlike
        ``reset_prefix_cache`` this works while requests run: their blocks stay theirs, only unshareable.)"""
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()

    def bookkeeping(self) -> Iterator[Any]:
        """Every object whose state allocation changes: the pool, its free queue (sentinels too), its blocks.
        ``snapshot.Snapshot`` saves and restores them around a step that runs a learner's part."""
        yield self
        yield self.free_block_queue
        yield self.free_block_queue.fake_free_list_head
        yield self.free_block_queue.fake_free_list_tail
        yield from self.blocks

    # ---- accounting --------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now, cached-but-free ones included."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (the null block counts neither way)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)


# ---- LRU eviction: the two functions BlockPool's methods run (exercise 08 writes them) -------------------
def _remove(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    """The queue's own ``remove``, as the part's signature has it (``remove(queue, block)``)."""
    queue.remove(block)


def get_new_blocks(pool: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
    """Pop ``num_blocks`` blocks from the front of ``pool``'s free queue (the least recently freed) and hand
    each out with ``ref_cnt = 1``, evicting its cached hash first: the block is about to hold other tokens, so a
    later lookup must no longer find it. ``BlockPool.get_new_blocks`` checks the count and calls this::

        free queue:  head -> [b7 #h7] [b2] [b5 #h5] ... <- tail       get_new_blocks(pool, 2)
        handed out:  b7 (hash h7 dropped from the cache map), b2      queue: head -> [b5 #h5] ...
    """
    blocks = pool.free_block_queue.popleft_n(num_blocks)
    for block in blocks:
        if pool.enable_caching:
            pool._maybe_evict_cached_block(block)
        assert block.ref_cnt == 0, f"block {block.block_id} in the free queue with ref_cnt {block.ref_cnt}"
        block.ref_cnt = 1
    return blocks


def free_blocks(pool: BlockPool, ordered_blocks: Sequence[KVCacheBlock]) -> None:
    """Drop one reference to each block; those reaching 0 join the back of the free queue in the order given,
    their hashes kept (cached but free: a later prompt may still hit them until they reach the front).
    ``BlockPool.free_blocks`` checks the list (no null block, no double free) and calls this."""
    released: list[KVCacheBlock] = []
    for block in ordered_blocks:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            released.append(block)
    pool.free_block_queue.append_n(released)
