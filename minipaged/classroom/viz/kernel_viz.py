"""Chapter 05 pictures: which physical blocks each attention program reads, and what decode costs in bytes.

The paged kernels never see a sequence as one run of memory: each program walks a
range of token positions and turns every position into a physical block through the
block table. This module computes, with the same arithmetic as the kernel wrappers
(``minipaged.kernels.paged_decode`` / ``paged_prefill``), what each program reads::

    decode_read_plan(tables, seq_lens, block_size, num_splits=3)   one entry per (sequence, KV segment)
    prefill_read_plan(tables, cu_seqlens_q, seq_lens, block_size)  one entry per (sequence, query tile)
    gqa_query_tile(9, 3, kv_head=1)     the query rows one decode program packs: [3, 4, 5, None x 13]
    decode_traffic(...), prefill_traffic(...)   bytes and FLOPs of attention -> arithmetic intensity

and draws it: ``PagedReadView`` (ipywidgets + plotly) shows the pool as a grid of
physical blocks, one row per program, with a slider for the number of KV splits; a
learner picks a program and sees exactly the blocks it loads. Its state lives in plain
attributes (``programs``, ``selected``, ``cells``, ``caption``) so tests drive it from
Python. ``roofline_figure`` is a static matplotlib roofline, and ``bandwidth_runs_figure`` the decode
kernel's measured bandwidth on one or more machines (``BandwidthSeries``: a recorded run of
``benchmarks/bench_paged_attention.py``, or a sweep measured live), each against its own GPU's peak from
``minipaged.gpus``.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as W
from IPython.display import display

from ...gpus import GPU, by_device_name
from ...utils import cdiv
from .block_viz import FREE_COLOR, OWNER_COLORS
from .layout import label_style, widget_width
from .live_figure import LiveFigure

MIN_DOT_ROWS = 16  # tl.dot on an NVIDIA GPU wants every tile dimension >= 16
# The pictures show the tiles the kernels pick for SmolLM2 as the GPU engine runs it (bfloat16, head_dim 64).
PICTURE_DTYPE, PICTURE_HEAD_DIM = "bfloat16", 64


def decode_tile(block_size: int) -> int:
    """Tokens per K/V tile of the decode kernel at this block size (its own ``decode_config``)."""
    import torch

    from ...kernels.paged_decode import decode_config  # minipaged.kernels picks compiled vs interpreted first

    return decode_config(getattr(torch, PICTURE_DTYPE), PICTURE_HEAD_DIM, block_size).tile_n


def prefill_tiles(block_size: int, max_q_len: int) -> tuple[int, int]:
    """``(block_m, tile_n)`` of the prefill kernel (its own ``prefill_config``)."""
    import torch

    from ...kernels.paged_prefill import prefill_config

    cfg = prefill_config(getattr(torch, PICTURE_DTYPE), PICTURE_HEAD_DIM, block_size, max_q_len)
    return cfg.block_m, cfg.tile_n


def _max_splits() -> int:
    from ...kernels.paged_decode import MAX_SPLITS

    return MAX_SPLITS


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _rows(x: Any) -> list[list[int]]:
    values = x.tolist() if hasattr(x, "tolist") else x
    return [[int(b) for b in row] for row in values]


def _ints(x: Any) -> list[int]:
    values = x.tolist() if hasattr(x, "tolist") else x
    return [int(v) for v in values]


@dataclass(frozen=True)
class ProgramRead:
    """What one attention program reads: token positions ``first .. end - 1`` of sequence ``seq``.

    ``part`` is the KV segment (decode) or the query tile (prefill). A program whose range is empty
    returns at once (its sequence is shorter than the longest in the batch). ``reads`` lists, in the
    order the program meets them, ``(logical block, physical block, tokens read from it)``.
    """

    kind: str
    seq: int
    part: int
    first: int
    end: int
    reads: tuple[tuple[int, int, int], ...]
    tiles: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.first

    @property
    def physical_blocks(self) -> list[int]:
        return [p for _, p, _ in self.reads]

    @property
    def logical_blocks(self) -> list[int]:
        return [lg for lg, _, _ in self.reads]

    @property
    def label(self) -> str:
        what = "segment" if self.kind == "decode" else "query tile"
        return f"seq {self.seq} · {what} {self.part}"

    def describe(self) -> str:
        if not self.reads:
            return f"{self.label}: nothing to read, returns at once"
        lo, hi = self.logical_blocks[0], self.logical_blocks[-1]
        logical = f"logical block {lo}" if lo == hi else f"logical blocks {lo}–{hi}"
        return (
            f"{self.label}: tokens {self.first}–{self.end - 1} ({self.num_tokens}, {self.tiles} tile"
            f"{'s' if self.tiles != 1 else ''}) → {logical} → physical {self.physical_blocks}"
        )


def _reads(table: Sequence[int], first: int, end: int, block_size: int) -> tuple[tuple[int, int, int], ...]:
    out = []
    pos = first
    while pos < end:
        logical = pos // block_size
        stop = min(end, (logical + 1) * block_size)
        out.append((logical, table[logical], stop - pos))
        pos = stop
    return tuple(out)


def split_kv_segments(capacity: int, num_splits: int, tile: int) -> tuple[int, int]:
    """``(segment_len, num_segments)`` as ``paged_decode_attention`` computes them.

    ``capacity`` is the block table's width times the block size (no sequence is longer). Segments are
    a whole number of tiles of ``tile`` tokens, so fewer segments than asked may come out.
    """
    if not 1 <= num_splits <= _max_splits():
        raise ValueError(f"num_splits must be from 1 to {_max_splits()}, got {num_splits}")
    segment_len = cdiv(cdiv(capacity, num_splits), tile) * tile
    return segment_len, cdiv(capacity, segment_len)


def decode_read_plan(
    block_tables: Any, seq_lens: Any, block_size: int, num_splits: int = 1, tile: int | None = None
) -> list[ProgramRead]:
    """One ``ProgramRead`` per (sequence, KV segment) of the split-KV decode grid, for one KV head.

    Every KV head's program reads the same blocks (its own head's slice of them), so the grid is
    ``(num_seqs, num_kv_heads, num_segments)`` and this plan is one ``num_kv_heads``-th of it.
    """
    tables, lens = _rows(block_tables), _ints(seq_lens)
    if len(tables) != len(lens):
        raise ValueError(f"{len(tables)} block tables but {len(lens)} sequence lengths")
    capacity = max(len(t) for t in tables) * block_size
    tile = tile or decode_tile(block_size)
    segment_len, num_segments = split_kv_segments(capacity, num_splits, tile)
    plan = []
    for seq, (table, n) in enumerate(zip(tables, lens)):
        if n > len(table) * block_size:
            raise ValueError(f"sequence {seq} has {n} tokens but its table holds {len(table) * block_size}")
        for seg in range(num_segments):
            first = min(seg * segment_len, n)
            end = min(first + segment_len, n) if seg * segment_len < n else first
            plan.append(
                ProgramRead(
                    "decode", seq, seg, first, end, _reads(table, first, end, block_size), cdiv(end - first, tile)
                )
            )
    return plan


def prefill_read_plan(
    block_tables: Any,
    cu_seqlens_q: Any,
    seq_lens: Any,
    block_size: int,
    block_m: int | None = None,
    tile: int | None = None,
) -> list[ProgramRead]:
    """One ``ProgramRead`` per (sequence, query tile of ``block_m`` new tokens), for one query head.

    Query tile ``m`` of a sequence with ``ctx_len`` cached tokens holds new tokens at positions
    ``ctx_len + m·block_m ...``; causality lets it stop at ``min(seq_len, ctx_len + (m + 1)·block_m)``.
    ``block_m`` and ``tile`` default to the wrapper's choice (``prefill_config``): the query tile is
    ``max(16, next_pow2(longest q_len))``, capped by the kernel's table (64 in bfloat16).
    """
    tables, cu, lens = _rows(block_tables), _ints(cu_seqlens_q), _ints(seq_lens)
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    if len(q_lens) != len(lens) or len(tables) != len(lens):
        raise ValueError("block_tables, cu_seqlens_q and seq_lens disagree on the number of sequences")
    default_m, default_tile = prefill_tiles(block_size, max(q_lens))
    block_m, tile = block_m or default_m, tile or default_tile
    num_tiles = cdiv(max(q_lens), block_m)
    plan = []
    for seq, (table, q_len, n) in enumerate(zip(tables, q_lens, lens)):
        ctx_len = n - q_len
        for m in range(num_tiles):
            end = min(n, ctx_len + (m + 1) * block_m) if m * block_m < q_len else 0
            plan.append(ProgramRead("prefill", seq, m, 0, end, _reads(table, 0, end, block_size), cdiv(end, tile)))
    return plan


def format_read_plan(plan: Sequence[ProgramRead]) -> str:
    """One line per program, as printed in chapter 05."""
    return "\n".join(p.describe() for p in plan)


def gqa_query_tile(num_q_heads: int, num_kv_heads: int, kv_head: int) -> list[int | None]:
    """The rows of the query tile one decode program loads: its KV head's query heads, then padding.

    ``G = num_q_heads // num_kv_heads`` query heads share KV head ``kv_head``; the tile has
    ``max(16, next_pow2(G))`` rows so that ``tl.dot`` compiles on an NVIDIA GPU. ``None`` is a
    padding row: loaded as zeros, masked on the way back.
    """
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 0 <= kv_head < num_kv_heads:
        raise ValueError(f"kv_head must be in 0..{num_kv_heads - 1}, got {kv_head}")
    group = num_q_heads // num_kv_heads
    rows = max(MIN_DOT_ROWS, _next_pow2(group))
    return [kv_head * group + r if r < group else None for r in range(rows)]


def decode_traffic(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, batch: int, context: int, num_layers: int = 1
) -> dict[str, float]:
    """Bytes read and FLOPs of the attention of one decode step (every sequence ``context`` tokens long).

    K and V of every cached token are read once: ``2 · layers · batch · context · kv_heads · head_dim · bytes``.
    Each query head does a dot product with every key and a multiply-add with every value:
    ``4 · layers · batch · context · q_heads · head_dim`` FLOPs. Their ratio, the arithmetic
    intensity, is ``2 · G / bytes`` FLOP per byte with ``G = q_heads / kv_heads``: it does not grow with
    batch or context, which is why decode attention is memory-bound on every GPU.
    """
    tokens = num_layers * batch * context
    kv_bytes = 2 * tokens * num_kv_heads * head_dim * dtype_bytes
    flops = 4 * tokens * num_q_heads * head_dim
    return dict(kv_bytes=kv_bytes, flops=flops, intensity=flops / kv_bytes)


def prefill_traffic(
    num_q_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int, q_len: int, ctx_len: int = 0
) -> dict[str, float]:
    """Compulsory bytes and FLOPs of one sequence's prefill attention, per layer.

    ``q_len`` new tokens after ``ctx_len`` cached ones. Bytes: K and V of all ``ctx_len + q_len`` tokens read
    once, the queries read and the outputs written once. FLOPs: ``4 · q_heads · head_dim`` per visible
    (query, key) pair; new token ``j`` sees ``ctx_len + j + 1`` keys. The intensity grows with ``q_len``.
    """
    seq_len = ctx_len + q_len
    pairs = q_len * ctx_len + q_len * (q_len + 1) // 2
    kv_bytes = 2 * seq_len * num_kv_heads * head_dim * dtype_bytes
    total = kv_bytes + 2 * q_len * num_q_heads * head_dim * dtype_bytes
    flops = 4 * pairs * num_q_heads * head_dim
    return dict(kv_bytes=kv_bytes, bytes=total, flops=flops, intensity=flops / total)


# Where a point's label may go, in the order tried: (x, y offset in points, horizontal, vertical alignment).
# Below-right of a point on the roof is under the roof (it rises to the right); above-left is over it.
_LABEL_SPOTS = (
    (6, -6, "left", "top"),
    (-6, 6, "right", "bottom"),
    (-6, -6, "right", "top"),
    (6, -22, "left", "top"),
    (-6, -22, "right", "top"),
    (0, -12, "center", "top"),
    (6, -38, "left", "top"),
    (-6, -38, "right", "top"),
)


def roofline_figure(peak_tflops: float, peak_gbps: float, points: Sequence[tuple[str, float]], title: str = ""):
    """A matplotlib roofline: attainable TFLOP/s = min(peak, bandwidth × intensity), with labelled points.

    Each label takes the first spot beside its point that stays inside the axes, off the roof, the ridge
    line and the other points, and clear of the labels placed before it (``check_mpl_layout`` holds).
    """
    import matplotlib.pyplot as plt

    from .layout import hits, inside, line_pixels

    ridge = peak_tflops * 1e12 / (peak_gbps * 1e9)
    lo = min([p for _, p in points] + [ridge]) / 4
    hi = max([p for _, p in points] + [ridge]) * 4
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    roof = [min(peak_tflops, peak_gbps * 1e9 * x / 1e12) for x in xs]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    ax.plot(xs, roof, color="black", lw=1.5)
    bottom = roof[0] / 2
    ax.plot([ridge, ridge], [bottom, peak_tflops], color="grey", lw=0.8, ls="--")  # the ridge, up to the roof
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(bottom, peak_tflops * 2.5)  # room under the low end and over the flat roof for labels
    ax.set_xlabel("arithmetic intensity (FLOP per byte read)")
    ax.set_ylabel("attainable TFLOP/s")
    ax.set_title(title)
    # (label, the point, the spots to try beside it, the annotation's style)
    placed: list[tuple[str, tuple[float, float], Sequence[tuple[int, int, str, str]], dict[str, Any]]] = []
    for i, (label, x) in enumerate(points):
        y = min(peak_tflops, peak_gbps * 1e9 * x / 1e12)
        ax.plot([x], [y], "o", color=f"C{i % 10}")
        placed.append((label, (x, y), _LABEL_SPOTS, {}))
    # the ridge's label last, at the foot of its line, else under the roof's corner
    placed.append(
        (
            f"ridge {ridge:.0f} FLOP/B",
            (ridge, bottom),
            ((5, 5, "left", "bottom"), (-5, 5, "right", "bottom"), (5, -8, "left", "top")),
            dict(color="dimgray"),
        )
    )
    fig.tight_layout()
    fig.canvas.draw()  # the layout is final: measure in pixels
    # Only Agg-based canvases (inline and file backends) have get_renderer; FigureCanvasBase does not declare it.
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    box, paths = ax.get_window_extent(renderer), line_pixels(ax)
    taken: list[Any] = []  # the labels' boxes so far
    for label, xy, spots, kw in placed:
        for dx, dy, ha, va in spots:
            text = ax.annotate(label, xy, textcoords="offset points", xytext=(dx, dy), ha=ha, va=va, fontsize=8, **kw)
            b = text.get_window_extent(renderer)
            if inside(b, box) and not hits(b, paths) and not any(b.overlaps(t) for t in taken):
                taken.append(b)
                break
            if (dx, dy, ha, va) != spots[-1]:
                text.remove()  # nowhere clean: the last spot stays, and check_mpl_layout in the tests says so
    return fig


@dataclass(frozen=True)
class BandwidthSeries:
    """The paged decode kernel's bandwidth on one machine: KV bytes read per step and GB/s at each point.

    ``device`` is what ``torch.cuda.get_device_name()`` said there, ``date`` the day it ran (``YYYY-MM-DD``),
    ``note`` where the figures come from ("recorded", "this run"). The GPU's peak comes from the package's table
    of GPUs (``minipaged.gpus``), by device name; None for a GPU the table does not list."""

    device: str
    date: str
    kv_bytes: tuple[int, ...]
    gbps: tuple[float, ...]
    note: str = ""
    batch: int | None = None

    @classmethod
    def from_rows(
        cls, device: str, date: str, rows: Sequence[dict[str, Any]], note: str = "", batch: int | None = None
    ) -> BandwidthSeries:
        """From rows of the benchmark (``run_point``: ``kv_bytes``, ``paged_gbps``, ``batch``), those of
        ``batch`` only when given, by bytes read."""
        picked = sorted((r for r in rows if batch is None or r["batch"] == batch), key=lambda r: r["kv_bytes"])
        return cls(
            device,
            date[:10],
            tuple(int(r["kv_bytes"]) for r in picked),
            tuple(float(r["paged_gbps"]) for r in picked),
            note,
            batch,
        )

    @classmethod
    def from_result(cls, result: dict[str, Any], batch: int = 32, note: str = "recorded") -> BandwidthSeries:
        """From a recorded run (``assets/benchmarks/gpu/paged_attention_*.json``): its grid's points at ``batch``."""
        return cls.from_rows(result["device"], result["date"], result["grid"], note, batch)

    @property
    def gpu(self) -> GPU | None:
        return by_device_name(self.device)

    @property
    def peak_gbps(self) -> float | None:
        gpu = self.gpu
        return gpu.bandwidth_gbps if gpu else None

    @property
    def fractions(self) -> tuple[float, ...] | None:
        """Each point's GB/s over the GPU's peak, or None where the peak is not known."""
        peak = self.peak_gbps
        return tuple(g / peak for g in self.gbps) if peak else None

    @property
    def label(self) -> str:
        """The machine and the day, e.g. "NVIDIA H100 80GB HBM3, 2026-11-25 (recorded)"."""
        return f"{self.device}, {self.date}" + (f" ({self.note})" if self.note else "")


def bandwidth_runs_figure(series: Sequence[BandwidthSeries], title: str = "", target: float = 0.8):
    """Decode bandwidth against KV read per step, one line per machine: GB/s with each GPU's peak dashed in its
    colour (left), and the fraction of that peak, with the benchmark's ``target`` (right). The legend, one entry
    per machine, sits under the plots, off the data (``check_mpl_layout`` holds)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.0 + 0.2 * len(series)), layout="constrained")
    for i, s in enumerate(series):
        color, marker = f"C{i % 10}", "s" if s.note == "this run" else "o"
        mib = [b / 2**20 for b in s.kv_bytes]
        peak = f"peak {s.peak_gbps:,.0f} GB/s" if s.peak_gbps else "peak not in minipaged.gpus"
        left.plot(mib, s.gbps, marker + "-", color=color, label=f"{s.label}: {peak}")
        if s.peak_gbps:
            left.axhline(s.peak_gbps, color=color, lw=0.8, ls="--")
        if s.fractions:
            right.plot(mib, s.fractions, marker + "-", color=color)
    right.axhline(target, color="grey", lw=0.8, ls=":")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("KV read per step (MiB)")
    left.set_yscale("log")
    left.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    left.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    left.yaxis.set_minor_formatter(NullFormatter())
    left.set_ylabel("GB/s read (dashed: the GPU's peak)")
    left.set_title("bandwidth")
    right.set_ylim(0, 1.05)
    right.set_ylabel(f"fraction of the GPU's peak (dotted: {target:.0%})")
    right.set_title("fraction of peak")
    if series:
        fig.legend(loc="outside lower center", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


class PagedReadView:
    """The pool's physical blocks (columns) and the decode programs (rows): who reads which block.

    Each row is one program of the split-KV decode grid (for one KV head: every KV head reads the
    same blocks). A cell shows how many tokens that program reads from that block, coloured by the
    sequence owning the block. Move ``splits`` to cut each sequence into more segments; pick a
    ``program`` to highlight its row and read, in the caption, the logical → physical walk it does.

    Args:
        block_tables: one list of physical block ids per sequence (or an int32 tensor).
        seq_lens: tokens per sequence.
        block_size: tokens per block.
        num_blocks: blocks in the pool (columns); default: up to the largest id in the tables.
        num_splits: the initial ``num_splits`` of ``paged_decode_attention``.
        tile: tokens per K/V tile (default: the kernel's ``TILE_N`` at this block size); a smaller one
            makes small examples split.
    """

    def __init__(
        self,
        block_tables: Any,
        seq_lens: Any,
        block_size: int,
        num_blocks: int | None = None,
        num_splits: int = 1,
        tile: int | None = None,
        title: str = "which blocks each program reads",
    ) -> None:
        self.tables, self.seq_lens = _rows(block_tables), _ints(seq_lens)
        self.block_size, self.tile = block_size, tile or decode_tile(block_size)
        used = [b for t, n in zip(self.tables, self.seq_lens) for b in t[: cdiv(n, block_size)]]
        largest = max(used, default=0)
        self.num_blocks = largest + 1 if num_blocks is None else num_blocks
        if largest >= self.num_blocks:
            raise ValueError(f"block id {largest} is outside a pool of {self.num_blocks} blocks")
        self.owner: dict[int, tuple[int, int, int]] = {}  # physical -> (seq, logical, tokens held)
        for seq, (t, n) in enumerate(zip(self.tables, self.seq_lens)):
            for logical in range(cdiv(n, block_size)):
                self.owner[t[logical]] = (seq, logical, min(block_size, n - logical * block_size))
        capacity = max(len(t) for t in self.tables) * block_size
        max_splits = min(_max_splits(), max(1, cdiv(capacity, self.tile)))
        self._style = label_style("num_splits", "program")
        self.splits = W.IntSlider(
            value=min(num_splits, max_splits),
            min=1,
            max=max_splits,
            description="num_splits",
            continuous_update=False,
            style=self._style,
        )
        self.program = W.Dropdown(description="program", style=self._style)  # its width follows its options
        self.caption = W.HTML()
        self.programs: list[ProgramRead] = []
        self.selected: ProgramRead | None = None
        self.cells: list[dict[str, Any]] = []
        self.segment_len = 0
        self.figure = LiveFigure(
            layout=dict(
                title=title,
                width=max(420, 60 + 24 * self.num_blocks),
                margin=dict(l=150, r=10, t=40, b=40),
                plot_bgcolor="white",
                showlegend=False,
                hovermode="closest",
                xaxis=dict(title="physical block", dtick=1, range=[-0.6, self.num_blocks - 0.4]),
                yaxis=dict(title="decode program (one KV head)", zeroline=False, showgrid=False, automargin=True),
            )
        )
        self.splits.observe(lambda _change: self._replan(), names="value")
        self.program.observe(lambda _change: self.update(), names="value")
        self._replan()

    def _replan(self) -> None:
        self.segment_len, _ = split_kv_segments(
            max(len(t) for t in self.tables) * self.block_size, self.splits.value, self.tile
        )
        self.programs = decode_read_plan(self.tables, self.seq_lens, self.block_size, self.splits.value, self.tile)
        options = [(p.label + ("" if p.reads else " (returns at once)"), i) for i, p in enumerate(self.programs)]
        current = self.program.value
        first_busy = next(i for i, p in enumerate(self.programs) if p.reads)
        self.program.options = options
        self.program.layout.width = widget_width(self._style["description_width"], [o for o, _ in options])
        self.program.value = current if current is not None and current < len(options) else first_busy
        self._draw()

    def _draw(self) -> None:
        xs, ys, colors, sizes, hovers = [], [], [], [], []
        for row, p in enumerate(self.programs, start=1):
            for logical, block, n in p.reads:
                xs.append(block)
                ys.append(row)
                colors.append(OWNER_COLORS[p.seq % len(OWNER_COLORS)])
                sizes.append(8 + 14 * n / self.block_size)
                hovers.append(f"{p.label} reads {n} token(s) of physical block {block} (logical block {logical})")
        pool_x = list(range(self.num_blocks))
        pool_colors = [
            OWNER_COLORS[self.owner[b][0] % len(OWNER_COLORS)] if b in self.owner else FREE_COLOR for b in pool_x
        ]
        pool_hover = [
            f"block {b}: seq {self.owner[b][0]}, logical {self.owner[b][1]}, {self.owner[b][2]} token(s)"
            if b in self.owner
            else f"block {b}: not used by this batch"
            for b in pool_x
        ]
        labels = [p.label for p in self.programs]
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_scatter(
                x=pool_x,
                y=[0] * len(pool_x),
                mode="markers",
                name="pool",
                marker=dict(symbol="square", size=18, color=pool_colors),
                hovertext=pool_hover,
                hoverinfo="text",
            )
            self.figure.add_scatter(
                x=xs,
                y=ys,
                mode="markers",
                name="reads",
                hovertext=hovers,
                hoverinfo="text",
                marker=dict(symbol="square", size=sizes, color=colors),
            )
            self.figure.layout.yaxis.update(
                tickvals=list(range(len(labels) + 1)), ticktext=["pool"] + labels, range=[len(labels) + 0.6, -0.6]
            )
            self.figure.layout.height = 90 + 26 * (len(labels) + 1)
        self.update()

    def update(self) -> None:
        index = self.program.value
        if index is None:
            return
        p = self.programs[index]
        self.selected = p
        reads = {block: (logical, n) for logical, block, n in p.reads}
        self.cells = []
        for b in range(self.num_blocks):
            seq, logical, held = self.owner.get(b, (None, None, 0))
            self.cells.append(
                dict(
                    block=b,
                    seq=seq,
                    logical=logical,
                    tokens_held=held,
                    read=b in reads,
                    tokens_read=reads.get(b, (None, 0))[1],
                )
            )
        segs = cdiv(max(len(t) for t in self.tables) * self.block_size, self.segment_len)
        self.caption.value = (
            f"num_splits {self.splits.value} → segments of {self.segment_len} tokens ({segs} per sequence), "
            f"grid = ({len(self.tables)} seqs, num_kv_heads, {segs}).<br><b>{html.escape(p.describe())}</b>"
        )
        shapes = []
        if p.reads:
            row = 1 + index  # row 0 is the pool
            shapes.append(
                dict(
                    type="rect",
                    xref="x",
                    yref="y",
                    x0=-0.5,
                    x1=self.num_blocks - 0.5,
                    y0=row - 0.45,
                    y1=row + 0.45,
                    line=dict(color="#d62728", width=2),
                    fillcolor="rgba(0,0,0,0)",
                )
            )
            for block in reads:
                shapes.append(
                    dict(
                        type="rect",
                        xref="x",
                        yref="y",
                        x0=block - 0.45,
                        x1=block + 0.45,
                        y0=-0.45,
                        y1=0.45,
                        line=dict(color="#d62728", width=3),
                        fillcolor="rgba(0,0,0,0)",
                    )
                )
        with self.figure.batch_update():
            self.figure.layout.shapes = shapes

    @property
    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.splits, self.program]), self.caption, self.figure])

    def _ipython_display_(self) -> None:
        display(self.widget)


__all__ = [
    "BandwidthSeries",
    "PagedReadView",
    "ProgramRead",
    "bandwidth_runs_figure",
    "decode_read_plan",
    "decode_traffic",
    "format_read_plan",
    "gqa_query_tile",
    "prefill_read_plan",
    "prefill_traffic",
    "roofline_figure",
    "split_kv_segments",
]
