"""Checks for exercise 03: O(1) removal from the middle of the free block queue.

The learner writes ``remove(queue, block)`` over the real ``KVCacheBlock``
links of a real ``FreeKVCacheBlockQueue``. Every expected value comes from doing
the same thing with the package's own ``FreeKVCacheBlockQueue.remove`` on a twin
queue. O(1) is checked without a clock: the blocks of a 200,000-block queue
count every read and write of their ``prev_free_block``/``next_free_block``, and
a removal may touch only the removed block and its two neighbours. Walking the
list, even once, touches thousands of other blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ...core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request
from .core import Check, CheckOutcome, report

Remove = Callable[[FreeKVCacheBlockQueue, KVCacheBlock], None]
HUGE = 200_000

_PREV = KVCacheBlock.__dict__["prev_free_block"]  # the slot descriptors of the real class
_NEXT = KVCacheBlock.__dict__["next_free_block"]


class ProbeBlock(KVCacheBlock):
    """A ``KVCacheBlock`` that counts reads and writes of its queue links in ``touches`` (block id -> count)."""

    __slots__ = ()
    touches: ClassVar[dict[int, int]] = {}

    def _touch(self) -> None:
        ProbeBlock.touches[self.block_id] = ProbeBlock.touches.get(self.block_id, 0) + 1

    @property
    def prev_free_block(self) -> KVCacheBlock | None:
        self._touch()
        return _PREV.__get__(self)

    @prev_free_block.setter
    def prev_free_block(self, value: KVCacheBlock | None) -> None:
        self._touch()
        _PREV.__set__(self, value)

    @property
    def next_free_block(self) -> KVCacheBlock | None:
        self._touch()
        return _NEXT.__get__(self)

    @next_free_block.setter
    def next_free_block(self, value: KVCacheBlock | None) -> None:
        self._touch()
        _NEXT.__set__(self, value)


class GuardedQueue(FreeKVCacheBlockQueue):
    """The queue a learner's ``remove`` is given: the package's own removal is off limits to it."""

    reference_allowed = False

    def _guard(self) -> None:
        if not self.reference_allowed:
            raise RuntimeError("queue.remove is the method you are writing: unlink the block with its own links")

    def remove(self, block: KVCacheBlock) -> None:
        self._guard()
        super().remove(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        self._guard()
        super()._unlink(block)


def _queue(n: int, probe: bool = False) -> tuple[GuardedQueue, list[KVCacheBlock]]:
    cls = ProbeBlock if probe else KVCacheBlock
    blocks = [cls(i) for i in range(n)]
    return GuardedQueue(blocks), blocks


def _forward(q: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in q.get_all_free_blocks()]


def _backward(q: FreeKVCacheBlockQueue) -> list[int]:
    out, b = [], q.fake_free_list_tail.prev_free_block
    while b is not None and b is not q.fake_free_list_head:
        out.append(b.block_id)
        b = b.prev_free_block
    return out


def _state(q: FreeKVCacheBlockQueue) -> tuple[list[int], list[int], int]:
    """What a queue looks like: ids front to back, ids back to front, its count."""
    return _forward(q), _backward(q), q.num_free_blocks


def _reference(q: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    """The package's own removal (allowed here, on a twin queue, to compute what is expected)."""
    if isinstance(q, GuardedQueue):
        q.reference_allowed = True
        try:
            q.remove(block)
        finally:
            q.reference_allowed = False
    else:
        q.remove(block)


def _after_removals(remove: Remove, n: int, ids: list[int]) -> tuple[list[int], list[int], int]:
    q, blocks = _queue(n)
    for i in ids:
        remove(q, blocks[i])
    return _state(q)


def _removed_links(remove: Remove) -> tuple[Any, Any]:
    q, blocks = _queue(6)
    remove(q, blocks[3])
    return blocks[3].prev_free_block, blocks[3].next_free_block


def _remove_twice(remove: Remove) -> tuple[str, tuple[list[int], list[int], int]]:
    q, blocks = _queue(6)
    remove(q, blocks[2])
    try:
        remove(q, blocks[2])
        outcome = "no error"
    except ValueError:
        outcome = "ValueError"
    return outcome, _state(q)


def _remove_then_append(remove: Remove) -> tuple[list[int], list[int], int]:
    q, blocks = _queue(6)
    remove(q, blocks[1])
    remove(q, blocks[4])
    q.append(blocks[1])  # refuses a block whose links were left set
    return _state(q)


def check_remove_links(remove: Remove) -> list[CheckOutcome]:
    """``remove(queue, block)``: unlink ``block`` from anywhere in ``queue``; the list stays whole both ways."""
    cases = [
        ("the first block (next to the fake head)", 6, [0]),
        ("a block in the middle", 6, [3]),
        ("the last block (next to the fake tail)", 6, [5]),
        ("blocks 1, 3, 5 one after the other", 7, [1, 3, 5]),
        ("every block, back to front", 5, [4, 3, 2, 1, 0]),
    ]
    hint = (
        "compare the three parts: the ids read front to back, back to front, and the count. After a removal "
        "the list must read the same both ways without the block, and num_free_blocks must agree with it; "
        "thanks to the fake head and tail a queued block always has two neighbours (chapter 03, section 3)"
    )
    checks = [
        Check(
            f"remove blocks {ids} from a queue of {n}  # {label}; then (ids front→back, ids back→front, "
            f"num_free_blocks)",
            lambda n=n, ids=ids: _after_removals(remove, n, ids),
            _after_removals(_reference, n, ids),
            hint=hint,
        )
        for label, n, ids in cases
    ]
    checks.append(
        Check(
            "remove block 3 of 6, then read (block.prev_free_block, block.next_free_block)",
            lambda: _removed_links(remove),
            _removed_links(_reference),
            hint="a block outside the queue must not point into it: what did your removal leave in "
            "the removed block itself?",
        )
    )
    checks.append(
        Check(
            "remove block 1 and block 4, then queue.append(block 1)",
            lambda: _remove_then_append(remove),
            _remove_then_append(_reference),
            hint="append refuses a block that still looks linked: look at the removed block's own "
            "fields after your removal",
        )
    )
    checks.append(
        Check(
            "remove block 2 twice: the second call raises ValueError and changes nothing",
            lambda: _remove_twice(remove),
            _remove_twice(_reference),
            hint="how can you tell, from the block alone, that it is not in the queue? That case must "
            "raise ValueError before changing anything",
        )
    )
    return report("remove_links", checks)


def _far_touches(remove: Remove, q: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock], i: int) -> int:
    """Reads/writes of queue links on blocks other than ``blocks[i]`` and its two neighbours."""
    near = {blocks[i].block_id}
    for nb in (_PREV.__get__(blocks[i]), _NEXT.__get__(blocks[i])):
        if nb is not None:
            near.add(nb.block_id)
    ProbeBlock.touches.clear()
    remove(q, blocks[i])
    touched = dict(ProbeBlock.touches)
    ProbeBlock.touches.clear()
    # The fake head and tail are plain blocks (id -1): they are neighbours or never reached without a walk.
    return sum(c for bid, c in touched.items() if bid not in near)


def _huge_queue() -> tuple[FreeKVCacheBlockQueue, list[KVCacheBlock]]:
    q, blocks = _queue(HUGE, probe=True)
    ProbeBlock.touches.clear()
    return q, blocks


def check_remove_is_O1(remove: Remove) -> list[CheckOutcome]:
    """One removal from a 200,000-block queue touches the removed block and its two neighbours, nothing else."""
    ref_q, ref_blocks = _huge_queue()
    q, blocks = _huge_queue()
    checks = []
    for label, i in (
        ("the middle block", HUGE // 2),
        ("the first block", 0),
        ("the last block", HUGE - 1),
        ("a block near the back", HUGE - 17),
    ):
        expected = _far_touches(_reference, ref_q, ref_blocks, i)
        checks.append(
            Check(
                f"remove {label} (id {i}) of a {HUGE:,}-block queue; count link reads/writes on other blocks",
                lambda i=i: _far_touches(remove, q, blocks, i),
                expected,
                hint="this counts link reads and writes on blocks other than the removed one and its "
                "two neighbours, so any walk or search over the queue shows up; everything a "
                "removal needs is reachable from the block itself",
            )
        )
    checks.append(
        Check(
            f"after those 4 removals: num_free_blocks of the {HUGE:,}-block queue",
            lambda: q.num_free_blocks,
            ref_q.num_free_blocks,
            hint="the queue's count must follow its removals",
        )
    )
    return report("remove_is_O1", checks)


def _pool_scenario(remove: Remove | None) -> tuple[list[int], int, list[int], list[int]]:
    """Two prompts cached and freed; a third request hits the first prompt's blocks in the middle of the queue.

    Returns (free queue ids, free blocks, ref counts of the hit blocks, the new request's block table).
    """
    mgr = KVCacheManager(block_size=4, num_blocks=12, enable_caching=True, watermark=0.0)
    q = mgr.block_pool.free_block_queue
    if remove is not None:
        # The pool's cache hits now go through the learner's code (patched on this one queue, on purpose).
        q.remove = lambda block: remove(q, block)  # type: ignore[method-assign]
    for rid, prompt in (("p1", list(range(9))), ("p2", list(range(100, 109)))):
        req = Request(rid, prompt)
        mgr.allocate_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        mgr.free(req)
    hit = Request("hit", list(range(9)) + [55, 56])
    blocks, n = mgr.get_computed_blocks(hit)
    if mgr.allocate_slots(hit, hit.num_tokens - n, num_new_computed_tokens=n, new_computed_blocks=blocks) is None:
        raise RuntimeError("the scenario's pool is too small")
    return (_forward(q), mgr.get_num_free_blocks(), [b.ref_cnt for b in blocks], mgr.get_block_ids("hit"))


def check_remove_in_pool(remove: Remove) -> list[CheckOutcome]:
    """The learner's ``remove`` serving a real ``BlockPool``: prefix-cache hits take cached blocks out of the queue."""
    expected = _pool_scenario(None)
    labels = [
        "the free queue after the hit (ids front→back)",
        "free blocks after the hit",
        "ref counts of the two hit blocks",
        "the hitting request's block table",
    ]
    checks = [
        Check(
            f"KVCacheManager(block_size=4, num_blocks=12): p1, p2 cached and freed, a request with p1's "
            f"prefix hits 2 blocks; {label}",
            lambda k=k: _pool_scenario(remove)[k],
            expected[k],
            hint="a cache hit calls your remove on a block in the middle of the free queue: make "
            "remove_links pass first, then compare what the pool did next",
        )
        for k, label in enumerate(labels)
    ]
    return report("remove_in_pool", checks)
