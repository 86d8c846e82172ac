"""Chapters 06-08 widgets and figures: a continuous-batching player, static vs continuous timelines, shared
prefix blocks, and the whole-run figures (batch and latency, the watermark sweep, swap against recompute).

Every number shown comes from the real ``Scheduler`` / ``KVCacheManager`` (through
``minipaged.lab.simulator``) and is kept in plain attributes (``state``, ``history``,
``segments``, ``markers``, ``rows``, ``summary``), so tests drive the widgets from
Python and check what a learner sees::

    BatchingPlayer()                  "7 requests compete for a 48-block pool" (the vLLM Deep Dive site's
                                      continuous-batching simulator), step by step:
                                      waiting queue, running batch, pool grid; step / play / reset
    BatchingTimeline(requests, ...)   one bar per request, static above continuous: waiting, running,
                                      padded (static), preempted; preemptions marked ✕
    PrefixSharingView.system_prompt() requests sharing a system prompt: their block tables side by side,
                                      shared blocks highlighted with their ref counts
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request, RequestStatus
from ...core.scheduler import Scheduler, SchedulerOutput
from ...lab.simulator import CostModel, SimConfig, SimRequest, simulate_continuous, simulate_static
from .block_viz import CACHED_FREE_COLOR, FREE_COLOR, SHARED_COLOR, UNUSED_COLOR, OwnerColors
from .layout import aligned_ticks, label_style, legend_above, legend_right, padded, text_color
from .live_figure import LiveFigure

# One second per step: the player and small timelines count steps, not seconds.
STEP_CLOCK = CostModel(
    weight_bytes=1.0,
    kv_bytes_per_token=0.0,
    flops_per_token=0.0,
    mem_bandwidth=1.0,
    flops=1.0,
    swap_bandwidth=1.0,
    name="one time unit per step",
)

# The scene of the "vLLM Deep Dive" site's continuous-batching simulator: 7 requests, a 48-block pool. The site
# gives no lengths; these are ours: they ask for 81 blocks in all, so the queue waits, finishes free room at
# once, and the pool runs dry twice.
SEVEN_REQUESTS: tuple[tuple[str, int, int], ...] = (  # (id, prompt tokens, output tokens), all arriving at once
    ("A", 24, 24),
    ("B", 20, 40),
    ("C", 32, 8),
    ("D", 16, 32),
    ("E", 12, 20),
    ("F", 28, 16),
    ("G", 16, 36),
)
SEVEN_CONFIG = SimConfig(
    block_size=4,
    num_gpu_blocks_override=49,
    max_num_seqs=8,
    max_num_batched_tokens=32,
    max_model_len=128,
    watermark=0.0,
)
# The timeline's default: the same pool, requests up to 64 tokens long.
TIMELINE_CONFIG = SimConfig(
    block_size=4, num_gpu_blocks_override=49, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, watermark=0.0
)

# A padded row is held but empty: the same pink as chapter 02's reserved-but-empty slots.
SEGMENT_COLORS = {"waiting": "#d9d9d9", "running": "#4c78a8", "padding": UNUSED_COLOR, "preempted": "#f58518"}
# What the legend calls each kind of bar, and the preemption marker (each name once).
SEGMENT_NAMES = {
    "waiting": "waiting",
    "running": "running",
    "padding": "padding (done, row still held)",
    "preempted": "preempted (back in the queue)",
}
PREEMPT_MARKER_NAME = "✕ preemption"


def _pool_ticks(left_max: float, usable: int) -> dict[str, tuple[float, float]]:
    """Round ticks for (requests, blocks of a ``usable``-block pool) on one grid: the block axis ends at the
    pool's size when a round step divides it (48 -> 0, 12, 24, 36, 48), the request axis has as many steps."""
    for n in (4, 6, 3, 8, 5, 2):
        step = usable / n
        if step == int(step) and (step < 10 or step % 2 == 0 or step % 5 == 0):
            left = max(1, -(-int(left_max) // n))
            return dict(left=(left * n, float(left)), right=(float(usable), step))
    return aligned_ticks(left_max, usable, left_integer=True, right_integer=True)


# ---- (a) the continuous-batching player ------------------------------------------------------
class BatchingPlayer:
    """Replays the real scheduler step by step: waiting queue, running batch and the pool's blocks.

    The whole run is computed up front (``history``: one snapshot before the first
    step, then one after each step), so ``step()``, ``reset()``, the slider and the
    play button only move ``index``; ``state`` is the snapshot shown. A snapshot::

        {"step": k, "waiting": [{"id", "status", "tokens", "computed"}, ...],
         "running": [{"id", "prompt", "outputs", "max_tokens", "computed", "blocks", "new_tokens"}, ...],
         "finished": [ids], "not_arrived": [ids], "cells": [{"block_id", "owner", "ref_cnt", "status"}],
         "free": n, "used": n, "usage": f, "scheduled": {id: tokens}, "tokens": n,
         "admitted": [ids], "preempted": [ids], "finished_now": [ids], "log": "..."}
    """

    def __init__(
        self,
        requests: Sequence[SimRequest] | None = None,
        config: SimConfig = SEVEN_CONFIG,
        columns: int = 12,
        title: str = "7 requests compete for a 48-block pool",
    ) -> None:
        if requests is None:
            requests = [SimRequest(rid, 0.0, p, o) for rid, p, o in SEVEN_REQUESTS]
        self.requests, self.config, self.columns, self.title = list(requests), config, columns, title
        self.colors = OwnerColors()
        for r in self.requests:
            self.colors(r.req_id)
        self.history: list[dict[str, Any]] = []
        self._finished: list[Request] = []
        self.result = simulate_continuous(self.requests, STEP_CLOCK, config, on_step=self._record)
        if self.history:  # the scene before the first step: everything that arrived at t=0 waits
            first = self.history[0]
            start = dict(
                first,
                step=0,
                running=[],
                finished=[],
                scheduled={},
                tokens=0,
                admitted=[],
                preempted=[],
                finished_now=[],
                free=config.num_blocks - 1,
                used=0,
                usage=0.0,
                cells=[
                    dict(c, owner=None, ref_cnt=0, status="free") if c["status"] != "null" else c
                    for c in first["cells"]
                ],
            )
            arrived = [r for r in self.requests if r.arrival <= 0]
            start["waiting"] = [dict(id=r.req_id, status="waiting", tokens=r.prompt_len, computed=0) for r in arrived]
            start["not_arrived"] = [r.req_id for r in self.requests if r.arrival > 0]
            start["log"] = f"step 0: {len(arrived)} requests waiting, the pool is empty"
            self.history.insert(0, start)
        self.index = 0
        self.state: dict[str, Any] = self.history[0]
        # controls
        n = len(self.history) - 1
        self.slider = W.IntSlider(
            value=0, min=0, max=n, description="step", style=label_style("step"), layout=W.Layout(width="480px")
        )
        self.play = W.Play(value=0, min=0, max=n, interval=500, description="play")
        W.jslink((self.play, "value"), (self.slider, "value"))
        self.step_button = W.Button(description="step ▶", layout=W.Layout(width="80px"))
        self.reset_button = W.Button(description="reset ⟲", layout=W.Layout(width="80px"))
        self.step_button.on_click(lambda _b: self.step())
        self.reset_button.on_click(lambda _b: self.reset())
        self.header = W.HTML()
        self.queues = W.HTML()
        self.grid = W.HTML()
        s = self.result.steps
        xs = list(range(1, len(s["time"]) + 1))
        usable = config.num_blocks - 1
        # Two y axes on one grid: requests on the left, blocks on the right, both in round steps. The title
        # takes the top row, the legend the row under it, above the plot: nothing covers a peak.
        ticks = _pool_ticks(max([*s["num_running"].tolist(), *s["num_waiting"].tolist(), 1]), usable)
        self.figure = LiveFigure(
            layout=dict(
                height=300,
                margin=dict(l=60, r=70, t=90, b=45),
                title=dict(text="running, waiting and blocks in use", y=0.97, yanchor="top"),
                xaxis=dict(title="step"),
                legend=legend_above(),
                yaxis=dict(title="requests", range=padded(ticks["left"][0]), tickmode="linear", dtick=ticks["left"][1]),
                yaxis2=dict(
                    title=f"blocks in use (of {usable})",
                    overlaying="y",
                    side="right",
                    range=padded(ticks["right"][0]),
                    tickmode="linear",
                    dtick=ticks["right"][1],
                ),
            )
        )
        self.figure.add_scatter(x=xs, y=s["num_running"].tolist(), name="running", mode="lines", line_shape="hv")
        self.figure.add_scatter(x=xs, y=s["num_waiting"].tolist(), name="waiting", mode="lines", line_shape="hv")
        self.figure.add_scatter(
            x=xs, y=s["blocks_in_use"].tolist(), name="blocks in use", mode="lines", line_shape="hv", yaxis="y2"
        )
        self.slider.observe(lambda ch: self._go(ch["new"]), names="value")
        self._draw()

    # -- recording ---------------------------------------------------------------------------
    def _record(self, sched: Scheduler, out: SchedulerOutput, now: float, finished: list[Request]) -> None:
        kv = sched.kv_cache_manager
        self._finished += finished
        owners: dict[int, list[str]] = {}
        for rid, blocks in kv.req_to_blocks.items():
            for b in blocks:
                owners.setdefault(b.block_id, []).append(rid)
        cells = []
        for block in kv.block_pool.blocks:
            who = owners.get(block.block_id, [])
            if block.is_null:
                status = "null"
            elif block.ref_cnt == 0:
                status = "free, cached" if block.block_hash is not None else "free"
            else:
                status = "shared" if block.ref_cnt > 1 else "in use"
            cells.append(
                dict(
                    block_id=block.block_id,
                    owner=who[0] if len(who) == 1 else None,
                    owners=who,
                    ref_cnt=block.ref_cnt,
                    status=status,
                )
            )
        scheduled = {s.request_id: s.num_new_tokens for s in out.scheduled}
        prev_running = {r["id"] for r in self.history[-1]["running"]} if self.history else set()
        admitted = [rid for rid in scheduled if rid not in prev_running]
        finished_now = [r.request_id for r in finished if r.finish_reason != "rejected"]
        running = [
            dict(
                id=r.request_id,
                prompt=r.num_prompt_tokens,
                outputs=r.num_output_tokens,
                max_tokens=r.sampling_params.max_tokens,
                computed=r.num_computed_tokens,
                blocks=kv.get_block_ids(r.request_id),
                new_tokens=scheduled.get(r.request_id, 0),
            )
            for r in sched.running
        ]
        waiting = [
            dict(id=r.request_id, status=r.status.value, tokens=r.num_tokens, computed=r.num_computed_tokens)
            for r in (*sched.swapped, *sched.waiting)
        ]
        arrived = set(sched.requests) | {r.request_id for r in self._finished}
        usable = kv.num_blocks - 1
        free = kv.get_num_free_blocks()
        k = len(self.history) + 1  # the scene before step 1 is added once the run is over
        parts = [f"{rid} +{n}" for rid, n in scheduled.items()]
        log = f"step {k}: ran " + ", ".join(parts) + f" ({sum(scheduled.values())} tokens)"
        if out.preempted:
            log += " · preempted " + ", ".join(out.preempted) + " (pool dry)"
        if finished_now:
            log += " · finished " + ", ".join(finished_now) + " (blocks freed)"
        if admitted:
            log += " · admitted " + ", ".join(admitted)
        self.history.append(
            dict(
                step=k,
                time=now,
                waiting=waiting,
                running=running,
                finished=[r.request_id for r in self._finished if r.finish_reason != "rejected"],
                not_arrived=[r.req_id for r in self.requests if r.req_id not in arrived],
                cells=cells,
                free=free,
                used=usable - free,
                usage=(usable - free) / usable,
                scheduled=scheduled,
                tokens=sum(scheduled.values()),
                admitted=admitted,
                preempted=list(out.preempted),
                finished_now=finished_now,
                log=log,
            )
        )

    # -- controls ----------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One scheduler step forward (stays on the last one at the end)."""
        self.slider.value = min(self.index + 1, len(self.history) - 1)
        return self.state

    def reset(self) -> dict[str, Any]:
        self.play.playing = False
        self.slider.value = 0
        return self.state

    def _go(self, index: int) -> None:
        self.index = index
        self.state = self.history[index]
        self._draw()

    @property
    def num_steps(self) -> int:
        return len(self.history) - 1

    # -- drawing -----------------------------------------------------------------------------
    def _chip(self, rid: str, text: str, outline: bool = False) -> str:
        # Filled (running): black or white text, whichever reads on the colour. Outlined (waiting): the
        # colour marks the border only, the text stays dark on the page.
        color = self.colors(rid)
        style = (
            f"border:2px solid {color};color:#222"
            if outline
            else f"border:2px solid {color};background:{color};color:{text_color(color)}"
        )
        return (
            f"<span style='display:inline-block;margin:2px;padding:2px 6px;border-radius:4px;{style}'>"
            f"{html.escape(text)}</span>"
        )

    def _draw(self) -> None:
        st = self.state
        self.header.value = (
            f"<b>{html.escape(self.title)}</b> — step {st['step']} of {self.num_steps} · "
            f"{st['used']} of {len(st['cells']) - 1} blocks in use ({st['usage']:.0%}) · "
            f"{st['tokens']} tokens this step<br><i>{html.escape(st['log'])}</i>"
        )
        waiting = (
            "".join(
                self._chip(
                    w["id"],
                    f"{w['id']} {w['tokens']} tok" + (" (preempted)" if w["status"] == "preempted" else ""),
                    outline=True,
                )
                for w in st["waiting"]
            )
            or "—"
        )
        running = (
            "".join(
                self._chip(
                    r["id"],
                    f"{r['id']} {r['outputs']}/{r['max_tokens']} out · "
                    f"{len(r['blocks'])} blk" + (f" · +{r['new_tokens']}" if r["new_tokens"] else ""),
                )
                for r in st["running"]
            )
            or "—"
        )
        later = ", ".join(st["not_arrived"])
        self.queues.value = (
            f"<div><b>waiting</b> (FCFS): {waiting}</div><div><b>running</b>: {running}</div>"
            f"<div><b>finished</b>: {', '.join(st['finished']) or '—'}"
            + (f" · <b>not arrived yet</b>: {later}" if later else "")
            + "</div>"
        )
        cells = []
        for c in st["cells"][1:]:  # the null block is not part of the 48
            if c["status"] in ("in use", "shared") and c["owner"]:
                color, text = self.colors(c["owner"]), c["owner"]
            elif c["status"] == "shared":
                color, text = SHARED_COLOR, f"×{c['ref_cnt']}"
            else:
                color, text = CACHED_FREE_COLOR if c["status"] == "free, cached" else FREE_COLOR, ""
            fg = text_color(color)
            cells.append(
                f"<div title='block {c['block_id']}: {c['status']}' style='width:34px;height:26px;"
                f"background:{color};color:{fg};display:flex;align-items:center;justify-content:center;"
                f"font-size:11px;border:1px solid #999'>{html.escape(text)}<sub>{c['block_id']}</sub></div>"
            )
        self.grid.value = (
            f"<div style='display:grid;grid-template-columns:repeat({self.columns},36px);gap:2px'>"
            + "".join(cells)
            + "</div>"
        )
        with self.figure.batch_update():
            self.figure.layout.shapes = [
                dict(
                    type="line",
                    x0=st["step"],
                    x1=st["step"],
                    y0=0,
                    y1=1,
                    yref="paper",
                    line=dict(dash="dot", color="gray"),
                )
            ]

    @property
    def widget(self) -> W.Widget:
        return W.VBox(
            [
                W.HBox([self.play, self.step_button, self.reset_button, self.slider]),
                self.header,
                self.queues,
                self.grid,
                self.figure,
            ]
        )

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (b) a request timeline, static vs continuous ----------------------------------------------
def request_segments(result) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Bars and markers for one ``SimResult``: (segments, markers).

    Continuous: waiting (arrival → admitted), running (admitted → preempted or
    finished), preempted (preempted → resumed). Static: waiting (arrival → its
    batch starts), running (→ its last token), padding (→ its batch ends: its row
    and its memory are still held). A marker per preemption.
    """
    segs: list[dict[str, Any]] = []
    marks: list[dict[str, Any]] = []
    policy = result.policy

    def add(rid: str, kind: str, start: float, end: float) -> None:
        if end > start:
            segs.append(dict(policy=policy, req_id=rid, kind=kind, start=start, end=end))

    if policy == "static":
        for m in result.requests:
            if m.rejected:
                continue
            add(m.req_id, "waiting", m.arrival, m.start)
            add(m.req_id, "running", m.start, m.finish)
            add(m.req_id, "padding", m.finish, m.release)
        return segs, marks
    last: dict[str, tuple[str, float]] = {m.req_id: ("waiting", m.arrival) for m in result.requests}
    for t, kind, rid in result.events:
        state, since = last[rid]
        if kind in ("admit", "resume"):
            add(rid, state, since, t)
            last[rid] = ("running", t)
        elif kind == "preempt":
            add(rid, "running", since, t)
            marks.append(dict(policy=policy, req_id=rid, time=t, kind="preempt"))
            last[rid] = ("preempted", t)
        elif kind == "finish":
            add(rid, "running", since, t)
            last[rid] = ("done", t)
    return segs, marks


class BatchingTimeline:
    """One row per request, static batching above continuous batching, on the same time axis.

    Controls: the static batch size and the pool size (blocks); both runs are
    recomputed on change. ``segments`` and ``markers`` hold what is drawn,
    ``summary`` the two runs' ``summary()``, ``errors`` why a policy could not run
    (a pool too small for one static reservation, or for any request).
    """

    def __init__(
        self,
        requests: Sequence[SimRequest],
        cost: CostModel = STEP_CLOCK,
        config: SimConfig = TIMELINE_CONFIG,
        batch_size: int = 4,
        time_label: str = "step",
        time_scale: float = 1.0,
    ) -> None:
        self.requests, self.cost, self.config = list(requests), cost, config
        self.time_label, self.time_scale = time_label, time_scale
        style = label_style("static batch B", "pool blocks")
        self.batch_size = W.IntSlider(
            value=batch_size,
            min=1,
            max=max(len(self.requests), batch_size),
            description="static batch B",
            style=style,
            continuous_update=False,
        )
        self.num_blocks = W.IntSlider(
            value=config.num_blocks - 1,
            min=8,
            max=max(4 * (config.num_blocks - 1), 64),
            description="pool blocks",
            style=style,
            continuous_update=False,
        )
        self.caption = W.HTML()
        self.figure = LiveFigure(
            make_subplots(
                rows=2,
                cols=1,
                shared_xaxes=True,
                vertical_spacing=0.08,
                subplot_titles=("static batching", "continuous batching"),
            )
        )
        # The legend goes to the right: above are the subplot titles, below the time axis and its title.
        self.figure.update_layout(
            height=120 + 36 * len(self.requests),
            barmode="overlay",
            margin=dict(l=60, r=10, t=40, b=45),
            legend=legend_right(),
        )
        self.figure.update_yaxes(title_text="request")
        self.segments: list[dict[str, Any]] = []
        self.markers: list[dict[str, Any]] = []
        self.summary: dict[str, dict[str, float]] = {}
        self.info: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.batch_size.observe(lambda _c: self.update(), names="value")
        self.num_blocks.observe(lambda _c: self.update(), names="value")
        self.update()

    def update(self) -> None:
        from dataclasses import replace

        cfg = replace(self.config, num_gpu_blocks_override=self.num_blocks.value + 1)
        self.segments, self.markers, self.summary, self.errors = [], [], {}, {}
        self.info = dict(static_batch=0, static_cap=cfg.static_batch_cap())
        for policy in ("static", "continuous"):
            try:
                if policy == "static":
                    res = simulate_static(self.requests, self.cost, cfg, batch_size=self.batch_size.value, padded=False)
                    self.info["static_batch"] = res.info["batch_size"]
                else:
                    res = simulate_continuous(self.requests, self.cost, cfg)
                self.summary[policy] = res.summary()
            except ValueError as exc:  # a pool too small for this policy: say so instead of drawing
                self.errors[policy] = str(exc)
                continue
            segs, marks = request_segments(res)
            self.segments += segs
            self.markers += marks
        self._draw()

    def _draw(self) -> None:
        k = self.time_scale
        order = [r.req_id for r in self.requests][::-1]
        shown: set[str] = set()
        with self.figure.batch_update():
            self.figure.data = []
            for row, policy in ((1, "static"), (2, "continuous")):
                for kind, color in SEGMENT_COLORS.items():
                    segs = [s for s in self.segments if s["policy"] == policy and s["kind"] == kind]
                    if not segs:
                        continue
                    self.figure.add_bar(
                        y=[s["req_id"] for s in segs],
                        x=[(s["end"] - s["start"]) * k for s in segs],
                        base=[s["start"] * k for s in segs],
                        orientation="h",
                        marker_color=color,
                        name=SEGMENT_NAMES[kind],
                        legendgroup=kind,
                        showlegend=kind not in shown,
                        row=row,
                        col=1,
                        hovertext=[
                            f"{s['req_id']} {kind}: {s['start'] * k:.3g} → {s['end'] * k:.3g} {self.time_label}"
                            for s in segs
                        ],
                        hoverinfo="text",
                    )
                    shown.add(kind)
                marks = [m for m in self.markers if m["policy"] == policy]
                if marks:
                    self.figure.add_scatter(
                        x=[m["time"] * k for m in marks],
                        y=[m["req_id"] for m in marks],
                        mode="markers",
                        marker=dict(symbol="x", size=10, color="#c00"),
                        name=PREEMPT_MARKER_NAME,
                        legendgroup="preempt",
                        showlegend="preempt" not in shown,
                        row=row,
                        col=1,
                    )
                    shown.add("preempt")
                self.figure.update_yaxes(categoryorder="array", categoryarray=order, row=row, col=1)
            self.figure.update_xaxes(title_text=self.time_label, row=2, col=1)
        parts = []
        st, co = self.summary.get("static"), self.summary.get("continuous")
        if st is not None:
            parts.append(
                f"static: batch {self.info['static_batch']} (memory allows {self.info['static_cap']} "
                f"reservations of max_model_len={self.config.max_model_len}), done at "
                f"{st['makespan_s'] * k:.4g} {self.time_label}, mean latency {st['latency_mean_s'] * k:.4g}"
            )
        if co is not None:
            parts.append(
                f"continuous: done at {co['makespan_s'] * k:.4g} {self.time_label}, mean latency "
                f"{co['latency_mean_s'] * k:.4g}, {co['preemptions']} preemption(s)"
                + (f", {co['rejected']} rejected" if co["rejected"] else "")
            )
        parts += [f"<span style='color:#c00'>{p}: {html.escape(e)}</span>" for p, e in self.errors.items()]
        self.caption.value = " · ".join(parts)

    @property
    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.batch_size, self.num_blocks]), self.caption, self.figure])

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (c) shared prefix blocks and their ref counts -----------------------------------------------
class PrefixSharingView:
    """Block tables of requests side by side; a block used by several requests is highlighted with its ref count.

    Like ``BlockPoolGrid``, it reads a live ``KVCacheManager`` when ``refresh(label)``
    is called and keeps every snapshot in ``history`` (a slider steps back).
    ``rows`` maps a request id to its cells ``{"block_id", "ref_cnt", "shared", "hashed"}``;
    ``summary`` counts block-table entries, distinct blocks, and what sharing saved.
    """

    def __init__(self, manager: KVCacheManager, title: str = "block tables", label: str = "start") -> None:
        self.kv_cache_manager = manager
        self.title = title
        self.history: list[dict[str, Any]] = []
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.summary: dict[str, Any] = {}
        self.label = ""
        self.slider = W.IntSlider(
            value=0, min=0, max=0, description="snapshot", style=label_style("snapshot"), layout=W.Layout(width="480px")
        )
        self.html = W.HTML()
        self.slider.observe(lambda ch: self._show(ch["new"]), names="value")
        self.refresh(label)

    def _snapshot(self, label: str) -> dict[str, Any]:
        rows = {}
        for rid, blocks in self.kv_cache_manager.req_to_blocks.items():
            rows[rid] = [
                dict(block_id=b.block_id, ref_cnt=b.ref_cnt, shared=b.ref_cnt > 1, hashed=b.block_hash is not None)
                for b in blocks
            ]
        entries = sum(len(r) for r in rows.values())
        distinct = len({c["block_id"] for r in rows.values() for c in r})
        pool = self.kv_cache_manager.block_pool
        cached_free = sum(1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None)
        summary = dict(
            requests=len(rows),
            table_entries=entries,
            distinct_blocks=distinct,
            shared_blocks=len({c["block_id"] for r in rows.values() for c in r if c["shared"]}),
            saved_blocks=entries - distinct,
            saved_fraction=(entries - distinct) / entries if entries else 0.0,
            free=pool.get_num_free_blocks(),
            cached_free=cached_free,
        )
        return dict(label=label, rows=rows, summary=summary)

    def refresh(self, label: str = "") -> dict[str, Any]:
        self.history.append(self._snapshot(label or f"snapshot {len(self.history)}"))
        last = len(self.history) - 1
        self.slider.max = last
        if self.slider.value == last:
            self._show(last)
        else:
            self.slider.value = last
        return self.summary

    def _show(self, index: int) -> None:
        snap = self.history[index]
        self.rows, self.summary, self.label = snap["rows"], snap["summary"], snap["label"]
        s = self.summary
        lines = [
            f"<b>{html.escape(self.title)}: {html.escape(self.label)}</b><br>"
            f"{s['requests']} requests, {s['table_entries']} block-table entries in {s['distinct_blocks']} "
            f"physical blocks: sharing saves {s['saved_blocks']} ({s['saved_fraction']:.0%}); "
            f"{s['free']} blocks free, {s['cached_free']} of them still cached"
        ]
        lines.append("<table style='border-collapse:separate;border-spacing:2px'>")
        for rid, cells in self.rows.items():
            tds = []
            for c in cells:
                if c["shared"]:
                    style = f"background:{SHARED_COLOR};color:{text_color(SHARED_COLOR)};font-weight:bold"
                    text = f"{c['block_id']}<sup>×{c['ref_cnt']}</sup>"
                else:
                    style = (
                        f"background:#4c78a8;color:{text_color('#4c78a8')}"
                        if c["hashed"]
                        else "border:1px dashed #4c78a8"
                    )
                    text = str(c["block_id"])
                tds.append(f"<td style='padding:2px 5px;font-size:11px;{style}'>{text}</td>")
            lines.append(f"<tr><td style='padding-right:8px'><b>{html.escape(rid)}</b></td>{''.join(tds)}</tr>")
        lines.append(
            "</table><small>brown: shared block (×ref count) · blue: full block, hashed (cached) · "
            "dashed: partial block, not hashed yet</small>"
        )
        self.html.value = "".join(lines)

    @classmethod
    def system_prompt(
        cls,
        num_requests: int = 4,
        prefix_len: int = 40,
        suffix_len: int = 12,
        block_size: int = 8,
        num_blocks: int = 64,
    ) -> PrefixSharingView:
        """Requests sharing a system prompt arrive one by one and finish; a late one still hits the
        cached-but-free blocks; another tenant (a different ``cache_salt``) shares nothing."""
        kv = KVCacheManager(block_size, num_blocks, enable_caching=True, watermark=0.0)
        system = list(range(1000, 1000 + prefix_len))
        view = cls(
            kv,
            title=f"{num_requests} requests with a {prefix_len}-token system prompt, block size {block_size}",
            label="an empty pool",
        )

        def admit(rid: str, salt: str | None = None) -> Request:
            own = 2000 + 100 * len(view.history)  # each request's question differs from every other
            req = Request(rid, system + [own + i for i in range(suffix_len)], cache_salt=salt)
            hits, n_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - n_hit, n_hit, hits) is None:
                raise RuntimeError("the pool is too small for this demo")
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
            view.refresh(f"{rid} arrives: {n_hit} prompt tokens ({len(hits)} blocks) found in the cache")
            return req

        reqs = [admit(f"r{i}") for i in range(num_requests)]
        for r in reqs:
            kv.free(r)
            view.refresh(
                f"{r.request_id} finishes: the shared blocks lose a reference; its full blocks stay "
                f"cached in the free queue"
            )
        admit("late")
        admit("tenant-2", salt="tenant-2")
        return view

    @property
    def widget(self) -> W.Widget:
        return W.VBox([self.slider, self.html])

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (d) figures of whole runs ------------------------------------------------------------------
POLICY_COLORS = {"static": "#e45756", "continuous": "#4c78a8", "recompute": "#e45756", "swap": "#4c78a8"}


def batch_and_latency_figure(runs: dict[str, Any], policies: Sequence[str] = ("static", "continuous")) -> go.Figure:
    """Chapter 06: the live batch over time (left) and the latency CDF (right) of a few ``SimResult``s.

    ``runs`` maps a policy name to its ``SimResult``. One legend entry per policy (its colour in both
    panels), to the right of the plots: the subplot titles are above.
    """
    import numpy as np

    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("live requests in the batch", "latency CDF"), horizontal_spacing=0.12
    )
    for name in policies:
        res, color = runs[name], POLICY_COLORS.get(name, "#54a24b")
        fig.add_scatter(
            x=res.steps["time"],
            y=res.steps["num_running"],
            mode="lines",
            line_shape="hv",
            name=name,
            legendgroup=name,
            line_color=color,
            row=1,
            col=1,
        )
        lat = np.sort([m.latency for m in res.finished])
        fig.add_scatter(
            x=lat,
            y=np.arange(1, len(lat) + 1) / len(lat),
            mode="lines",
            name=name,
            legendgroup=name,
            showlegend=False,
            line_color=color,
            row=1,
            col=2,
            hovertemplate=f"{name}: %{{y:.0%}} done within %{{x:.3g}} s<extra></extra>",
        )
    fig.update_xaxes(title_text="time (s)", row=1, col=1)
    fig.update_yaxes(title_text="requests running", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="latency (s)", row=1, col=2)
    fig.update_yaxes(title_text="requests finished", tickformat=".0%", range=[0, 1.02], dtick=0.25, row=1, col=2)
    fig.update_layout(height=360, margin=dict(l=60, r=10, t=50, b=50), legend=legend_right())
    return fig


def watermark_sweep_figure(
    sweep: dict[tuple[str, float], dict[str, float]], modes: Sequence[str] = ("recompute", "swap")
) -> go.Figure:
    """Chapter 07: preemptions (left axis, solid) and p99 latency (right axis, dotted) against the watermark.

    ``sweep`` maps ``(mode, watermark)`` to a ``SimResult.summary()``. The two y axes share one grid of
    round ticks (``aligned_ticks``); the legend is a row above the plot, clear of the right axis' title.
    """
    wms = sorted({wm for (mode, wm) in sweep if mode in modes})
    pre = [sweep[m, w]["preemptions"] for m in modes for w in wms]
    p99 = [sweep[m, w]["latency_p99_s"] for m in modes for w in wms]
    ticks = aligned_ticks(max(pre, default=0), max(p99, default=0), left_integer=True)
    fig = go.Figure()
    for mode in modes:
        color = POLICY_COLORS.get(mode, "#54a24b")
        fig.add_scatter(
            x=wms,
            y=[sweep[mode, w]["preemptions"] for w in wms],
            name=f"{mode}: preemptions",
            mode="lines+markers",
            line_color=color,
        )
        fig.add_scatter(
            x=wms,
            y=[sweep[mode, w]["latency_p99_s"] for w in wms],
            name=f"{mode}: p99 latency",
            mode="lines+markers",
            line_color=color,
            line_dash="dot",
            yaxis="y2",
        )
    fig.update_layout(
        height=360,
        margin=dict(l=70, r=70, t=60, b=50),
        legend=legend_above(),
        xaxis=dict(title="watermark (fraction of the pool)", tickformat=".0%"),
        yaxis=dict(title="preemptions", range=padded(ticks["left"][0]), tickmode="linear", dtick=ticks["left"][1]),
        yaxis2=dict(
            title="p99 latency (s)",
            overlaying="y",
            side="right",
            range=padded(ticks["right"][0]),
            tickmode="linear",
            dtick=ticks["right"][1],
        ),
    )
    return fig


MODEL_COLORS = ("#4c78a8", "#e45756", "#54a24b", "#b279a2")


def swap_block_size_figure(rows_by_model: dict[str, list[dict[str, float]]], num_tokens: int) -> go.Figure:
    """Chapter 07: bringing a preempted request back, swap (solid) against recompute (dotted), by block size.

    ``rows_by_model`` maps a model's name to ``simulator.swap_vs_recompute`` rows. Both axes are
    logarithmic: block sizes double, and the swap cost falls by orders of magnitude before it flattens
    where the bytes, not the copies, dominate. The legend sits to the right of the plot.
    """
    fig = go.Figure()
    for (name, rows), color in zip(rows_by_model.items(), MODEL_COLORS):
        x = [r["block_size"] for r in rows]
        fig.add_scatter(
            x=x,
            y=[r["swap_s"] * 1e3 for r in rows],
            name=f"{name}: swap out + in",
            mode="lines+markers",
            line_color=color,
            hovertemplate="block size %{x}: %{y:.1f} ms<extra></extra>",
        )
        fig.add_scatter(
            x=x,
            y=[r["recompute_s"] * 1e3 for r in rows],
            name=f"{name}: recompute",
            mode="lines",
            line_color=color,
            line_dash="dot",
            hovertemplate="block size %{x}: %{y:.1f} ms<extra></extra>",
        )
    sizes = sorted({r["block_size"] for rows in rows_by_model.values() for r in rows})
    fig.update_layout(
        height=380,
        margin=dict(l=70, r=10, t=50, b=50),
        legend=legend_right(),
        title=dict(text=f"bringing back a preempted request of {num_tokens:,} tokens", x=0.0, xanchor="left"),
        xaxis=dict(
            title="block size (tokens)", type="log", tickmode="array", tickvals=sizes, ticktext=[str(v) for v in sizes]
        ),
        yaxis=dict(title="time (ms)", type="log"),
    )
    return fig


__all__ = [
    "SEVEN_CONFIG",
    "SEVEN_REQUESTS",
    "STEP_CLOCK",
    "BatchingPlayer",
    "BatchingTimeline",
    "PrefixSharingView",
    "batch_and_latency_figure",
    "request_segments",
    "swap_block_size_figure",
    "watermark_sweep_figure",
]
