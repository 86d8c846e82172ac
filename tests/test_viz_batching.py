"""Chapters 06-08 widgets, driven from Python as a learner would drive them."""

import itertools
import re

import pytest

from minipaged.classroom.viz import BatchingPlayer, BatchingTimeline, PrefixSharingView
from minipaged.classroom.viz.batching_viz import (
    PREEMPT_MARKER_NAME,
    SEGMENT_NAMES,
    SEVEN_CONFIG,
    SEVEN_REQUESTS,
    STEP_CLOCK,
    batch_and_latency_figure,
    request_segments,
    swap_block_size_figure,
    watermark_sweep_figure,
)
from minipaged.classroom.viz.layout import check_layout, contrast_ratio
from minipaged.lab.simulator import (
    CostModel,
    SimConfig,
    SimRequest,
    simulate_continuous,
    simulate_static,
    swap_vs_recompute,
)


def _readable(html_text, page="white"):
    """Every coloured box in the widget's HTML: its text contrasts >= 4.5:1 with its background (or the page)."""
    styles = re.findall(r"style='([^']*)'", html_text)
    seen = 0
    for st in styles:
        fg = re.search(r"(?:^|;)color:([^;]+)", st)
        bg = re.search(r"background:([^;]+)", st)
        if fg:
            seen += 1
            ratio = contrast_ratio(fg.group(1), bg.group(1) if bg else page)
            assert ratio >= 4.5, f"{fg.group(1)} on {bg.group(1) if bg else page}: {ratio:.2f}:1 in <{st}>"
    return seen


def test_player_starts_with_seven_waiting_and_an_empty_pool():
    p = BatchingPlayer()
    st = p.state
    assert st["step"] == 0 and [w["id"] for w in st["waiting"]] == list("ABCDEFG")
    assert st["running"] == [] and st["used"] == 0 and st["free"] == 48
    assert len(st["cells"]) == 49 and st["cells"][0]["status"] == "null"
    assert p.grid.value.count("<div title='block") == 48  # the 48 usable blocks, null block hidden
    assert "step 0 of" in p.header.value and "7 requests compete for a 48-block pool" in p.header.value
    assert sum(p + o for _, p, o in SEVEN_REQUESTS) > 48 * SEVEN_CONFIG.block_size  # they really compete


def test_player_steps_through_the_real_schedule():
    p = BatchingPlayer()
    st = p.step()
    assert st["step"] == 1 and p.slider.value == 1
    # the token budget (32) admits A's whole prompt and a chunk of B's; the rest wait in arrival order
    assert st["scheduled"] == {"A": 24, "B": 8} and st["tokens"] == 32 <= SEVEN_CONFIG.max_num_batched_tokens
    assert [w["id"] for w in st["waiting"]] == list("CDEFG") and st["admitted"] == ["A", "B"]
    assert st["used"] == 6 + 2  # A: 24 tokens = 6 blocks of 4; B: 8 tokens = 2 blocks
    owners = [c["owner"] for c in st["cells"] if c["status"] == "in use"]
    assert owners.count("A") == 6 and owners.count("B") == 2
    assert "A +24" in p.header.value and ">A 1/24 out · 6 blk · +24<" in p.queues.value
    # every snapshot agrees with the pool and the budget
    for s in p.history[1:]:
        assert s["tokens"] <= SEVEN_CONFIG.max_num_batched_tokens
        assert s["used"] == sum(c["status"] != "free" for c in s["cells"][1:]) <= 48
        assert s["used"] == len({b for r in s["running"] for b in r["blocks"]})
    # the pool runs dry: the newest request is preempted, waits at the head of the queue, comes back
    k = next(i for i, s in enumerate(p.history) if s["preempted"])
    pre = p.history[k]
    head = pre["waiting"][0]
    assert pre["preempted"] == ["G"] and (head["id"], head["status"], head["computed"]) == ("G", "preempted", 0)
    assert head["tokens"] > 16  # its prompt and the tokens it had generated: all recomputed on return
    assert "preempted G (pool dry)" in pre["log"] and "G" not in {r["id"] for r in pre["running"]}
    back = next(s for s in p.history[k:] if "G" in s["admitted"])
    assert back["scheduled"]["G"] == head["tokens"] and "G" in {r["id"] for r in back["running"]}
    # finished requests free their blocks in the same step and a waiting one takes them
    fin = next(s for s in p.history if s["finished_now"] and p.history[s["step"] + 1]["admitted"])
    assert p.history[fin["step"] + 1]["admitted"] == ["G"]
    # at the end everything finished and the pool is empty
    end = p.history[-1]
    assert sorted(end["finished"]) == list("ABCDEFG") and end["used"] == 0 and end["running"] == []
    assert p.num_steps == p.result.summary()["steps"]


def test_player_buttons_and_reset():
    p = BatchingPlayer()
    p.step_button.click()
    p.step_button.click()
    assert p.state["step"] == 2 and p.index == 2
    p.slider.value = p.num_steps
    p.step()  # stays on the last step
    assert p.state["step"] == p.num_steps
    p.reset_button.click()
    assert p.state["step"] == 0 and p.slider.value == 0 and not p.play.playing
    assert p.play.max == p.slider.max == p.num_steps
    assert [t.name for t in p.figure.data] == ["running", "waiting", "blocks in use"]
    assert max(p.figure.data[2].y) == 48


def test_player_reads_well():
    p = BatchingPlayer()
    assert check_layout(p.figure) == []
    lay = p.figure.layout
    # the legend is a row above the plot, under the title; both y axes have titles and one grid of round ticks
    assert lay.legend.y >= 1 and lay.legend.yanchor == "bottom" and lay.margin.t >= 80
    assert lay.yaxis.title.text == "requests" and lay.yaxis2.title.text == "blocks in use (of 48)"
    assert lay.yaxis2.dtick == 12 and 48 <= lay.yaxis2.range[1] < 60  # 0, 12, 24, 36, 48
    assert lay.yaxis.range[1] / lay.yaxis.dtick == lay.yaxis2.range[1] / lay.yaxis2.dtick  # one grid
    assert lay.yaxis.range[1] > max(p.figure.data[0].y) and lay.yaxis2.range[1] > 48  # peaks stay in view
    # text on every request colour (G was white on light pink, 2:1) and on every block reads
    for k in range(0, p.num_steps + 1, 5):
        p.slider.value = k
        assert _readable(p.grid.value) and _readable(p.queues.value)
    p.slider.value = next(
        s["step"]
        for s in p.history
        if any(w["id"] == "G" for w in s["waiting"])
        and any(r["id"] == "G" for r in p.history[s["step"] - 1]["running"])
    )
    assert "(preempted)" in p.queues.value and _readable(p.queues.value)


def test_timeline_static_vs_continuous():
    reqs = [SimRequest(rid, 0.0, pr, o) for rid, pr, o in SEVEN_REQUESTS]
    cfg = SimConfig(
        block_size=4,
        num_gpu_blocks_override=49,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        watermark=0.0,
    )
    t = BatchingTimeline(reqs, config=cfg, batch_size=4)
    assert t.info == dict(static_batch=3, static_cap=3)  # 192 slots / 64 per reservation
    static = [s for s in t.segments if s["policy"] == "static"]
    cont = [s for s in t.segments if s["policy"] == "continuous"]
    # static: the shortest member of the first batch holds its row until the longest one is done
    c_pad = next(s for s in static if s["req_id"] == "C" and s["kind"] == "padding")
    b_run = next(s for s in static if s["req_id"] == "B" and s["kind"] == "running")
    assert c_pad["end"] == b_run["end"]
    d_wait = next(s for s in static if s["req_id"] == "D" and s["kind"] == "waiting")
    assert d_wait["end"] == b_run["end"]  # D waits for the whole first batch
    # continuous: preemptions are marked, and the preempted stretch is drawn
    assert t.markers and all(m["policy"] == "continuous" for m in t.markers)
    assert any(s["kind"] == "preempted" for s in cont)
    assert t.summary["continuous"]["makespan_s"] < t.summary["static"]["makespan_s"]
    assert {d.name for d in t.figure.data} >= {
        SEGMENT_NAMES[k] for k in ("waiting", "running", "padding", "preempted")
    } | {PREEMPT_MARKER_NAME}
    assert check_layout(t.figure) == []  # legend to the right, distinct names, every axis titled
    # each request's bars tile its life from arrival to its last token
    for rid, *_ in SEVEN_REQUESTS:
        mine = sorted((s for s in cont if s["req_id"] == rid), key=lambda s: s["start"])
        assert mine[0]["start"] == 0.0
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(mine))
    # the sliders recompute both runs
    t.batch_size.value = 1
    assert t.info["static_batch"] == 1 and "static: batch 1" in t.caption.value
    assert check_layout(t.figure) == []
    t.num_blocks.value = 192
    assert t.summary["continuous"]["preemptions"] == 0 and not t.markers
    assert t.info["static_cap"] == 12
    assert check_layout(t.figure) == []
    # a pool smaller than one 64-token reservation: static batching cannot run, continuous still can
    t.num_blocks.value = 15
    assert "static" in t.errors and "cannot reserve" in t.caption.value and "static" not in t.summary
    assert t.summary["continuous"]["requests"] == 7 and t.summary["continuous"]["preemptions"] > 0
    assert not [s for s in t.segments if s["policy"] == "static"]
    assert check_layout(t.figure) == []
    names = [d.name for d in t.figure.data if d.showlegend is not False]
    assert len(names) == len(set(names))  # "preempted" only once


def test_timeline_in_chapter_07_reads_well():
    seven = [SimRequest(rid, 0.0, p, o) for rid, p, o in SEVEN_REQUESTS]
    t = BatchingTimeline(
        seven,
        config=SimConfig(
            block_size=4,
            num_gpu_blocks_override=41,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            max_model_len=64,
            watermark=0.0,
        ),
        batch_size=3,
    )
    assert t.markers and check_layout(t.figure) == []
    assert t.figure.layout.legend.x >= 1 and t.figure.layout.legend.xanchor == "left"


def test_batch_and_latency_figure():
    reqs = [SimRequest(rid, 0.0, pr, o) for rid, pr, o in SEVEN_REQUESTS]
    runs = {
        "static": simulate_static(reqs, STEP_CLOCK, SEVEN_CONFIG, batch_size=3),
        "continuous": simulate_continuous(reqs, STEP_CLOCK, SEVEN_CONFIG),
    }
    fig = batch_and_latency_figure(runs)
    assert check_layout(fig) == []
    assert [d.name for d in fig.data if d.showlegend is not False] == ["static", "continuous"]
    assert fig.layout.yaxis.title.text and fig.layout.yaxis2.title.text
    assert fig.data[1].y[-1] == 1.0 and len(fig.data[1].x) == 7


def test_watermark_sweep_figure():
    sweep = {
        ("recompute", 0.0): dict(preemptions=41, latency_p99_s=12.7),
        ("recompute", 0.05): dict(preemptions=3, latency_p99_s=9.81),
        ("swap", 0.0): dict(preemptions=37, latency_p99_s=11.2),
        ("swap", 0.05): dict(preemptions=2, latency_p99_s=9.5),
    }
    fig = watermark_sweep_figure(sweep)
    assert check_layout(fig) == []
    lay = fig.layout
    assert lay.legend.y >= 1 and lay.legend.yanchor == "bottom"  # above: the right axis is on the right
    assert lay.yaxis2.title.text == "p99 latency (s)" and lay.yaxis.title.text == "preemptions"
    left, right = lay.yaxis.range[1] / lay.yaxis.dtick, lay.yaxis2.range[1] / lay.yaxis2.dtick
    assert left == pytest.approx(right) and lay.yaxis.range[1] > 41 and lay.yaxis2.range[1] > 12.7
    assert [d.name for d in fig.data] == [
        "recompute: preemptions",
        "recompute: p99 latency",
        "swap: preemptions",
        "swap: p99 latency",
    ]


def test_request_segments_follow_the_events():
    reqs = [SimRequest(rid, 0.0, pr, o) for rid, pr, o in SEVEN_REQUESTS]
    res = simulate_continuous(reqs, STEP_CLOCK, SEVEN_CONFIG)
    segs, marks = request_segments(res)
    g = [s for s in segs if s["req_id"] == "G"]
    assert [s["kind"] for s in g][:4] == ["waiting", "running", "preempted", "running"]
    assert len(marks) == res.summary()["preemptions"] == 2
    assert sum(s["end"] - s["start"] for s in g if s["kind"] == "running") <= res.summary()["makespan_s"]


def test_prefix_view_shows_shared_blocks_and_ref_counts():
    v = PrefixSharingView.system_prompt(num_requests=4, prefix_len=40, suffix_len=12, block_size=8)
    labels = [h["label"] for h in v.history]
    four = v.history[labels.index(next(x for x in labels if x.startswith("r3 arrives")))]
    rows = four["rows"]
    assert set(rows) == {"r0", "r1", "r2", "r3"}
    for cells in rows.values():  # 52 tokens: 5 shared prompt blocks, 1 own full block, 1 partial
        assert [c["shared"] for c in cells] == [True] * 5 + [False, False]
        assert [c["ref_cnt"] for c in cells[:5]] == [4] * 5
        assert cells[5]["hashed"] and not cells[6]["hashed"]
    assert len({tuple(c["block_id"] for c in cells[:5]) for cells in rows.values()}) == 1
    s = four["summary"]
    assert (s["table_entries"], s["distinct_blocks"], s["saved_blocks"]) == (28, 13, 15)
    # the slider shows what a learner sees
    v.slider.value = labels.index(four["label"])
    assert "<sup>×4</sup>" in v.html.value and v.summary == s
    assert _readable(v.html.value)
    # everyone finished: the prompt blocks wait, cached, in the free queue
    done = v.history[labels.index(next(x for x in labels if x.startswith("r3 finishes")))]
    assert done["summary"]["cached_free"] == 5 + 4 and done["rows"] == {}
    assert v.history[-2]["label"].startswith("late arrives: 40 prompt tokens (5 blocks)")
    assert v.history[-1]["label"].startswith("tenant-2 arrives: 0 prompt tokens")
    last = v.history[-1]["rows"]
    assert not set(c["block_id"] for c in last["late"]) & set(c["block_id"] for c in last["tenant-2"])


def test_swap_block_size_figure():
    rows = {
        "Llama-3-8B": swap_vs_recompute(CostModel.for_model("llama-3-8b", "a100"), 1024),
        "Llama-2-7B": swap_vs_recompute(CostModel.for_model("llama-2-7b", "a100"), 1024),
    }
    fig = swap_block_size_figure(rows, 1024)
    assert check_layout(fig) == []
    assert fig.layout.legend.x >= 1 and fig.layout.legend.xanchor == "left"
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert [d.name for d in fig.data] == [
        "Llama-3-8B: swap out + in",
        "Llama-3-8B: recompute",
        "Llama-2-7B: swap out + in",
        "Llama-2-7B: recompute",
    ]
    swap, recompute = fig.data[0].y, fig.data[1].y
    assert list(swap) == sorted(swap, reverse=True) and len(set(recompute)) == 1
    assert swap[0] > recompute[0] > swap[-1]  # recompute wins at block size 1, swap at 256
