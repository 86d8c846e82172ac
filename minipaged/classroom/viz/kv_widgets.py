"""Chapter 01 widgets: a KV-cache calculator and a token-by-token growth view.

Both keep their numbers in plain attributes (``summary``, ``state``) computed by
``minipaged.kv_math``, so tests can drive the controls from Python and check what
a learner would see, without a browser.
"""

from __future__ import annotations

import html
import json
from typing import Any

import ipywidgets as W
from IPython.display import display

from ...kv_math import PRESETS, GiB, KVSpec, attention_variants, format_bytes
from .layout import label_style, legend_right, text_color, widget_width
from .live_figure import LiveFigure

CUSTOM = "custom"
# Categorical colours, pairwise distinct (CIELAB ΔE >= 30) and far from the pool's status colours (grey free,
# green cached, brown shared, black null); text on each is black or white, whichever reads (``text_color``).
BLOCK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#439894", "#b279a2", "#ff9da6", "#eeca3b"]


class KVCalculator:
    """Model, tokens, batch, dtype, block size, TP ranks, GPU memory → bytes and capacity.

    ``summary`` holds the numbers shown; ``figure`` plots KV memory per request
    against tokens for the chosen model as MHA, as it is, and as MQA.
    """

    def __init__(
        self,
        preset: str = "llama-3-8b",
        tokens: int = 2048,
        batch: int = 8,
        dtype: str = "bf16",
        block_size: int = 16,
        tp: int = 1,
        gpu_gib: float = 80.0,
        utilization: float = 0.9,
    ) -> None:
        style = label_style("tokens / request", "GPU memory (GiB)", "memory utilization", "config.json")
        models = [(s.name, k) for k, s in PRESETS.items()] + [("paste a config.json", CUSTOM)]
        self.model = W.Dropdown(
            options=models,
            value=preset,
            description="model",
            style=style,
            layout=W.Layout(width=widget_width(style["description_width"], [m for m, _ in models])),
        )
        self.config_text = W.Textarea(
            placeholder='{"num_hidden_layers": 32, "num_attention_heads": 32, ...}',
            description="config.json",
            style=style,
            layout=W.Layout(width="520px", height="90px", display="none"),
        )
        self.tokens = W.IntSlider(
            value=tokens,
            min=16,
            max=131072,
            step=16,
            description="tokens / request",
            style=style,
            continuous_update=False,
            layout=W.Layout(width="520px"),
        )
        self.batch = W.IntSlider(
            value=batch,
            min=1,
            max=512,
            description="batch",
            style=style,
            continuous_update=False,
            layout=W.Layout(width="520px"),
        )
        self.dtype = W.Dropdown(
            options=["fp32", "fp16", "bf16", "fp8"], value=dtype, description="KV dtype", style=style
        )
        self.block_size = W.Dropdown(
            options=[1, 8, 16, 32, 64, 128, 256], value=block_size, description="block size", style=style
        )
        self.tp = W.Dropdown(options=[1, 2, 3, 4, 8, 16], value=tp, description="TP ranks", style=style)
        self.gpu_gib = W.FloatSlider(
            value=gpu_gib,
            min=8,
            max=192,
            step=8,
            description="GPU memory (GiB)",
            style=style,
            continuous_update=False,
            layout=W.Layout(width="520px"),
        )
        self.utilization = W.FloatSlider(
            value=utilization,
            min=0.5,
            max=0.98,
            step=0.01,
            description="memory utilization",
            style=style,
            continuous_update=False,
            layout=W.Layout(width="520px"),
        )
        self.output = W.HTML()
        self.error = W.HTML()
        self.figure = LiveFigure(
            layout=dict(
                height=340,
                margin=dict(l=60, r=20, t=40, b=50),
                title="KV cache of one request (per rank)",
                xaxis_title="tokens in the request",
                yaxis_title="KV cache (GiB)",
                legend=legend_right(),
            )
        )
        self.summary: dict[str, Any] = {}
        for w in (
            self.model,
            self.config_text,
            self.tokens,
            self.batch,
            self.dtype,
            self.block_size,
            self.tp,
            self.gpu_gib,
            self.utilization,
        ):
            w.observe(lambda _change: self.update(), names="value")
        self.update()

    # -- model -----------------------------------------------------------------------------------
    def spec(self) -> KVSpec:
        if self.model.value == CUSTOM:
            try:
                config = json.loads(self.config_text.value or "{}")
            except json.JSONDecodeError as exc:
                raise ValueError(f"config.json is not valid JSON: {exc.msg} (line {exc.lineno})") from None
            return KVSpec.from_hf_config(config, dtype=self.dtype.value, name="custom model")
        return KVSpec.from_preset(self.model.value, dtype=self.dtype.value)

    def update(self) -> None:
        self.config_text.layout.display = "" if self.model.value == CUSTOM else "none"
        try:
            spec = self.spec()
            self.summary = self._compute(spec)
        except ValueError as exc:
            self.error.value = f"<span style='color:#c00'>⚠ {html.escape(str(exc))}</span>"
            return
        self.error.value = ""
        self.output.value = self._html(self.summary)
        self._plot(spec)

    def _compute(self, spec: KVSpec) -> dict[str, Any]:
        tp, tokens, bs = self.tp.value, self.tokens.value, self.block_size.value
        rank = spec.per_rank(tp)
        heads, how = spec.kv_heads_per_rank(tp)
        # Weights are assumed bf16 and split evenly over the ranks.
        weights = (spec.num_params or 0) * 2 / tp
        budget = self.gpu_gib.value * GiB * self.utilization.value - weights
        s: dict[str, Any] = dict(
            model=spec.name,
            attention=spec.attention_kind,
            bytes_per_token=spec.bytes_per_token,
            kv_heads_per_rank=heads,
            sharding=how,
            bytes_per_token_per_rank=rank.bytes_per_token,
            bytes_per_block_per_rank=rank.bytes_per_block(bs),
            request_bytes_per_rank=rank.paged_bytes_for_tokens(tokens, bs),
            batch_bytes_per_rank=self.batch.value * rank.paged_bytes_for_tokens(tokens, bs),
            weights_bytes_per_rank=int(weights),
            kv_budget_per_rank=max(int(budget), 0),
            num_blocks=0,
            max_requests=0,
            fits=False,
        )
        if budget >= rank.bytes_per_block(bs):
            cap = rank.capacity(budget, bs, tokens)
            s.update(
                num_blocks=cap.num_blocks,
                max_requests=cap.full_requests,
                fits=cap.full_requests >= self.batch.value,
                tail_waste_tokens=cap.tail_waste_tokens,
            )
        return s

    def _html(self, s: dict[str, Any]) -> str:
        fb = format_bytes
        weights = fb(s["weights_bytes_per_rank"]) if s["weights_bytes_per_rank"] else "unknown (custom config)"
        verdict = "<b style='color:#2a7'>fits</b>" if s["fits"] else "<b style='color:#c00'>does not fit</b>"
        rows = [
            ("model", f"{s['model']} ({s['attention']})"),
            ("bytes / token (whole model)", f"{s['bytes_per_token']:,} B"),
            ("KV heads per rank", f"{s['kv_heads_per_rank']} ({s['sharding']})"),
            ("bytes / block per rank", fb(s["bytes_per_block_per_rank"])),
            ("one request per rank", fb(s["request_bytes_per_rank"])),
            ("the whole batch per rank", f"{fb(s['batch_bytes_per_rank'])} — {verdict}"),
            ("weights per rank (bf16)", weights),
            ("KV budget per rank", fb(s["kv_budget_per_rank"])),
            ("blocks in the pool", f"{s['num_blocks']:,}"),
            ("requests of this length at once", f"{s['max_requests']:,}"),
        ]
        body = "".join(f"<tr><td style='padding-right:1em'>{k}</td><td><b>{v}</b></td></tr>" for k, v in rows)
        return f"<table>{body}</table>"

    def _plot(self, spec: KVSpec) -> None:
        tp, tokens = self.tp.value, self.tokens.value
        xs = [int(tokens * f / 20) for f in range(0, 41)]
        with self.figure.batch_update():
            self.figure.data = []
            for name, variant in attention_variants(spec).items():
                rank = variant.per_rank(tp)
                self.figure.add_scatter(x=xs, y=[rank.bytes_for_tokens(x) / GiB for x in xs], name=name, mode="lines")
            self.figure.layout.shapes = [
                dict(type="line", x0=tokens, x1=tokens, y0=0, y1=1, yref="paper", line=dict(dash="dot", color="gray"))
            ]

    @property
    def widget(self) -> W.Widget:
        controls = W.VBox(
            [
                self.model,
                self.config_text,
                self.tokens,
                self.batch,
                W.HBox([self.dtype, self.block_size]),
                W.HBox([self.tp]),
                self.gpu_gib,
                self.utilization,
            ]
        )
        return W.VBox([controls, self.error, W.HBox([self.output, self.figure])])

    def _ipython_display_(self) -> None:
        display(self.widget)


class KVGrowthView:
    """Step through a sequence token by token and watch K/V fill blocks and a memory meter.

    After step ``t`` the cache holds tokens ``0..t-1``; the newest token's query was
    used once and thrown away, its key and value stay.
    """

    def __init__(self, tokens: list[str], spec: KVSpec, block_size: int = 4, budget_bytes: int | None = None) -> None:
        if not tokens:
            raise ValueError("KVGrowthView needs at least one token")
        self.tokens, self.spec, self.block_size = list(tokens), spec, block_size
        self.budget = budget_bytes or spec.paged_bytes_for_tokens(len(tokens), block_size)
        self.step = W.IntSlider(
            value=0, min=0, max=len(tokens), description="tokens seen", style=label_style("tokens seen", "KV memory")
        )
        self.play = W.Play(value=0, min=0, max=len(tokens), interval=400)
        W.jslink((self.play, "value"), (self.step, "value"))
        self.meter = W.FloatProgress(
            value=0,
            min=0,
            max=float(self.budget),
            description="KV memory",
            style=label_style("tokens seen", "KV memory"),
        )
        self.label = W.HTML()
        self.grid = W.HTML()
        self.state: dict[str, Any] = {}
        self.step.observe(lambda _change: self.update(), names="value")
        self.update()

    def update(self) -> None:
        t, bs = self.step.value, self.block_size
        blocks = self.spec.blocks_for_tokens(t, bs)
        used = self.spec.paged_bytes_for_tokens(t, bs)
        self.state = dict(
            tokens_cached=t,
            kv_bytes=self.spec.bytes_for_tokens(t),
            allocated_bytes=used,
            blocks=blocks,
            empty_slots=blocks * bs - t,
            query=self.tokens[t - 1] if t else None,
        )
        self.meter.value = float(min(used, self.budget))
        self.meter.bar_style = "danger" if used > self.budget else ""
        self.label.value = (
            f"{t} tokens cached · K+V {format_bytes(self.state['kv_bytes'])} "
            f"({self.spec.bytes_per_token:,} B/token) · {blocks} block(s) of {bs}, "
            f"{self.state['empty_slots']} slot(s) empty · allocated {format_bytes(used)} "
            f"of {format_bytes(self.budget)}"
        )
        self.grid.value = self._grid_html(t)

    def _grid_html(self, t: int) -> str:
        bs, cells = self.block_size, []
        for i in range(self.spec.blocks_for_tokens(max(t, 1), bs) * bs):
            color = BLOCK_COLORS[(i // bs) % len(BLOCK_COLORS)]
            if i < t:
                text = html.escape(self.tokens[i])
                mark = " <b>Q</b>" if i == t - 1 else ""
                style = f"background:{color};color:{text_color(color)}"
            else:
                text, mark, style = "·", "", f"border:1px dashed {color};color:#555"
            gap = "margin-right:10px" if i % bs == bs - 1 else "margin-right:2px"
            cells.append(f"<span style='display:inline-block;padding:2px 6px;{style};{gap}'>{text}{mark}</span>")
        return "<div style='line-height:2.2em'>" + "".join(cells) + "</div>"

    @property
    def widget(self) -> W.Widget:
        return W.VBox([W.HBox([self.play, self.step]), self.grid, self.meter, self.label])

    def _ipython_display_(self) -> None:
        display(self.widget)
