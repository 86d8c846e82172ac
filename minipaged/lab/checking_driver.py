"""Test support for the scheduler: a data-checking fake-model driver, the invariants, and a seeded fuzz.

Used by ``tests/test_scheduler.py`` (10,000 fuzz steps and a hypothesis state
machine), ``tests/test_simulator.py`` and ``benchmarks/fuzz_scheduler.py``
(100,000+ steps): one copy of each.

The ``Driver`` is a model-free stand-in that still moves real data: it keeps a
real ``CacheEngine`` and writes, for every computed position, a value that
depends only on the tokens up to that position (as a real model's K/V does).
After each step's writes it reads every scheduled request's context back
through its block table and checks it. A wrong swap, a missed copy-on-write, a
prefix hit on the wrong block or a block reused while still owned would all
show up there.

With a ``window`` it plays a hybrid model: a full-attention layer and a sliding-window layer, each in its own KV
cache group with its own block tables, sharing one tensor as vLLM's groups do. The window layer's values are
written through its own table and read back only inside the window; a block it gave back too early, or a slot
two groups both write, would show up the same way.

Its tokens depend only on the request and the position (``sample_at``), so a run
with speculative decoding must give every request the very tokens of a run
without. With ``period`` the tokens repeat every ``period`` positions, so prompt
lookup finds drafts the fake model accepts; drafts are checked as the runner
checks them (``worker.sampler.verify``), and their K/V are written and read back
like any token's: a rejected draft's value left where a later token should be
would show up.

The checks are ``assert`` statements: do not run this module under ``python -O``.
"""

from __future__ import annotations

import random

import torch

from ..core.kv_cache_coordinator import KVCacheGroupSpec
from ..core.kv_cache_manager import KVCacheManager
from ..core.kv_connector import OffloadingConnector
from ..core.request import PLACEHOLDER_TOKEN_ID, Request
from ..core.scheduler import Scheduler, SchedulerConfig, check_invariants
from ..core.scheduler_output import PendingOutput, Ready, RunnerOutput, SchedulerOutput, apply_block_updates
from ..engine.overlap import StepPipeline
from ..sampling_params import SamplingParams
from ..worker.block_table import slot_mapping
from ..worker.cache_engine import CacheEngine
from .simulator import fake_samples

EOS = 0


class InjectedFault(RuntimeError):
    """A step failure a test asked for (``Driver.fail_next``)."""


class _Failed:
    """A step's result that never comes: waiting for it raises (the device failed mid-step)."""

    def result(self) -> RunnerOutput:
        raise InjectedFault("the step failed on the device")


def prefix_value(tokens: list[int]) -> float:
    """What position len(tokens)-1 caches: a function of the whole prefix, like real K/V."""
    h = 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % 999_983
    return float(h)


def check_step_limits(sched: Scheduler, out: SchedulerOutput) -> None:
    """The step respects its limits: token budget, max_num_seqs, each request at most once, one slot per token."""
    assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(out.scheduled) <= sched.config.max_num_seqs
    assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
    assert all(s.num_new_tokens >= 1 for s in out.scheduled)


class Driver:
    """Runs a scheduler with a fake model; checks the cache contents and the invariants every step."""

    def __init__(
        self,
        block_size=4,
        num_blocks=32,
        caching=True,
        watermark_blocks=1,
        mode="recompute",
        num_cpu_blocks=0,
        budget=64,
        max_num_seqs=8,
        max_model_len=256,
        seed=0,
        spec_k=0,
        period=None,
        num_offload_blocks=0,
        window=None,
        overlap=False,
    ):
        connector = OffloadingConnector(num_offload_blocks, block_size) if num_offload_blocks and caching else None
        self.kv_cache_manager = KVCacheManager(
            block_size,
            num_blocks,
            enable_caching=caching,
            watermark_blocks=watermark_blocks,
            num_cpu_blocks=num_cpu_blocks,
            connector=connector,
            kv_cache_groups=None if window is None else [KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), window)],
        )
        self.window = window
        self.tables: dict[str, list[list[int]]] = {}  # request id -> its block tables, as the steps sent them
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                preemption_mode=mode,
                speculative_config=(
                    dict(num_speculative_tokens=spec_k, prompt_lookup_min=1, prompt_lookup_max=3) if spec_k else None
                ),
            ),
            self.kv_cache_manager,
        )
        self.cache = CacheEngine(
            1 if window is None else 2,  # a window: two layers (groups) in one shared tensor
            num_blocks,
            block_size,
            1,
            1,
            num_cpu_blocks=num_cpu_blocks,
            num_offload_blocks=num_offload_blocks,
            layer_tensors=None if window is None else [0, 0],
        )
        self.seed = seed
        self.block_size = block_size
        self.period = period
        self.steps = 0
        # The scheduler forgets a request when it finishes: the driver keeps every request it saw
        # (forks included) and every finish it was told of, to check each finishes exactly once.
        self.requests: dict[str, Request] = {}
        self.finished: list[Request] = []
        self._step_requests: dict[str, Request] = {}  # the requests of the step being run, by id
        # Async scheduling (engine/overlap.py): steps go through the overlap loop, and a step scheduled ahead
        # feeds placeholders that this fake device fills with what it sampled last, as the runner does.
        self.pipeline = StepPipeline(overlap)
        self.last_sampled: dict[str, int] = {}  # request id -> its token of the last step that ran
        self.fail_next: str | None = None  # "launch" or "result": the next step fails there (a test's fault)

    def add(self, rid, prompt, **params):
        req = Request(rid, prompt, sampling_params=SamplingParams(**params), eos_token_id=EOS)
        self.sched.add_request(req)
        self.requests[rid] = req
        if req.is_finished:  # rejected on arrival
            self.finished.append(req)
        return req

    def sample(self, req: Request) -> int:
        return self.sample_at(req.request_id, req.num_tokens)

    def sample_at(self, request_id: str, position: int) -> int:
        """The fake model's token at ``position`` of a request: the same whatever the batch, the drafts, or the
        preemptions (every ``period`` positions the same again, when set)."""
        step = position if self.period is None else position % self.period
        return random.Random(f"{self.seed}/{request_id}/{step}").randrange(0, 40)

    def step(self):
        """One step through the engine's own driver (``StepPipeline``: ``step.run_step``, or with ``overlap`` the
        overlap loop), with this fake model as the executor."""
        res = self.pipeline.step(self.sched, self, lambda: float(self.steps))
        self.finished += res.finished
        for r in res.finished:
            self.requests.setdefault(r.request_id, r)
        for req in self._step_requests.values():
            for child in req.children:
                self.requests.setdefault(child.request_id, child)
        self.check_invariants()
        return res.output

    def launch(self, out: SchedulerOutput) -> PendingOutput:
        """The step runs at once (a device that runs steps in launch order); a ``fail_next`` fault makes this
        call, or the wait for its result, raise instead."""
        fail, self.fail_next = self.fail_next, None
        if fail == "launch":
            raise InjectedFault("the step failed at launch")
        result = self._run(out)
        return _Failed() if fail == "result" else Ready(result)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """The step, waited for (``run_step``); a ``fail_next`` fault raises before it runs or after."""
        fail, self.fail_next = self.fail_next, None
        if fail == "launch":
            raise InjectedFault("the step failed before it ran")
        result = self._run(out)
        if fail == "result":
            raise InjectedFault("the step failed after it ran")
        return result

    def abort(self, request_id: str) -> None:
        """Abort a request between steps, as ``LLM.abort`` does (a step may be in flight with it)."""
        req = self.sched.abort(request_id)
        if req is not None:
            self.finished.append(req)
        self.pipeline.release_if_idle(self.sched, self)

    def _fed(self, request_id: str, tokens: list[int]) -> list[int]:
        """A request's tokens as this step feeds them: a placeholder is the token it sampled in the last step."""
        if tokens and tokens[-1] == PLACEHOLDER_TOKEN_ID:
            return tokens[:-1] + [self.last_sampled[request_id]]
        assert PLACEHOLDER_TOKEN_ID not in tokens, (request_id, "a placeholder before the last token")
        return tokens

    def _run(self, out: SchedulerOutput) -> RunnerOutput:
        """The fake model: block copies, a K/V write per new token, a read-back of every scheduled context."""
        self.steps += 1
        check_step_limits(self.sched, out)
        kv_meta = out.kv_connector_metadata
        if kv_meta:  # in the runner's order: offload first, load external hits last
            self.cache.offload(kv_meta.saves)
        self.cache.swap_out(out.swap_out)
        self.cache.swap_in(out.swap_in)
        self.cache.copy(out.copy_blocks)
        if kv_meta:
            self.cache.onload(kv_meta.loads)
        kcache = self.cache.gpu_cache[0][0].view(-1)
        bs = self.block_size
        # Every group's block tables (one without a window), kept from the steps' updates as the runner keeps
        # them, and checked against the KV cache manager's own; all groups write into the one tensor.
        apply_block_updates(self.tables, out)
        kv = self.kv_cache_manager
        for s in out.scheduled:
            held = [[b.block_id for b in m.req_to_blocks[s.request_id]] for m in kv.managers]
            assert self.tables[s.request_id] == held, (s.request_id, "block updates", self.steps)
        tables = [[self.tables[s.request_id][g] for s in out.scheduled] for g in range(len(kv.managers))]
        slots = torch.cat([slot_mapping(t, out.positions(), bs) for t in tables])
        assert slots.numel() == out.total_num_scheduled_tokens * len(tables) and bool((slots >= 0).all())
        assert len(set(slots.tolist())) == slots.numel()  # no two tokens, in no two groups, written to one slot
        requests = {s.request_id: self.sched.requests[s.request_id] for s in out.scheduled}  # the step's, by id
        self._step_requests = requests
        # The tokens each scheduled request feeds: its own, then this step's drafts (speculative decoding).
        fed = {
            s.request_id: self._fed(s.request_id, requests[s.request_id].all_token_ids) + s.spec_token_ids
            for s in out.scheduled
        }
        for s in out.scheduled:
            assert self._fed(s.request_id, s.token_ids) == fed[s.request_id][s.start : s.start + s.num_new_tokens]
        values = [
            prefix_value(fed[s.request_id][: p + 1])
            for s in out.scheduled
            for p in range(s.start, s.start + s.num_new_tokens)
        ]
        kcache[slots] = torch.tensor(values * len(tables))
        # Like a model layer, a step writes its new K/V first, then attends: every position up to the
        # last new one must now hold its own prefix's value (prefix hits may read blocks written this step).
        # The window layer reads only from its first new token's window on, and holds nothing before it.
        for s in out.scheduled:
            tokens = fed[s.request_id]
            own = self.tables[s.request_id]
            reads = [(own[0], 0)]
            if self.window is not None:
                first = max(0, s.start - self.window + 1)
                assert set(own[1][: first // bs]) <= {0}, (s.request_id, "kept behind the window")
                reads.append((own[1], first))
            for table, first in reads:
                for p in range(first, s.start + s.num_new_tokens):
                    slot = table[p // bs] * bs + p % bs
                    assert kcache[slot] == prefix_value(tokens[: p + 1]), (s.request_id, p, self.steps)
        sampled = fake_samples(out, lambda s: self.sample(requests[s.request_id]))
        for rid, tokens in sampled.items():  # an n > 1 request's siblings: each its own token
            tokens[1:] = [self.sample_at(f"{rid}#{j}", requests[rid].num_tokens) for j in range(1, len(tokens))]
        for s in out.scheduled:  # verification: the accepted drafts, then the model's own token
            if s.spec_token_ids:
                tokens = sampled[s.request_id] = []
                for i in range(len(s.spec_token_ids) + 1):
                    tokens.append(self.sample_at(s.request_id, s.start + i + 1))
                    if i == len(s.spec_token_ids) or tokens[-1] != s.spec_token_ids[i]:
                        break
        self.last_sampled = {rid: tokens[0] for rid, tokens in sampled.items()}
        return RunnerOutput(sampled)

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        for rid in request_ids:  # the fake model keeps only the block tables per request
            self.tables.pop(rid, None)

    def check_invariants(self):
        check_invariants(self.sched)

    def run(self, max_steps=10_000):
        while self.sched.has_unfinished():
            self.step()
            assert self.steps < max_steps, "no progress"
        assert (
            self.kv_cache_manager.block_pool.get_num_free_blocks() == self.kv_cache_manager.num_blocks - 1
        )  # nothing leaked


def random_config(rng: random.Random) -> dict:
    mode = rng.choice(["recompute", "swap"])
    offload = rng.choice([0, 0, 2, 16])
    # a hybrid model's two groups in some rounds (swap space and KV connectors serve one group only)
    window = rng.choice([None, None, 2, 5, 9, 17]) if mode == "recompute" and not offload else None
    return dict(
        block_size=rng.choice([1, 2, 4, 8, 16]),
        num_blocks=rng.randint(4, 40),
        caching=rng.random() < 0.6,
        watermark_blocks=rng.choice([0, 0, 1]),
        mode=mode,
        num_cpu_blocks=rng.randint(2, 30) if mode == "swap" else 0,
        budget=rng.choice([1, 3, 8, 32, 128]),
        max_num_seqs=rng.randint(1, 8),
        max_model_len=rng.choice([16, 48, 200]),
        spec_k=rng.choice([0, 0, 1, 3, 5]),
        period=rng.choice([None, None, 2, 5]),
        num_offload_blocks=offload,
        window=window,
    )


def fuzz(total_steps: int, seed: int = 0, overlap: bool = False, faults: bool = False) -> dict[str, int]:
    """Random configurations and workloads until ``total_steps`` steps have run; returns what happened.

    Each round draws a configuration (block sizes 1-16, pools down to 3 usable
    blocks, budgets down to 1 token, both preemption modes, swap space down to one
    block, caching on or off), then up to 12 requests, half of them sharing a
    prefix, some with n = 2 or 3, some stopping at EOS, and runs them to the end
    with the data-checking ``Driver``, speculating in some rounds (1 to 5 drafts), keeping evicted prefix
    blocks in a KV offloading store in others, and playing a hybrid model (a sliding window of 2 to 17
    positions beside full attention) in others. In the end every request must have finished
    exactly once with the right number of tokens, and every block must be free.
    """
    rng = random.Random(seed)
    seen = dict(
        steps=0,
        rounds=0,
        requests=0,
        preemptions=0,
        swapped_blocks=0,
        cow_copies=0,
        prefix_hit_tokens=0,
        rejected=0,
        forks=0,
        drafts=0,
        accepted_drafts=0,
        external_hit_tokens=0,
        hybrid_rounds=0,
        failed_steps=0,
        aborts=0,
        overlapped_steps=0,
    )
    while seen["steps"] < total_steps:
        cfg = random_config(rng)
        if overlap and rng.random() < 0.8:
            cfg.update(spec_k=0, num_offload_blocks=0)
        d = Driver(**cfg, seed=rng.randrange(1 << 30), overlap=overlap)
        shared = [rng.randrange(1, 40) for _ in range(rng.randint(0, 24))]
        expected = {}
        for i in range(rng.randint(1, 12)):
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 40) for _ in range(rng.randint(1, 30))]
            p = dict(max_tokens=rng.randint(1, 20), ignore_eos=rng.random() < 0.7, n=rng.choice([1, 1, 1, 2, 3]))
            d.add(f"q{i}", prompt, **p)
            expected[f"q{i}"] = p
        while d.sched.has_unfinished():
            if faults and rng.random() < 0.05:
                d.fail_next = rng.choice(["launch", "result"])
            try:
                out = d.step()
            except InjectedFault:
                seen["failed_steps"] += 1
                assert not any(r.num_output_placeholders for r in d.requests.values())
                d.check_invariants()
                continue
            if faults and rng.random() < 0.03 and d.sched.requests:
                d.abort(rng.choice(sorted(d.sched.requests)))
                seen["aborts"] += 1
            assert d.steps < 50_000, "no progress"
            seen["swapped_blocks"] += len(out.swap_out)
            seen["cow_copies"] += len(out.copy_blocks)
            seen["prefix_hit_tokens"] += sum(
                s.start for s in out.scheduled if d.requests[s.request_id].num_output_tokens == 0
            )
        assert (
            d.kv_cache_manager.block_pool.get_num_free_blocks() == d.kv_cache_manager.num_blocks - 1
        )  # nothing leaked
        assert not d.sched.requests  # the scheduler forgot every finished request
        for rid, req in d.requests.items():
            assert req.is_finished, rid
            if req.finish_reason in ("rejected", "abort"):
                continue
            p = expected[req.parent_id or rid]
            assert req.num_output_tokens <= p["max_tokens"]
            if req.finish_reason == "length" and req.num_tokens < d.sched.config.max_model_len:
                assert req.num_output_tokens == p["max_tokens"]
            if req.finish_reason == "stop":
                assert req.output_token_ids[-1] == EOS and not p["ignore_eos"]
        finished_ids = [r.request_id for r in d.finished]
        assert len(finished_ids) == len(set(finished_ids)) == len(d.requests)  # each exactly once
        seen["steps"] += d.steps
        seen["rounds"] += 1
        seen["requests"] += len(d.requests)
        seen["preemptions"] += d.sched.num_preemptions
        seen["rejected"] += sum(r.finish_reason == "rejected" for r in d.requests.values())
        seen["forks"] += sum(r.parent_id is not None for r in d.requests.values())
        seen["external_hit_tokens"] += d.kv_cache_manager.external_hits
        seen["hybrid_rounds"] += d.window is not None
        seen["overlapped_steps"] += d.pipeline.num_overlapped
        if (spec := d.sched.spec_decoding_stats) is not None:
            seen["drafts"] += spec.num_draft_tokens
            seen["accepted_drafts"] += spec.num_accepted_tokens
    return seen
