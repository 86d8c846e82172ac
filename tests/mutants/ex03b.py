"""Exercise 03b — the block pool from its spec: pools a learner gets wrong, each one mistake away from a right one.

``DictPool`` is a right answer written differently from the solution notebook's (which links its free blocks
through the blocks): an ``OrderedDict`` of free blocks by id. It is graded for full marks as the mutants' helper.
Each mutant below changes one method of it; ``SearchingPool`` is a whole pool that keeps its free blocks in a list.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

from minipaged.core.block_pool import KVCacheBlock

from . import mutant

CHECKS = {"BlockPool": ["check_pool_spec", "check_pool_twin", "check_pool_O1"]}


class DictPool:
    """Free blocks in an ``OrderedDict`` (id -> block), front = next out; hashes in two dicts."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free: OrderedDict[int, KVCacheBlock] = OrderedDict((i, self.blocks[i]) for i in range(1, num_blocks))
        self.by_hash: dict[bytes, KVCacheBlock] = {}
        self.hash_of: dict[int, bytes] = {}
        self.caching = enable_caching

    def get_num_free_blocks(self) -> int:
        return len(self.free)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free):
            raise ValueError(f"cannot get {n} blocks: {len(self.free)} free")
        out = []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            self.forget(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def forget(self, b: KVCacheBlock) -> None:
        h = self.hash_of.pop(b.block_id, None)
        if h is not None:
            del self.by_hash[h]

    def check_frees(self, blocks: list[KVCacheBlock]) -> None:
        counts = Counter(b.block_id for b in blocks)
        if any(counts[i] > self.blocks[i].ref_cnt for i in counts):
            raise ValueError("a block freed more times than it is used")

    def release(self, b: KVCacheBlock) -> None:
        self.free[b.block_id] = b  # to the back

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = [b for b in blocks if b.block_id != 0]
        self.check_frees(blocks)
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.release(b)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            if b.block_id == 0:
                continue
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def cache_full_blocks(
        self, request: Any, blocks: list[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int, block_size: int
    ) -> None:
        if not self.caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            b = blocks[i]
            if b.block_id not in self.hash_of:
                self.hash_of[b.block_id] = request.block_hashes[i]
                self.by_hash[request.block_hashes[i]] = b

    def get_cached_block(self, h: bytes) -> KVCacheBlock | None:
        return self.by_hash.get(h)


HELPERS: dict = {"BlockPool": DictPool}


@mutant("BlockPool", "freed blocks go to the front: the most recently freed is reused first (MRU, not LRU)")
class FrontOfTheQueue(DictPool):
    def release(self, b: KVCacheBlock) -> None:
        self.free[b.block_id] = b
        self.free.move_to_end(b.block_id, last=False)  # MISTAKE: freed blocks join the back


@mutant("BlockPool", "a block handed out again keeps its old hash: a later prompt 'hits' someone else's tokens")
class KeepsTheEvictedHash(DictPool):
    def forget(self, b: KVCacheBlock) -> None:
        pass  # MISTAKE: the block is about to hold other tokens; its hash must go


@mutant("BlockPool", "no double-free check: a block freed twice in one call is counted free while still used")
class NoDoubleFreeCheck(DictPool):
    def check_frees(self, blocks: list[KVCacheBlock]) -> None:
        pass  # MISTAKE: refuse (ValueError) a list that frees a block more times than it is used


@mutant("BlockPool", "a prefix hit on a free cached block leaves it among the free blocks: it can be handed out twice")
class HitStaysFree(DictPool):
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            if b.block_id != 0:
                b.ref_cnt += 1  # MISTAKE: a block with ref_cnt 0 must first leave the free blocks


@mutant("BlockPool", "freed blocks appended in reverse: the request's first block is evicted first")
class FreesInReverse(DictPool):
    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        super().free_blocks(list(blocks)[::-1])  # MISTAKE: in the order given (the caller passes tail first)


@mutant("BlockPool", "off by one: asking for exactly the number of free blocks is refused")
class OffByOne(DictPool):
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n >= len(self.free) and n:  # MISTAKE: n > the free count
            raise ValueError("not enough free blocks")
        return super().get_new_blocks(n)


@mutant("BlockPool", "a shortage found halfway: the blocks taken before it stay taken")
class TakesThenRaises(DictPool):
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        out = []
        for _ in range(n):
            if not self.free:
                raise ValueError("ran out")  # MISTAKE: check the count before taking any
            out += super().get_new_blocks(1)
        return out


@mutant("BlockPool", "freeing a block forgets its hash: no prompt can ever hit a finished request's blocks")
class DropsTheHashOnFree(DictPool):
    def release(self, b: KVCacheBlock) -> None:
        self.forget(b)  # MISTAKE: a freed block keeps its hash until it is handed out again
        super().release(b)


@mutant("BlockPool", "block 0 starts among the free blocks: the null block is handed out")
class HandsOutTheNullBlock(DictPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.free = OrderedDict((i, self.blocks[i]) for i in range(num_blocks))  # MISTAKE: from block 1


@mutant("BlockPool", "free blocks in a list: a hit removes its block with list.remove, a search over the list")
class SearchingPool(DictPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.queue = list(self.free.values())

    def get_num_free_blocks(self) -> int:
        return len(self.queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.queue):
            raise ValueError("not enough free blocks")
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            self.forget(b)
            b.ref_cnt = 1
        return out

    def release(self, b: KVCacheBlock) -> None:
        self.queue.append(b)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        for b in blocks:
            if b.block_id == 0:
                continue
            if b.ref_cnt == 0:
                self.queue.remove(b)  # MISTAKE: O(n), a comparison with every free block before it
            b.ref_cnt += 1


@mutant("BlockPool", "enable_caching ignored: a pool told to keep no hashes caches blocks and finds them")
class IgnoresTheCachingSwitch(DictPool):
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, enable_caching)
        self.caching = True  # MISTAKE: self.caching = enable_caching
