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

from ..kernel_trace import Kind
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

    def squares(cells: list[tuple[int, ...]], col: int, color: str, name: str, **kw: Any) -> None:
        """One trace of square markers on ``cells`` (x: slot, y: block) in panel ``col``."""
        marker = dict(symbol="square", size=22, color=color) | kw.pop("marker", {})
        xy = [((c[1] if dims == 2 else 0), c[0]) for c in cells]
        kw.setdefault("hovertemplate", f"{where}<extra></extra>")
        kw.setdefault("mode", "markers")
        fig.add_trace(
            go.Scatter(x=[x for x, _ in xy], y=[y for _, y in xy], marker=marker, name=name, **kw),
            row=1,
            col=col,
        )

    fig = make_subplots(
        rows=1,
        cols=2,
        shared_yaxes=True,
        horizontal_spacing=0.08,
        subplot_titles=(f"your kernel's {kind}s", f"a right kernel's {kind}s"),
    )
    every: list[tuple[int, ...]] = (
        [(b, s) for b in range(num_rows) for s in range(num_cols)] if dims == 2 else [(r,) for r in range(num_rows)]
    )
    for col in (1, 2):  # the empty pool in both panels, so untouched cells show
        squares(every, col, FREE_COLOR, "not touched", showlegend=col == 1, hoverinfo="skip", hovertemplate=None)
    touched: set[tuple[int, ...]] = set()
    if result.trace is not None:
        for i, (program, cells) in enumerate(result.trace.by_program(tensor, kind, dims).items()):
            touched |= cells
            color = PROGRAM_COLORS[i % len(PROGRAM_COLORS)]
            squares(
                sorted(cells), 1, color, "touched by program n (n in the cell)",
                mode="markers+text", text=[str(i)] * len(cells), textfont=dict(color=text_color(color), size=11),
                legendgroup="programs", showlegend=i == 0,
                hovertemplate=f"{_program_label(program)}<br>{where}<extra></extra>",
            )  # fmt: skip
    for cells, symbol, color, name in (
        (sorted(touched - want), "x-thin", STRAY_COLOR, "✗ a right kernel never touches it"),
        (sorted(want - touched), "square-open", MISSING_COLOR, "missed: a right kernel touches it"),
    ):
        if cells:
            mistake = dict(symbol=symbol, size=20, line=dict(width=3, color=color))
            squares(cells, 1, color, name, marker=mistake, hovertemplate=f"{where}<extra>{name}</extra>")
    squares(sorted(want), 2, RIGHT_COLOR, "a right kernel touches it")
    for col in (1, 2):
        fig.update_xaxes(title_text=x_title or None, range=[-0.7, num_cols - 0.3], dtick=1, row=1, col=col)
    y_range = [num_rows - 0.5, -0.5]  # block 0 on top
    fig.update_yaxes(title_text=y_title, range=y_range, dtick=1, row=1, col=1)
    fig.update_yaxes(range=y_range, dtick=1, row=1, col=2)
    fig.update_layout(
        title=dict(text=title or f"{tensor}, {case.label}: {verdict(result)}", font=dict(size=13)),
        height=160 + 30 * max(num_rows, 5),  # room for the legend beside a pool of few rows
        width=880,
        legend=legend_right(),
        margin=dict(t=90),
        plot_bgcolor="white",
    )
    return fig


def show_puzzle(puzzle: str, kernel: Any, case: int = 0) -> go.Figure | None:
    """One case of a puzzle (``puzzles.run``), drawn: ``trace_figure`` of what the kernel touched, where the
    interpreter runs it. Compiled on a GPU a kernel leaves no trace, and a figure would show every cell missed:
    the verdict is printed instead (``None`` returned)."""
    from ...kernels.launch import kernel_device
    from ..puzzles import run, verdict

    result = run(puzzle, kernel, case)
    if kernel_device().type != "cpu":
        print(f"{result.case.label}: {verdict(result)}")
        print("(compiled on a GPU: Triton records an access trace only in its interpreter, on a CPU)")
        return None
    return trace_figure(result)
