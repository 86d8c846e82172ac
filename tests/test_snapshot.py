"""The static site's renderers (``minipaged/classroom/viz/snapshot.py``): a figure is a div that draws with the
page's plotly.js (none inside it), and a widget is a labelled snapshot of its state, boxes, text and figures
included."""

import ipywidgets as W
import plotly.graph_objects as go
import plotly.io as pio

from minipaged.classroom.viz import snapshot


def test_a_figure_carries_no_plotly_js_and_its_marker():
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout=dict(title="blocks in use"))
    html = snapshot.figure_html(fig)
    assert html.startswith(f'<div class="{snapshot.FIGURE_CLASS}">') and "Plotly.newPlot" in html
    assert "blocks in use" in html and len(html) < 100_000  # plotly.js alone is 4.8 MB


def test_a_widget_snapshot_shows_its_state_and_how_to_make_it_live():
    fig = go.FigureWidget(go.Scatter(x=[0, 1], y=[1, 0]))
    box = W.VBox([W.HBox([W.IntSlider(value=7, description="step"), W.Dropdown(options=["a", "b"], value="b",
                 description="policy"), W.Button(description="reset")]), W.HTML("<b>pool: 12 blocks</b>"), fig])  # fmt: skip
    html = snapshot.snapshot_html(box)
    assert html.count(f'class="{snapshot.WIDGET_CLASS}"') == 1 and html.count(f'class="{snapshot.FIGURE_CLASS}"') == 1
    for shown in ("<b>pool: 12 blocks</b>", "<code>7</code>", "<b>step</b>", "<code>b</code>", "reset", "make lab"):
        assert shown in html, shown
    assert "flex-direction:row" in html and "flex-direction:column" in html


def test_install_makes_the_site_renderer_the_default():
    before = pio.renderers.default
    try:
        snapshot.install()  # no IPython shell here: the renderer only
        bundle = pio.renderers["minipaged_site"].to_mimebundle(go.Figure(go.Bar(y=[1])).to_dict())
        assert pio.renderers.default == "minipaged_site" and snapshot.FIGURE_CLASS in bundle["text/html"]
    finally:
        pio.renderers.default = before
