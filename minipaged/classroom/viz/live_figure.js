// The browser side of minipaged's LiveFigure (live_figure.py): draw a plotly figure from the whole state its model
// syncs (_widget_data, _widget_layout, _config), and draw it again whenever that state changes. No edit protocol:
// a view that starts late, or misses a message, still ends up showing the figure Python holds.
//
// plotly.js itself (4.8 MB) is not in this module. It is sent once per kernel, as the `source` of one PlotlySource
// widget whose model id every LiveFigure carries in `_plotly_js`, and loaded once per page. This module stays a few
// kilobytes, so it loads well inside anywidget's 2 s window for a model to load its module (a 5 MB module per
// figure, plotly's own, missed it on a loaded machine: the model then dropped every later message).

const LOADED = Symbol.for("minipaged.plotly");
const TYPED = {
  int8: Int8Array, int16: Int16Array, int32: Int32Array, uint8: Uint8Array, uint16: Uint16Array,
  uint32: Uint32Array, float32: Float32Array, float64: Float64Array,
};

// The state as plotly's Python serializer sent it (plotly/serializers.py), as new objects plotly.js may keep:
// a 1-D numeric NumPy array arrives as {buffer, dtype, shape} over a binary buffer, an unset value as "_undefined_".
function decode(value) {
  if (Array.isArray(value)) return value.map(decode);
  if (value === "_undefined_") return undefined;
  if (value === null || typeof value !== "object") return value;
  const raw = value.buffer ?? value.value;
  if (TYPED[value.dtype] && value.shape && ArrayBuffer.isView(raw)) {
    return new TYPED[value.dtype](raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.byteLength));
  }
  const out = {};
  for (const [key, item] of Object.entries(value)) {
    const decoded = decode(item);
    if (decoded !== undefined) out[key] = decoded;
  }
  return out;
}

function loadPlotly(model) {
  const id = model.get("_plotly_js");
  const cache = (globalThis[LOADED] ??= new Map());
  if (!cache.has(id)) {
    const loading = (async () => {
      const source = await model.widget_manager.get_model(id);
      const url = URL.createObjectURL(new Blob([source.get("source")], { type: "text/javascript" }));
      const before = globalThis.Plotly; // plotly.js sets window.Plotly: give back whatever the page had
      try {
        await import(/* webpackIgnore: true */ /* @vite-ignore */ url);
        return globalThis.Plotly;
      } finally {
        URL.revokeObjectURL(url);
        if (before !== undefined) globalThis.Plotly = before;
      }
    })();
    loading.catch(() => cache.delete(id)); // a later view tries again
    cache.set(id, loading);
  }
  return cache.get(id);
}

async function render({ model, el }) {
  let Plotly;
  try {
    Plotly = await loadPlotly(model);
  } catch (error) {
    el.textContent = `minipaged: plotly.js could not be loaded (${error})`;
    throw error;
  }
  let frame = 0;
  let alive = true;
  const draw = () => {
    frame = 0;
    if (!alive) return;
    const layout = decode(model.get("_widget_layout") ?? {});
    layout.height ??= 360; // as plotly's own FigureWidget
    const config = { ...(model.get("_config") ?? {}), editSelection: false };
    Plotly.react(el, decode(model.get("_widget_data") ?? []), layout, config);
  };
  const later = () => {
    frame ||= requestAnimationFrame(draw); // one draw per frame, however many changes arrived
  };
  model.on("change:_widget_data", later);
  model.on("change:_widget_layout", later);
  model.on("change:_config", later);
  const resize = new ResizeObserver(() => {
    if (alive && el._fullLayout && model.get("_widget_layout")?.width === undefined) Plotly.Plots.resize(el);
  });
  resize.observe(el);
  draw();
  return () => {
    alive = false;
    if (frame) cancelAnimationFrame(frame);
    resize.disconnect();
    Plotly.purge(el);
  };
}

export { decode }; // for tests/test_live_figure.py
export default { render };
