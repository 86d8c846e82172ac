"""``LiveFigure``: the plotly ``FigureWidget`` of every course widget, drawn in the browser from its whole state.

Why not plotly's own ``go.FigureWidget``. Its browser side is a 5 MB JavaScript module (plotly.js and the widget
code) sent with *every* figure, and it keeps the picture in step by *edits* (``_py2js_addTraces``, ``_py2js_restyle``
…) applied to the state the view was first drawn from. anywidget (0.11) gives a model 2 s to load its module; a
model that misses that window drops every message it receives afterwards. On a loaded machine a 5 MB module per
figure misses it: the figure is then drawn from the state its model was created with (no trace, a layout of three
keys) and never changes again — what the browser test saw in chapters 03 and 11 (reproduced on purpose by closing
the window early: ``tools/browser_test.py --anywidget-window``).

``LiveFigure`` changes both halves:

* its module (``live_figure.js``) is 4 KB, so it loads well inside that window (a badly overloaded machine can still
  miss it: once, with the window cut to 500 ms). plotly.js is sent once per kernel, as the source of one
  ``PlotlySource`` widget that every figure names, and loaded once per page;
* the browser draws the figure from its whole synced state (``_widget_data``, ``_widget_layout``), again at every
  change (``Plotly.react``, at most once per animation frame). Python sends that state after each change, once per
  outermost ``batch_update()`` block; plotly's edit messages are not sent at all. A view drawn late, a second view, a
  reloaded page: each shows the figure Python holds.

Use it like a ``go.FigureWidget``; group the changes of one redraw in ``with fig.batch_update():`` so the state goes
out once:

    fig = LiveFigure(layout=dict(title="…"))
    with fig.batch_update():
        fig.data = []
        fig.add_scatter(x=xs, y=ys)

What a view sends back (zoom, clicks) is not wired to Python: no course widget listens for it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
import traitlets
from plotly.offline import get_plotlyjs


class PlotlySource(W.Widget):
    """plotly.js, sent to the browser once per kernel (every ``LiveFigure`` names this widget's model)."""

    source = traitlets.Unicode().tag(sync=True)


_SOURCE: list[PlotlySource] = []  # the one PlotlySource of this kernel, made on first use


def plotly_source() -> PlotlySource:
    """The kernel's ``PlotlySource`` (made, and its 4.8 MB sent, the first time a figure needs it)."""
    if not _SOURCE or _SOURCE[0].comm is None:  # none yet, or closed (Widget.close_all())
        _SOURCE[:] = [PlotlySource(source=get_plotlyjs())]
    return _SOURCE[0]


class LiveFigure(go.FigureWidget):
    """A ``go.FigureWidget`` drawn from its whole state (see the module docstring)."""

    _esm = Path(__file__).with_name("live_figure.js").read_text()
    _plotly_js = traitlets.Unicode().tag(sync=True)  # the PlotlySource's model id
    _holds = 0  # open batch_update() blocks: the state goes out when the outermost one closes

    @traitlets.default("_plotly_js")
    def _default_plotly_js(self) -> str:
        return plotly_source().model_id

    @contextmanager
    def batch_update(self) -> Iterator[None]:
        """plotly's ``batch_update``, and the whole state sent once when the outermost block closes."""
        self._holds += 1
        try:
            with super().batch_update():
                yield
        finally:
            self._holds -= 1
            if not self._holds:
                self._send_state()

    def _send_state(self) -> None:
        """Set the synced state to the figure Python holds (traitlets send only what changed)."""
        with self.hold_sync():  # one comm message
            self._widget_data = copy.deepcopy(self._data)
            self._widget_layout = copy.deepcopy(self._layout_obj._props)

    def _edited(self, *args: Any, **kwargs: Any) -> None:
        if not self._holds:
            self._send_state()

    # plotly calls these after each change of the Python figure, to send an edit; we send the state instead
    _send_relayout_msg = _send_restyle_msg = _send_addTraces_msg = _send_moveTraces_msg = _edited
    _send_update_msg = _send_animate_msg = _send_deleteTraces_msg = _edited


__all__ = ["LiveFigure", "PlotlySource", "plotly_source"]
