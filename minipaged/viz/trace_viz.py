"""The puzzle ladder's picture: what a learner's kernel read or wrote, next to what a right kernel does.

One panel per side, each the pool as a grid of slots (one row per physical block, one column per slot in the
block). On the left, every cell the kernel touched, coloured by the program that touched it; cells a right
kernel never touches carry a red ✗, cells it must touch but the kernel left alone a hollow orange square. On
the right, the cells a right kernel touches, worked out from the block tables (``puzzles.Case.cells``)::

    trace_figure(puzzles.run("gather", my_kernel))            the case's default tensor and kind
    trace_figure(result, tensor="value_cache", kind="load")   another one

The figure's title is the verdict (``puzzles.verdict``), so a learner reads the first problem in words too.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..kernels.trace import Kind
from .block_viz import FREE_COLOR
from .layout import legend_right, text_color

STRAY_COLOR = "#d62728"  # red: touched, but a right kernel never touches it
MISSING_COLOR = "#ff7f0e"  # orange: a right kernel touches it, this one did not
RIGHT_COLOR = "#5a5a5a"  # dark grey: the right answer's cells
# One colour per program, none of them the red or orange of a mistake; the program's number is in its cells too.
PROGRAM_COLORS = ["#1f77b4", "#9467bd", "#17becf", "#8c564b", "#e377c2", "#393b79", "#bcbd22", "#637939"]


def _program_label(program: tuple[int, int, int]) -> str:
    used = [str(i) for i in program]
    while len(used) > 1 and used[-1] == "0":
        used.pop()
    return f"program ({', '.join(used)})"


def trace_figure(result: Any, tensor: str | None = None, kind: Kind | None = None, title: str = "") -> go.Figure:
    """Two panels (the kernel's accesses, a right kernel's) of ``tensor``'s ``[blocks, slots]`` grid."""
    from ..puzzles import PUZZLES, verdict

    case = result.case
    tensor, kind = (tensor, kind) if tensor and kind else PUZZLES[result.puzzle].drawn
    want = case.cells.get((tensor, kind), set())
    shape = tuple(case.tensors[tensor].shape)
    dims = len(next(iter(want))) if want else min(2, len(shape))  # (block, slot) of a cache, (row,) of an output
    num_rows, num_cols = shape[0], (shape[1] if dims == 2 else 1)

    y_title, x_title = PUZZLES[result.puzzle].axes if dims == 2 else ("row", "")
    where = f"{y_title} %{{y}}, {x_title} %{{x}}" if dims == 2 else "row %{y}"

    def cell_xy(cell: tuple[int, ...]) -> tuple[int, int]:
        return (cell[1] if dims == 2 else 0), cell[0]

    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.08,
        subplot_titles=(f"your kernel's {kind}s", f"a right kernel's {kind}s"),
    )
    # The empty pool, drawn once per panel, so untouched cells show.
    every = [(s, b) for b in range(num_rows) for s in range(num_cols)]
    for col in (1, 2):
        fig.add_trace(
            go.Scatter(
                x=[x for x, _ in every],
                y=[y for _, y in every],
                mode="markers",
                marker=dict(symbol="square", size=22, color=FREE_COLOR),
                name="not touched",
                showlegend=col == 1,
                hoverinfo="skip",
            ),
            row=1,
            col=col,
        )
    touched: set[tuple[int, ...]] = set()
    if result.trace is not None:
        for i, (program, cells) in enumerate(result.trace.by_program(tensor, kind, dims).items()):
            touched |= cells
            xy = [cell_xy(c) for c in sorted(cells)]
            color = PROGRAM_COLORS[i % len(PROGRAM_COLORS)]
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in xy],
                    y=[y for _, y in xy],
                    mode="markers+text",
                    marker=dict(symbol="square", size=22, color=color),
                    text=[str(i)] * len(xy),
                    textfont=dict(color=text_color(color), size=11),
                    name="touched by program n (n in the cell)",
                    legendgroup="programs",
                    showlegend=i == 0,
                    hovertemplate=f"{_program_label(program)}<br>{where}<extra></extra>",
                ),
                row=1,
                col=1,
            )
    for cells, symbol, color, name in (
        (sorted(touched - want), "x-thin", STRAY_COLOR, "✗ a right kernel never touches it"),
        (sorted(want - touched), "square-open", MISSING_COLOR, "missed: a right kernel touches it"),
    ):
        if cells:
            xy = [cell_xy(c) for c in cells]
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in xy],
                    y=[y for _, y in xy],
                    mode="markers",
                    marker=dict(symbol=symbol, size=20, color=color, line=dict(width=3, color=color)),
                    name=name,
                    hovertemplate=f"{where}<extra>{name}</extra>",
                ),
                row=1,
                col=1,
            )
    xy = [cell_xy(c) for c in sorted(want)]
    fig.add_trace(
        go.Scatter(
            x=[x for x, _ in xy],
            y=[y for _, y in xy],
            mode="markers",
            marker=dict(symbol="square", size=22, color=RIGHT_COLOR),
            name="a right kernel touches it",
            hovertemplate=f"{where}<extra></extra>",
        ),
        row=1,
        col=2,
    )
    for col in (1, 2):
        fig.update_xaxes(title_text=x_title or None, range=[-0.7, num_cols - 0.3], dtick=1, row=1, col=col)
    y_range = [num_rows - 0.5, -0.5]  # block 0 on top
    fig.update_yaxes(title_text=y_title, range=y_range, dtick=1, row=1, col=1)
    fig.update_yaxes(range=y_range, dtick=1, row=1, col=2)
    fig.update_layout(
        title=dict(text=title or f"{tensor}, {case.label}: {verdict(result)}", font=dict(size=13)),
        height=150 + 30 * num_rows,
        width=880,
        legend=legend_right(),
        margin=dict(t=90),
        plot_bgcolor="white",
    )
    return fig
