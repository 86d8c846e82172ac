"""KV connectors: the offloading store's bookkeeping, external hits in ``allocate_slots``, and the data.

The fake-model ``Driver`` (``minipaged.testing``) performs the connector's saves and loads on a real cache and
reads every scheduled context back: a block loaded into the wrong place, or a slot overwritten before it was
read, shows up as a wrong value. The engine on SmolLM2 is in ``tests/test_engine.py``.
"""

from __future__ import annotations

import pytest

from minipaged.core.block_pool import BlockHash
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.kv_connector import KVConnectorMetadata, OffloadingConnector
from minipaged.core.request import Request
from minipaged.engine.step import run_step
from minipaged.lab.checking_driver import Driver


def h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def hashed_request(rid: str, tokens: list[int], block_size: int) -> Request:
    from minipaged.core.block_pool import get_request_block_hasher

    return Request(rid, tokens, block_hasher=get_request_block_hasher(block_size))


# ---- the store's bookkeeping -------------------------------------------------------------------------------
def test_saves_become_findable_only_when_the_step_commits():
    c = OffloadingConnector(num_slots=2, block_size=4)
    c.on_evict(7, h(1))
    assert c.build_connector_meta() == KVConnectorMetadata(saves=[(7, 0)])
    assert h(1) not in c.index  # the copy has not happened yet
    c.commit_step()
    assert c.index == {h(1): 0} and c.num_saved == 1
    c.on_evict(3, h(2))
    c.rollback_step()  # the step failed: its save never happened, its slot is free again
    assert h(2) not in c.index and c.free_slots == [1]


def test_lru_slots_and_pinning():
    c = OffloadingConnector(num_slots=2, block_size=1)
    for i, block in ((1, 5), (2, 6)):
        c.on_evict(block, h(i))
    c.commit_step()  # h1 -> 0, h2 -> 1
    c.on_evict(9, h(1))  # stored already: only touched, h2 is now the least recently used
    c.on_evict(8, h(3))  # full: takes h2's slot
    assert c.build_connector_meta().saves == [(8, 1)] and h(2) not in c.index
    c.commit_step()
    req = Request("r", [1, 2, 3])
    req.block_hashes[:] = [h(1), h(3)]  # block_size 1: 3 tokens, the first 2 may hit
    assert c.get_num_new_matched_tokens(req, 0) == 2
    assert c.get_num_new_matched_tokens(req, 1) == 1
    from minipaged.core.block_pool import KVCacheBlock

    c.update_state_after_alloc(req, [KVCacheBlock(4), KVCacheBlock(5)], 0)
    assert c.build_connector_meta().loads == [(0, 4), (1, 5)]
    c.on_evict(2, h(9))  # both slots are read this step: nothing may overwrite them, so h9 is not kept
    assert c.build_connector_meta().saves == []
    c.commit_step()
    assert c.num_loaded == 2
    c.reset()
    assert not c.index and len(c.free_slots) == 2


def test_lookups_stop_at_the_first_miss_and_before_the_last_token():
    c = OffloadingConnector(num_slots=8, block_size=2)
    req = hashed_request("r", list(range(9)), 2)  # 4 full blocks
    for i, bh in enumerate(req.block_hashes):
        if i != 2:
            c.on_evict(10 + i, bh)
    c.commit_step()
    assert c.get_num_new_matched_tokens(req, 0) == 4  # blocks 0, 1; block 2 missing
    req8 = hashed_request("s", list(range(8)), 2)  # 8 tokens: the 4th block holds the last token, never a hit
    c2 = OffloadingConnector(num_slots=8, block_size=2)
    for i, bh in enumerate(req8.block_hashes):
        c2.on_evict(i + 1, bh)
    c2.commit_step()
    assert c2.get_num_new_matched_tokens(req8, 0) == 6


def test_allocate_slots_refuses_external_tokens_it_cannot_hold():
    kv = KVCacheManager(4, 20)
    req = Request("r", list(range(10)))
    with pytest.raises(ValueError, match="external hits come from a KV connector"):
        kv.allocate_slots(req, 2, num_external_computed_tokens=8)
    kv2 = KVCacheManager(4, 20, connector=OffloadingConnector(4, 4))
    with pytest.raises(ValueError, match="in whole blocks"):
        kv2.allocate_slots(req, 2, num_external_computed_tokens=6)


def test_offloading_needs_prefix_caching():
    from minipaged.config import Config

    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        Config(kv_offloading_size="1MiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        Config(kv_offloading_size="lots")
    from minipaged.lab.simulator import SimConfig

    with pytest.raises(ValueError, match="no KV offloading store"):
        SimConfig(kv_offloading_size="1MiB", enable_prefix_caching=True)


# ---- the scheduler and the data, with the fake model ---------------------------------------------------------
PREFIX = [30 + i % 7 for i in range(12)]  # 3 blocks of 4


def waves(d: Driver) -> list[list[int]]:
    """A request with a 3-block prefix, then long requests that push it out of a 12-block pool, then the
    prefix again: what each request generated, in order."""
    d.add("a", PREFIX + [1, 2], max_tokens=3, ignore_eos=True)
    d.run()
    for i in range(3):
        d.add(f"evict{i}", [10 + i] * 30, max_tokens=2, ignore_eos=True)
        d.run()
    d.add("b", PREFIX + [3], max_tokens=4, ignore_eos=True)
    d.run()
    return [r.output_token_ids for r in d.requests.values()]


def test_an_evicted_prefix_comes_back_from_the_store():
    plain = Driver(block_size=4, num_blocks=13, watermark_blocks=0)
    outputs = waves(plain)
    assert plain.kv_cache_manager.prefix_cache_hits == 0  # the pool lost the prefix
    d = Driver(block_size=4, num_blocks=13, watermark_blocks=0, num_offload_blocks=16)
    assert waves(d) == outputs  # the Driver read every loaded block back: the right K/V in the right slots
    assert d.kv_cache_manager.external_hits == 12 and d.kv_cache_manager.prefix_cache_hits == 0
    assert d.kv_cache_manager.connector.num_loaded == 3 and d.kv_cache_manager.connector.num_saved >= 3


def test_a_failed_step_keeps_nothing_it_saved():
    d = Driver(block_size=4, num_blocks=13, watermark_blocks=0, num_offload_blocks=16)
    d.add("a", PREFIX + [1, 2], max_tokens=3, ignore_eos=True)
    d.run()
    d.add("evict", [9] * 40, max_tokens=1, ignore_eos=True)

    class Broken:
        def execute(self, out):
            assert out.kv_connector_metadata.saves  # this step evicts the prefix and would save it
            raise RuntimeError("the device fell over")

        def release(self, ids, keys):
            pass

    with pytest.raises(RuntimeError, match="fell over"):
        run_step(d.sched, Broken(), lambda: 0.0)
    assert (
        not d.kv_cache_manager.connector.index and not d.kv_cache_manager.connector.pending
    )  # nothing it never copied is findable
    # The failed step may have written over the evicted blocks before it fell over: their prefix is lost for
    # good, not saved later from blocks that may hold anything by then.
    d.run()
    assert not d.kv_cache_manager.connector.index
    d.add("b", PREFIX + [3], max_tokens=2, ignore_eos=True)
    d.run()  # computed again, and the Driver reads it back
    assert d.kv_cache_manager.external_hits == 0 and d.requests["b"].num_output_tokens == 2
