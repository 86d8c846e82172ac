"""Random allocate / append / free / touch / cache-hit sequences against KVCacheManager + BlockPool.

Hypothesis drives a small pool (block_size 4, 10 usable blocks) through random
request traffic built from a few shared prefixes (so prefix hits are common),
and checks after every step:

* free + in use = total usable blocks;
* no block is both in the free queue and referenced; ref counts >= 0 and equal
  to the number of block lists and extra holds naming the block;
* the null block is never handed out, freed, queued or referenced;
* the hash map names exactly the cached blocks, and each hash is the hash of the
  tokens the block really holds (a shadow map block_id -> tokens written);
* a cache hit returns blocks holding exactly the request's tokens (and salt).

Derandomized: the same sequences run every time.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minipaged.core.block_pool import KVCacheBlock, get_request_block_hasher
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request

BLOCK_SIZE = 4
NUM_BLOCKS = 11  # 10 usable + the null block: small, so the pool runs dry often
MAX_TOKENS = 32  # a request never outgrows 8 blocks (10 - watermark 2), so "could never fit" cannot happen
PREFIXES = [(), (1, 1, 1, 1), (1, 1, 1, 1, 2, 2, 2, 2), (3, 3, 3, 3, 3, 3)]
tokens_st = st.lists(st.integers(0, 3), min_size=0, max_size=10)


class AllocatorMachine(RuleBasedStateMachine):
    @initialize(caching=st.booleans(), watermark=st.sampled_from([0, 0, 2]))
    def setup(self, caching: bool, watermark: int) -> None:
        self.mgr = KVCacheManager(BLOCK_SIZE, NUM_BLOCKS, enable_caching=caching, watermark_blocks=watermark)
        self.pool = self.mgr.block_pool
        self.running: dict[str, Request] = {}
        self.holds: list[KVCacheBlock] = []  # extra references taken with touch (another user of the block)
        # block_id -> (cache salt, every token up to the end of the block): what its K/V depends on.
        self.shadow: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.seen: list[tuple[tuple[int, ...], str | None]] = []
        self.next_id = 0
        self.hits = 0

    # ---- helpers -------------------------------------------------------------------------
    def snapshot(self):
        return (
            self.pool.get_num_free_blocks(),
            [b.ref_cnt for b in self.pool.blocks],
            {k: list(v) for k, v in self.mgr.req_to_blocks.items()},
        )

    @staticmethod
    def expected(req: Request, i: int) -> tuple[str | None, tuple[int, ...]]:
        return req.cache_salt, tuple(req.all_token_ids[: (i + 1) * BLOCK_SIZE])

    def record_written(self, req: Request, first_new_block: int) -> None:
        """Blocks from ``first_new_block`` on were written by ``req``: note what the full ones hold."""
        blocks = self.mgr.get_blocks(req.request_id)
        for i in range(first_new_block, req.num_computed_tokens // BLOCK_SIZE):
            self.shadow[blocks[i].block_id] = self.expected(req, i)

    def submit(self, tokens: tuple[int, ...], salt: str | None) -> None:
        if len(tokens) > MAX_TOKENS:
            return
        req = Request(f"r{self.next_id}", list(tokens), cache_salt=salt)
        self.next_id += 1
        hits, n = self.mgr.get_computed_blocks(req)
        assert n == len(hits) * BLOCK_SIZE and n <= req.num_tokens - 1  # never the last token
        for i, block in enumerate(hits):  # a hit holds exactly this request's tokens
            assert self.shadow[block.block_id] == self.expected(req, i)
        before = self.snapshot()
        new = self.mgr.allocate_slots(req, req.num_tokens - n, n, hits)
        if new is None:
            assert self.snapshot() == before  # None changes nothing
            return
        self.hits += len(hits)
        req.num_computed_tokens = req.num_tokens
        self.running[req.request_id] = req
        self.seen.append((tokens, salt))
        self.record_written(req, len(hits))

    # ---- rules ---------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=tokens_st, salt=st.sampled_from([None, None, "s"]))
    def add_request(self, prefix, suffix, salt):
        tokens = tuple(prefix) + tuple(suffix)
        if tokens:
            self.submit(tokens, salt)

    @precondition(lambda self: self.seen)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=3))
    def resubmit(self, data, extra):
        """The cache-hit path: a prompt that was served before, possibly extended."""
        tokens, salt = data.draw(st.sampled_from(self.seen))
        self.submit(tokens + tuple(extra), salt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, data, new_tokens):
        req = self.running[data.draw(st.sampled_from(sorted(self.running)))]
        if req.num_tokens + len(new_tokens) > MAX_TOKENS:
            return
        req.append_output_token_ids(new_tokens)
        before = self.snapshot()
        full_before = req.num_computed_tokens // BLOCK_SIZE
        new = self.mgr.allocate_slots(req, len(new_tokens))
        if new is None:  # pool exhausted: nothing changed; preempt it (recompute later)
            assert self.snapshot() == before
            self.mgr.free(req)
            del self.running[req.request_id]
            return
        assert len(self.mgr.get_blocks(req.request_id)) == -(-req.num_tokens // BLOCK_SIZE)
        req.num_computed_tokens = req.num_tokens
        self.record_written(req, full_before)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = self.running.pop(data.draw(st.sampled_from(sorted(self.running))))
        self.mgr.free(req)

    @precondition(lambda self: self.pool.cached_block_hash_to_block)
    @rule(data=st.data())
    def touch_cached(self, data):
        cached = sorted(
            (b for same in self.pool.cached_block_hash_to_block.values() for b in same.values()),
            key=lambda b: b.block_id,
        )
        block = data.draw(st.sampled_from(cached))
        free_before = self.pool.get_num_free_blocks()
        self.pool.touch([block])
        assert self.pool.get_num_free_blocks() == free_before - (block.ref_cnt == 1)
        self.holds.append(block)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release_hold(self, data):
        i = data.draw(st.integers(0, len(self.holds) - 1))
        self.pool.free_blocks([self.holds.pop(i)])

    # ---- invariants ------------------------------------------------------------------------
    @invariant()
    def counts_add_up(self):
        free = self.pool.free_block_queue.get_all_free_blocks()
        assert len(free) == self.pool.get_num_free_blocks()
        in_use = [b for b in self.pool.blocks if b.ref_cnt > 0 and not b.is_null]
        assert len(free) + len(in_use) == NUM_BLOCKS - 1
        assert all(b.ref_cnt == 0 for b in free)  # nothing both free and referenced
        assert len({b.block_id for b in free}) == len(free)

    @invariant()
    def ref_counts_are_exact(self):
        users = [0] * NUM_BLOCKS
        for blocks in self.mgr.req_to_blocks.values():
            for b in blocks:
                users[b.block_id] += 1
        for b in self.holds:
            users[b.block_id] += 1
        assert [b.ref_cnt for b in self.pool.blocks] == users
        assert all(b.ref_cnt >= 0 for b in self.pool.blocks)

    @invariant()
    def null_block_untouched(self):
        null = self.pool.null_block
        assert null.block_id == 0 and null.is_null and null.ref_cnt == 0 and null.block_hash is None
        assert null.prev_free_block is None and null.next_free_block is None
        assert all(b.block_id != 0 for blocks in self.mgr.req_to_blocks.values() for b in blocks)

    @invariant()
    def hash_map_names_what_blocks_hold(self):
        mapped = {}
        for key, same in self.pool.cached_block_hash_to_block.items():
            assert same, "empty entries must be removed"
            for block_id, block in same.items():
                assert block.block_id == block_id and block.block_hash == key
                mapped[block_id] = key
                salt, tokens = self.shadow[block_id]
                probe = Request(
                    "probe", list(tokens), cache_salt=salt, block_hasher=get_request_block_hasher(BLOCK_SIZE)
                )
                assert probe.block_hashes[-1] == key  # the hash is the hash of the real contents
        hashed = {b.block_id for b in self.pool.blocks if b.block_hash is not None}
        assert hashed == set(mapped)
        if not self.mgr.enable_caching:
            assert not mapped

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for req in list(self.running.values()):
            self.mgr.free(req)
        self.pool.free_blocks(self.holds)
        assert self.pool.get_num_free_blocks() == NUM_BLOCKS - 1  # nothing leaked


AllocatorMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestAllocatorStateMachine = AllocatorMachine.TestCase


def test_the_machine_exercises_cache_hits_and_preemption():
    """Guard against a machine that silently stops reaching the interesting states."""
    m = AllocatorMachine()
    m.setup(caching=True, watermark=0)
    for _ in range(3):
        m.submit((1, 1, 1, 1, 2, 2, 2, 2, 0), None)
    assert m.hits == 4  # 2 blocks hit by each of the 2 repeats
    for i in range(8):
        m.submit(tuple([i % 4] * 8 + [i]), "s")
    assert len(m.running) < 11  # some were refused: the pool ran out
    m.counts_add_up()
    m.ref_counts_are_exact()
    m.hash_map_names_what_blocks_hold()
    m.teardown()
