"""EngineMonitor (minipaged/classroom/viz/monitor.py): what it draws matches the engine's own events and pool, step by step."""

from __future__ import annotations

import random
import time
import warnings

import pytest
from conftest import PREEMPTING_PROMPTS, small_engine

from minipaged import LLM, SamplingParams
from minipaged.classroom.viz import EngineMonitor
from minipaged.classroom.viz.block_viz import CACHED_FREE_COLOR, FREE_COLOR, NULL_COLOR, SHARED_COLOR
from minipaged.classroom.viz.layout import check_layout, contrast_ratio
from minipaged.engine.events import StepEvent

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def watched(llm: LLM) -> list[StepEvent]:
    events: list[StepEvent] = []
    llm.observers.attach(events.append)
    return events


def pool_now(llm: LLM) -> tuple[set[int], dict[int, list[str]]]:
    """The pool itself (read while the engine is idle): free blocks still cached, and each block's owners."""
    pool = llm.kv_cache_manager.block_pool
    cached = {b.block_id for same in pool.cached_block_hash_to_block.values() for b in same.values() if b.ref_cnt == 0}
    owners: dict[int, list[str]] = {}
    for rid, blocks in llm.kv_cache_manager.req_to_blocks.items():
        for b in blocks:
            owners.setdefault(b.block_id, []).append(rid)
    return cached, owners


def check_against_pool(llm: LLM, mon: EngineMonitor) -> tuple[bool, bool]:
    """After a step: the monitor's cells, labels and waste against the event and the pool itself."""
    assert llm.observers.flush()
    e = mon.last_event
    assert e is not None and e.step == llm.num_steps and mon.drawn_step == e.step
    cached, owners = pool_now(llm)
    assert len(mon.cells) == e.num_blocks == llm.num_blocks
    colors = {"null": NULL_COLOR, "free": FREE_COLOR, "free, cached": CACHED_FREE_COLOR}
    for c in mon.cells:
        b = c["block_id"]
        assert sorted(c["owners"]) == sorted(owners.get(b, []))
        if b == 0 or b not in owners:
            want = "null" if b == 0 else "free, cached" if b in cached else "free"
            assert (c["status"], c["color"]) == (want, colors[want]), (e.step, b)
        else:
            assert c["status"] == ("shared" if len(owners[b]) > 1 else "in use")
            assert c["color"] == (SHARED_COLOR if len(owners[b]) > 1 else mon.colors(owners[b][0]))
    assert {c["block_id"] for c in mon.cells if c["status"] == "free, cached"} == set(e.cached_free_block_ids)
    # each request's last block carries its fill; no other block is labelled
    labels = {r.block_ids[-1]: f"{e.block_size - r.unused_slots}/{e.block_size}" for r in e.requests if r.block_ids}
    assert {c["block_id"]: c["label"] for c in mon.cells if c["label"]} == labels
    # the waste shown is each request's unused_slots, in the dict and in the bar chart
    waste = {r.request_id: r.unused_slots for r in e.requests if r.block_ids}
    assert mon.waste == waste
    bar = mon.waste_figure.data[0]
    assert dict(zip(bar.y, bar.x)) == waste
    # the figure draws every block once, where its id puts it, in its owner's trace (or its status's)
    drawn = {}
    for t in mon.grid.data:
        for x, y, text in zip(t.x, t.y, t.text):
            drawn[-y * mon.columns + x] = (t.name, text)
    assert sorted(drawn) == list(range(llm.num_blocks))
    for c in mon.cells:
        assert drawn[c["block_id"]] == (c["owners"][0] if c["status"] == "in use" else c["status"], c["label"])
    return bool(cached and owners), bool(e.preempted)


def test_grid_and_waste_match_the_pool_after_every_step(tiny_model) -> None:
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0)
    shared_prefix = [8, 9, 10, 11, 12, 13, 14, 15]  # two full blocks: later requests hit them in the cache
    for i, p in enumerate(PREEMPTING_PROMPTS + [shared_prefix + [1, 2], shared_prefix + [3]]):
        llm.add_request(p, SamplingParams(temperature=0.0, max_tokens=4 + i, ignore_eos=True))
    seen = []
    while llm.scheduler.running or llm.scheduler.waiting:
        llm.step()
        seen.append(check_against_pool(llm, mon))
    assert any(c for c, _ in seen) and any(p for _, p in seen)  # cached blocks beside running ones; preemptions
    assert mon.summary["running"] == [] and "idle" in mon.caption.value
    mon.close()


@pytest.mark.parametrize("num_blocks", [14, 18, 22])
def test_cached_free_blocks_are_shown_under_eviction(tiny_model, num_blocks) -> None:
    """Many requests sharing prefixes through a small pool: cached blocks are evicted, hit and freed again."""
    rng = random.Random(num_blocks)
    llm = small_engine(tiny_model, num_gpu_blocks_override=num_blocks)
    mon = EngineMonitor(llm, min_interval_s=0)
    base = [rng.randrange(1, 90) for _ in range(9)]
    for i in range(8):
        tail = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 14))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 14), ignore_eos=True)
        llm.add_request((base if i % 2 else []) + tail, params)
    seen_cached = 0
    while llm.scheduler.running or llm.scheduler.waiting:
        llm.step()
        check_against_pool(llm, mon)
        seen_cached += bool(mon.last_event.cached_free_block_ids)
    assert seen_cached > 5
    mon.close()


def test_timeline_has_one_point_per_event_and_marks_where_they_happened(tiny_model) -> None:
    llm = small_engine(tiny_model)
    events = watched(llm)
    mon = EngineMonitor(llm, min_interval_s=0)
    llm.generate(PREEMPTING_PROMPTS, GREEDY)
    llm.generate(PREEMPTING_PROMPTS[:1], GREEDY)  # the same prompt again: prefix-cache hits
    assert llm.observers.flush()
    assert list(mon.series["step"]) == [e.step for e in events] == list(range(1, llm.num_steps + 1))
    assert list(mon.series["kv_use"]) == pytest.approx([100 * e.usage for e in events])
    assert list(mon.series["batch"]) == [e.num_scheduled_requests for e in events]
    assert list(mon.series["unused_slots"]) == [e.unused_slots for e in events]
    preempted = [e for e in events if e.preempted]
    hits = [e for e in events if e.prefix_hits]
    assert preempted and hits
    assert [m["step"] for m in mon.marks["preempted"]] == [e.step for e in preempted]
    assert [m["step"] for m in mon.marks["prefix_hit"]] == [e.step for e in hits]
    use, pre, hit, batch = mon.timeline.data
    assert (use.name, pre.name, hit.name, batch.name) == ("KV use", "preemption", "prefix-cache hit", "batch size")
    assert list(use.x) == [e.time for e in events] and list(batch.y) == list(mon.series["batch"])
    assert list(pre.x) == [e.time for e in preempted]
    assert list(pre.y) == pytest.approx([100 * e.usage for e in preempted])
    assert list(hit.x) == [e.time for e in hits]
    s = mon.summary
    assert s["preemptions"] == llm.scheduler.num_preemptions == sum(len(e.preempted) for e in events)
    assert (s["prefix_hits"], s["prefix_queries"]) == (
        llm.kv_cache_manager.prefix_cache_hits,
        llm.kv_cache_manager.prefix_cache_queries,
    )
    assert (
        f"<b>{s['preemptions']} preemptions</b>" in mon.caption.value
        and f"on <b>{llm.device.type}</b>" in mon.caption.value
    )
    assert f"{s['prefix_hits']} of {s['prefix_queries']} prompt tokens hit" in mon.caption.value
    for fig in (mon.grid, mon.waste_figure, mon.timeline):
        assert check_layout(fig) == []
    mon.close()


def test_history_bounds_the_timeline(tiny_model) -> None:
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0, history=5)
    llm.generate(PREEMPTING_PROMPTS, GREEDY)
    assert llm.observers.flush()
    assert list(mon.series["step"]) == list(range(llm.num_steps - 4, llm.num_steps + 1))
    assert len(mon.timeline.data[0].x) == 5 and mon.totals["events"] == llm.num_steps
    mon.close()


def test_redraws_are_throttled_and_the_idle_state_is_always_drawn(tiny_model) -> None:
    llm = small_engine(tiny_model)
    every, rare = EngineMonitor(llm, min_interval_s=0), EngineMonitor(llm, min_interval_s=1000)
    llm.generate(PREEMPTING_PROMPTS, GREEDY)
    assert llm.observers.flush()
    steps = llm.num_steps
    assert every.num_draws == steps > 10
    assert 1 <= rare.num_draws <= 3 < steps  # the first step, and the idle one at the end
    assert rare.drawn_step == steps and rare.summary["running"] == [] and "idle" in rare.caption.value
    assert rare.cells == every.cells and rare.waste == every.waste == {}
    assert list(rare.series["step"]) == list(range(1, steps + 1))  # recorded all the same
    every.close()
    rare.close()


def test_a_burst_that_stops_short_of_idle_is_drawn_after_the_interval(tiny_model) -> None:
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0.2)
    for p in PREEMPTING_PROMPTS:
        llm.add_request(p, GREEDY)
    for _ in range(4):  # by hand: the engine stops while requests still run
        llm.step()
    assert llm.observers.flush()
    deadline = time.monotonic() + 10
    while mon.drawn_step != 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mon.drawn_step == 4 and mon.summary["running"]
    mon.close()


def test_close_detaches(tiny_model) -> None:
    llm = small_engine(tiny_model)
    with EngineMonitor(llm, min_interval_s=0) as mon:
        assert len(llm.observers) == 1
        llm.generate(PREEMPTING_PROMPTS[:2], GREEDY)
        assert llm.observers.flush()
    recorded, draws = mon.totals["events"], mon.num_draws
    assert recorded == llm.num_steps and len(llm.observers) == 0
    llm.generate(PREEMPTING_PROMPTS[:2], GREEDY)
    assert llm.observers.flush()
    assert (mon.totals["events"], mon.num_draws) == (recorded, draws) and llm.num_steps > recorded


def test_a_monitor_that_fails_to_draw_is_detached_and_the_engine_serves_on(tiny_model) -> None:
    expected = tokens(small_engine(tiny_model).generate(PREEMPTING_PROMPTS, GREEDY))
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0)

    def broken() -> None:
        raise RuntimeError("plotly is gone")

    mon._draw_grid = broken  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tokens(llm.generate(PREEMPTING_PROMPTS, GREEDY)) == expected
        assert llm.observers.flush()
    assert len(llm.observers) == 0 and mon.num_draws == 0 and mon.totals["events"] == 1
    assert any("was detached" in str(w.message) and "plotly is gone" in str(w.message) for w in caught)
    assert "plotly is gone" in mon.error and "monitor stopped" in mon.caption.value
    mon.close()  # detaching twice is harmless


def test_figures_read_well_before_and_after_and_labels_contrast(tiny_model) -> None:
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0)
    for fig in (mon.grid, mon.waste_figure, mon.timeline):
        assert check_layout(fig) == []
    assert "waiting for the engine's first step" in mon.caption.value
    for p in PREEMPTING_PROMPTS:
        llm.add_request(p, GREEDY)
    for _ in range(6):
        llm.step()
    assert llm.observers.flush()
    for fig in (mon.grid, mon.waste_figure, mon.timeline):
        assert check_layout(fig) == []
    labelled = 0
    for t in mon.grid.data:  # one colour per trace, and its ink
        assert isinstance(t.marker.color, str) and contrast_ratio(t.textfont.color, t.marker.color) >= 4.5
        labelled += sum(bool(text) for text in t.text)
    assert labelled == sum(bool(r.block_ids) for r in mon.last_event.requests) > 0
    legend = {t.name for t in mon.grid.data if t.showlegend}
    assert legend <= {"null", "free", "free, cached", "shared"} and "null" in legend
    mon.close()


def test_a_pool_of_thousands_of_blocks_draws(tiny_model) -> None:
    llm = small_engine(tiny_model, num_gpu_blocks_override=3000, max_num_batched_tokens=1024)
    mon = EngineMonitor(llm, min_interval_s=0)
    assert 8 <= mon.columns <= 128 and 4 <= mon.cell_px < 20
    for i in range(40):  # more requests than owner traces: the rest share one trace per colour
        llm.add_request(PREEMPTING_PROMPTS[i % len(PREEMPTING_PROMPTS)] + [i + 1] * 8, GREEDY)
    for _ in range(3):
        llm.step()
    assert llm.observers.flush()
    assert len(mon.last_event.in_state("running")) == 40
    assert sum(len(t.x) for t in mon.grid.data) == 3000 == len(mon.cells)
    assert all(t.marker.size == mon.cell_px - 2 for t in mon.grid.data)
    assert mon.grid.layout.height <= 1000 and mon.grid.layout.width <= 1100
    color_at = {-y * mon.columns + x: t.marker.color for t in mon.grid.data for x, y in zip(t.x, t.y)}
    assert all(color_at[c["block_id"]] == c["color"] for c in mon.cells)
    names = [t.name for t in mon.grid.data]
    assert (
        "more requests" in names and len(set(names) - {"more requests", "null", "free", "free, cached", "shared"}) == 24
    )
    t0 = time.perf_counter()
    mon.draw()
    assert time.perf_counter() - t0 < 5.0  # generous: a 2-core machine shared with other jobs
    assert check_layout(mon.grid) == []
    mon.close()


def test_bad_arguments_are_refused(tiny_model) -> None:
    llm = small_engine(tiny_model)
    with pytest.raises(ValueError, match="columns"):
        EngineMonitor(llm, columns=0)
    with pytest.raises(ValueError, match="min_interval_s"):
        EngineMonitor(llm, min_interval_s=-1)
    assert len(llm.observers) == 0


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs it)")
def test_the_monitor_watches_a_cuda_small_engine(tiny_model) -> None:
    """The same pictures from an engine whose pool lives on the GPU: the monitor reads only events."""
    llm = small_engine(tiny_model, device="cuda")
    mon = EngineMonitor(llm, min_interval_s=0)
    for p in PREEMPTING_PROMPTS:
        llm.add_request(p, GREEDY)
    while llm.scheduler.running or llm.scheduler.waiting:
        llm.step()
        check_against_pool(llm, mon)
    assert mon.last_event.device == "cuda" and "on <b>cuda</b>" in mon.caption.value
    mon.close()


def test_a_browser_that_missed_edits_is_drawn_from_the_current_figures(tiny_model) -> None:
    """A browser view draws the synced state whole (live_figure.py), so after the observer thread's redraws that
    state must be the figures as they are now."""
    llm = small_engine(tiny_model)
    mon = EngineMonitor(llm, min_interval_s=0)
    llm.generate(PREEMPTING_PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    llm.observers.flush()
    assert all(any(len(t.x or ()) for t in fig.data) for fig in (mon.grid, mon.timeline))  # something to lose
    for fig in (mon.grid, mon.waste_figure, mon.timeline):
        assert fig._widget_data == list(fig._data) and fig._widget_layout == fig._layout_obj._props
    mon.close()
