"""The layout rules themselves: each one catches the problem it names, and passes a figure that reads well."""

import plotly.graph_objects as go
import pytest
from plotly.subplots import make_subplots

from minipaged.classroom.viz.layout import (
    aligned_ticks,
    check_layout,
    check_mpl_layout,
    contrast_ratio,
    delta_e,
    label_style,
    legend_above,
    legend_right,
    nice_ticks,
    text_color,
    text_px,
    widget_width,
)


def _two_lines(**layout):
    fig = go.Figure(layout=dict(xaxis_title="step", yaxis_title="requests", **layout))
    fig.add_scatter(x=[0, 1], y=[1, 2], name="a")
    fig.add_scatter(x=[0, 1], y=[2, 1], name="b")
    return fig


def test_a_figure_that_reads_well_passes():
    assert check_layout(_two_lines()) == []  # plotly's default: a legend right of the plot
    assert check_layout(_two_lines(legend=legend_right())) == []
    assert check_layout(_two_lines(legend=legend_above())) == []
    assert check_layout(_two_lines(showlegend=False, legend=dict(x=0.5, y=0.5))) == []
    assert check_layout(_two_lines().to_dict()) == []  # a dict works too
    one = go.Figure(layout=dict(xaxis_title="x", yaxis_title="y", legend=dict(x=0.1, y=0.9)))
    one.add_scatter(x=[1], y=[1], name="only")  # one trace: plotly shows no legend
    assert check_layout(one) == []


def test_axis_titles():
    fig = _two_lines()
    fig.update_layout(yaxis_title=None)
    (problem,) = check_layout(fig)
    assert "yaxis shows data" in problem and "no title" in problem
    with pytest.raises(AssertionError, match="yaxis shows data"):
        check_layout(fig, strict=True)
    # a secondary axis needs its own title
    fig = _two_lines(
        legend=legend_above(), yaxis2=dict(overlaying="y", side="right", range=[0, 10], tickmode="linear", dtick=2.5)
    )
    fig.data[1].yaxis = "y2"
    assert any("yaxis2 shows data" in p for p in check_layout(fig))
    # shared subplot axes count as one; hidden axes need none
    sub = make_subplots(rows=2, cols=1, shared_xaxes=True)
    sub.add_scatter(x=[1, 2], y=[1, 2], row=1, col=1, showlegend=False)
    sub.add_scatter(x=[1, 2], y=[1, 2], row=2, col=1, showlegend=False)
    sub.update_yaxes(title_text="request")
    assert len(check_layout(sub)) == 2  # neither x axis has a title
    sub.update_xaxes(title_text="step", row=2, col=1)
    assert check_layout(sub) == []
    grid = go.Figure(layout=dict(xaxis=dict(visible=False), yaxis=dict(visible=False)))
    grid.add_scatter(x=[0], y=[0])
    assert check_layout(grid) == []


def test_legend_placement():
    # inside the plot (chapter 02's utilisation plot, chapter 01's calculator)
    assert "lies on the plotting area" in check_layout(_two_lines(legend=dict(x=0.01, y=0.2)))[0]
    assert "lies on the plotting area" in check_layout(_two_lines(legend=dict(orientation="h", y=0.9)))[0]
    # above but anchored at its top: it hangs down over the plot (the old BatchingPlayer)
    assert check_layout(_two_lines(legend=dict(orientation="h", y=1.15)))
    # below, over the x axis title (the old BatchingTimeline); plotly's horizontal default is there too
    assert "below the plot" in check_layout(_two_lines(legend=dict(orientation="h", y=-0.08)))[0]
    assert "below the plot" in check_layout(_two_lines(legend=dict(orientation="h")))[0]
    # right, over a right-side axis (chapter 07's latency figure)
    fig = _two_lines(
        yaxis2=dict(title="p99 (s)", overlaying="y", side="right", range=[0, 10], tickmode="linear", dtick=2.5)
    )
    fig.data[1].yaxis = "y2"
    assert "right-side axis" in check_layout(fig)[0]
    fig.update_layout(legend=legend_above())
    assert check_layout(fig) == []
    # above, under subplot titles; above with a title needs a taller top margin
    sub = make_subplots(rows=1, cols=2, subplot_titles=("left", "right"))
    sub.add_scatter(x=[1], y=[1], name="a", row=1, col=1)
    sub.add_scatter(x=[1], y=[1], name="b", row=1, col=2)
    sub.update_xaxes(title_text="x")
    sub.update_yaxes(title_text="y")
    assert check_layout(sub) == []
    sub.update_layout(legend=legend_above())
    assert "collides with the annotation 'left'" in check_layout(sub)[0]
    titled = _two_lines(title="t", legend=legend_above(), margin=dict(t=40))
    assert "top margin of 40px" in check_layout(titled)[0]
    titled.update_layout(margin=dict(t=90))
    assert check_layout(titled) == []


def test_legend_names_are_distinct():
    fig = _two_lines()
    fig.data[1].name = "a"
    assert "2 legend entries are called 'a'" in check_layout(fig)[0]
    fig.data[1].showlegend = False  # one entry for a legend group is fine
    assert check_layout(fig) == []


def test_secondary_axis_ticks():
    def fig_with(**y2):
        fig = _two_lines(
            legend=legend_above(),
            yaxis=dict(title="a", range=[0, 8], tickmode="linear", dtick=2),
            yaxis2=dict(title="b", overlaying="y", side="right", **y2),
        )
        fig.data[1].yaxis = "y2"
        return fig

    assert "leaves its ticks to plotly" in check_layout(fig_with(range=[0, 48]))[0]
    assert check_layout(fig_with(range=[0, 48], tickmode="linear", dtick=12)) == []
    assert "round ticks" in check_layout(fig_with(range=[2.4, 39.4], tickmode="linear", dtick=12.33))[0]
    assert "round ticks" in check_layout(fig_with(range=[0, 48], tickmode="linear", dtick=12, tick0=2.4))[0]
    assert "intervals" in check_layout(fig_with(range=[0, 49.92], tickmode="linear", dtick=12))[0]  # 4.16 vs 4
    assert "grid of 2 intervals" in check_layout(fig_with(range=[0, 48], tickmode="linear", dtick=24))[0]
    assert check_layout(fig_with(range=[0, 48], tickmode="linear", dtick=24, showgrid=False)) == []
    assert "intervals" in check_layout(fig_with(range=[0, 50], tickmode="linear", dtick=12))[0]
    assert check_layout(fig_with(tickmode="array", tickvals=[0, 10, 20, 30, 40])) == []
    assert "not evenly spaced" in check_layout(fig_with(tickmode="array", tickvals=[2.4, 14.7, 27.1, 39.4]))[0]


def test_contrast_and_text_color():
    assert contrast_ratio("black", "white") == pytest.approx(21.0)
    assert contrast_ratio("#fff", "#ffffff") == pytest.approx(1.0)
    assert contrast_ratio("#777777", "white") == pytest.approx(4.48, abs=0.01)  # WCAG's classic near miss
    assert contrast_ratio("rgb(255, 255, 255)", "#ff9da6") < 2.1  # white on light pink: ~2:1
    assert text_color("#ff9da6") == "black" and text_color("#303030") == "white"
    for grey in range(0, 256, 5):  # any background has a text colour
        bg = f"#{grey:02x}{grey:02x}{grey:02x}"
        assert contrast_ratio(text_color(bg), bg) >= 4.5
    assert delta_e("#f2c7c7", "#f7a8a8") < 20 < delta_e("#f4a3b4", "#d62728")  # the two old pinks were alike


def test_nice_and_aligned_ticks():
    assert nice_ticks(48, 4) == (80, 20) and nice_ticks(48, 5) == (50, 10)
    assert nice_ticks(7, 4, integer=True) == (8, 2)
    assert nice_ticks(0.3, 4, integer=True) == (4, 1)
    assert nice_ticks(12.7, 5) == (25, 5)
    assert nice_ticks(0, 4) == (4, 1)
    t = aligned_ticks(41, 12.7, left_integer=True)
    (lt, ld), (rt, rd) = t["left"], t["right"]
    assert lt >= 41 and rt >= 12.7 and round(lt / ld) == round(rt / rd)


def test_widget_sizes():
    style = label_style("GPU memory (GiB)", "memory utilization")
    assert int(style["description_width"][:-2]) >= 123  # DejaVu Sans 13px draws them 123 px wide
    assert int(widget_width("100px", ["seq 0 · segment 1 (returns at once)"])[:-2]) >= 100 + 231 + 30
    assert text_px("mmmm") > text_px("iiii")


def test_matplotlib_check():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    problems = check_mpl_layout(fig)
    assert any("x axis has no label" in p for p in problems) and any("y axis" in p for p in problems)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    assert check_mpl_layout(fig) == []
    ax.text(0.5, 0.5, "on the line", ha="center", va="center")
    assert any("drawn over a line" in p for p in check_mpl_layout(fig))
    ax.texts[0].remove()
    ax.text(0.95, 0.1, "a long label running out", ha="left")
    assert any("runs past the axes" in p for p in check_mpl_layout(fig))
    plt.close(fig)
