"""The scheduler: continuous batching, chunked prefill, preemption, prefix caching, forks — and a fuzz run.

The data-checking fake-model ``Driver``, the invariants and the fuzz live in
``minipaged.testing`` (one copy, shared with ``benchmarks/fuzz_scheduler.py``):
the driver keeps a real ``CacheEngine``, writes for every computed position a
value that depends only on the tokens up to it (as a real model's K/V does),
and reads every scheduled request's context back through its block table each
step. A wrong swap, a missed copy-on-write, a prefix hit on the wrong block or
a block reused while still owned would all show up there.
"""

from __future__ import annotations

import random
import time

import pytest

from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.lab.checking_driver import EOS, Driver, fuzz, random_config
from minipaged.sampling_params import SamplingParams


def test_requests_finish_with_their_lengths_and_free_everything():
    d = Driver()
    reqs = [d.add(f"r{i}", list(range(1, 6 + 3 * i)), max_tokens=5 + i, ignore_eos=True) for i in range(5)]
    d.run()
    assert [r.num_output_tokens for r in reqs] == [5, 6, 7, 8, 9]
    assert all(r.finish_reason == "length" for r in reqs)
    assert len(d.finished) == 5 and not d.sched.requests  # finished requests are forgotten


def test_chunked_prefill_mixes_with_decodes():
    d = Driver(num_blocks=64, budget=16)
    short = d.add("short", [1, 2, 3], max_tokens=20, ignore_eos=True)
    d.step()  # short prefills
    long = d.add("long", list(range(1, 41)), max_tokens=2, ignore_eos=True)
    chunks = []
    while long.num_computed_tokens < 40:
        out = d.step()
        got = {s.request_id: s.num_new_tokens for s in out.scheduled}
        assert got["short"] == 1  # the decode keeps going every step
        chunks.append(got["long"])
    assert chunks == [15, 15, 10] and long.num_output_tokens == 1
    d.run()
    assert short.num_output_tokens == 20


def test_eos_and_stop_tokens_finish_early():
    d = Driver()
    r = d.add("a", [5, 6, 7], max_tokens=100)
    d.sample = lambda req: EOS if req.num_output_tokens == 3 else 9
    d.run()
    assert (r.num_output_tokens, r.finish_reason, r.output_token_ids[-1]) == (4, "stop", EOS)
    d2 = Driver()
    r2 = d2.add("b", [5, 6, 7], max_tokens=100, stop_token_ids=[9], ignore_eos=True)
    d2.sample = lambda req: 9 if req.num_output_tokens == 2 else EOS
    d2.run()
    assert (r2.num_output_tokens, r2.finish_reason) == (3, "stop")


def test_max_num_seqs_and_arrival_order():
    d = Driver(num_blocks=64, max_num_seqs=2)
    reqs = [d.add(f"r{i}", [1, 2, 3], max_tokens=3, ignore_eos=True) for i in range(4)]
    out = d.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    d.run()
    assert [r.request_id for r in d.finished] == ["r0", "r1", "r2", "r3"]
    assert all(r.num_output_tokens == 3 for r in reqs)


@pytest.mark.parametrize("mode, cpu", [("recompute", 0), ("swap", 64), ("swap", 4)])
def test_preemption_when_the_pool_runs_dry(mode, cpu):
    d = Driver(num_blocks=12, watermark_blocks=0, mode=mode, num_cpu_blocks=cpu, caching=False)
    reqs = [d.add(f"r{i}", list(range(1, 9)), max_tokens=12, ignore_eos=True) for i in range(4)]
    d.run()
    assert d.sched.num_preemptions > 0
    assert all(r.num_output_tokens == 12 and r.finish_reason == "length" for r in reqs)
    # the same greedy stream as an unconstrained run: preemption must not change anyone's tokens
    d_free = Driver(num_blocks=128, caching=False)
    ref = [d_free.add(f"r{i}", list(range(1, 9)), max_tokens=12, ignore_eos=True) for i in range(4)]
    d_free.run()
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]


def test_swap_moves_blocks_and_falls_back_to_recompute():
    d = Driver(num_blocks=12, watermark_blocks=0, mode="swap", num_cpu_blocks=64, caching=False)
    for i in range(4):
        d.add(f"r{i}", list(range(1, 9)), max_tokens=12, ignore_eos=True)
    swapped_out = swapped_in = 0
    while d.sched.has_unfinished():
        out = d.step()
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
    assert swapped_out > 0 and swapped_in == swapped_out
    tiny = Driver(num_blocks=12, watermark_blocks=0, mode="swap", num_cpu_blocks=2, caching=False)
    for i in range(4):
        tiny.add(f"r{i}", list(range(1, 9)), max_tokens=12, ignore_eos=True)
    tiny.run()
    # one usable CPU block: no request fits in swap space, so every preemption recomputes
    assert tiny.sched.num_preemptions > 0 and not tiny.kv_cache_manager.swap.swapped_blocks


def test_prefix_cache_hit_skips_the_shared_prompt():
    d = Driver(block_size=4, num_blocks=64)
    system = list(range(1, 21))  # 5 full blocks
    a = d.add("a", system + [30, 31], max_tokens=2, ignore_eos=True)
    d.run()
    b = d.add("b", system + [40], max_tokens=2, ignore_eos=True)
    out = d.step()
    assert out.scheduled[0].start == 20 and out.scheduled[0].num_new_tokens == 1
    assert b.num_computed_tokens == 21 and a.is_finished
    d.run()
    salted = Driver(block_size=4, num_blocks=64)
    salted.add("a", system + [30], max_tokens=1, ignore_eos=True)
    salted.run()
    other = Request("t2", system + [30], cache_salt="tenant-2", sampling_params=SamplingParams(max_tokens=1))
    salted.sched.add_request(other)
    assert salted.step().scheduled[0].start == 0  # another tenant's salt: no hit


def test_parallel_sampling_forks_and_copies_on_write():
    d = Driver(block_size=4, num_blocks=64)
    parent = d.add("p", [1, 2, 3, 4, 5, 6], max_tokens=4, n=3, ignore_eos=True)
    out = d.step()  # prefill: 2 blocks, the second holds 2 of 4 tokens
    assert out.scheduled[0].samples and out.scheduled[0].num_samples == 3
    kids = [d.sched.requests["p#1"], d.sched.requests["p#2"]]
    first_block, last_block = d.kv_cache_manager.get_blocks("p")
    assert first_block.ref_cnt == 3 and last_block.ref_cnt == 3
    out = d.step()  # all three write position 6 into the shared partial block
    assert len(out.copy_blocks) == 2  # two of them copy; the last one keeps the original
    assert len({tuple(d.kv_cache_manager.get_block_ids(r)) for r in ("p", "p#1", "p#2")}) == 3
    assert first_block.ref_cnt == 3  # full blocks stay shared
    d.run()
    assert all(r.num_output_tokens == 4 for r in [parent, *kids])
    assert kids[0].parent_id == "p"


def test_rejected_requests_leave_the_others_alone():
    d = Driver(num_blocks=10, max_model_len=32)
    too_long = d.add("long", list(range(1, 40)), max_tokens=1)
    too_big = Request("big", list(range(1, 20)), sampling_params=SamplingParams(max_tokens=13))  # 32 tokens
    d.sched.add_request(too_big)  # 8 blocks; the pool offers 9 - 1 watermark = 8: fits
    huge = d.add("huge", list(range(1, 25)), max_tokens=8)  # also 32 tokens, 8 blocks
    ok = d.add("ok", [1, 2, 3], max_tokens=3, ignore_eos=True)
    assert too_long.finish_reason == "rejected" and "max_model_len=32" in too_long.error
    d2 = Driver(num_blocks=6, max_model_len=64)
    never = d2.add("never", list(range(1, 30)), max_tokens=4)
    fine = d2.add("fine", [1, 2], max_tokens=2, ignore_eos=True)
    assert never.finish_reason == "rejected" and "KV pool can give one request at most" in never.error
    d2.run()
    assert fine.num_output_tokens == 2
    d.run()
    assert ok.num_output_tokens == 3 and too_big.is_finished and huge.is_finished
    d.add("live", [1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="already in use"):  # an id is taken while its request lives
        d.add("live", [1], max_tokens=1)
    again = d.add("ok", [1], max_tokens=1, ignore_eos=True)  # and free again once it finished
    d.run()
    assert again.num_output_tokens == 1 and not d.sched.requests


def test_bad_config():
    with pytest.raises(ValueError, match="swap space"):
        Scheduler(SchedulerConfig(preemption_mode="swap"), KVCacheManager(4, 8))
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


def test_fuzz_ten_thousand_steps():
    t0 = time.perf_counter()
    seen = fuzz(10_000, seed=1)
    print(f"fuzz: {seen}, {time.perf_counter() - t0:.1f} s")
    assert seen["steps"] >= 10_000
    for what in (
        "preemptions",
        "swapped_blocks",
        "cow_copies",
        "prefix_hit_tokens",
        "rejected",
        "forks",
        "accepted_drafts",
        "external_hit_tokens",
        "hybrid_rounds",
    ):
        assert seen[what] > 0, f"the fuzz never exercised {what}"


from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402


class SchedulerMachine(RuleBasedStateMachine):
    """Hypothesis drives arrivals, steps and aborts in any order; the Driver checks data and invariants."""

    @initialize(cfg=st.integers(0, 10_000))
    def setup(self, cfg):
        self.d = Driver(**random_config(random.Random(cfg)), seed=cfg)
        self.n = 0

    @rule(
        prompt=st.lists(st.integers(1, 6), min_size=1, max_size=20),
        max_tokens=st.integers(1, 12),
        n=st.sampled_from([1, 1, 2]),
        ignore_eos=st.booleans(),
    )
    def arrive(self, prompt, max_tokens, n, ignore_eos):
        self.d.add(f"h{self.n}", prompt, max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        self.n += 1

    @rule()
    def step(self):
        if self.d.sched.has_unfinished():
            self.d.step()

    @rule(i=st.integers(0, 50))
    def abort(self, i):
        ids = list(self.d.sched.requests)  # the unfinished ones: finished requests are forgotten
        if ids:
            self.d.finished.append(self.d.sched.abort(ids[i % len(ids)]))
            assert ids[i % len(ids)] not in self.d.sched.requests
            self.d.check_invariants()

    @invariant()
    def finished_once(self):
        if hasattr(self, "d"):
            ids = [r.request_id for r in self.d.finished]
            assert len(ids) == len(set(ids))

    def teardown(self):
        if hasattr(self, "d"):
            self.d.run(max_steps=self.d.steps + 20_000)
            assert not self.d.sched.requests and all(r.is_finished for r in self.d.requests.values())


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True)


def test_scheduler_output_is_plain_data_that_pickles():
    """What a step hands the runner names requests by id and carries their tokens: no live Request, so it can
    cross a process boundary as it is (issue 25); finished ids and their random streams come with the next step."""
    import dataclasses
    import pickle

    from minipaged.core.scheduler_output import SchedulerOutput

    d = Driver(num_blocks=64, budget=16)
    d.add("a", [1, 2, 3], max_tokens=1, ignore_eos=True)
    d.add("b", list(range(1, 21)), max_tokens=3, ignore_eos=True, n=2)
    first = d.step()
    out = d.sched.schedule()

    def values(obj):
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                yield from values(getattr(obj, f.name))
        elif isinstance(obj, (list, tuple)):
            for x in obj:
                yield from values(x)
        yield obj

    for o in (first, out):
        assert isinstance(o, SchedulerOutput)
        assert not any(isinstance(v, Request) for v in values(o))
        assert pickle.loads(pickle.dumps(o)) == o
    assert out.finished_req_ids == ["a"] and out.finished_sample_keys == [("a", 0)]
    assert [s.token_ids for s in first.scheduled] == [[1, 2, 3], list(range(1, 14))]  # a budget of 16 tokens
