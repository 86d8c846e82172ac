"""Chapters 02-04 widgets: the block pool as a grid, contiguous vs paged on one trace, a block table as arrows.

Every number a widget shows comes from the package (``block_pool``,
``kv_cache_manager``, ``contiguous``, ``block_table``) and is kept in plain
attributes (``cells``, ``summary``, ``state``, ``arrows``, ``resolved``), so the
tests can drive the controls from Python and check what a learner would see::

    BlockPoolGrid(manager)            one square per physical block, coloured by owner;
                                      hover: request, tokens, ref count, hash
    ContiguousVsPaged(trace, slots)   the same trace on a contiguous arena and a paged
                                      pool, step by step, with utilisation over time
    BlockTableView(tables, 16)        logical blocks -> physical blocks as arrows;
                                      pick a position and follow resolve() to its slot
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import ipywidgets as W
import numpy as np
from IPython.display import display

from ...core.block_pool import BlockPool, KVCacheBlock
from ...core.kv_cache_manager import KVCacheManager
from ...lab.contiguous import TraceResult, contiguous_layouts, reservation_size, simulate_trace
from ...lab.workloads import Trace
from ...utils import cdiv
from ...worker.block_table import BlockTable
from .kv_widgets import BLOCK_COLORS
from .layout import label_style, legend_right, text_color
from .live_figure import LiveFigure

FREE_COLOR = "#e6e6e6"
CACHED_FREE_COLOR = "#b9dcb4"  # free, but still holding a cached prefix block
NULL_COLOR = "#303030"
SHARED_COLOR = "#8c564b"
UNUSED_COLOR = "#f4a3b4"  # pink: reserved (or allocated) but holding no token (yet, or ever)
HOLE_COLOR = "#d62728"  # red: free, but in a hole too small for the request waiting: external fragmentation
# Owners: chapter 01's block colours, then four more; every pair and every status colour above stays apart
# (CIELAB ΔE >= 30), so two requests never look alike. Text on them is black or white (``text_color``).
OWNER_COLORS = BLOCK_COLORS + ["#d6278f", "#6a3d9a", "#7f7f00", "#fdd0a2"]
STATUS_COLORS = {"free": FREE_COLOR, "free, cached": CACHED_FREE_COLOR, "null": NULL_COLOR, "shared": SHARED_COLOR}


class OwnerColors:
    """A stable colour per request id, in order of first appearance."""

    def __init__(self) -> None:
        self._colors: dict[str, str] = {}

    def __call__(self, owner: str) -> str:
        if owner not in self._colors:
            self._colors[owner] = OWNER_COLORS[len(self._colors) % len(OWNER_COLORS)]
        return self._colors[owner]


def _token_count(value: Any) -> int:
    """Tokens held by a request: an int, or a ``Request`` (its ``num_computed_tokens``)."""
    return int(value) if isinstance(value, (int, np.integer)) else int(value.num_computed_tokens)


# ---- (a) the block pool as a grid ------------------------------------------------------------
class BlockPoolGrid:
    """The physical blocks of a live ``BlockPool`` (or ``KVCacheManager``) as a grid of squares.

    A square is coloured by the request owning the block (brown when several
    requests share it), light green for a free block that still holds a cached
    prefix, grey for a free one, black for the null block. Hovering shows the
    request(s), the token positions the block holds, ``ref_cnt``, the hash and the
    block's place in the free queue.

    The widget does not watch the pool: change the pool, then call
    ``refresh("what happened")``. Each refresh is kept in ``history`` and the
    slider steps back through them, so a notebook can replay a whole trace.

    Args:
        source: a ``KVCacheManager`` (owners and block size are read from it) or a ``BlockPool``.
        owners: for a bare ``BlockPool``: request id -> its blocks in logical order (read at each refresh).
        tokens: request id -> tokens written (an int, or a ``Request``: its ``num_computed_tokens``).
        block_size: for a bare ``BlockPool``, to show token positions.
        columns: squares per row.
    """

    def __init__(
        self,
        source: BlockPool | KVCacheManager,
        owners: Mapping[str, Sequence[KVCacheBlock]] | None = None,
        tokens: Mapping[str, Any] | None = None,
        block_size: int | None = None,
        columns: int = 16,
        title: str = "block pool",
        label: str = "start",
    ) -> None:
        self.manager = source if isinstance(source, KVCacheManager) and owners is None else None
        if isinstance(source, KVCacheManager):
            self.pool = source.block_pool
            self._owners = source.req_to_blocks if owners is None else owners
            self.block_size: int | None = source.block_size if block_size is None else block_size
        elif isinstance(source, BlockPool):
            self.pool, self._owners, self.block_size = source, owners if owners is not None else {}, block_size
        else:
            raise TypeError(f"BlockPoolGrid needs a BlockPool or a KVCacheManager, got {type(source).__name__}")
        if columns < 1:
            raise ValueError(f"columns must be >= 1, got {columns}")
        self._tokens = tokens if tokens is not None else {}
        self.columns = columns
        self.colors = OwnerColors()
        self.history: list[dict[str, Any]] = []
        self.cells: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self.label = ""
        rows = cdiv(self.pool.num_blocks, columns)
        self.figure = LiveFigure(
            layout=dict(
                title=title,
                height=90 + 42 * rows,
                width=max(320, 46 * columns + 160),
                margin=dict(l=10, r=10, t=40, b=10),
                plot_bgcolor="white",
                hovermode="closest",
                xaxis=dict(visible=False, range=[-0.6, columns - 0.4]),
                yaxis=dict(visible=False, range=[-rows + 0.4, 0.6]),
                legend=legend_right(),
            )
        )
        self.step = W.IntSlider(
            value=0,
            min=0,
            max=0,
            description="snapshot",
            continuous_update=True,
            style=label_style("snapshot"),
            layout=W.Layout(width="520px"),
        )
        self.caption = W.HTML()
        self.step.observe(lambda _change: self._show(self.step.value), names="value")
        self.refresh(label)

    # -- reading the pool --------------------------------------------------------------------
    def _snapshot(self, label: str) -> dict[str, Any]:
        pool, bs = self.pool, self.block_size
        owned: dict[int, list[tuple[str, int]]] = {}
        tables, request_of = self._tables()
        for rid, blocks in tables.items():
            for logical, block in enumerate(blocks):
                if not block.is_null:  # a sliding window's place-holder for the blocks behind it
                    owned.setdefault(block.block_id, []).append((rid, logical))
        free_order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        queue_pos = {bid: i for i, bid in enumerate(free_order)}
        cells = []
        for block in pool.blocks:
            who = owned.get(block.block_id, [])
            h = block.block_hash.hex()[:8] if block.block_hash is not None else None
            if block.is_null:
                status, color = "null", NULL_COLOR
            elif block.ref_cnt == 0:
                status = "free, cached" if h else "free"
                color = CACHED_FREE_COLOR if h else FREE_COLOR
            elif len(who) > 1 or block.ref_cnt > 1:
                status, color = "shared", SHARED_COLOR
            else:
                status = "in use"
                color = self.colors(who[0][0]) if who else SHARED_COLOR
            token_text = []
            for rid, logical in who:
                if bs is None:
                    token_text.append(f"{rid}: logical block {logical}")
                    continue
                first = logical * bs
                req = request_of.get(rid, rid)
                n = _token_count(self._tokens[req]) if req in self._tokens else None
                filled = bs if n is None else max(0, min(bs, n - first))
                rng = (
                    "none yet"
                    if not filled
                    else f"token {first}"
                    if filled == 1
                    else f"tokens {first}–{first + filled - 1}"
                )
                token_text.append(f"{rid}: logical block {logical}, {rng} ({filled}/{bs} slots)")
            cell = dict(
                block_id=block.block_id,
                status=status,
                owners=[rid for rid, _ in who],
                logical=[lg for _, lg in who],
                ref_cnt=block.ref_cnt,
                hash=h,
                free_queue_position=queue_pos.get(block.block_id),
                tokens=token_text,
                color=color,
            )
            cell["hover"] = self._hover(cell)
            cells.append(cell)
        usable = pool.num_blocks - 1
        summary = dict(
            num_blocks=pool.num_blocks,
            usable=usable,
            free=pool.get_num_free_blocks(),
            in_use=usable - pool.get_num_free_blocks(),
            usage=pool.get_usage(),
            cached_free=sum(c["status"] == "free, cached" for c in cells),
            free_queue=free_order,
            block_tables={rid: [b.block_id for b in blocks] for rid, blocks in tables.items()},
        )
        return dict(label=label, cells=cells, summary=summary)

    def _tables(self) -> tuple[dict[str, Sequence[KVCacheBlock]], dict[str, str]]:
        """Every block table to draw, and the request each belongs to. A manager with several KV cache groups
        (a hybrid model) has one table per request per group, named ``"a · full"``, ``"a · window 6"``: each its
        own colour, so the window's blocks are seen going back while the full group's stay."""
        if self.manager is None or len(self.manager.managers) == 1:
            return dict(self._owners), {}
        kinds = [g.sliding_window for g in self.manager.kv_cache_groups]
        tables: dict[str, Sequence[KVCacheBlock]] = {}
        request_of: dict[str, str] = {}
        for manager, rid, blocks in self.manager.held_blocks():
            w = kinds[manager.group_id]
            kind = "full" if w is None else f"window {w}"
            name = f"{rid} · {kind}" if kinds.count(w) == 1 else f"{rid} · {kind} (group {manager.group_id})"
            tables[name], request_of[name] = blocks, rid
        return tables, request_of

    @staticmethod
    def _hover(c: dict[str, Any]) -> str:
        if c["status"] == "null":
            return f"block {c['block_id']}: the null block<br>never handed out, freed or cached"
        lines = [f"<b>block {c['block_id']}</b> · {c['status']}"]
        lines += c["tokens"] or ["no request"]
        lines.append(f"ref_cnt {c['ref_cnt']}")
        lines.append(f"hash {c['hash'] or '—'}")
        pos = c["free_queue_position"]
        lines.append("free queue: " + ("not in it" if pos is None else f"position {pos} (0 = handed out next)"))
        return "<br>".join(html.escape(x) if not x.startswith("<b>") else x for x in lines)

    def refresh(self, label: str = "") -> dict[str, Any]:
        """Read the pool now, keep the snapshot in ``history`` and show it."""
        self.history.append(self._snapshot(label or f"snapshot {len(self.history)}"))
        last = len(self.history) - 1
        self.step.max = last
        if self.step.value == last:
            self._show(last)
        else:
            self.step.value = last  # the observer draws it
        return self.summary

    # -- drawing -----------------------------------------------------------------------------
    def _show(self, index: int) -> None:
        snap = self.history[index]
        self.cells, self.summary, self.label = snap["cells"], snap["summary"], snap["label"]
        groups: dict[str, list[dict[str, Any]]] = {}
        for c in self.cells:
            key = c["owners"][0] if c["status"] == "in use" and c["owners"] else c["status"]
            groups.setdefault(key, []).append(c)
        with self.figure.batch_update():
            self.figure.data = []
            for name, cs in groups.items():
                self.figure.add_scatter(
                    x=[c["block_id"] % self.columns for c in cs],
                    y=[-(c["block_id"] // self.columns) for c in cs],
                    mode="markers+text",
                    name=name,
                    text=[str(c["block_id"]) for c in cs],
                    textfont=dict(color=[text_color(c["color"]) for c in cs], size=11),
                    marker=dict(
                        symbol="square", size=36, color=[c["color"] for c in cs], line=dict(color="#999", width=1)
                    ),
                    hovertext=[c["hover"] for c in cs],
                    hoverinfo="text",
                )
        s = self.summary
        tables = " · ".join(f"<b>{html.escape(r)}</b> → {ids}" for r, ids in s["block_tables"].items()) or "none"
        self.caption.value = (
            f"<b>{html.escape(self.label)}</b> — {s['in_use']} of {s['usable']} usable blocks in "
            f"use ({s['usage']:.0%}), {s['free']} free ({s['cached_free']} still cached)<br>"
            f"block tables: {tables}<br>free queue (front → back): {s['free_queue']}"
        )

    @property
    def widget(self) -> W.Widget:
        return W.VBox([self.step, self.caption, self.figure])

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (b) contiguous vs paged on the same trace -----------------------------------------------
class ContiguousVsPaged:
    """One trace on a contiguous arena and on a paged pool of the same size, side by side.

    The slider picks a step. The top figure shows the memory at that step: the
    contiguous arena as it really is (each reservation where first fit put it:
    live tokens dark; reserved-but-empty light, hatched where it lies past the
    request's final length and will never hold a token; holes too small for the
    waiting request red) and the paged pool by category (which physical blocks a
    request holds does not matter: any block fits anywhere). The bottom figure is
    the utilisation of both over time. ``state`` holds the numbers of the current step:
    ``internal`` (reserved but empty) is ``reservation`` (slots for tokens still to
    come) plus ``internal_fragmentation`` (slots past the request's end), the PagedAttention
    paper's split (section 3.1).
    """

    def __init__(
        self,
        trace: Trace,
        num_slots: int,
        max_model_len: int = 2048,
        policy: str = "max",
        block_size: int = 16,
        step: int = 0,
    ) -> None:
        self.trace, self.num_slots, self.max_model_len = trace, num_slots, max_model_len
        self.block_size = block_size
        style = label_style("reserve", "step")
        self.policy = W.Dropdown(
            options=["max", "pow2", "exact"],
            value=policy,
            description="reserve",
            style=style,
            layout=W.Layout(width="200px"),
        )
        self.step = W.IntSlider(
            value=0,
            min=0,
            max=0,
            description="step",
            continuous_update=False,
            style=style,
            layout=W.Layout(width="620px"),
        )
        self.play = W.Play(value=0, min=0, max=0, interval=150)
        W.jslink((self.play, "value"), (self.step, "value"))
        self.caption = W.HTML()
        # Both figures keep their legend in the right margin, so their plots line up and nothing covers a bar
        # or a curve; plotly widens the margin to fit it.
        self.memory = LiveFigure(
            layout=dict(
                height=230,
                barmode="overlay",
                margin=dict(l=130, r=20, t=40, b=50),
                showlegend=True,
                xaxis=dict(title="token slots (position in the arena)", range=[0, num_slots]),
                yaxis=dict(title="allocator", automargin=True),
                legend=legend_right(),
            )
        )
        self.timeline = LiveFigure(
            layout=dict(
                height=260,
                margin=dict(l=130, r=20, t=30, b=50),
                xaxis_title="step",
                yaxis=dict(title="utilisation (live / slots)", tickformat=".0%", range=[0, 1.02], dtick=0.25),
                legend=legend_right(),
            )
        )
        self.state: dict[str, Any] = {}
        self.layout: dict[str, Any] = {}
        self.policy.observe(lambda _change: self._simulate(), names="value")
        self.step.observe(lambda _change: self.update(), names="value")
        self._simulate(step)

    def _simulate(self, step: int | None = None) -> None:
        policy = self.policy.value
        self.contiguous = simulate_trace(self.trace, self.num_slots, "contiguous", self.max_model_len, policy)
        self.paged = simulate_trace(self.trace, self.num_slots, "paged", self.max_model_len, block_size=self.block_size)
        self.layouts = contiguous_layouts(self.trace, self.contiguous, self.max_model_len, policy)
        last = int(max(self.contiguous.step[-1], self.paged.step[-1]))
        with self.timeline.batch_update():
            self.timeline.data = []
            for name, res, color in (
                ("contiguous", self.contiguous, BLOCK_COLORS[1]),
                ("paged", self.paged, BLOCK_COLORS[0]),
            ):
                self.timeline.add_scatter(
                    x=res.step, y=res.utilisation, name=name, mode="lines", line=dict(color=color)
                )
        self.step.max = self.play.max = last
        target = self.step.value if step is None else step
        target = min(max(target, 0), last)
        if self.step.value == target:
            self.update()
        else:
            self.step.value = target

    @staticmethod
    def _row(res: TraceResult, t: int) -> int | None:
        i = int(np.searchsorted(res.step, t))
        return i if i < len(res.step) and res.step[i] == t else None

    def _numbers(self, res: TraceResult, t: int) -> dict[str, Any]:
        i = self._row(res, t)
        done = int(res.step[-1]) < t
        if i is None:
            return dict(
                active=False,
                finished=done,
                live=0,
                internal=0,
                reservation=0,
                internal_fragmentation=0,
                external=0,
                free=self.num_slots,
                utilisation=0.0,
                running=0,
                waiting=0,
                refusals_so_far=int(res.refused[res.step <= t].sum()),
            )
        return dict(
            active=True,
            finished=False,
            live=int(res.live_tokens[i]),
            internal=int(res.internal_waste[i]),
            reservation=int(res.reservation[i]),
            internal_fragmentation=int(res.internal_fragmentation[i]),
            external=int(res.external_waste[i]),
            free=int(res.free_slots[i]),
            utilisation=float(res.utilisation[i]),
            running=int(res.num_running[i]),
            waiting=int(res.num_waiting[i]),
            refusals_so_far=int(res.refused[: i + 1].sum()),
        )

    def update(self) -> None:
        t = self.step.value
        self.state = dict(
            step=t,
            policy=self.policy.value,
            contiguous=self._numbers(self.contiguous, t),
            paged=self._numbers(self.paged, t),
        )
        i = self._row(self.contiguous, t)
        self.layout = (
            self.layouts[i]
            if i is not None
            else dict(step=t, reservations=[], free_extents=[(0, self.num_slots)], waiting_head=None)
        )
        self._draw()

    def _draw(self) -> None:
        t, lay, st = self.step.value, self.layout, self.state
        c_name, p_name = f"contiguous ({self.policy.value})", f"paged (block {self.block_size})"
        head = lay["waiting_head"]
        head_size = (
            reservation_size(next(r for r in self.trace if r.req_id == head), self.policy.value, self.max_model_len)
            if head
            else None
        )
        never = "reserved, never used"
        bars: dict[str, dict[str, list]] = {
            k: dict(x=[], base=[], y=[], text=[])
            for k in ("live", "reserved, empty", never, "free hole (too small)", "free")
        }
        final = {r.req_id: r.total_len for r in self.trace}

        def add(kind: str, start: int, length: int, row: str, text: str) -> None:
            if length > 0:
                b = bars[kind]
                b["x"].append(length)
                b["base"].append(start)
                b["y"].append(row)
                b["text"].append(text)

        for rid, start, length, live in lay["reservations"]:
            end = min(length, final[rid])  # the request will fill its reservation up to here
            add("live", start, live, c_name, f"{rid}: {live} tokens")
            add(
                "reserved, empty",
                start + live,
                end - live,
                c_name,
                f"{rid}: {end - live} slots reserved for tokens still to come",
            )
            add(
                never,
                start + end,
                length - end,
                c_name,
                f"{rid}: {length - end} slots past its final length ({final[rid]}): never used",
            )
        for start, length in lay["free_extents"]:
            small = head_size is not None and length < head_size
            add(
                "free hole (too small)" if small else "free",
                start,
                length,
                c_name,
                f"hole of {length} slots" + (f" < {head} needs {head_size}" if small else ""),
            )
        p = st["paged"]
        add("live", 0, p["live"], p_name, f"{p['live']} live tokens in {p['running']} requests")
        add(
            "reserved, empty",
            p["live"],
            p["reservation"],
            p_name,
            f"{p['reservation']} empty slots in last blocks, for tokens still to come",
        )
        add(
            never,
            p["live"] + p["reservation"],
            p["internal_fragmentation"],
            p_name,
            f"{p['internal_fragmentation']} slots in last blocks past their request's end",
        )
        add("free", p["live"] + p["internal"], p["free"], p_name, f"{p['free']} free slots")
        colors = {
            "live": BLOCK_COLORS[0],
            "reserved, empty": UNUSED_COLOR,
            never: UNUSED_COLOR,
            "free hole (too small)": HOLE_COLOR,
            "free": FREE_COLOR,
        }
        with self.memory.batch_update():
            self.memory.data = []
            for kind, b in bars.items():
                marker = dict(color=colors[kind], line=dict(color="white", width=1))
                if kind == never:  # the same pink, hatched: empty like the reservation, but for good
                    marker["pattern"] = dict(shape="/", fgcolor=HOLE_COLOR, solidity=0.3)
                self.memory.add_bar(
                    x=b["x"],
                    base=b["base"],
                    y=b["y"],
                    orientation="h",
                    name=kind,
                    marker=marker,
                    hovertext=b["text"],
                    hoverinfo="text",
                )
            self.memory.layout.title = f"memory at step {t}"
            self.memory.layout.yaxis.update(categoryorder="array", categoryarray=[p_name, c_name])
        with self.timeline.batch_update():
            self.timeline.layout.shapes = [
                dict(type="line", x0=t, x1=t, y0=0, y1=1, yref="paper", line=dict(dash="dot", color="gray"))
            ]

        def fmt(name: str, n: dict[str, Any]) -> str:
            if not n["active"]:
                return f"<b>{name}</b>: " + ("all requests finished" if n["finished"] else "idle this step")
            return (
                f"<b>{name}</b>: {n['running']} running, {n['waiting']} waiting · utilisation "
                f"{n['utilisation']:.1%} · reserved for tokens to come {n['reservation']:,} · internal "
                f"fragmentation {n['internal_fragmentation']:,} · external {n['external']:,} · free "
                f"{n['free']:,} slots · refusals so far {n['refusals_so_far']}"
            )

        self.caption.value = fmt(c_name, st["contiguous"]) + "<br>" + fmt(p_name, st["paged"])

    @property
    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.play, self.step, self.policy]), self.caption, self.memory, self.timeline])

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (c) a block table as logical -> physical arrows -----------------------------------------
class BlockTableView:
    """Each request's logical blocks (left) with arrows to the physical blocks (right) holding them.

    Pick a request and a token position: ``resolve`` finds its physical block and
    offset, the arrow is highlighted, and the caption spells out
    ``slot = block · block_size + offset``. ``resolved`` and ``arrows`` hold what is drawn.

    Args:
        tables: request id -> ``BlockTable`` or list of physical block ids.
        block_size: tokens per block.
        num_blocks: blocks in the pool (the right column); default: up to the largest id.
        num_tokens: request id -> tokens written (default: whole blocks).
    """

    def __init__(
        self,
        tables: Mapping[str, BlockTable | Sequence[int]],
        block_size: int,
        num_blocks: int | None = None,
        num_tokens: Mapping[str, int] | None = None,
        request: str | None = None,
        position: int = 0,
        title: str = "block tables",
    ) -> None:
        if not tables:
            raise ValueError("BlockTableView needs at least one block table")
        num_tokens = dict(num_tokens or {})
        self.block_size = block_size
        self.tables: dict[str, BlockTable] = {}
        for rid, t in tables.items():
            ids = t.block_ids if isinstance(t, BlockTable) else [int(b) for b in t]
            n = num_tokens.get(rid, t.num_tokens if isinstance(t, BlockTable) else None)
            self.tables[rid] = BlockTable(block_size, ids, num_tokens=len(ids) * block_size if n is None else n)
        largest = max((b for t in self.tables.values() for b in t.block_ids), default=0)
        self.num_blocks = largest + 1 if num_blocks is None else num_blocks
        if largest >= self.num_blocks:
            raise ValueError(f"block id {largest} is outside a pool of {self.num_blocks} blocks")
        self.colors = OwnerColors()
        for rid in self.tables:
            self.colors(rid)
        style = label_style("request", "position")
        self.request = W.Dropdown(
            options=list(self.tables), value=request or next(iter(self.tables)), description="request", style=style
        )
        self.position = W.IntSlider(value=0, min=0, max=0, description="position", continuous_update=True, style=style)
        self.caption = W.HTML()
        rows = max(self.num_blocks, sum(len(t) + 1 for t in self.tables.values()))
        self.figure = LiveFigure(
            layout=dict(
                title=title,
                height=70 + 26 * rows,
                width=560,
                margin=dict(l=10, r=10, t=40, b=10),
                plot_bgcolor="white",
                showlegend=False,
                hovermode="closest",
                xaxis=dict(visible=False, range=[-0.75, 1.75]),
                yaxis=dict(visible=False, range=[-rows, 1]),
            )
        )
        self.arrows: list[dict[str, Any]] = []
        self.resolved: dict[str, Any] = {}
        self._draw_static()
        self.request.observe(lambda _change: self._on_request(), names="value")
        self.position.observe(lambda _change: self.update(), names="value")
        self._on_request(position)

    @classmethod
    def from_manager(
        cls, manager: KVCacheManager, num_tokens: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> BlockTableView:
        """The block tables a ``KVCacheManager`` holds now (``num_tokens``: ints or ``Request`` objects)."""
        tables = {rid: manager.get_block_ids(rid) for rid in manager.req_to_blocks}
        counts = {rid: _token_count(v) for rid, v in (num_tokens or {}).items()}
        return cls(tables, manager.block_size, num_blocks=manager.num_blocks, num_tokens=counts, **kwargs)

    def _logical_y(self) -> dict[tuple[str, int], float]:
        ys, y = {}, 0.0
        for rid, t in self.tables.items():
            for i in range(len(t)):
                ys[(rid, i)] = -y
                y += 1
            y += 1  # a gap between requests
        return ys

    def _draw_static(self) -> None:
        self._ly = self._logical_y()
        owner = {b: rid for rid, t in self.tables.items() for b in t.block_ids}
        bs = self.block_size
        lx, ly, ltext, lcol, lhover = [], [], [], [], []
        for (rid, i), y in self._ly.items():
            t = self.tables[rid]
            assert t.num_tokens is not None  # every table of the view is built with its token count
            first, last = i * bs, min((i + 1) * bs, t.num_tokens) - 1
            lx.append(0)
            ly.append(y)
            lcol.append(self.colors(rid))
            ltext.append(f"{rid}[{i}]")
            lhover.append(f"{rid}, logical block {i}: tokens {first}–{last} → physical {t.block_ids[i]}")
        px, py, ptext, pcol, phover = [], [], [], [], []
        for b in range(self.num_blocks):
            px.append(1)
            py.append(-b)
            ptext.append(f"#{b}")
            if b == 0:
                pcol.append(NULL_COLOR)
                phover.append("block 0: the null block")
            elif b in owner:
                pcol.append(self.colors(owner[b]))
                phover.append(f"block {b}: {owner[b]}")
            else:
                pcol.append(FREE_COLOR)
                phover.append(f"block {b}: free")
        self.arrows = [
            dict(request=rid, logical=i, physical=self.tables[rid].block_ids[i], highlighted=False)
            for (rid, i) in self._ly
        ]
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_scatter(
                x=lx,
                y=ly,
                mode="markers+text",
                text=ltext,
                hovertext=lhover,
                hoverinfo="text",
                textfont=dict(color=[text_color(c) for c in lcol]),
                name="logical",
                marker=dict(symbol="square", size=30, color=lcol),
            )
            self.figure.add_scatter(
                x=px,
                y=py,
                mode="markers+text",
                text=ptext,
                hovertext=phover,
                hoverinfo="text",
                name="physical",
                textfont=dict(color=[text_color(c) for c in pcol]),
                marker=dict(symbol="square", size=26, color=pcol),
            )

    def _on_request(self, position: int | None = None) -> None:
        t = self.tables[self.request.value]
        assert t.num_tokens is not None  # every table of the view is built with its token count
        self.position.max = max(t.num_tokens - 1, 0)
        target = self.position.value if position is None else position
        target = min(max(target, 0), self.position.max)
        if self.position.value == target:
            self.update()
        else:
            self.position.value = target

    def update(self) -> None:
        rid, pos = self.request.value, self.position.value
        t = self.tables[rid]
        if t.num_tokens == 0:
            self.resolved = dict(request=rid, position=None)
            self.caption.value = f"<b>{html.escape(rid)}</b> holds no tokens yet"
        else:
            block, offset = t.resolve(pos)
            self.resolved = dict(
                request=rid,
                position=pos,
                logical_block=pos // self.block_size,
                offset=offset,
                block=block,
                slot=t.slot(pos),
            )
            r = self.resolved
            self.caption.value = (
                f"<b>{html.escape(rid)}</b>, position {pos} → logical block {r['logical_block']}, "
                f"offset {offset} → physical block {block} → slot {block} · {self.block_size} + "
                f"{offset} = <b>{r['slot']}</b>"
            )
        annotations = []
        for a in self.arrows:
            a["highlighted"] = a["request"] == rid and a["logical"] == self.resolved.get("logical_block")
            annotations.append(
                dict(
                    x=0.93,
                    y=-a["physical"],
                    ax=0.07,
                    ay=self._ly[(a["request"], a["logical"])],
                    xref="x",
                    yref="y",
                    axref="x",
                    ayref="y",
                    showarrow=True,
                    arrowhead=2,
                    arrowsize=1,
                    arrowwidth=3.5 if a["highlighted"] else 1.2,
                    arrowcolor="#d62728" if a["highlighted"] else self.colors(a["request"]),
                    opacity=1.0 if a["highlighted"] else 0.6,
                    text="",
                )
            )
        with self.figure.batch_update():
            self.figure.layout.annotations = annotations

    @property
    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.request, self.position]), self.caption, self.figure])

    def _ipython_display_(self) -> None:
        display(self.widget)


# ---- (d) one request's memory as it generates (a static figure) ----------------------------------
def memory_growth_figure(curve: Mapping[str, Any], block_size: int | None = None, figsize=(8, 3.2)):
    """Chapter 02: KV memory of one request as it generates, contiguous vs paged (matplotlib).

    ``curve`` is ``contiguous.memory_vs_generated_tokens(...)``. The gap between the two is shaded: what
    the contiguous reservation holds empty. The legend sits in the empty corner under the paged line
    (lower right), off both lines; ``layout.check_mpl_layout`` holds.
    """
    import matplotlib.pyplot as plt

    from ...kv_math import MiB

    g = curve["generated_tokens"]
    contiguous, paged = np.asarray(curve["contiguous_bytes"]) / MiB, np.asarray(curve["paged_bytes"]) / MiB
    fig, ax = plt.subplots(figsize=figsize)
    ax.plot(g, contiguous, color=BLOCK_COLORS[1], label="contiguous (reserve max_model_len)")
    ax.plot(
        g,
        paged,
        color=BLOCK_COLORS[0],
        label=f"paged ({block_size}-token blocks)" if block_size else "paged (whole blocks)",
    )
    ax.fill_between(g, paged, contiguous, color=UNUSED_COLOR, alpha=0.5, label="reserved but empty")
    ax.set_xlim(0, g[-1] * 1.02)
    ax.set_ylim(0, contiguous.max() * 1.08)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("KV memory (MiB)")
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    return fig


# ---- (e) where the KV memory goes: the paper's Fig. 2 beside our simulation (a static figure) -----------
WASTE_CATEGORIES = (
    "token states",
    "reservation (tokens to come)",
    "internal fragmentation (never used)",
    "free: external fragmentation & other",
)


def waste_breakdown_figure(
    ours: Mapping[str, Sequence[float]],
    paper: Mapping[str, Sequence[float | None]],
    names: Mapping[str, str],
    figsize=(9, 4.6),
):
    """Chapter 02: one stacked bar per allocator, the paper's bar above ours (matplotlib).

    ``ours`` maps a policy (``"max"``, ...) to four shares in % (``contiguous.waste_breakdown``);
    ``paper`` maps a system name to its four printed shares, ``None`` where the paper does not split
    them (``contiguous.PAPER_FIG2``); ``names`` maps each policy to the paper's system
    (``contiguous.PAPER_BASELINE_OF``). A segment of 6 % or more carries its number; the legend sits
    above the plot, off the bars, and ``layout.check_mpl_layout`` holds.
    """
    import matplotlib.pyplot as plt

    colors = [BLOCK_COLORS[0], UNUSED_COLOR, UNUSED_COLOR, FREE_COLOR]
    hatches = ["", "", "///", ""]
    rows: list[tuple[str, list[float | None]]] = []
    for policy, our_shares in ours.items():
        rows.append((f"{names[policy]}, the paper", list(paper[names[policy]])))
        rows.append((f"{policy}, this course", list(our_shares)))
    fig, ax = plt.subplots(figsize=figsize)
    for i, (_label, shares) in enumerate(rows):
        y = len(rows) - 1 - i - 0.25 * (i // 2)  # a gap between pairs
        left = 0.0
        for k, share in enumerate(shares):
            if share is None:
                continue
            ax.barh(
                y,
                share,
                left=left,
                color=colors[k],
                hatch=hatches[k],
                edgecolor="white",
                label=WASTE_CATEGORIES[k] if i == 0 or (k == 2 and i == 1) else None,
            )
            if share >= 6:
                ax.text(
                    left + share / 2,
                    y,
                    f"{share:.1f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color=text_color(colors[k]),
                )
            left += share
        if left < 99.95:  # the part the paper does not break down
            ax.barh(
                y,
                100 - left,
                left=left,
                color="white",
                hatch="..",
                edgecolor="#9e9e9e",
                label="not broken down in the paper",
            )
    ticks = [len(rows) - 1 - i - 0.25 * (i // 2) for i in range(len(rows))]
    ax.set_yticks(ticks, [label for label, _ in rows], fontsize=9)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of the KV cache (%)")
    ax.set_ylabel("allocator")
    handles, labels = ax.get_legend_handles_labels()
    by_label = dict(zip(labels, handles))
    ax.legend(
        by_label.values(),
        by_label.keys(),
        loc="lower center",
        bbox_to_anchor=(0.5, 1.01),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig


__all__ = [
    "BlockPoolGrid",
    "BlockTableView",
    "ContiguousVsPaged",
    "memory_growth_figure",
    "waste_breakdown_figure",
]
