"""Chapters 02-04 widgets, driven from Python as a learner would drive them."""

import pytest

from minipaged.classroom.viz import BlockPoolGrid, BlockTableView, ContiguousVsPaged
from minipaged.classroom.viz.block_viz import (
    CACHED_FREE_COLOR,
    FREE_COLOR,
    HOLE_COLOR,
    NULL_COLOR,
    OWNER_COLORS,
    SHARED_COLOR,
    STATUS_COLORS,
    UNUSED_COLOR,
)
from minipaged.classroom.viz.layout import check_layout, contrast_ratio, delta_e, text_color
from minipaged.core.block_pool import BlockPool
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.lab.contiguous import contiguous_layouts, reservation_size
from minipaged.lab.workloads import Trace, TraceRequest, sharegpt_like_trace
from minipaged.worker.block_table import BlockTable


def _grow(manager, request, n):
    """Allocate and 'compute' n more tokens of request, as a scheduler step would."""
    assert manager.allocate_slots(request, n) is not None
    request.num_computed_tokens += n


def test_pool_grid_replays_the_ab_trace_with_history():
    mgr = KVCacheManager(block_size=4, num_blocks=20, enable_caching=False, watermark=0.0)
    a = Request("A", [11])
    grid = BlockPoolGrid(mgr, tokens={"A": a}, columns=10)
    assert grid.cells[0]["status"] == "null" and grid.cells[0]["color"] == NULL_COLOR
    assert grid.summary["free"] == 19 and grid.summary["free_queue"] == list(range(1, 20))
    for i in range(5):
        _grow(mgr, a, 1)
        a.append_output_token_ids(100 + i)
    grid.refresh("A has 5 tokens")
    assert grid.summary["block_tables"] == {"A": [1, 2]}
    one, two = grid.cells[1], grid.cells[2]
    assert one["owners"] == ["A"] and one["ref_cnt"] == 1 and one["color"] == two["color"] != FREE_COLOR
    assert "tokens 0–3 (4/4 slots)" in one["hover"] and "token 4 (1/4 slots)" in two["hover"]
    assert "ref_cnt 1" in two["hover"] and "hash —" in two["hover"]
    b = Request("B", [7])
    grid._tokens["B"] = b
    _grow(mgr, b, 1)
    grid.refresh("B starts")
    assert grid.cells[3]["owners"] == ["B"] and grid.cells[3]["color"] != one["color"]
    mgr.free(a)
    grid.refresh("A finishes")
    s = grid.summary
    assert s["free"] == 18 and s["free_queue"][-2:] == [2, 1]  # freed tail first, at the back
    assert grid.cells[1]["status"] == "free" and grid.cells[1]["free_queue_position"] == 17
    # the plot: one trace per owner or status, each square hoverable
    names = {t.name for t in grid.figure.data}
    assert {"B", "free", "null"} <= names
    assert sum(len(t.x) for t in grid.figure.data) == 20
    # the slider steps back through history
    assert grid.step.max == 3 and grid.step.value == 3
    grid.step.value = 1
    assert grid.label == "A has 5 tokens" and grid.summary["block_tables"] == {"A": [1, 2]}
    assert "A has 5 tokens" in grid.caption.value
    assert check_layout(grid.figure) == []
    _squares_readable(grid.figure)


def _squares_readable(fig):
    """The number on every square contrasts >= 4.5:1 with the square's colour."""
    for t in fig.data:
        if t.text is None:
            continue
        fills = t.marker.color if isinstance(t.marker.color, (list, tuple)) else [t.marker.color] * len(t.x)
        inks = t.textfont.color if isinstance(t.textfont.color, (list, tuple)) else [t.textfont.color] * len(t.x)
        for fill, ink in zip(fills, inks):
            assert contrast_ratio(ink, fill) >= 4.5, (t.name, ink, fill)


def test_palette_is_distinct_and_readable():
    # every owner colour is far from every other one and from the status colours (free, cached, null, shared)
    for i, a in enumerate(OWNER_COLORS):
        for b in OWNER_COLORS[i + 1 :]:
            assert delta_e(a, b) >= 30, (a, b)
        for name, b in STATUS_COLORS.items():
            assert delta_e(a, b) >= 25, (a, name, b)
    for color in OWNER_COLORS + list(STATUS_COLORS.values()) + [UNUSED_COLOR, HOLE_COLOR]:
        assert contrast_ratio(text_color(color), color) >= 4.5
    # chapter 02's memory bar: live, reserved-but-empty, too-small hole and free look nothing alike
    bar = [OWNER_COLORS[0], UNUSED_COLOR, HOLE_COLOR, FREE_COLOR]
    assert min(delta_e(a, b) for i, a in enumerate(bar) for b in bar[i + 1 :]) >= 30


def test_pool_grid_shows_shared_and_cached_blocks():
    mgr = KVCacheManager(block_size=4, num_blocks=8, enable_caching=True, watermark=0.0)
    prompt = list(range(9))
    a = Request("A", prompt)
    _grow(mgr, a, 9)
    b = Request("B", prompt)
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8
    mgr.allocate_slots(b, 1, num_new_computed_tokens=n, new_computed_blocks=hits)
    grid = BlockPoolGrid(mgr)
    shared = grid.cells[hits[0].block_id]
    assert shared["status"] == "shared" and shared["color"] == SHARED_COLOR
    assert shared["owners"] == ["A", "B"] and shared["ref_cnt"] == 2 and shared["hash"] is not None
    assert shared["hash"] in shared["hover"]
    mgr.free(a)
    mgr.free(b)
    grid.refresh("both finished")
    cached = grid.cells[hits[0].block_id]
    assert cached["status"] == "free, cached" and cached["color"] == CACHED_FREE_COLOR
    assert grid.summary["cached_free"] == 2 and grid.summary["in_use"] == 0
    assert check_layout(grid.figure) == []
    _squares_readable(grid.figure)


def test_pool_grid_on_a_bare_pool_with_owners():
    pool = BlockPool(6, enable_caching=False)
    owners = {"x": pool.get_new_blocks(2)}
    grid = BlockPoolGrid(pool, owners=owners, columns=3)
    assert grid.cells[1]["owners"] == ["x"] and grid.cells[2]["tokens"] == ["x: logical block 1"]
    assert grid.summary["in_use"] == 2 and grid.summary["usage"] == pytest.approx(2 / 5)
    with pytest.raises(TypeError):
        BlockPoolGrid([1, 2, 3])


def _small_trace():
    # A 12-slot arena reserving exact lengths: A (3 slots) and B (6) start, C (5) waits. When A leaves, the
    # arena has 6 free slots, in two holes of 3: C still cannot start (external fragmentation).
    return Trace([TraceRequest("A", 0, 2, 1), TraceRequest("B", 0, 2, 4), TraceRequest("C", 0, 3, 2)])


def test_contiguous_vs_paged_steps_through_the_same_trace():
    view = ContiguousVsPaged(_small_trace(), num_slots=12, max_model_len=12, policy="exact", block_size=2)
    st, c = view.state, view.contiguous
    assert st["step"] == 0 and st["contiguous"]["active"] and st["paged"]["active"]
    assert [r[:3] for r in view.layout["reservations"]] == [("A", 0, 3), ("B", 3, 6)]
    assert st["contiguous"]["waiting"] == 1 and st["paged"]["waiting"] == 0  # paging runs C at once
    view.step.value = 1
    st = view.state
    assert view.layout["free_extents"] == [(0, 3), (9, 3)] and view.layout["waiting_head"] == "C"
    assert st["contiguous"]["external"] == c.external_waste[1] == 6 and c.refused_fragmented[1] == 1
    hole_bars = [t for t in view.memory.data if t.name == "free hole (too small)"]
    assert sum(hole_bars[0].x) == 6 and hole_bars[0].marker.color == HOLE_COLOR
    assert "1 waiting" in view.caption.value and "external 6" in view.caption.value
    # the timeline: one line per allocator and a marker at the current step
    assert [t.name for t in view.timeline.data] == ["contiguous", "paged"]
    assert view.timeline.layout.yaxis.title.text == "utilisation (live / slots)"
    for fig in (view.memory, view.timeline):  # legends to the right, off the bars and the curves
        assert check_layout(fig) == [] and fig.layout.legend.x >= 1
    assert view.timeline.layout.shapes[0].x0 == 1
    # the paged run ends first: after its last step it reads "finished"
    view.step.value = view.step.max
    assert view.state["paged"]["finished"] and not view.state["paged"]["active"]
    assert "all requests finished" in view.caption.value
    # another reservation policy re-runs both simulations
    view.policy.value = "max"
    assert all(r[2] == 12 for r in view.layouts[0]["reservations"])
    assert check_layout(view.memory) == [] and check_layout(view.timeline) == []
    assert view.memory.layout.yaxis.title.text == "allocator"  # kept when the bars are redrawn


def test_contiguous_layouts_replay_matches_the_simulation():
    trace = sharegpt_like_trace(40, seed=3, arrival_rate=0.3, max_model_len=1024)
    for policy in ("max", "pow2", "exact"):
        view = ContiguousVsPaged(trace, num_slots=6 * 1024, max_model_len=1024, policy=policy)
        res = view.contiguous
        lays = contiguous_layouts(trace, res, 1024, policy)
        for i, lay in enumerate(lays):
            assert sum(r[2] for r in lay["reservations"]) == res.allocated_slots[i]
            assert sum(r[3] for r in lay["reservations"]) == res.live_tokens[i]
            head = lay["waiting_head"]
            size = reservation_size(next(r for r in trace if r.req_id == head), policy, 1024) if head else None
            ext = sum(n for _, n in lay["free_extents"] if size is not None and n < size)
            assert ext == res.external_waste[i]
    with pytest.raises(ValueError):
        contiguous_layouts(trace, view.paged, 1024)


def test_block_table_view_resolves_positions_to_slots():
    view = BlockTableView(
        {"A": [7, 2, 9], "B": [1, 4], "C": [6]}, block_size=16, num_blocks=12, num_tokens={"A": 48, "B": 32, "C": 16}
    )
    assert [(a["request"], a["logical"], a["physical"]) for a in view.arrows] == [
        ("A", 0, 7),
        ("A", 1, 2),
        ("A", 2, 9),
        ("B", 0, 1),
        ("B", 1, 4),
        ("C", 0, 6),
    ]
    assert view.position.max == 47
    view.position.value = 20
    r = view.resolved
    assert (r["logical_block"], r["block"], r["offset"], r["slot"]) == (1, 2, 4, 2 * 16 + 4)
    assert [a["highlighted"] for a in view.arrows] == [False, True, False, False, False, False]
    assert "slot 2 · 16 + 4 = <b>36</b>" in view.caption.value
    assert len(view.figure.layout.annotations) == 6
    assert view.figure.layout.annotations[1].arrowwidth > view.figure.layout.annotations[0].arrowwidth
    view.request.value = "C"
    assert view.position.max == 15 and view.resolved["block"] == 6
    physical = view.figure.data[1]
    assert len(physical.x) == 12 and physical.marker.color[0] == NULL_COLOR
    assert physical.marker.color[3] == FREE_COLOR and physical.marker.color[6] != FREE_COLOR
    assert check_layout(view.figure) == []
    _squares_readable(view.figure)


def test_block_table_view_from_a_manager_and_the_docstring_table():
    mgr = KVCacheManager(block_size=16, num_blocks=8, enable_caching=False, watermark=0.0)
    req = Request("r", list(range(50)))
    _grow(mgr, req, 50)
    view = BlockTableView.from_manager(mgr, num_tokens={"r": req}, position=49)
    assert view.resolved == dict(request="r", position=49, logical_block=3, offset=1, block=4, slot=4 * 16 + 1)
    small = BlockTableView({"A": BlockTable(4, [19, 18, 5], num_tokens=11)}, block_size=4, position=10)
    assert (small.resolved["block"], small.resolved["offset"], small.resolved["slot"]) == (5, 2, 22)
    with pytest.raises(ValueError):
        BlockTableView({"A": [30]}, block_size=4, num_blocks=8)


def test_memory_growth_figure_keeps_its_legend_off_the_lines():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minipaged.classroom.viz.block_viz import memory_growth_figure
    from minipaged.classroom.viz.layout import check_mpl_layout
    from minipaged.lab.contiguous import memory_vs_generated_tokens

    for prompt_len in (0, 4000):
        fig = memory_growth_figure(
            memory_vs_generated_tokens(max_model_len=8192, block_size=16, prompt_len=prompt_len), block_size=16
        )
        assert check_mpl_layout(fig) == []
        assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
            "contiguous (reserve max_model_len)",
            "paged (16-token blocks)",
            "reserved but empty",
        ]
        plt.close(fig)


def test_waste_breakdown_figure_puts_the_papers_bars_beside_ours():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minipaged.classroom.viz.block_viz import WASTE_CATEGORIES, waste_breakdown_figure
    from minipaged.classroom.viz.layout import check_mpl_layout
    from minipaged.lab.contiguous import PAPER_BASELINE_OF, PAPER_FIG2

    ours = {"max": (20.0, 14.0, 57.0, 9.0), "exact": (50.0, 35.0, 0.0, 15.0), "paged": (97.0, 2.0, 0.0, 1.0)}
    fig = waste_breakdown_figure(ours, PAPER_FIG2, PAPER_BASELINE_OF)
    ax = fig.axes[0]
    assert check_mpl_layout(fig) == []
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "Orca (Max), the paper",
        "max, this course",
        "Orca (Oracle), the paper",
        "exact, this course",
        "vLLM, the paper",
        "paged, this course",
    ]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [*WASTE_CATEGORIES, "not broken down in the paper"]
    fig.canvas.draw()
    assert legend.get_window_extent().y0 >= ax.get_window_extent().y1 - 1  # above the plot, off the bars
    assert "57.3" in [t.get_text() for t in ax.texts] and "96.3" in [t.get_text() for t in ax.texts]
    plt.close(fig)


def test_pool_grid_of_a_hybrid_model_draws_each_group_of_each_request():
    """Chapter 13 §4: one table per request per KV cache group, each its own colour; the window's blocks leave."""
    from minipaged.core.kv_cache_coordinator import KVCacheGroupSpec

    groups = [KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((2, 3), sliding_window=8)]
    mgr = KVCacheManager(4, 40, watermark=0.0, enable_caching=False, kv_cache_groups=groups)
    req = Request("a", list(range(10)))
    grid = BlockPoolGrid(mgr, tokens={"a": req}, columns=10)
    _grow(mgr, req, 10)
    grid.refresh("prompt")
    for _ in range(14):  # decode to 24 tokens: the window's first blocks go back
        _grow(mgr, req, 1)
    s = grid.refresh("decoded")
    full, window = s["block_tables"]["a · full"], s["block_tables"]["a · window 8"]
    assert len(full) == len(window) == 6 and 0 not in full and window[:4] == [0] * 4  # (23 - 7) // 4 = 4 behind
    in_use = {c["block_id"]: c for c in grid.cells if c["status"] == "in use"}
    assert {c["owners"][0] for c in in_use.values()} == {"a · full", "a · window 8"}
    assert set(in_use) == set(full) | set(window[4:])  # the null block is no one's
    assert grid.cells[0]["status"] == "null" and not grid.cells[0]["owners"]
    colors = {c["owners"][0]: c["color"] for c in in_use.values()}
    assert colors["a · full"] != colors["a · window 8"]
    assert "tokens 20–23" in in_use[window[5]]["hover"]  # token positions read from the request
    assert len(grid.history[1]["summary"]["block_tables"]["a · window 8"]) == 3  # after the prompt
