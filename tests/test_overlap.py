"""Async scheduling: the overlap loop (engine/overlap.py) and the scheduler's side (core/async_scheduler.py).

What must hold: step N+1 is launched before step N's result is waited for, once per step; every request gets
the very tokens it gets without overlap (placeholders filled with the right token); a step that fails, at its
launch or on the device, rolls back whole, the step scheduled ahead of it included; an abort while a step that
serves the request is in flight leaves nothing behind.
"""

from __future__ import annotations

import pytest
from conftest import PREEMPTING_PROMPTS, small_engine
from test_engine_faults import Fault, assert_clean, fail_on_call, token_ids

from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.core.scheduler import Scheduler, SchedulerConfig, check_invariants
from minipaged.engine.overlap import StepPipeline
from minipaged.engine.step import run_step
from minipaged.lab.checking_driver import fuzz
from minipaged.lab.fake_device import FakeDeviceExecutor
from minipaged.sampling_params import SamplingParams
from minipaged.worker.sampler import DeviceSamples

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


# ---- the loop's order, on a fake device ---------------------------------------------------------
def fake_engine(num: int = 6, max_tokens: int = 9, step_s: float = 0.0, stop: int | None = None):
    kv = KVCacheManager(4, 64, enable_caching=True, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64), kv)
    dev = FakeDeviceExecutor(4, 4, 16, 16, step_s=step_s, vocab=30)
    stops = [] if stop is None else [stop]
    for i in range(num):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stops)
        sched.add_request(Request(f"r{i}", [1 + i] + [7] * (3 + 2 * i), sampling_params=params))
    return sched, dev


def run(sched, dev, overlap: bool, until=None) -> dict[str, list[int]]:
    pipeline, done, now = StepPipeline(), {}, iter(range(1, 10_000))
    reqs = dict(sched.requests)
    while sched.has_unfinished():
        res = pipeline.step(sched, dev, lambda: float(next(now))) if overlap else run_step(sched, dev, lambda: 0.0)
        check_invariants(sched)
        assert not any(r.num_output_placeholders for r in reqs.values())  # never seen between two steps
        for r in res.finished:
            done[r.request_id] = r
        if until is not None and until(sched, pipeline):
            break
    return {rid: (r.output_token_ids, r.finish_reason) for rid, r in sorted(reqs.items())}


@pytest.mark.parametrize("stop", [None, 3, 11])
def test_same_tokens_with_and_without_overlap(stop):
    """Chunked prefills, decodes, stop tokens (a request stopped by a token the step ahead already served)."""
    sync = run(*fake_engine(stop=stop), overlap=False)
    sched, dev = fake_engine(stop=stop)
    assert run(sched, dev, overlap=True) == sync
    assert any(reason == "stop" for _, reason in sync.values()) == (stop is not None)


def test_the_next_step_is_launched_before_this_one_is_waited_for():
    sched, dev = fake_engine()
    run(sched, dev, overlap=True)
    events = dev.events
    results = [n for what, n in events if what == "result"]
    assert results == sorted(results) and len(results) == len(set(results))  # each step waited for once, in order
    overlapped = 0
    for n in results:
        launched_next = events.index(("launch", n + 1)) if ("launch", n + 1) in events else len(events)
        overlapped += launched_next < events.index(("result", n))
    assert overlapped >= len(results) - 3  # all but the first steps and the last (nothing left to launch)


def test_the_device_never_waits_for_the_host_between_steps():
    """With a 20 ms device step, the next step is launched before the device finishes the one it runs: the
    device goes from step to step without idling (plain steps leave it idle while the host schedules)."""
    sched, dev = fake_engine(num=4, max_tokens=12, step_s=0.02)
    pipeline = StepPipeline()
    while sched.has_unfinished():
        pipeline.step(sched, dev, lambda: 0.0)
    assert pipeline.num_overlapped >= dev.num_device_steps - 2 and pipeline.hidden_s > 0
    assert dev.idle_launches <= 2  # the first step, and the one after the last prefill chunk at most
    sched, dev = fake_engine(num=4, max_tokens=12, step_s=0.02)
    run(sched, dev, overlap=False)
    assert dev.idle_launches == dev.num_device_steps  # plain: every step finds the device idle


def test_a_request_that_max_tokens_ends_is_not_scheduled_ahead():
    sched, dev = fake_engine(num=1, max_tokens=3)
    run(sched, dev, overlap=True)
    assert dev.num_device_steps == 3  # prefill (token 1), two decodes (tokens 2, 3): no wasted fourth step


# ---- rollback, aborts: the data-checking fuzz -----------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_overlap_with_faults_and_aborts(seed):
    """The checking driver writes and reads back every K/V through the block tables: placeholders filled with
    the wrong token, a block freed while the step ahead uses it, or a rollback that keeps what a failed step
    was to write would all show up; every request still finishes exactly once with the right tokens."""
    seen = fuzz(1500, seed=seed, overlap=True, faults=True)
    assert seen["overlapped_steps"] > 1000 and seen["failed_steps"] > 20 and seen["aborts"] > 10
    assert seen["swapped_blocks"] and seen["cow_copies"] and seen["prefix_hit_tokens"] and seen["hybrid_rounds"]


def test_fuzz_plain_steps_with_faults():
    """The same faults without overlap: a failed step's copy-on-write, swap-in and swap-out copies are redone
    by computing again, not assumed made."""
    seen = fuzz(2000, seed=0, faults=True)
    assert seen["failed_steps"] > 20 and seen["cow_copies"] and seen["swapped_blocks"]


def test_a_failed_step_takes_back_the_placeholders_and_the_step_ahead():
    sched, dev = fake_engine(num=3)
    pipeline = StepPipeline()
    for _ in range(4):
        pipeline.step(sched, dev, lambda: 0.0)
    assert pipeline.in_flight is not None
    before = {rid: (r.num_computed_tokens, list(r.output_token_ids)) for rid, r in sched.requests.items()}
    real = pipeline.in_flight.pending

    class Broken:
        def result(self):
            real.result()
            raise Fault("injected into the device")

    pipeline.in_flight.pending = Broken()
    with pytest.raises(Fault):
        pipeline.step(sched, dev, lambda: 0.0)
    assert pipeline.in_flight is None  # the step launched ahead was dropped
    after = {rid: (r.num_computed_tokens, list(r.output_token_ids)) for rid, r in sched.requests.items()}
    assert after == before  # as if the failed step never ran: no placeholder left, computed tokens as they were
    assert not any(r.num_output_placeholders for r in sched.requests.values())
    check_invariants(sched)
    assert not sched.kv_cache_manager.step.in_flight_blocks and not sched.kv_cache_manager.step.uncommitted_blocks


# ---- the engine on the tiny model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def expected(tiny_model):
    return token_ids(small_engine(tiny_model).generate(PREEMPTING_PROMPTS, GREEDY))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_greedy_tokens_are_the_same(tiny_model, expected, mode):
    kw = dict(preemption_mode=mode, swap_space=4096 if mode == "swap" else 0)
    llm = small_engine(tiny_model, async_scheduling=True, **kw)
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected
    assert llm.pipeline.num_overlapped > 5 and llm.scheduler.num_preemptions > 0
    assert_clean(llm)
    assert llm.pipeline.in_flight is None  # nothing kept once every request is done


def test_engine_seeded_sampling_is_the_same(tiny_model):
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    plain = token_ids(small_engine(tiny_model).generate(PREEMPTING_PROMPTS, params))
    assert token_ids(small_engine(tiny_model, async_scheduling=True).generate(PREEMPTING_PROMPTS, params)) == plain


@pytest.mark.parametrize(
    "phase",
    ["schedule", "forward", "sample", "wait", "update"],
)
def test_engine_a_fault_in_any_phase_leaves_nothing_behind(tiny_model, expected, phase, monkeypatch):
    llm = small_engine(tiny_model, async_scheduling=True, preemption_mode="swap", swap_space=4096)
    target = {
        "schedule": (llm.scheduler, "schedule"),
        "forward": (llm.model, "forward"),
        "sample": (llm.sampler, "sample_on_device"),
        "update": (llm.scheduler, "finish_if_done"),
    }
    if phase == "wait":
        calls = [0]
        real = DeviceSamples.to_host

        def to_host(self):
            calls[0] += 1
            if calls[0] == 4:
                raise Fault("injected into to_host")
            return real(self)

        monkeypatch.setattr(DeviceSamples, "to_host", to_host)
    else:
        fail_on_call(*target[phase], 4)  # the fourth: a step scheduled ahead is in flight
    with pytest.raises(Fault, match="injected into"):
        llm.generate(PREEMPTING_PROMPTS, GREEDY)
    assert_clean(llm)
    assert llm.pipeline.in_flight is None
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected
    assert_clean(llm)


def test_engine_abort_while_a_step_is_in_flight(tiny_model, expected):
    llm = small_engine(tiny_model, async_scheduling=True)
    ids = [llm.add_request(p, GREEDY) for p in PREEMPTING_PROMPTS]
    for _ in range(3):
        llm.step()
    assert llm.pipeline.in_flight is not None
    in_flight = {s.request_id for s in llm.pipeline.in_flight.output.scheduled}
    victim = sorted(in_flight)[0]
    llm.abort(victim)
    while llm.scheduler.has_unfinished():
        llm.step()
    outs = {rid: llm.get_output(rid) for rid in ids if rid != victim}
    assert [outs[rid].outputs[0].token_ids for rid in ids if rid != victim] == [
        e for rid, e in zip(ids, expected) if rid != victim
    ]
    assert_clean(llm)
    # a stream closed early aborts its requests: the step in flight for them is drained
    stream = llm.stream(PREEMPTING_PROMPTS, GREEDY)
    next(stream)
    stream.close()
    assert_clean(llm) and llm.pipeline.in_flight is None


def test_engine_reset_drops_the_step_in_flight(tiny_model, expected):
    llm = small_engine(tiny_model, async_scheduling=True)
    for p in PREEMPTING_PROMPTS:
        llm.add_request(p, GREEDY)
    llm.step()
    llm.step()
    assert llm.pipeline.in_flight is not None
    llm.reset()
    assert llm.pipeline.in_flight is None
    assert token_ids(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected


def test_async_scheduling_defaults_and_refusals(tiny_model):
    assert not small_engine(tiny_model, device="cpu").pipeline.overlap  # a CPU runs the forward itself
    default = small_engine(tiny_model)  # on a GPU where there is one: then overlapped
    assert default.pipeline.overlap == (default.device.type == "cuda")
    with pytest.raises(ValueError, match="async_scheduling=True needs tensor_parallel_size=1"):
        small_engine(tiny_model, async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        small_engine(tiny_model, async_scheduling="yes")


def test_engine_a_part_plugged_in_while_a_step_is_in_flight(tiny_model, expected):
    """The step in flight is waited for and applied, not dropped; then every step is the plain one, snapshot and
    all, with the learner's function called (here the package's own slot mapping, so the tokens must match)."""
    from minipaged.classroom import parts
    from minipaged.worker.block_table import slot_mapping

    llm = small_engine(tiny_model, async_scheduling=True)
    ids = [llm.add_request(p, GREEDY) for p in PREEMPTING_PROMPTS]
    llm.step()
    assert llm.pipeline.in_flight is not None
    with parts.use(slot_mapping=slot_mapping) as wrappers:
        overlapped = llm.pipeline.num_overlapped
        while llm.scheduler.has_unfinished():
            llm.step()
        assert llm.pipeline.num_overlapped == overlapped  # nothing scheduled ahead while a part is in
    assert wrappers["slot_mapping"].calls > 0
    assert [llm.get_output(rid).outputs[0].token_ids for rid in ids] == expected
    assert_clean(llm)
