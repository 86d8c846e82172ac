"""Engine events (minipaged/engine/events.py): what observers see after each step, and that no observer can stall or
break the engine."""

from __future__ import annotations

import threading
import warnings

import pytest
from conftest import PREEMPTING_PROMPTS, small_engine

from minipaged import SamplingParams
from minipaged.engine.events import Observers, StepEvent

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_model):
    return tokens(small_engine(tiny_model).generate(PREEMPTING_PROMPTS, GREEDY))


def test_one_event_per_step_matching_the_pool(tiny_model, expected) -> None:
    llm = small_engine(tiny_model)
    events: list[StepEvent] = []
    llm.observers.attach(events.append)
    assert tokens(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected  # watching changes nothing
    assert llm.observers.flush()
    assert [e.step for e in events] == list(range(1, llm.num_steps + 1))
    assert len(events) == len(llm.step_stats)
    for e, row in zip(events, llm.step_stats):
        assert e.blocks_in_use == row["blocks_used"] and len(e.in_state("running")) == row["running"]
        assert e.num_scheduled_tokens == row["tokens"] and len(e.preempted) == row["preempted"]
        held = [b for r in e.requests for b in r.block_ids]
        assert 0 not in held  # the null block is never handed out
        assert len(set(held)) == e.blocks_in_use  # every block in use belongs to a request (shared ones once)
        assert e.num_cached_free_blocks <= e.num_free_blocks
        assert e.device == llm.device.type and e.block_size == 4 and e.num_blocks == 14
        for r in e.requests:
            if r.state == "running":  # blocks cover its computed tokens, and only the last has room left
                assert r.block_ids and 0 <= r.unused_slots < 4
                assert len(r.block_ids) * 4 - r.num_computed_tokens == r.unused_slots
            else:  # waiting (new or preempted for recompute) or swapped: no device blocks
                assert r.block_ids == () and r.unused_slots == 0
    assert sum(len(e.preempted) for e in events) == llm.scheduler.num_preemptions > 0
    for e in events:  # a preempted request waits with no blocks right after
        for rid in e.preempted:
            assert rid in e.in_state("waiting") and rid not in e.in_state("running")
    assert sorted(rid for e in events for rid in e.finished) == [str(i) for i in range(len(PREEMPTING_PROMPTS))]
    assert events[-1].blocks_in_use == 0 and not events[-1].requests
    assert events[0].usage == 0 or 0 < events[0].usage <= 1


def test_prefix_hits_are_counted_in_the_step_that_admits(tiny_model) -> None:
    llm = small_engine(tiny_model, num_gpu_blocks_override=32)
    events: list[StepEvent] = []
    llm.observers.attach(events.append)
    prompt = list(range(1, 14))  # 13 tokens: three full blocks of 4 can be cached
    llm.generate([prompt], GREEDY)
    llm.generate([prompt], GREEDY)
    llm.observers.flush()
    assert sum(e.prefix_queries for e in events) == llm.kv_cache_manager.prefix_cache_queries == 26
    assert sum(e.prefix_hits for e in events) == llm.kv_cache_manager.prefix_cache_hits == 12
    second = [e for e in events if e.prefix_hits]
    assert len(second) == 1 and second[0].prefix_queries == 13
    idle = [e for e in events if not e.requests]  # after the first run: its blocks freed, still cached
    assert idle and idle[0].num_cached_free_blocks >= 3


def test_a_raising_observer_is_detached_and_the_engine_goes_on(tiny_model, expected) -> None:
    llm = small_engine(tiny_model)
    seen: list[int] = []
    calls = 0

    def broken(event: StepEvent) -> None:
        nonlocal calls
        calls += 1
        raise RuntimeError("a bug in a widget")

    llm.observers.attach(broken)
    llm.observers.attach(lambda e: seen.append(e.step))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tokens(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected
        assert llm.observers.flush()
    assert calls == 1 and len(llm.observers) == 1
    assert seen == list(range(1, llm.num_steps + 1))  # the other observer missed nothing
    assert any("was detached" in str(w.message) and "a bug in a widget" in str(w.message) for w in caught)
    assert llm.observers.detached[-1][1] == "RuntimeError('a bug in a widget')"


def test_a_stuck_observer_never_blocks_a_step(tiny_model, expected) -> None:
    llm = small_engine(tiny_model)
    llm.observers = Observers(maxlen=4)
    release = threading.Event()
    got: list[int] = []

    def stuck(event: StepEvent) -> None:
        release.wait(30)
        got.append(event.step)

    llm.observers.attach(stuck)
    assert (
        tokens(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected
    )  # finishes while the observer is stuck on step 1
    assert not llm.observers.flush(timeout=0.05)
    release.set()
    assert llm.observers.flush()
    assert got[0] == 1 and got[-4:] == list(range(llm.num_steps - 3, llm.num_steps + 1))  # the newest kept
    assert llm.observers.dropped == llm.num_steps - len(got) > 0


def test_nothing_is_built_without_an_observer(tiny_model, monkeypatch) -> None:
    import minipaged.engine.llm as engine_module

    def boom(*args, **kwargs):
        raise AssertionError("an event was built with nobody watching")

    monkeypatch.setattr(engine_module, "step_event", boom)
    llm = small_engine(tiny_model)
    llm.generate(PREEMPTING_PROMPTS[:2], GREEDY)
    observer = llm.observers.attach(lambda e: None)
    thread = llm.observers._thread
    assert thread is not None and thread.is_alive()
    llm.observers.detach(observer)
    llm.generate(PREEMPTING_PROMPTS[:2], GREEDY)
    thread.join(5)  # with nobody watching, the delivering thread ends
    assert not thread.is_alive() and llm.observers._thread is None


def test_attach_refuses_what_cannot_be_called() -> None:
    with pytest.raises(TypeError, match="observer must be callable"):
        Observers().attach("print")  # type: ignore[arg-type]
