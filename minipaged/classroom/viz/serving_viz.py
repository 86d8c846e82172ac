"""Chapter 11: what a load test against the server measured, as one figure.

``serving_figure(results)`` takes the ``LoadResult`` of each request rate (``minipaged.serving.load``) and
draws, left to right: time to first token and inter-token latency (p50 solid, p99 dashed) against the rate,
and the share of the KV cache in use during each run, as the server's ``/metrics`` reported it::

    TTFT (ms)  ▲            p99 ╱          ITL (ms) ▲                KV in use ▲   ╭──╮ 16 req/s
               │       ╱──────╱                     │ ────────── p99           │ ╭─╯  ╰╮
               │ ─────╱  p50                        │ ────────── p50           │╭╯ 4   ╰─╮
               └────────────▶ rate                  └────────────▶ rate        └──────────▶ time
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .layout import legend_right

if TYPE_CHECKING:
    from ...serving.load import LoadResult

RATE_COLORS = ["#1f77b4", "#dd6b20", "#2ca02c", "#9467bd", "#8c564b", "#d6278f"]


def serving_figure(results: Sequence[LoadResult], title: str = "") -> go.Figure:
    """Latency against the request rate, and KV use over time, for load runs at several rates."""
    if not results:
        raise ValueError("serving_figure needs at least one LoadResult")
    runs = sorted(results, key=lambda r: r.rate)
    fig = make_subplots(
        rows=1,
        cols=3,
        subplot_titles=("time to first token", "inter-token latency", "KV cache in use"),
        horizontal_spacing=0.09,
    )
    rates = [r.rate for r in runs]
    for col, key in ((1, "ttft"), (2, "itl")):
        for q, dash in (("p50", "solid"), ("p99", "dash")):
            ys = [r.summary()[f"{key}_ms_{q}"] for r in runs]
            fig.add_scatter(
                x=rates,
                y=ys,
                mode="lines+markers",
                name=q,
                legendgroup=q,
                showlegend=col == 1,
                line=dict(color="#303030", dash=dash),
                hovertemplate=f"{q} at %{{x:g}} req/s: %{{y:.0f}} ms<extra></extra>",
                row=1,
                col=col,
            )
    for i, r in enumerate(runs):
        if r.kv_usage:
            fig.add_scatter(
                x=[t for t, _ in r.kv_usage],
                y=[100 * u for _, u in r.kv_usage],
                mode="lines",
                name=f"{r.rate:g} req/s",
                line=dict(color=RATE_COLORS[i % len(RATE_COLORS)]),
                hovertemplate=f"{r.rate:g} req/s, %{{x:.1f}} s: %{{y:.0f}} % in use<extra></extra>",
                row=1,
                col=3,
            )
    for col in (1, 2):
        fig.update_xaxes(title_text="request rate (req/s)", type="log", row=1, col=col)
        fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=col)
    fig.update_xaxes(title_text="seconds into the run", row=1, col=3)
    fig.update_yaxes(title_text="% of the KV cache", range=[0, 102], row=1, col=3)
    fig.update_layout(
        title=title or None,
        height=340,
        margin=dict(l=60, r=10, t=70 if title else 50, b=50),
        legend=legend_right(),
    )
    return fig
