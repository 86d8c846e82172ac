"""Checks for exercise 04b (the build track): ``KVCacheManager`` over a block pool, from its spec.

The learner writes ``KVCacheManager(block_pool, block_size, watermark_blocks=0)`` with vLLM's names:
``get_computed_blocks`` (the prefix-cache lookup), ``allocate_slots`` (all five regions of a request's tokens:
computed, new prefix hits, external hits, new tokens, lookahead; and the watermark), ``free`` and
``get_block_ids``. Every check drives the learner's manager, over a package ``BlockPool``, and the package's
``KVCacheManager`` (the twin) through the same calls on the same requests, and compares what can be seen from
outside: the blocks each call returns, each request's block table, the pool's free count, every block's
``ref_cnt``, what each hash finds in the prefix cache and the order the free blocks would be handed out in. How
the learner keeps the tables and counts is theirs.

The package's manager takes external hits only from a KV connector; the twin is given one that holds nothing
(``_QuietConnector``): which tokens are external hits is the driver's say, the same for both managers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ...core.block_pool import BlockPool as PackagePool
from ...core.block_pool import get_request_block_hasher
from ...core.kv_cache_coordinator import KVCacheCoordinator
from ...core.kv_cache_manager import KVCacheManager as PackageManager
from ...core.kv_connector import KVConnector
from ...core.request import Request
from ...core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from .core import Check, CheckOutcome, report

ManagerClass = Callable[..., Any]
Factory = Callable[[int, int], Any]  # (num_blocks, watermark_blocks) -> a manager over a fresh pool
BLOCK_SIZE = 4
TWIN_SEEDS = (1, 2, 3, 4)
TWIN_OPS, TWIN_BLOCKS, TWIN_WATERMARK = 300, 24, 2
VOCAB = 6  # few token ids: prompts share prefixes, so the prefix cache is hit often


class _QuietConnector(KVConnector):
    """A KV connector that holds nothing and hears everything (the base class's no-ops): lets the package's manager
    take external hits."""


def package_manager(num_blocks: int, watermark_blocks: int) -> PackageManager:
    """The twin: the package's manager with the same pool size and watermark, block size ``BLOCK_SIZE``."""
    return PackageManager(BLOCK_SIZE, num_blocks, watermark_blocks=watermark_blocks, connector=_QuietConnector())


def learner_factory(cls: ManagerClass) -> Factory:
    """The learner's manager over a fresh package ``BlockPool`` (exercise 03b's pool is graded there)."""
    return lambda num_blocks, watermark_blocks: cls(
        PackagePool(num_blocks), BLOCK_SIZE, watermark_blocks=watermark_blocks
    )


def make_request(request_id: str, token_ids: list[int]) -> Request:
    """A request whose ``block_hashes`` follow its tokens (one hash per full block of ``BLOCK_SIZE``)."""
    return Request(request_id, list(token_ids), block_hasher=get_request_block_hasher(BLOCK_SIZE))


def _ids(blocks: Any) -> list[int] | None:
    return None if blocks is None else [b.block_id for b in blocks]


def _call(fn: Callable[[], Any]) -> Any:
    """What a call returns as ids, or the name of the error it raised (an error is an answer too)."""
    try:
        return _ids(fn())
    except ValueError:
        return "ValueError"


def _found(manager: Any, hashes: list[Any]) -> list[int | None]:
    """Which block each hash finds in the manager's pool."""
    found = (manager.block_pool.get_cached_block(h) for h in hashes)
    return [None if b is None else b.block_id for b in found]


def _drain(manager: Any) -> list[int]:
    """The order the pool's free blocks would be handed out in (a final look: the pool is spent)."""
    pool = manager.block_pool
    return [b.block_id for b in pool.get_new_blocks(pool.get_num_free_blocks())]


def _ref_cnts(manager: Any) -> list[int]:
    return [b.ref_cnt for b in manager.block_pool.blocks]


def _admit(m: Any, r: Request, num_new_tokens: int, **kw: Any) -> Any:
    """``allocate_slots`` for a new request with its prefix hits; on success the request's tokens are computed."""
    hits, num_hit = m.get_computed_blocks(r)
    num_ext = kw.pop("num_external_computed_tokens", 0)
    out = _call(lambda: m.allocate_slots(r, num_new_tokens, num_hit, hits, num_external_computed_tokens=num_ext, **kw))
    if isinstance(out, list):
        r.num_computed_tokens += num_hit + num_ext + num_new_tokens
    return out


def _run(m: Any, r: Request, num_new_tokens: int, **kw: Any) -> Any:
    """``allocate_slots`` for a running request; on success its new tokens are computed."""
    out = _call(lambda: m.allocate_slots(r, num_new_tokens, **kw))
    if isinstance(out, list):
        r.num_computed_tokens += num_new_tokens
    return out


def _tokens(start: int, n: int) -> list[int]:
    """``n`` token ids that share nothing with another start's (the spec cases' distinct prompts)."""
    return [1000 * start + i for i in range(n)]


# ---- the spec, case by case ------------------------------------------------------------------------------------
def _first_admission(make: Factory) -> list[Any]:
    m = make(12, 0)
    r = make_request("a", _tokens(1, 10))
    got = _admit(m, r, 10)
    return [got, m.get_block_ids("a"), m.block_pool.get_num_free_blocks(), _found(m, r.block_hashes)]


def _chunks(make: Factory) -> list[Any]:
    m = make(12, 0)
    r = make_request("a", _tokens(1, 10))
    first = _admit(m, r, 4)
    found_first = _found(m, r.block_hashes)
    return [first, found_first, _run(m, r, 6), m.get_block_ids("a"), _found(m, r.block_hashes)]


def _decode(make: Factory) -> list[Any]:
    m = make(12, 0)
    r = make_request("a", _tokens(1, 7))
    out = [_admit(m, r, 7)]
    r.append_output_token_ids(7)  # 8 tokens: the 8th fills block 1
    out += [_run(m, r, 1), _found(m, r.block_hashes)]
    r.append_output_token_ids(8)  # 9 tokens: the 9th needs a third block
    out += [_run(m, r, 1), m.get_block_ids("a")]
    return out


def _lookahead(make: Factory) -> list[Any]:
    m = make(12, 0)
    r = make_request("a", _tokens(1, 6))
    got = _admit(m, r, 6, num_lookahead_tokens=3)
    return [got, m.block_pool.get_num_free_blocks(), _found(m, r.block_hashes)]


def _watermark(make: Factory) -> list[Any]:
    m = make(11, 3)  # 10 usable, 3 kept from new requests
    a = make_request("a", _tokens(1, 40))
    out = [_admit(m, a, 20)]  # 5 blocks + 3 kept <= 10 free
    b = make_request("b", _tokens(2, 12))
    out += [_admit(m, b, 12), _run(m, a, 20), m.block_pool.get_num_free_blocks()]  # b: 3 + 3 > 5; a may dig in
    return out


def _prefix_hit(make: Factory) -> list[Any]:
    m = make(12, 0)
    a = make_request("a", _tokens(1, 13))
    _admit(m, a, 13)
    m.free(a)
    b = make_request("b", _tokens(1, 12) + [7, 8])
    hits, num_hit = m.get_computed_blocks(b)
    got = _call(lambda: m.allocate_slots(b, 2, num_hit, hits))
    return [(_ids(hits), num_hit), got, m.get_block_ids("b"), _ref_cnts(m), m.block_pool.get_num_free_blocks()]


def _hits_take_free_blocks(make: Factory) -> list[Any]:
    """Cached hits that sit among the free blocks use up free blocks too; a refusal changes nothing."""
    m = make(8, 0)
    a = make_request("a", _tokens(1, 13))
    _admit(m, a, 13)
    m.free(a)
    _admit(m, make_request("c", _tokens(2, 12)), 12)  # 3 of the 7 free blocks; a's 3 cached blocks stay free
    before = (_ref_cnts(m), m.block_pool.get_num_free_blocks())
    b = make_request("b", _tokens(1, 12) + _tokens(3, 9))  # 3 hits + 3 new blocks: 6 > 4 free
    refused = _admit(m, b, 9)
    after = (_ref_cnts(m), m.block_pool.get_num_free_blocks(), m.get_block_ids("b"))
    b2 = make_request("b2", _tokens(1, 12) + [5])  # 3 hits + 1 new block: 4 <= 4
    return [refused, after[:2] == before, after[2], _admit(m, b2, 1), m.get_block_ids("b2")]


def _hits_before_new_blocks(make: Factory) -> list[Any]:
    """The hits sit at the front of the free blocks: touched first, no fresh block can take one of them."""
    m = make(4, 0)
    a = make_request("a", _tokens(1, 8))
    _admit(m, a, 8)
    x = make_request("x", _tokens(2, 4))
    _admit(m, x, 4)
    m.free(a)  # free blocks, front first: 2, 1
    m.free(x)  # ... then 3
    b = make_request("b", _tokens(1, 8) + [5])
    got = _admit(m, b, 1)
    return [got, m.get_block_ids("b"), _ref_cnts(m), _found(m, a.block_hashes)]


def _computed_blocks(make: Factory) -> list[Any]:
    m = make(12, 0)
    a = make_request("a", _tokens(1, 12))
    _admit(m, a, 12)
    out = []
    for rid, toks in (("same", _tokens(1, 12)), ("longer", _tokens(1, 13)), ("forks", _tokens(1, 4) + [9] * 9)):
        hits, n = m.get_computed_blocks(make_request(rid, toks))
        out.append((_ids(hits), n))
    return [*out, _ref_cnts(m), m.block_pool.get_num_free_blocks()]


def _external_hits(make: Factory) -> list[Any]:
    m = make(12, 0)
    p = make_request("p", _tokens(1, 5))
    _admit(m, p, 5)
    a = make_request("a", _tokens(1, 4) + _tokens(2, 12))  # 1 prefix hit, 8 external, 4 new
    got = _admit(m, a, 4, num_external_computed_tokens=8)
    return [got, m.get_block_ids("a"), a.num_computed_tokens, _found(m, a.block_hashes)]


def _never_fits(make: Factory) -> list[Any]:
    m = make(8, 2)  # 7 usable, 2 kept from new requests: a new request gets at most 5
    big = make_request("big", _tokens(1, 24))
    refused = _admit(m, big, 24)
    state = (_ref_cnts(m), m.block_pool.get_num_free_blocks(), m.get_block_ids("big"))
    return [refused, state, _admit(m, make_request("ok", _tokens(2, 20)), 20)]


def _free(make: Factory) -> list[Any]:
    m = make(7, 0)
    a = make_request("a", _tokens(1, 9))
    _admit(m, a, 9)
    m.free(a)
    return [m.get_block_ids("a"), m.block_pool.get_num_free_blocks(), _drain(m)]


SPEC_CASES: list[tuple[str, Callable[[Factory], Any], str]] = [
    (
        "a new 10-token request, allocate_slots(r, 10): [blocks, block table, free count, what its 2 hashes find]",
        _first_admission,
        "cdiv(10, 4) = 3 blocks from the front of the free blocks; the 2 full blocks go into the prefix cache",
    ),
    (
        "10 tokens in two chunks, 4 then 6: [blocks, what hashes find, blocks, block table, what hashes find]",
        _chunks,
        "a chunk gets the blocks its tokens reach past the ones the request holds; cache a block once it is full",
    ),
    (
        "a 7-token prompt, then two decode steps of 1 token: [blocks, blocks, hashes found, blocks, table]",
        _decode,
        "a decode token that fits in the last block takes nothing ([]); the one after a full block takes one",
    ),
    (
        "6 tokens with num_lookahead_tokens=3: [blocks, free count, what its hashes find]",
        _lookahead,
        "lookahead slots take blocks (cdiv(6 + 3, 4) = 3) but hold no tokens yet: never cache them",
    ),
    (
        "watermark 3 of 10: a (40 tokens) admits 20, b (12) asks for 3 blocks, a asks for 5 more: [..., free]",
        _watermark,
        "a new request (one that holds no blocks) must leave watermark_blocks free; a running one may use them",
    ),
    (
        "a (13 tokens) served and freed; b shares its first 12: [(hits, tokens), blocks, b's table, ref_cnts, free]",
        _prefix_hit,
        "new_computed_blocks join the table first (touched: ref_cnt 1, out of the free blocks), then fresh blocks",
    ),
    (
        "3 cached hits among 4 free blocks; b needs 3 more (refused?), then b2 needs 1: [..., unchanged?, ...]",
        _hits_take_free_blocks,
        "a hit with ref_cnt 0 is taken from the free blocks: count it with the new blocks; None changes nothing",
    ),
    (
        "b's 2 hits are the first 2 free blocks and it needs 1 more: [blocks, table, ref_cnts, a's hashes found]",
        _hits_before_new_blocks,
        "touch the hits before taking fresh blocks, or a fresh block may be one of them (and lose its hash)",
    ),
    (
        "12 tokens cached; get_computed_blocks for the same 12, 13 tokens, and 4 then different: [..., ref, free]",
        _computed_blocks,
        "the longest run of leading full blocks found, at most (num_tokens - 1) // block_size; it touches nothing",
    ),
    (
        "a: 1 prefix-hit block, 8 external tokens, 4 new: [blocks, table, num_computed_tokens, hashes found]",
        _external_hits,
        "external hits are loaded, not computed, into fresh blocks: allocate them after the hits; cache them",
    ),
    (
        "7 usable, watermark 2: a new 24-token request, then a 20-token one: [error, unchanged state, blocks]",
        _never_fits,
        "a request that could never fit (6 blocks > 7 - 2) raises ValueError, changing nothing; 5 blocks fit",
    ),
    (
        "a (9 tokens, 3 blocks) freed: [its table, free count, the order the free blocks go out in]",
        _free,
        "free gives the blocks back last block first (its first blocks, shared the most, are evicted last)",
    ),
]


def _not_the_package(manager: Any) -> str:
    if isinstance(manager, PackageManager):
        return "it is (a subclass of) the package's KVCacheManager"
    for v in vars(manager).values() if hasattr(manager, "__dict__") else []:
        if isinstance(v, (PackageManager, KVCacheCoordinator, SingleTypeKVCacheManager)):
            return f"it holds the package's {type(v).__name__}"
    return "your own"


def check_manager_spec(KVCacheManager: ManagerClass) -> list[CheckOutcome]:
    """The spec, one behaviour at a time, each expected value computed by the package's ``KVCacheManager``."""
    mine = learner_factory(KVCacheManager)
    checks = [Check(tried, lambda fn=fn: fn(mine), fn(package_manager), hint=hint) for tried, fn, hint in SPEC_CASES]
    checks.append(
        Check(
            "KVCacheManager(BlockPool(8), 4) is your own: not, and holding no, KVCacheManager, KVCacheCoordinator or "
            "SingleTypeKVCacheManager of the package",
            lambda: _not_the_package(KVCacheManager(PackagePool(8), BLOCK_SIZE)),
            "your own",
            hint="this exercise is to write them: keep each request's blocks in a structure of your own",
        )
    )
    return report("manager_spec", checks)


# ---- the twin: a random scheduler drives both managers ----------------------------------------------------------
class _Twins:
    """The learner's manager and the package's, driven by the same random admissions, chunks, decode steps,
    preemptions and finishes, as a scheduler would (each request exists twice, one copy per manager)."""

    def __init__(self, make: Factory, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mine, self.ref = make(TWIN_BLOCKS, TWIN_WATERMARK), package_manager(TWIN_BLOCKS, TWIN_WATERMARK)
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(n)] for n in (13, 8, 21)]
        self.waiting: list[tuple[Request, Request]] = []
        self.running: list[tuple[Request, Request]] = []
        self.count = 0
        self.all_hashes: list[Any] = []

    def _new(self) -> None:
        rng = self.rng
        tokens = rng.choice(self.prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))]
        if rng.random() < 0.04:
            tokens = tokens * 5  # now and then a prompt no pool of TWIN_BLOCKS could ever hold
        rid = f"r{self.count}"
        self.waiting.append((make_request(rid, tokens), make_request(rid, tokens)))

    def _both(self, call: Callable[[Any, Request], Any], pair: tuple[Request, Request]) -> tuple[Any, Any]:
        return _call(lambda: call(self.mine, pair[0])), _call(lambda: call(self.ref, pair[1]))

    def _admit(self) -> str | None:
        rng = self.rng
        pair = self.waiting[0]
        (hits_m, n_m), (hits_r, n_r) = self.mine.get_computed_blocks(pair[0]), self.ref.get_computed_blocks(pair[1])
        if (_ids(hits_m), n_m) != (_ids(hits_r), n_r):
            mine, ref = (_ids(hits_m), n_m), (_ids(hits_r), n_r)
            return f"get_computed_blocks({pair[1].request_id}): yours {mine}, the package's {ref}"
        left = pair[1].num_tokens - 1 - n_r  # the last token is always computed
        ext = BLOCK_SIZE * rng.randint(0, left // BLOCK_SIZE) if rng.random() < 0.3 else 0
        rest = pair[1].num_tokens - n_r - ext
        new = rest if rng.random() < 0.5 else rng.randint(1, rest)
        look = rng.choice((0, 0, 0, 1, 3))
        self.what = (
            f"admitting {pair[1].request_id} ({pair[1].num_tokens} tokens): allocate_slots(r, {new}, {n_r}, "
            f"<{len(hits_r)} hits>, num_lookahead_tokens={look}, num_external_computed_tokens={ext})"
        )
        mine, ref = (
            _call(lambda: self.mine.allocate_slots(pair[0], new, n_m, hits_m, look, ext)),
            _call(lambda: self.ref.allocate_slots(pair[1], new, n_r, hits_r, look, ext)),
        )
        if mine != ref:
            return f"{self.what}: yours gave {mine}, the package's {ref}"
        if ref == "ValueError":
            self.waiting.pop(0)  # rejected: it could never fit
        elif ref is not None:
            for r in pair:
                r.num_computed_tokens += n_r + ext + new
            self.running.append(self.waiting.pop(0))
        return None

    def _step(self) -> str | None:
        rng = self.rng
        pair = rng.choice(self.running)
        r = pair[1]
        if r.num_computed_tokens == r.num_tokens:  # prefill done: the step sampled a token
            token = rng.randrange(VOCAB)
            for q in pair:
                q.append_output_token_ids(token)
        left = r.num_tokens - r.num_computed_tokens
        new = left if left == 1 or rng.random() < 0.5 else rng.randint(1, left)
        look = rng.choice((0, 0, 0, 1, 3))
        self.what = (
            f"{r.request_id} running ({r.num_computed_tokens} of {r.num_tokens} computed): "
            f"allocate_slots(r, {new}, num_lookahead_tokens={look})"
        )
        mine, ref = self._both(lambda m, q: m.allocate_slots(q, new, num_lookahead_tokens=look), pair)
        if mine != ref:
            return f"{self.what}: yours gave {mine}, the package's {ref}"
        if ref is None:  # no room: preempt it (recompute), as a scheduler with nothing else to preempt would
            self._release(pair, preempt=True)
        elif isinstance(ref, list):
            for q in pair:
                q.num_computed_tokens += new
            if r.num_tokens >= 40 and r.num_computed_tokens == r.num_tokens:
                self._release(pair, preempt=False)
        return None

    def _release(self, pair: tuple[Request, Request], preempt: bool) -> None:
        self.what = f"free({pair[1].request_id}) ({'preempted' if preempt else 'finished'})"
        self.mine.free(pair[0])
        self.ref.free(pair[1])
        self.running.remove(pair)
        if preempt:
            for q in pair:
                q.num_computed_tokens = 0
            self.waiting.append(pair)

    def step(self) -> str | None:
        """One random operation on both; a description of the first difference, or None."""
        self.count += 1
        rng = self.rng
        kind = rng.choices(["new", "admit", "step", "finish", "preempt"], [2, 3, 6, 1, 1])[0]
        if kind == "new" or (kind == "admit" and not self.waiting):
            self._new()
            self.what = "a new request arrives"
        elif kind == "admit":
            diff = self._admit()
            if diff:
                return diff
        elif not self.running:
            return None
        elif kind == "step":
            diff = self._step()
            if diff:
                return diff
        else:
            self._release(rng.choice(self.running), preempt=kind == "preempt")
        return self._compare()

    def _compare(self) -> str | None:
        for pair in self.running:
            self.all_hashes += [h for h in pair[1].block_hashes if h not in self.all_hashes]
        live = sorted(p[1].request_id for p in self.running + self.waiting)
        for label, fn in (
            ("free count", lambda m: m.block_pool.get_num_free_blocks()),
            ("ref_cnt of blocks 0..", _ref_cnts),
            ("block tables", lambda m: {rid: list(m.get_block_ids(rid)) for rid in live}),
            ("what each cached hash finds", lambda m: _found(m, self.all_hashes)),
        ):
            a, b = fn(self.mine), fn(self.ref)
            if a != b:
                return f"after op {self.count}, {self.what}: {label}: yours {a}, the package's {b}"
        return None


def _twin_run(make: Factory, seed: int) -> str:
    twins = _Twins(make, seed)
    for _ in range(TWIN_OPS):
        diff = twins.step()
        if diff:
            return diff if diff.startswith("after op") else f"op {twins.count}, {diff}"
    mine, ref = _drain(twins.mine), _drain(twins.ref)
    return "same" if mine == ref else f"after {TWIN_OPS} ops, the free blocks go out as {mine}, the package's {ref}"


def check_manager_twin(KVCacheManager: ManagerClass) -> list[CheckOutcome]:
    """Random schedules of admissions (prefix hits, external hits, lookahead), chunks, decode steps, preemptions
    and finishes, the learner's manager beside the package's."""
    make = learner_factory(KVCacheManager)
    hint = (
        "the first call where your manager and the package's disagree is named: replay it with the spec "
        "(the five regions, cdiv to blocks, hits touched first and counted when free, the watermark for requests "
        "that hold no blocks, full blocks cached once)"
    )
    checks = [
        Check(
            f"seed {seed}: {TWIN_OPS} random scheduler calls on a pool of {TWIN_BLOCKS} blocks (watermark "
            f"{TWIN_WATERMARK}), yours and the package's; the first difference in results, tables, free count, "
            "ref counts, cache lookups or final order",
            lambda seed=seed: _twin_run(make, seed),
            "same",
            hint=hint,
        )
        for seed in TWIN_SEEDS
    ]
    return report("manager_twin", checks)
