"""Every programmatic change to a ``go.FigureWidget``: ``with redraw(fig): ...`` instead of ``fig.batch_update()``.

Why not plotly's own ``batch_update`` alone: a ``FigureWidget`` keeps its traces in the browser by *edits*
(``_py2js_addTraces``, ``_py2js_restyle`` …) that its JavaScript model applies to a copy of the data it was
born with (``_widget_data``, ``_widget_layout``; both are synced only when the widget is created). That model
starts listening only once the widget's JavaScript module has loaded. An edit sent before that — a figure
redrawn by the engine's observer thread a few milliseconds after the cell displayed it, while the browser is
still loading plotly — is lost, and every later edit then refers to traces the browser never got: the figure
stays empty for good (seen in the browser test on a slow machine: the caption moved, the figures never did).

``redraw`` makes the edits as before (a view already on screen moves smoothly) and then sets the synced full
state to what Python holds. A browser that missed edits, or a view rendered later (a second ``display``, a
reloaded page), starts from the current figure. The full state is only sent when it changed (traitlets compare
old and new), and sending it costs what the edits cost: the course's figures are redrawn whole anyway.

    with redraw(fig):
        fig.data[0].x = xs
        fig.update_layout(title="…")

``display_widget(widget)`` does the same for every figure in a widget tree before showing it, so the edits a
widget made while it was being built (``add_scatter`` after the constructor) cannot be lost either.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import ipywidgets as W
import plotly.graph_objects as go


@contextmanager
def redraw(fig: go.FigureWidget) -> Iterator[go.FigureWidget]:
    """Batch the edits made in the block, then sync the widget's full state (see the module docstring)."""
    with fig.batch_update():
        yield fig
    sync_full_state(fig)


def sync_full_state(fig: go.FigureWidget) -> None:
    """Set the state a late browser view is drawn from (``_widget_data``, ``_widget_layout``) to the figure now."""
    fig._widget_data = copy.deepcopy(fig._data)
    fig._widget_layout = copy.deepcopy(fig._layout_obj._props)


def display_widget(widget: W.Widget) -> None:
    """Show ``widget`` in the notebook, every ``FigureWidget`` in it synced to its full state first."""
    from IPython.display import display

    todo = [widget]
    while todo:
        w = todo.pop()
        if isinstance(w, go.FigureWidget):
            sync_full_state(w)
        todo.extend(getattr(w, "children", ()))
    display(widget)


__all__ = ["display_widget", "redraw", "sync_full_state"]
