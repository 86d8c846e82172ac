"""Chapter 09: a live engine's own KV pool, redrawn while it serves.

    monitor = EngineMonitor(llm)      # attaches an observer to llm.observers (events.py)
    monitor                           # in a notebook: caption, pool grid, waste per request, timeline
    llm.generate(prompts, params)     # the widget redraws while this runs
    monitor.close()                   # detach (or: with EngineMonitor(llm) as monitor: ...)

It only reads ``StepEvent``s, so it watches a CPU or a CUDA engine alike. Those arrive on the observers' own
thread, one per step: recording one is cheap (a few appends to bounded deques); drawing (plotly, the widget
comms) happens at most every ``min_interval_s``, so a fast engine never outruns the browser, plus once when
the engine falls idle, so the final state always shows, and once ``min_interval_s`` after a burst that ended
without going idle (``llm.step()`` by hand). ipykernel hands comm messages sent from any thread to its IOPub
thread, so the figures move in the browser while the cell that serves is still running.

What is drawn is kept in plain attributes: ``cells`` (one dict per block), ``summary``, ``waste`` (request
id -> unused slots in its last block), ``series`` and ``marks`` (the timeline), ``num_draws``, ``last_event``.
"""

from __future__ import annotations

import html
import math
import threading
import time
from collections import deque
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display
from plotly.subplots import make_subplots

from ...engine.events import StepEvent
from .block_viz import CACHED_FREE_COLOR, FREE_COLOR, NULL_COLOR, SHARED_COLOR, OwnerColors
from .layout import legend_right, text_color
from .live_figure import LiveFigure

MAX_OWNER_TRACES = 24  # requests beyond these share one grid trace (per-point colours)
MAX_WASTE_BARS = 32  # the bar chart shows the requests wasting most, at most this many
MAX_IDS = 24  # request ids listed per queue in the caption
_STATUS_ORDER = ("null", "free", "free, cached", "shared")
_STATUS_COLOR = {"null": NULL_COLOR, "free": FREE_COLOR, "free, cached": CACHED_FREE_COLOR, "shared": SHARED_COLOR}


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


class EngineMonitor:
    """Watch an ``LLM``'s KV pool while it serves (see the module docstring).

    Args:
        llm: the engine (its ``observers``, ``num_blocks`` and ``block_size`` are read).
        columns: squares per row of the pool grid; default from the pool's size (a few thousand blocks fit).
        min_interval_s: the least time between two redraws (0: one redraw per step).
        history: points kept in the timeline (its oldest drop out).
    """

    def __init__(self, llm: Any, columns: int | None = None, min_interval_s: float = 0.3, history: int = 5000):
        if columns is not None and columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        if min_interval_s < 0 or history < 1:
            raise ValueError(f"need min_interval_s >= 0 and history >= 1, got {min_interval_s}, {history}")
        self.llm, self.min_interval_s, self.history = llm, float(min_interval_s), history
        self.num_blocks, self.block_size = int(llm.num_blocks), int(llm.block_size)
        n = self.num_blocks
        self.columns = columns or max(8, min(128, math.ceil(math.sqrt(2 * n))))
        self.cell_px = max(4, min(34, 900 // self.columns))
        self.colors = OwnerColors()
        keys = ("step", "time", "kv_use", "batch", "unused_slots")
        self.series: dict[str, deque] = {k: deque(maxlen=history) for k in keys}
        self.marks: dict[str, deque] = {k: deque(maxlen=history) for k in ("preempted", "prefix_hit")}
        self.totals = dict(events=0, preemptions=0, prefix_hits=0, prefix_queries=0)
        self.last_event: StepEvent | None = None
        self.cells: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.waste: dict[str, int] = {}
        self.num_draws = 0
        self.drawn_step: int | None = None  # the step of the event drawn last
        self.error: str | None = None  # why drawing failed (the observers then detached the monitor)
        self._lock = threading.RLock()  # one draw at a time: the observer thread, a timer, or draw()
        self._last_draw_at = -math.inf
        self._drawn_busy = True  # the last drawn event had requests (so an idle one is news)
        self._timer: threading.Timer | None = None
        self.caption = W.HTML("waiting for the engine's first step …")
        self.grid, self.waste_figure, self.timeline = self._grid_figure(), self._waste_figure(), self._timeline_figure()
        self.closed = False
        llm.observers.attach(self._on_event)

    # -- the figures, empty ------------------------------------------------------------------------
    def _grid_figure(self) -> LiveFigure:
        rows, px = math.ceil(self.num_blocks / self.columns), self.cell_px
        title = dict(text=f"KV pool: {self.num_blocks} blocks of {self.block_size} slots", x=0.0)
        return LiveFigure(layout=dict(
            title=title, width=self.columns * px + 160, height=rows * px + 60, margin=dict(l=10, r=140, t=45, b=5),
            plot_bgcolor="white", hovermode="closest", legend=legend_right(),
            xaxis=dict(visible=False, range=[-0.5, self.columns - 0.5], fixedrange=True),
            yaxis=dict(visible=False, range=[-rows + 0.5, 0.5], fixedrange=True),
        ))  # fmt: skip

    def _waste_figure(self) -> LiveFigure:
        fig = LiveFigure(layout=dict(
            width=380, height=148, margin=dict(l=70, r=15, t=45, b=50), showlegend=False,  # height: as _draw_waste
            xaxis=dict(title="unused slots in its last block", range=[0, self.block_size],
                       dtick=max(1, self.block_size // 4)),
            yaxis=dict(title="request", type="category", autorange="reversed"),
        ))  # fmt: skip
        fig.add_bar(x=[], y=[], orientation="h", name="unused slots", hoverinfo="text")
        return fig

    def _timeline_figure(self) -> LiveFigure:
        fig = LiveFigure(
            make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08, row_heights=[0.6, 0.4])
        )
        for name, row, style in [
            ("KV use", 1, dict(mode="lines", line=dict(color="#4c78a8"))),
            ("preemption", 1, dict(mode="markers", marker=dict(symbol="x", size=10, color="#d62728"))),
            ("prefix-cache hit", 1, dict(mode="markers", marker=dict(symbol="triangle-up", size=10, color="#2ca02c"))),
            ("batch size", 2, dict(mode="lines", line=dict(color="#f58518", shape="hv"))),
        ]:
            fig.add_scatter(x=[], y=[], name=name, row=row, col=1, **style)
        title = dict(text="KV use and batch size, step by step", x=0.0)
        fig.update_layout(
            title=title, width=760, height=290, margin=dict(l=70, r=20, t=40, b=45), legend=legend_right()
        )
        fig.update_yaxes(title_text="KV use (%)", range=[0, 105], row=1, col=1)
        fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
        fig.update_xaxes(title_text="engine clock (s)", row=2, col=1)
        return fig

    # -- the observer (its own thread) -----------------------------------------------------------
    def _on_event(self, event: StepEvent) -> None:
        with self._lock:
            if self.closed:  # an event queued before close()
                return
            self._record(event)
            idle = not event.requests
            if (idle and self._drawn_busy) or time.monotonic() - self._last_draw_at >= self.min_interval_s:
                self._draw_now()
            elif self._timer is None and not self.closed:  # draw the latest once the interval is over
                wait = self._last_draw_at + self.min_interval_s - time.monotonic()
                self._timer = threading.Timer(max(0.0, wait), self._trailing)
                self._timer.daemon = True
                self._timer.start()

    def _trailing(self) -> None:
        with self._lock:
            self._timer = None
            if not self.closed and self.last_event is not None and self.last_event.step != self.drawn_step:
                self._draw_now()

    def _record(self, e: StepEvent) -> None:
        """Bookkeeping of one event, no drawing: O(requests + blocks that changed hands)."""
        for key, value in zip(self.series, (e.step, e.time, 100 * e.usage, e.num_scheduled_requests, e.unused_slots)):
            self.series[key].append(value)
        if e.preempted:
            self.marks["preempted"].append(dict(step=e.step, time=e.time, kv_use=100 * e.usage, ids=e.preempted))
        if e.prefix_hits:
            self.marks["prefix_hit"].append(
                dict(step=e.step, time=e.time, kv_use=100 * e.usage, hits=e.prefix_hits, queries=e.prefix_queries)
            )
        for key, value in zip(self.totals, (1, len(e.preempted), e.prefix_hits, e.prefix_queries)):
            self.totals[key] += value
        self.last_event = e

    # -- drawing ---------------------------------------------------------------------------------
    def draw(self) -> None:
        """Redraw from the latest event now (the observer does it by itself while the engine runs)."""
        with self._lock:
            if self.last_event is not None:
                self._draw_now()

    def _draw_now(self) -> None:
        e = self.last_event
        assert e is not None
        try:
            self._draw(e)
        except Exception as exc:  # the observers detach us and warn; say so on screen too
            self.error = repr(exc)
            self.caption.value = f"<b>monitor stopped</b>: drawing step {e.step} raised {html.escape(repr(exc))}"
            raise
        self.num_draws += 1
        self.drawn_step, self._drawn_busy = e.step, bool(e.requests)
        self._last_draw_at = time.monotonic()

    def _draw(self, e: StepEvent) -> None:
        self.cells = self._cells(e)
        self.waste = {r.request_id: r.unused_slots for r in e.requests if r.block_ids}
        self._draw_grid()
        self._draw_waste(e)
        self._draw_timeline()
        self.summary = self._summary(e)
        self.caption.value = self._caption(e, self.summary)

    def _cells(self, e: StepEvent) -> list[dict[str, Any]]:
        bs = e.block_size
        held: dict[int, list[tuple[str, int, int, bool]]] = {}  # block -> (owner, logical, filled, last)
        for r in e.requests:
            for i, b in enumerate(r.block_ids):
                filled = max(0, min(bs, r.num_computed_tokens - i * bs))
                held.setdefault(b, []).append((r.request_id, i, filled, i == len(r.block_ids) - 1))
        cached = set(e.cached_free_block_ids)
        cells = []
        for b in range(e.num_blocks):
            who = held.get(b, [])
            if b < e.num_null_blocks:
                status, hover = "null", f"block {b}: the null block (padding in block tables, never handed out)"
            elif not who:
                status = "free, cached" if b in cached else "free"
                hover = f"block {b}: free" + (", still holding a cached prefix" if b in cached else "")
            else:
                status = "shared" if len(who) > 1 else "in use"
                hover = f"<b>block {b}</b>" + "".join(
                    f"<br>request {html.escape(rid)}: logical block {i}, "
                    + (f"tokens {i * bs}–{i * bs + f - 1} ({f}/{bs} slots)" if f else "empty")
                    for rid, i, f, _ in who
                )
            owner, _, filled, last = who[0] if who else ("", 0, 0, False)
            color = self.colors(owner) if status == "in use" else _STATUS_COLOR[status]
            label = f"{filled}/{bs}" if last else ""
            cells.append(dict(block_id=b, status=status, owners=[w[0] for w in who], filled=filled,
                              label=label, color=color, hover=hover))  # fmt: skip
        return cells

    def _draw_grid(self) -> None:
        """One trace per status and per owner (requests past the first MAX_OWNER_TRACES: one per colour), each of
        one colour: plotly checks every colour of a per-point list, too slow for thousands of blocks."""
        groups: dict[tuple[str, str], list[dict[str, Any]]] = {(s, _STATUS_COLOR[s]): [] for s in _STATUS_ORDER}
        rank: dict[str, int] = {}  # owners in order of their first block
        for c in self.cells:
            name = c["status"]
            if name == "in use":
                name = c["owners"][0]
                rank.setdefault(name, len(rank))
                name = name if rank[name] < MAX_OWNER_TRACES else "more requests"
            groups.setdefault((name, c["color"]), []).append(c)
        px, labels = self.cell_px, self.cell_px >= 28
        traces = [
            go.Scatter(
                x=[c["block_id"] % self.columns for c in cs],
                y=[-(c["block_id"] // self.columns) for c in cs],
                mode="markers+text" if labels else "markers",
                name=name,
                showlegend=name in _STATUS_ORDER,
                text=[c["label"] for c in cs] if labels else None,
                textfont=dict(size=9, color=text_color(color)),
                marker=dict(symbol="square", size=px - 2, color=color, line=dict(color="#999", width=int(px >= 10))),
                hovertext=[c["hover"] for c in cs],
                hoverinfo="text",
            )
            for (name, color), cs in groups.items()
            if cs
        ]
        with self.grid.batch_update():
            self.grid.data = []
            self.grid.add_traces(traces)

    def _draw_waste(self, e: StepEvent) -> None:
        rows = sorted(self.waste.items(), key=lambda kv: -kv[1])[:MAX_WASTE_BARS]
        rows.sort(key=lambda kv: (len(kv[0]), kv[0]))  # request ids in order
        total, slots = sum(self.waste.values()), e.block_size * e.blocks_in_use
        shown = f" ({len(rows)} of {len(self.waste)} shown)" if len(rows) < len(self.waste) else ""
        share = f"{total / slots:.0%} of the {slots:,} slots in use" if slots else "no block in use"
        hover = [f"request {html.escape(r)}: {w} of its last block's {e.block_size} slots unused" for r, w in rows]
        with self.waste_figure.batch_update():
            self.waste_figure.data[0].update(x=[w for _, w in rows], y=[r for r, _ in rows], hovertext=hover,
                                             marker_color=[self.colors(r) for r, _ in rows])  # fmt: skip
            self.waste_figure.update_layout(
                height=100 + 16 * max(3, len(rows)), yaxis_showticklabels=bool(rows),
                title=dict(text=f"internal waste: {_n(total, 'slot')}{shown}<br><sup>{share}</sup>", x=0),
            )  # fmt: skip

    def _draw_timeline(self) -> None:
        s, pre, hit = self.series, self.marks["preempted"], self.marks["prefix_hit"]
        with self.timeline.batch_update():
            use, pmark, hmark, batch = self.timeline.data
            use.x, use.y, use.hovertext = list(s["time"]), list(s["kv_use"]), [f"step {n}" for n in s["step"]]
            batch.x, batch.y = list(s["time"]), list(s["batch"])
            pmark.x, pmark.y = [m["time"] for m in pre], [m["kv_use"] for m in pre]
            pmark.hovertext = [f"step {m['step']}: preempted {', '.join(m['ids'])}" for m in pre]
            hmark.x, hmark.y = [m["time"] for m in hit], [m["kv_use"] for m in hit]
            hmark.hovertext = [f"step {m['step']}: {m['hits']} of {m['queries']} prompt tokens cached" for m in hit]

    def _summary(self, e: StepEvent) -> dict[str, Any]:
        t = self.totals
        return dict(
            step=e.step, device=e.device, running=e.in_state("running"), waiting=e.in_state("waiting"),
            swapped=e.in_state("swapped"), blocks_in_use=e.blocks_in_use, free=e.num_free_blocks,
            cached_free=e.num_cached_free_blocks, null=e.num_null_blocks,
            usable=e.num_blocks - e.num_null_blocks, usage=e.usage, batch=e.num_scheduled_requests,
            tokens=e.num_scheduled_tokens, preempted=list(e.preempted), finished=list(e.finished),
            preemptions=t["preemptions"], prefix_hits=t["prefix_hits"], prefix_queries=t["prefix_queries"],
            hit_rate=t["prefix_hits"] / t["prefix_queries"] if t["prefix_queries"] else None,
            unused_slots=e.unused_slots,
        )  # fmt: skip

    def _ids(self, ids: list[str], chips: bool = False) -> str:
        def one(rid: str) -> str:
            if not chips:
                return html.escape(rid)
            bg = self.colors(rid)
            return f'<span style="background:{bg};color:{text_color(bg)};padding:0 3px">{html.escape(rid)}</span>'

        more = f" … (+{len(ids) - MAX_IDS})" if len(ids) > MAX_IDS else ""
        return (" ".join(one(r) for r in ids[:MAX_IDS]) + more) if ids else "—"

    def _caption(self, e: StepEvent, s: dict[str, Any]) -> str:
        rate = "no prompt looked up yet"
        if s["hit_rate"] is not None:
            rate = f"{s['prefix_hits']:,} of {s['prefix_queries']:,} prompt tokens hit ({s['hit_rate']:.0%})"
        state = "<b>idle</b>: no request in the engine"
        if e.requests:
            state = " · ".join(f"{q} ({len(s[q])}): {self._ids(s[q], chips=q == 'running')}"
                               for q in ("running", "waiting", "swapped"))  # fmt: skip
        lines = [
            f"<b>step {e.step}</b> on <b>{html.escape(e.device)}</b> · {e.step_s * 1e3:.0f} ms · engine clock "
            f"{e.time:.2f} s",
            state,
            f"pool: <b>{s['blocks_in_use']}</b> of {s['usable']} usable blocks in use (KV use {s['usage']:.0%}) · "
            f"{s['free']} free, {s['cached_free']} of them still cached · {s['null']} null",
            f"this step: a batch of {_n(s['batch'], 'request')}, {_n(s['tokens'], 'token')} · preempted: "
            f"{self._ids(s['preempted'])} · finished: {self._ids(s['finished'])}",
            f"so far: <b>{_n(s['preemptions'], 'preemption')}</b> · prefix cache: {rate} · internal waste now: "
            f"{_n(s['unused_slots'], 'slot')}",
        ]
        return "<br>".join(lines)

    # -- life cycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching: detach from the engine's observers (an event being delivered may still draw)."""
        with self._lock:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self.llm.observers.detach(self._on_event)

    def __enter__(self) -> EngineMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def widget(self) -> W.Widget:
        figures = W.HBox([self.grid, self.waste_figure], layout=W.Layout(flex_flow="row wrap"))
        return W.VBox([self.caption, figures, self.timeline])

    def _ipython_display_(self) -> None:
        display(self.widget)


__all__ = ["EngineMonitor"]
