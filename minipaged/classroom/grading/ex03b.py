"""Checks for exercise 03b (the build track): the whole ``BlockPool``, from its spec, with no skeleton.

The learner writes a class with the package's interface (vLLM's names): ``BlockPool(num_blocks, enable_caching)``
with ``blocks``, ``null_block``, ``get_num_free_blocks``, ``get_new_blocks``, ``free_blocks``, ``touch``,
``cache_full_blocks`` and ``get_cached_block``, and its own free queue. Nothing here compares one output with one
answer where several are right: every check drives the learner's pool and the package's ``BlockPool`` (the twin)
through the same operations and compares what can be observed from outside — the ids handed out, the free count,
every block's ``ref_cnt``, what each hash looks up, and the order in which the free blocks would be handed out.
How the learner keeps the free blocks (links through the blocks, an ``OrderedDict``, anything) is theirs.

O(1) is checked without a clock, as in exercise 03: the pool's blocks are turned into probes that count every
read and write of their queue links and every ``==`` or ``hash()`` on them, so a walk, a ``list.remove`` or an
``in`` test over the free blocks shows up as touches on blocks the operation has no business with.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ...core.block_hash import BlockHash
from ...core.block_pool import BlockPool as PackagePool
from ...core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from .core import Check, CheckOutcome, report
from .ex03 import ProbeBlock

PoolClass = Callable[..., Any]
BLOCK_SIZE = 4  # tokens per block in the hashes' story; the pool never reads tokens
TWIN_SEEDS = (1, 2, 3, 4)
TWIN_OPS, TWIN_BLOCKS = 250, 24
HUGE = 100_000


class PoolProbe(ProbeBlock):
    """A ``KVCacheBlock`` that also counts ``==`` and ``hash()`` on itself: ``list.remove``, ``deque.remove`` and
    ``x in some_list`` compare the searched block with every other one, each comparison a touch."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        self._touch()
        return self is other

    def __hash__(self) -> int:
        self._touch()
        return object.__hash__(self)  # what the block hashed to before it became a probe: dicts still find it


def block_hash(tag: str) -> BlockHash:
    """A stand-in for a block's chained hash (chapter 08): unique per tag, the type the package uses."""
    return BlockHash(hashlib.sha256(tag.encode()).digest())


def fake_request(request_id: str, hashes: list[BlockHash]) -> Any:  # duck-typed: the pools read only these
    """What ``cache_full_blocks`` reads of a request: its id and its blocks' hashes."""
    return SimpleNamespace(request_id=request_id, block_hashes=hashes)


def _ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def _not_the_package(pool: Any) -> str:
    """'your own' or which package object the learner's pool holds (the exercise is to write them)."""
    if isinstance(pool, PackagePool):
        return "it is (a subclass of) the package's BlockPool"
    values = list(vars(pool).values()) if hasattr(pool, "__dict__") else []
    for v in values:
        if isinstance(v, (PackagePool, FreeKVCacheBlockQueue)):
            return f"it holds the package's {type(v).__name__}"
    return "your own"


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError:
        return "ValueError"
    except Exception as exc:  # the wrong kind of error is an answer too
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _found(pool: Any, h: BlockHash) -> int | None:
    """The id of the block ``h`` finds in ``pool``, or None."""
    block = pool.get_cached_block(h)
    return None if block is None else block.block_id


def _drain(pool: Any) -> list[int]:
    """The order the free blocks would be handed out in: take them all (a final look; the pool is spent)."""
    return _ids(pool.get_new_blocks(pool.get_num_free_blocks()))


# ---- the spec, case by case ------------------------------------------------------------------------------------
def _fresh(cls: PoolClass) -> list[Any]:
    pool = cls(6)
    return [pool.get_num_free_blocks(), _ids(pool.blocks), pool.null_block is pool.blocks[0], _drain(cls(6))]


def _first_blocks(cls: PoolClass) -> list[Any]:
    pool = cls(8)
    a = pool.get_new_blocks(3)
    return [_ids(a), [b.ref_cnt for b in a], pool.get_num_free_blocks(), _ids(pool.get_new_blocks(0))]


def _lru(cls: PoolClass) -> list[int]:
    """A's blocks freed tail first, then B's: the next allocations take A's last block first, then B's."""
    pool = cls(9)
    a, b = pool.get_new_blocks(3), pool.get_new_blocks(2)
    pool.free_blocks(list(reversed(a)))
    pool.free_blocks(list(reversed(b)))
    return _drain(pool)


def _shared(cls: PoolClass) -> list[Any]:
    pool = cls(6)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks)  # a second user
    pool.free_blocks(blocks)
    after_one = ([b.ref_cnt for b in blocks], pool.get_num_free_blocks())
    pool.free_blocks(blocks)
    return [after_one, ([b.ref_cnt for b in blocks], pool.get_num_free_blocks()), _drain(pool)]


def _too_many(cls: PoolClass) -> list[Any]:
    pool = cls(5)
    pool.get_new_blocks(2)
    outcome = _raises(lambda: pool.get_new_blocks(3))
    return [outcome, pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks], _drain(pool)]


def _double_free(cls: PoolClass) -> list[Any]:
    pool = cls(6)
    a = pool.get_new_blocks(2)
    outcome = _raises(lambda: pool.free_blocks([a[1], a[0], a[1]]))  # the whole call refused, nothing freed
    return [outcome, [b.ref_cnt for b in a], pool.get_num_free_blocks(), _drain(pool)]


def _null_block(cls: PoolClass) -> list[Any]:
    pool = cls(4)
    null = pool.null_block
    pool.free_blocks([null])
    pool.touch([null])
    return [pool.get_num_free_blocks(), null.ref_cnt, 0 in _drain(pool)]


def _cached_then_evicted(cls: PoolClass) -> list[Any]:
    """A block cached, freed (still found), then handed out again (no longer found)."""
    pool = cls(4)
    blocks = pool.get_new_blocks(2)
    hashes = [block_hash("p0"), block_hash("p1")]
    pool.cache_full_blocks(fake_request("r", hashes), blocks, 0, 2, BLOCK_SIZE)
    in_use = [_ids([pool.get_cached_block(h)]) for h in hashes]
    pool.free_blocks(list(reversed(blocks)))
    free = [_found(pool, h) for h in hashes]
    pool.get_new_blocks(2)  # the lone never-used block, then block 2 (freed first): its hash must go
    after = [_found(pool, h) for h in hashes]
    return [in_use, free, after, pool.get_cached_block(block_hash("never")) is None]


def _hit_from_the_middle(cls: PoolClass) -> list[Any]:
    """A cached block sitting in the middle of the free blocks is touched: it leaves them, the others keep order."""
    pool = cls(8)
    blocks = pool.get_new_blocks(5)
    pool.cache_full_blocks(fake_request("r", [block_hash(f"m{i}") for i in range(5)]), blocks, 0, 5, BLOCK_SIZE)
    pool.free_blocks(blocks)
    hit = pool.get_cached_block(block_hash("m2"))
    pool.touch([hit])
    return [hit.block_id, hit.ref_cnt, pool.get_num_free_blocks(), _drain(pool)]


def _partly_cached(cls: PoolClass) -> list[Any]:
    """``cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, ...)`` caches only the new ones."""
    pool = cls(8)
    blocks = pool.get_new_blocks(4)
    hashes = [block_hash(f"q{i}") for i in range(4)]
    pool.cache_full_blocks(fake_request("r", hashes), blocks, 0, 1, BLOCK_SIZE)
    pool.cache_full_blocks(fake_request("r", hashes), blocks, 1, 3, BLOCK_SIZE)  # block 3 is not full
    return [_found(pool, h) for h in hashes]


def _caching_off(cls: PoolClass) -> list[Any]:
    """``enable_caching=False``: cache_full_blocks records nothing, so nothing is found and nothing evicted."""
    pool = cls(6, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    hashes = [block_hash("o0"), block_hash("o1")]
    pool.cache_full_blocks(fake_request("r", hashes), blocks, 0, 2, BLOCK_SIZE)
    found = [_found(pool, h) for h in hashes]
    pool.free_blocks(list(reversed(blocks)))
    return [found, [_found(pool, h) for h in hashes], [b.block_hash is None for b in blocks], _drain(pool)]


SPEC_CASES: list[tuple[str, Callable[[PoolClass], Any], str]] = [
    (
        "BlockPool(6): [free count, block ids, null_block is blocks[0], the order they are handed out]",
        _fresh,
        "block 0 is the null block: in blocks, never free, never handed out; the rest start free in id order",
    ),
    (
        "BlockPool(8).get_new_blocks(3): [ids, their ref_cnt, free count]; then get_new_blocks(0)",
        _first_blocks,
        "hand out from the front of the free blocks, each with ref_cnt 1; asking for 0 gives []",
    ),
    (
        "get 3 blocks (A) and 2 (B); free A tail first, then B tail first; the order all free blocks go out in",
        _lru,
        "freed blocks join the *back*, in the order given: the never-used blocks go first, then A's (tail first)",
    ),
    (
        "get 2 blocks, touch them (a second user), free twice: [(ref_cnt, free) after one, after two, order]",
        _shared,
        "a block is free only when its last user frees it (ref_cnt reaches 0); touch adds a user",
    ),
    (
        "BlockPool(5): get 2, then ask for 3 (only 2 free): [error, free count, ref_cnts, order]",
        _too_many,
        "asking for more than are free raises ValueError and hands out nothing: check before you take",
    ),
    (
        "free_blocks([a1, a0, a1]) frees a1 twice: [error, ref_cnts, free count, order]",
        _double_free,
        "check the whole list before changing anything: a double free raises ValueError and frees nothing",
    ),
    (
        "free_blocks([null_block]) and touch([null_block]): [free count, its ref_cnt, 0 ever handed out?]",
        _null_block,
        "the null block has no owner: free_blocks and touch skip it, and it is never free",
    ),
    (
        "cache 2 blocks, free them, get 2 new blocks: [lookups in use, lookups free, lookups after reuse, miss]",
        _cached_then_evicted,
        "a freed block keeps its hash (a later prompt may hit it) until it is handed out again: then it goes",
    ),
    (
        "5 cached blocks freed; touch the one cached as m2: [its id, ref_cnt, free count, order of the rest]",
        _hit_from_the_middle,
        "a hit takes the block out of the free blocks from wherever it is; the others keep their order",
    ),
    (
        "cache_full_blocks(req, blocks, 0, 1) then (req, blocks, 1, 3): what each of 4 hashes finds",
        _partly_cached,
        "blocks[num_cached_blocks:num_full_blocks] are the new full blocks, hashed request.block_hashes[i]",
    ),
    (
        "BlockPool(6, enable_caching=False): cache 2 blocks, free them: [found in use, found free, hashless, order]",
        _caching_off,
        "enable_caching=False keeps no hashes: cache_full_blocks records nothing, get_cached_block finds nothing",
    ),
]


def check_pool_spec(BlockPool: PoolClass) -> list[CheckOutcome]:
    """The spec, one behaviour at a time, each expected value computed by the package's ``BlockPool``."""
    checks = [
        Check(f"{tried}", lambda fn=fn: fn(BlockPool), fn(PackagePool), hint=hint) for tried, fn, hint in SPEC_CASES
    ]
    checks.append(
        Check(
            "BlockPool(4) is your own: it is not, and holds no, BlockPool or FreeKVCacheBlockQueue of the package",
            lambda: _not_the_package(BlockPool(4)),
            "your own",
            hint="this exercise is to write them: keep the free blocks in a structure of your own",
        )
    )
    return report("pool_spec", checks)


# ---- the twin: random operations, everything observable compared ----------------------------------------------
class _Twins:
    """The learner's pool and the package's, driven by the same random operations."""

    def __init__(self, cls: PoolClass, seed: int) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.mine, self.ref = cls(TWIN_BLOCKS), PackagePool(TWIN_BLOCKS)
        self.owners: dict[str, list[int]] = {}  # owner -> block ids, in its table's order
        self.cached: dict[str, int] = {}  # owner -> blocks of it cached so far
        self.hashes: dict[str, list[BlockHash]] = {}  # owner -> the hash of each of its blocks
        self.all_hashes: list[BlockHash] = []
        self.count = 0

    def both(self, fn: Callable[[Any], Any]) -> tuple[Any, Any]:
        def one(pool: Any) -> Any:
            try:
                return fn(pool)
            except ValueError:
                return "ValueError"

        return one(self.mine), one(self.ref)

    def blocks(self, pool: Any, ids: list[int]) -> list[Any]:
        return [pool.blocks[i] for i in ids]

    def state(self, pool: Any) -> tuple[int, list[int], list[int | None]]:
        looked = [pool.get_cached_block(h) for h in self.all_hashes]
        return pool.get_num_free_blocks(), [b.ref_cnt for b in pool.blocks], [b and b.block_id for b in looked]

    def step(self) -> str | None:
        """One random operation on both pools; a description of the first difference, or None."""
        self.count += 1
        rng, free = self.rng, self.ref.get_num_free_blocks()
        kind = rng.choices(["new", "grow", "cache", "hit", "free", "bad"], [4, 2, 3, 2, 3, 1])[0]
        if kind in ("new", "grow") or not self.owners:
            k = rng.randint(1, 4) if rng.random() > 0.1 else free + 1  # now and then, more than are free
            owner = f"o{self.count}" if kind == "new" or not self.owners else rng.choice(sorted(self.owners))
            what = f"get_new_blocks({k}) for {owner}"
            mine, ref = self.both(lambda p: _ids(p.get_new_blocks(k)))
            if mine != ref:
                return f"{what}: yours gave {mine}, the package's {ref}"
            if ref != "ValueError":
                self.owners.setdefault(owner, []).extend(ref)
                self.cached.setdefault(owner, 0)
                self.hashes.setdefault(owner, [])
                have = len(self.hashes[owner])
                self.hashes[owner] += [block_hash(f"{self.seed}/{owner}/{have + j}") for j in range(len(ref))]
        elif kind == "cache":
            owner = rng.choice(sorted(self.owners))
            have, done = len(self.owners[owner]), self.cached[owner]
            full = rng.randint(done, have)
            what = f"cache_full_blocks({owner}, num_cached_blocks={done}, num_full_blocks={full})"
            req = fake_request(owner, self.hashes[owner])
            for pool in (self.mine, self.ref):
                pool.cache_full_blocks(req, self.blocks(pool, self.owners[owner]), done, full, BLOCK_SIZE)
            self.all_hashes += [h for h in self.hashes[owner][done:full] if h not in self.all_hashes]
            self.cached[owner] = full
        elif kind == "hit":
            found = [h for h in self.all_hashes if self.ref.get_cached_block(h) is not None]
            if not found:
                return None
            h = rng.choice(found)
            owner = f"o{self.count}"
            what = f"a prefix hit: get_cached_block(...) then touch it, for {owner}"
            mine, ref = self.both(lambda p: getattr(p.get_cached_block(h), "block_id", None))
            if mine != ref:
                return f"{what}: yours found block {mine}, the package's {ref}"
            for pool in (self.mine, self.ref):
                pool.touch(self.blocks(pool, [ref]))
            self.owners[owner], self.cached[owner], self.hashes[owner] = [ref], 1, [h]
        elif kind == "free":
            owner = rng.choice(sorted(self.owners))
            ids = list(reversed(self.owners.pop(owner)))
            what = f"free_blocks({ids}) for {owner} (tail first)"
            mine, ref = self.both(lambda p: p.free_blocks(self.blocks(p, ids)))
            if mine != ref:
                return f"{what}: yours {mine or 'returned'}, the package's {ref or 'returned'}"
        else:  # a double free in one call, or the null block: refused or skipped, nothing changes
            first = self.owners[rng.choice(sorted(self.owners))][0]
            ids = [first, first] if rng.random() < 0.5 and self.ref.blocks[first].ref_cnt == 1 else [0]
            what = f"free_blocks({ids}) ({'a double free' if ids != [0] else 'the null block'})"
            mine, ref = self.both(lambda p: p.free_blocks(self.blocks(p, ids)))
            if mine != ref:
                return f"{what}: yours {mine or 'returned'}, the package's {ref or 'returned'}"
        mine_state, ref_state = self.state(self.mine), self.state(self.ref)
        for label, a, b in zip(("free count", "ref_cnt of blocks 0..", "what each cached hash finds"),
                               mine_state, ref_state):  # fmt: skip
            if a != b:
                return f"after op {self.count}, {what}: {label}: yours {a}, the package's {b}"
        return None


def _twin_run(cls: PoolClass, seed: int) -> str:
    twins = _Twins(cls, seed)
    for _ in range(TWIN_OPS):
        diff = twins.step()
        if diff:
            return diff if diff.startswith("after op") else f"op {twins.count}, {diff}"
    mine, ref = _drain(twins.mine), _drain(twins.ref)
    return "same" if mine == ref else f"after {TWIN_OPS} ops, the free blocks go out as {mine}, the package's {ref}"


def check_pool_twin(BlockPool: PoolClass) -> list[CheckOutcome]:
    """Random workloads of allocations, prefix hits, caching and frees, the learner's pool beside the package's."""
    hint = (
        "the first operation where your pool and the package's disagree is named: replay it by hand with the "
        "spec (front of the free blocks out, back in, tail first; ref counts; a hash kept until reuse)"
    )
    checks = [
        Check(
            f"seed {seed}: {TWIN_OPS} random operations on BlockPool({TWIN_BLOCKS}) and on the package's; "
            "the first difference in results, free count, ref counts, cache lookups or final order",
            lambda seed=seed: _twin_run(BlockPool, seed),
            "same",
            hint=hint,
        )
        for seed in TWIN_SEEDS
    ]
    return report("pool_twin", checks)


# ---- O(1) ----------------------------------------------------------------------------------------------------
def _half_cached(pool: Any) -> Any:
    """``pool`` with half its blocks handed out and cached, then every other one freed: cached blocks spread
    through the free blocks (block i + 1 holds hash b{i})."""
    blocks = pool.get_new_blocks(HUGE // 2)
    pool.cache_full_blocks(
        fake_request("big", [block_hash(f"b{i}") for i in range(len(blocks))]), blocks, 0, len(blocks), BLOCK_SIZE
    )
    pool.free_blocks(blocks[::2])
    return pool


def _probed(cls: PoolClass) -> Any:
    """A ``_half_cached`` pool of HUGE blocks whose blocks count touches."""
    pool = cls(HUGE)
    for b in pool.blocks:
        if type(b) is not KVCacheBlock:
            raise TypeError(f"pool.blocks must hold KVCacheBlock objects, found {type(b).__name__}")
        b.__class__ = PoolProbe
    _half_cached(pool)
    ProbeBlock.touches.clear()
    return pool


def _touches(pool: Any, op: Callable[[], Any], allowed: set[int]) -> int:
    ProbeBlock.touches.clear()
    op()
    touched = dict(ProbeBlock.touches)
    ProbeBlock.touches.clear()
    return sum(c for bid, c in touched.items() if bid not in allowed)


def _o1_ops(cls: PoolClass) -> list[int]:
    """Touches on blocks an operation has no business with, for five operations on a HUGE-block pool."""
    pool, ref = _probed(cls), _half_cached(PackagePool(HUGE))

    def near(block_id: int) -> set[int]:
        """A block and its neighbours in the package's free queue (a linked pool may touch those)."""
        b = ref.blocks[block_id]
        out = {block_id}
        for nb in (b.prev_free_block, b.next_free_block):
            if nb is not None:
                out.add(nb.block_id)
        return out

    out = [_touches(pool, pool.get_num_free_blocks, set())]
    mid = HUGE // 2 - 2  # an even index: cached, and free in the middle of the free blocks
    h = block_hash(f"b{mid}")
    target = ref.get_cached_block(h)
    assert target is not None
    allowed = near(target.block_id)
    out.append(_touches(pool, lambda: pool.touch([pool.get_cached_block(h)]), allowed))
    ref.touch([target])
    first = ref.free_block_queue.fake_free_list_head.next_free_block
    assert first is not None
    out.append(_touches(pool, lambda: pool.get_new_blocks(1), near(first.block_id) | {first.block_id}))
    ref.get_new_blocks(1)
    last = ref.free_block_queue.fake_free_list_tail.prev_free_block
    assert last is not None
    back = {target.block_id, last.block_id}
    out.append(_touches(pool, lambda: pool.free_blocks([pool.blocks[target.block_id]]), back))
    out.append(_touches(pool, lambda: pool.get_cached_block(block_hash(f"b{HUGE // 2 - 1}")), set()))
    return out


def check_pool_O1(BlockPool: PoolClass) -> list[CheckOutcome]:
    """Five operations on a 100,000-block pool, each touching only the blocks it works on."""
    labels = [
        "get_num_free_blocks()",
        "touch a cached block sitting in the middle of the free blocks (a prefix hit)",
        "get_new_blocks(1)",
        "free_blocks([one block])",
        "get_cached_block(a hash)",
    ]
    cache: dict[str, Any] = {}

    def measured() -> list[int]:
        if "ops" not in cache:
            cache["ops"] = _o1_ops(BlockPool)
        return cache["ops"]

    hint = (
        "this counts link reads and writes, == and hash() on blocks other than the one an operation works on "
        "(and its neighbours in the free order), so a walk, a list.remove or an `in` over the free blocks shows "
        "up; keep a count instead of counting, and find a block by its links or a dict, not a search"
    )
    checks = [
        Check(
            f"BlockPool({HUGE:,}), half its blocks cached and every other one freed: {label}; count touches on "
            "blocks it has no business with",
            lambda i=i: measured()[i],
            0,
            hint=hint,
        )
        for i, label in enumerate(labels)
    ]
    return report("pool_O1", checks)
