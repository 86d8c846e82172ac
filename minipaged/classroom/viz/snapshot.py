"""The course's figures as a static page shows them: plotly figures drawn by a local plotly.js, and widgets as a
snapshot of their first state.

``make site`` (``tools/build_site.py``) executes every chapter in a kernel that has called ``install()`` first:

* plotly figures render as a ``<div>`` and a script that calls ``Plotly.newPlot``, without plotly.js inside
  (the site loads one copy, ``_static/plotly.min.js``, on every page: no network, and no 4.8 MB per figure);
* an ipywidgets widget renders as static HTML of its state when it was displayed: ``HTML`` widgets as their
  markup, boxes as rows and columns, sliders, dropdowns and buttons as disabled controls with their values, a
  plotly ``FigureWidget`` as a plotly figure. Each snapshot is framed and labelled with the command that makes
  it live, since nothing on a static page can call back into Python.

Both carry a marker class (``FIGURE_CLASS``, ``WIDGET_CLASS``) that the site's browser test counts.
"""

from __future__ import annotations

import html
from typing import Any

FIGURE_CLASS = "minipaged-figure"
WIDGET_CLASS = "minipaged-widget-snapshot"
LIVE_HINT = "A snapshot of the widget's first state. To move it: <code>make lab</code>, then run this notebook."


def figure_html(fig: Any) -> str:
    """One plotly figure as HTML that draws with the page's own plotly.js."""
    import plotly.io as pio

    body = pio.to_html(fig, include_plotlyjs=False, full_html=False, config={"responsive": True})
    return f'<div class="{FIGURE_CLASS}">{body}</div>'


def _control(description: str, value: str, kind: str) -> str:
    label = f"<b>{html.escape(description)}</b> " if description else ""
    return f'<span class="minipaged-control" data-kind="{kind}">{label}<code>{html.escape(value)}</code></span>'


def widget_html(widget: Any) -> str:
    """A widget's state as static HTML (recursively for boxes); anything unknown shows its class name."""
    import ipywidgets as W
    import plotly.graph_objects as go

    if isinstance(widget, go.FigureWidget):
        return figure_html(go.Figure(widget))
    if isinstance(widget, W.Box):
        direction = "row" if isinstance(widget, W.HBox) else "column"
        children = "".join(widget_html(child) for child in widget.children)
        return f'<div style="display:flex;flex-direction:{direction};gap:6px;flex-wrap:wrap">{children}</div>'
    if isinstance(widget, (W.HTML, W.HTMLMath)):
        return f"<div>{widget.value}</div>"
    if isinstance(widget, W.Label):
        return f"<div>{html.escape(widget.value)}</div>"
    if isinstance(widget, W.Output):
        return "".join(_output_html(o) for o in widget.outputs)
    if isinstance(widget, W.Button):
        return f"<button disabled>{html.escape(widget.description or 'button')}</button>"
    if isinstance(widget, W.Play):
        return _control("play", f"step {widget.value}", "play")
    if isinstance(widget, (W.Dropdown, W.RadioButtons, W.Select, W.ToggleButtons)):
        return _control(widget.description, str(widget.label), "choice")
    if isinstance(widget, (W.Text, W.Textarea)):
        return _control(widget.description, widget.value or widget.placeholder, "text")
    if isinstance(widget, W.ValueWidget):  # sliders, progress bars, checkboxes
        return _control(getattr(widget, "description", ""), str(widget.value), "value")
    return f"<div><code>{html.escape(type(widget).__name__)}</code></div>"


def _output_html(output: dict[str, Any]) -> str:
    data = output.get("data", {})
    if "text/html" in data:
        return str(data["text/html"])
    text = data.get("text/plain") or output.get("text", "")
    return f"<pre>{html.escape(str(text))}</pre>" if text else ""


def snapshot_html(widget: Any) -> str:
    """The framed, labelled snapshot of a displayed widget."""
    return (
        f'<div class="{WIDGET_CLASS}" style="border:1px dashed #888;padding:8px;margin:4px 0">'
        f"{widget_html(widget)}"
        f'<p style="font-size:85%;color:#444;margin:6px 0 0">{LIVE_HINT}</p></div>'
    )


def install() -> None:
    """In this kernel, display plotly figures and widgets as the static site shows them (see the module doc)."""
    import ipywidgets as W
    import plotly.graph_objects as go
    import plotly.io as pio
    from IPython import get_ipython
    from plotly.io._base_renderers import HtmlRenderer

    class SiteRenderer(HtmlRenderer):
        """plotly's HTML renderer, without plotly.js and with the course's marker class."""

        def __init__(self) -> None:
            super().__init__(connected=False, full_html=False, include_plotlyjs=False)

        def to_mimebundle(self, fig_dict: dict[str, Any]) -> dict[str, str]:
            return {"text/html": figure_html(go.Figure(fig_dict))}

    pio.renderers["minipaged_site"] = SiteRenderer()
    pio.renderers.default = "minipaged_site"
    shell = get_ipython()
    if shell is None:
        return
    formatter = shell.display_formatter.mimebundle_formatter

    def snapshot(widget: Any, include: Any = None, exclude: Any = None) -> dict[str, str]:
        if isinstance(widget, go.FigureWidget):
            return {"text/html": figure_html(go.Figure(widget))}
        return {"text/html": snapshot_html(widget), "text/plain": repr(widget)}

    formatter.for_type(W.Widget, snapshot)
    formatter.for_type(go.FigureWidget, snapshot)
