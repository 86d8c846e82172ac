"""LiveFigure (minipaged/classroom/viz/live_figure.py): every course figure is drawn in the browser from its whole
synced state, sent once per change; plotly.js goes out once per kernel, not with each figure."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import comm
import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.basedatatypes import Undefined
from plotly.serializers import _py_to_js

from minipaged.classroom.viz import live_figure
from minipaged.classroom.viz.live_figure import LiveFigure, plotly_source

VIZ = Path(live_figure.__file__).parent


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, list[str]]]:
    """(message type, state keys) of every comm message a widget sends."""
    messages: list[tuple[str, list[str]]] = []

    class Recorder(comm.base_comm.BaseComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys) -> None:  # type: ignore[override]
            messages.append((msg_type, sorted((data or {}).get("state", {}))))

    monkeypatch.setattr(comm, "create_comm", lambda *a, **k: Recorder(*a, **k))
    return messages


def _synced(fig: LiveFigure) -> bool:
    return fig._widget_data == list(fig._data) and fig._widget_layout == fig._layout_obj._props


def test_every_change_sends_the_whole_state_and_no_edit(sent) -> None:
    fig = LiveFigure(layout=dict(title="first"))
    fig.add_scatter(x=[1, 2], y=[3, 4], name="a")  # outside a batch: sent at once
    assert _synced(fig) and sent[-1] == ("comm_msg", ["_widget_data"])
    sent.clear()
    with fig.batch_update():
        fig.data = []
        fig.add_bar(x=[1], y=[2], name="b")
        with fig.batch_update():  # nested: still one message, when the outer block closes
            fig.update_layout(title="second")
        fig.data[0].y = [5]
        assert sent == []
    assert sent == [("comm_msg", ["_widget_data", "_widget_layout"])]
    assert _synced(fig) and fig._widget_data[0]["y"] == [5] and fig._widget_layout["title"]["text"] == "second"
    sent.clear()
    with fig.batch_update():  # nothing changed: nothing sent
        fig.update_layout(title="second")
    assert sent == []
    fig.update_layout(width=400)
    assert all(not k.startswith("_py2js_") for _, keys in sent for k in keys) and _synced(fig)


def test_plotly_js_goes_to_the_browser_once_and_the_module_is_small(sent) -> None:
    figures = [LiveFigure(), LiveFigure(), go.FigureWidget(LiveFigure(layout=dict(title="x")))]
    source = plotly_source()
    assert {f._plotly_js for f in figures[:2]} == {source.model_id}
    assert sum("source" in keys for _, keys in sent) <= 1  # made once (or by an earlier test: then not here)
    assert source.source.startswith("/**\n* plotly.js v") and len(source.source) > 1_000_000
    esm = figures[0]._esm
    assert len(esm) < 10_000 and "Plotly.react" in esm  # not plotly.js: it is loaded from the source widget
    source.close()
    assert plotly_source() is not source and LiveFigure()._plotly_js == plotly_source().model_id  # made again


def test_every_figure_widget_of_the_course_is_a_live_figure() -> None:
    """A go.FigureWidget would bring back plotly's 5 MB module per figure and its edit protocol (the figures the
    browser test saw drawn empty and deaf on a loaded machine)."""
    found = [
        f"{p.name}:{n}"
        for p in sorted(VIZ.parent.parent.rglob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"\bFigureWidget\(", line) and p.name != "live_figure.py"
    ]
    assert found == []


def test_a_course_widget_is_drawn_from_its_current_state() -> None:
    from minipaged.classroom.viz import KVCalculator

    calc = KVCalculator()
    before = calc.figure._widget_data
    calc.tokens.value = calc.tokens.max  # a slider moved: the figure is redrawn, and its synced state with it
    assert isinstance(calc.figure, LiveFigure) and _synced(calc.figure) and calc.figure._widget_data != before


@pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js to run live_figure.js's decoder")
def test_the_browser_decodes_numpy_arrays_and_unset_values_as_plotlys_serializer_sends_them() -> None:
    """plotly's Python serializer sends a 1-D numeric NumPy array as {buffer, dtype, shape} over a binary buffer and
    an unset value as "_undefined_"; the module must hand plotly.js the numbers and leave the unset key out."""
    y = np.array([0.5, -2.0, 7.25], dtype=np.float32)
    sent = _py_to_js([{"type": "scatter", "x": [1, 2, 3], "y": y, "name": Undefined}], None)
    assert isinstance(sent[0]["y"]["buffer"], memoryview)  # what goes over the comm as a binary buffer
    script = f"""
        import {{ decode }} from {json.dumps((VIZ / "live_figure.js").as_uri())};
        const bytes = Uint8Array.from(Buffer.from({json.dumps(y.tobytes().hex())}, "hex"));
        const padded = new Uint8Array(bytes.length + 8); padded.set(bytes, 8);  // a view that does not start at 0
        const y = {{ buffer: new DataView(padded.buffer, 8, bytes.length), dtype: "float32", shape: [3] }};
        const [trace] = decode([{{ type: "scatter", x: [1, 2, 3], y, name: "_undefined_" }}]);
        console.log(JSON.stringify({{ y: Array.from(trace.y), typed: trace.y instanceof Float32Array,
                                      keys: Object.keys(trace), x: trace.x }}));
    """
    out = subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"y": [0.5, -2.0, 7.25], "typed": True, "keys": ["type", "x", "y"], "x": [1, 2, 3]}
