"""The scheduler: continuous batching, chunked prefill, preemption, prefix caching, forks — and a fuzz run.

The fuzz driver is a model-free stand-in that still moves real data: it keeps a
real ``CacheEngine`` and writes, for every computed position, a value that
depends only on the tokens up to that position (as a real model's K/V does).
Before each step it reads every scheduled request's context back through its
block table and checks it. A wrong swap, a missed copy-on-write, a prefix hit on
the wrong block or a block reused while still owned would all show up there.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from minipaged.cache_engine import CacheEngine
from minipaged.kv_cache_manager import KVCacheManager
from minipaged.request import Request, RequestStatus
from minipaged.sampling_params import SamplingParams
from minipaged.scheduler import Scheduler, SchedulerConfig

EOS = 0


def prefix_value(tokens: list[int]) -> float:
    """What position len(tokens)-1 caches: a function of the whole prefix, like real K/V."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 999_983
    return float(h)


class Driver:
    """Runs a scheduler with a fake model; checks the cache contents and the invariants every step."""

    def __init__(self, block_size=4, num_blocks=32, caching=True, watermark_blocks=1, mode="recompute",
                 num_cpu_blocks=0, budget=64, max_num_seqs=8, max_model_len=256, seed=0):
        self.kv = KVCacheManager(block_size, num_blocks, enable_caching=caching, watermark_blocks=watermark_blocks)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                               max_model_len=max_model_len, preemption_mode=mode,
                                               num_cpu_blocks=num_cpu_blocks), self.kv)
        self.cache = CacheEngine(1, num_blocks, block_size, 1, 1, num_cpu_blocks=num_cpu_blocks)
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.steps = 0

    def add(self, rid, prompt, **params):
        req = Request(rid, prompt, sampling_params=SamplingParams(**params), eos_token_id=EOS)
        self.sched.add_request(req)
        return req

    def sample(self, req: Request) -> int:
        return random.Random(f"{req.request_id}/{req.num_tokens}").randrange(0, 40)

    def step(self):
        out = self.sched.schedule()
        self.steps += 1
        assert out.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.config.max_num_seqs
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        self.cache.swap_out(out.swap_out)
        self.cache.swap_in(out.swap_in)
        self.cache.copy(out.copy_blocks)
        kcache = self.cache.gpu_cache[0][0].view(-1)
        bs = self.block_size
        slots = out.slot_mapping()
        assert slots.numel() == out.total_num_scheduled_tokens and bool((slots >= 0).all())
        assert len(set(slots.tolist())) == slots.numel()  # no two tokens written to one slot
        values = [prefix_value(s.request.all_token_ids[: p + 1]) for s in out.scheduled
                  for p in range(s.start, s.start + s.num_new_tokens)]
        kcache[slots] = torch.tensor(values)
        # Like a model layer, a step writes its new K/V first, then attends: every position up to the
        # last new one must now hold its own prefix's value (prefix hits may read blocks written this step).
        for s in out.scheduled:
            assert s.num_new_tokens >= 1
            tokens = s.request.all_token_ids
            for p in range(s.start + s.num_new_tokens):
                slot = s.block_ids[p // bs] * bs + p % bs
                assert kcache[slot] == prefix_value(tokens[: p + 1]), (s.request_id, p, self.steps)
        sampled = {}
        for s in out.scheduled:
            if s.samples:
                n = s.num_samples
                sampled[s.request_id] = [self.sample(s.request)] + [self.rng.randrange(0, 40) for _ in range(n - 1)]
        self.sched.update_from_output(out, sampled, now=float(self.steps))
        self.check_invariants()
        return out

    def check_invariants(self):
        pool = self.kv.block_pool
        free = pool.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free) == pool.get_num_free_blocks()
        refs = {}
        for blocks in self.kv.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}"
            assert (b.block_id in free_ids) == (b.ref_cnt == 0)
        assert 0 not in free_ids and 0 not in refs  # the null block is never handed out
        live = {r.request_id for r in self.sched.running}
        assert set(self.kv.req_to_blocks) <= live | {r.request_id for r in self.sched.waiting
                                                     if r.status is RequestStatus.SWAPPED}
        if self.sched.cpu_pool is not None:
            in_cpu = sum(len(v) for v in self.sched.swapped_blocks.values())
            assert in_cpu + self.sched.cpu_pool.get_num_free_blocks() == self.sched.config.num_cpu_blocks - 1

    def run(self, max_steps=10_000):
        while self.sched.has_unfinished():
            self.step()
            assert self.steps < max_steps, "no progress"
        assert self.kv.block_pool.get_num_free_blocks() == self.kv.num_blocks - 1  # nothing leaked


def test_requests_finish_with_their_lengths_and_free_everything():
    d = Driver()
    reqs = [d.add(f"r{i}", list(range(1, 6 + 3 * i)), max_tokens=5 + i, ignore_eos=True) for i in range(5)]
    d.run()
    assert [r.num_output_tokens for r in reqs] == [5, 6, 7, 8, 9]
    assert all(r.finish_reason == "length" for r in reqs)
    assert len(d.sched.finished) == 5


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
    assert [r.request_id for r in d.sched.finished] == ["r0", "r1", "r2", "r3"]
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
    assert tiny.sched.num_preemptions > 0 and not tiny.sched.swapped_blocks


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
    first_block, last_block = d.kv.get_blocks("p")
    assert first_block.ref_cnt == 3 and last_block.ref_cnt == 3
    out = d.step()  # all three write position 6 into the shared partial block
    assert len(out.copy_blocks) == 2  # two of them copy; the last one keeps the original
    assert len({tuple(d.kv.get_block_ids(r)) for r in ("p", "p#1", "p#2")}) == 3
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
    with pytest.raises(ValueError, match="already in use"):
        d.add("ok", [1], max_tokens=1)


def test_bad_config():
    with pytest.raises(ValueError, match="swap space"):
        SchedulerConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)


def random_config(rng: random.Random) -> dict:
    mode = rng.choice(["recompute", "swap"])
    return dict(block_size=rng.choice([1, 2, 4, 8, 16]), num_blocks=rng.randint(4, 40),
                caching=rng.random() < 0.6, watermark_blocks=rng.choice([0, 0, 1]), mode=mode,
                num_cpu_blocks=rng.randint(2, 30) if mode == "swap" else 0, budget=rng.choice([1, 3, 8, 32, 128]),
                max_num_seqs=rng.randint(1, 8), max_model_len=rng.choice([16, 48, 200]))


def fuzz(total_steps: int, seed: int = 0) -> dict[str, int]:
    """Random configurations and workloads until ``total_steps`` steps have run; returns what happened."""
    rng = random.Random(seed)
    seen = dict(steps=0, requests=0, preemptions=0, swapped_blocks=0, cow_copies=0, prefix_hit_tokens=0,
                rejected=0, forks=0)
    while seen["steps"] < total_steps:
        cfg = random_config(rng)
        d = Driver(**cfg, seed=rng.randrange(1 << 30))
        shared = [rng.randrange(1, 40) for _ in range(rng.randint(0, 24))]
        expected = {}
        for i in range(rng.randint(1, 12)):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 30))]
            p = dict(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.7, n=rng.choice([1, 1, 1, 2, 3]))
            try:
                d.add(f"q{i}", prompt, **p)
            except ValueError as exc:  # a pool smaller than the watermark: refused at construction
                raise AssertionError(exc) from exc
            expected[f"q{i}"] = p
        while d.sched.has_unfinished():
            out = d.step()
            assert d.steps < 50_000, "no progress"
            seen["swapped_blocks"] += len(out.swap_out)
            seen["cow_copies"] += len(out.copy_blocks)
            seen["prefix_hit_tokens"] += sum(s.start for s in out.scheduled if s.request.num_output_tokens == 0)
        assert d.kv.block_pool.get_num_free_blocks() == d.kv.num_blocks - 1  # nothing leaked
        for rid, req in d.sched.requests.items():
            assert req.is_finished, rid
            if req.finish_reason == "rejected":
                continue
            p = expected[req.parent_id or rid]
            assert req.num_output_tokens <= p["max_tokens"]
            if req.finish_reason == "length" and req.num_tokens < d.sched.config.max_model_len:
                assert req.num_output_tokens == p["max_tokens"]
            if req.finish_reason == "stop":
                assert req.output_token_ids[-1] == EOS and not p["ignore_eos"]
        finished_ids = [r.request_id for r in d.sched.finished]
        assert len(finished_ids) == len(set(finished_ids)) == len(d.sched.requests)  # each exactly once
        seen["steps"] += d.steps
        seen["requests"] += len(d.sched.requests)
        seen["preemptions"] += d.sched.num_preemptions
        seen["rejected"] += sum(r.finish_reason == "rejected" for r in d.sched.requests.values())
        seen["forks"] += sum(r.parent_id is not None for r in d.sched.requests.values())
    return seen


def test_fuzz_ten_thousand_steps():
    t0 = time.perf_counter()
    seen = fuzz(10_000, seed=1)
    print(f"fuzz: {seen}, {time.perf_counter() - t0:.1f} s")
    assert seen["steps"] >= 10_000
    for what in ("preemptions", "swapped_blocks", "cow_copies", "prefix_hit_tokens", "rejected", "forks"):
        assert seen[what] > 0, f"the fuzz never exercised {what}"


from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402


class SchedulerMachine(RuleBasedStateMachine):
    """Hypothesis drives arrivals, steps and aborts in any order; the Driver checks data and invariants."""

    @initialize(cfg=st.integers(0, 10_000))
    def setup(self, cfg):
        self.d = Driver(**random_config(random.Random(cfg)), seed=cfg)
        self.n = 0

    @rule(prompt=st.lists(st.integers(1, 6), min_size=1, max_size=20), max_tokens=st.integers(1, 12),
          n=st.sampled_from([1, 1, 2]), ignore_eos=st.booleans())
    def arrive(self, prompt, max_tokens, n, ignore_eos):
        self.d.add(f"h{self.n}", prompt, max_tokens=max_tokens, n=n, ignore_eos=ignore_eos)
        self.n += 1

    @rule()
    def step(self):
        if self.d.sched.has_unfinished():
            self.d.step()

    @rule(i=st.integers(0, 50))
    def abort(self, i):
        ids = [r for r, q in self.d.sched.requests.items() if not q.is_finished]
        if ids:
            self.d.sched.abort(ids[i % len(ids)])
            self.d.check_invariants()

    @invariant()
    def finished_once(self):
        if hasattr(self, "d"):
            ids = [r.request_id for r in self.d.sched.finished]
            assert len(ids) == len(set(ids))

    def teardown(self):
        if hasattr(self, "d"):
            self.d.run(max_steps=self.d.steps + 20_000)
            assert all(r.is_finished for r in self.d.sched.requests.values())


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                         derandomize=True)
