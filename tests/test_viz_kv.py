"""Chapter 01 widgets, driven from Python as a learner would drive them."""

import json
import re

from minipaged.classroom.viz import KVCalculator, KVGrowthView
from minipaged.classroom.viz.layout import check_layout, contrast_ratio, text_px
from minipaged.kv_math import GiB, KVSpec, MiB


def test_calculator_follows_its_controls():
    calc = KVCalculator(preset="llama-3-8b", tokens=2048, batch=8, dtype="bf16", tp=1, gpu_gib=80)
    s = calc.summary
    assert s["bytes_per_token"] == 131_072 and s["request_bytes_per_rank"] == 256 * MiB
    assert s["batch_bytes_per_rank"] == 8 * 256 * MiB and s["fits"]
    assert len(calc.figure.data) == 3  # MHA, GQA, MQA
    assert [t.name for t in calc.figure.data] == ["MHA (32 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)"]
    calc.dtype.value = "fp32"
    assert calc.summary["bytes_per_token"] == 262_144
    calc.model.value = "llama-3-70b"
    calc.tokens.value = 8192
    calc.dtype.value = "fp16"
    calc.tp.value = 2
    s = calc.summary
    assert s["kv_heads_per_rank"] == 4 and s["request_bytes_per_rank"] == 1.25 * GiB
    assert s["weights_bytes_per_rank"] == 70_600_000_000
    expected_blocks = int((80 * GiB * 0.9 - 70_600_000_000) // (16 * 160 * 1024))
    assert s["num_blocks"] == expected_blocks
    assert s["max_requests"] == expected_blocks // 512
    assert "1.25 GiB" in calc.output.value
    calc.batch.value = 512
    assert not calc.summary["fits"] and "does not fit" in calc.output.value
    assert check_layout(calc.figure) == []


def test_calculator_labels_are_not_cut():
    calc = KVCalculator()
    for w in (
        calc.model,
        calc.config_text,
        calc.tokens,
        calc.batch,
        calc.dtype,
        calc.block_size,
        calc.tp,
        calc.gpu_gib,
        calc.utilization,
    ):
        width = int(w.style.description_width.removesuffix("px"))
        assert width >= text_px(w.description), w.description  # "GPU memory (…", "memory utiliz…" before
    options = int(calc.model.layout.width.removesuffix("px")) - int(calc.model.style.description_width[:-2])
    assert options >= max(text_px(label) for label, _ in calc.model.options)


def test_calculator_reads_a_pasted_config_and_reports_bad_json():
    calc = KVCalculator()
    calc.model.value = "custom"
    assert calc.config_text.layout.display == ""
    calc.config_text.value = json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    )
    assert calc.summary["bytes_per_token"] == KVSpec(30, 3, 64, 2).bytes_per_token
    assert calc.error.value == ""
    calc.config_text.value = "{not json"
    assert "not valid JSON" in calc.error.value
    calc.config_text.value = json.dumps({"num_hidden_layers": 2})
    assert "num_attention_heads" in calc.error.value


def test_calculator_tp3_falls_back_to_replicated_heads():
    calc = KVCalculator(preset="llama-3-70b", tp=3)
    assert calc.summary["kv_heads_per_rank"] == 8 and "replicated" in calc.summary["sharding"]


def test_growth_view_steps_token_by_token():
    spec = KVSpec(30, 3, 64, 4)
    view = KVGrowthView("The cat sat on the mat .".split(), spec, block_size=4)
    assert view.state["tokens_cached"] == 0 and view.meter.value == 0
    view.step.value = 5
    st = view.state
    assert (st["blocks"], st["empty_slots"], st["query"]) == (2, 3, "the")
    assert st["kv_bytes"] == 5 * 46_080 and view.meter.value == 8 * 46_080
    assert view.grid.value.count("<b>Q</b>") == 1 and view.grid.value.count("·") == 3
    view.step.value = 7
    assert view.state["blocks"] == 2 and view.state["empty_slots"] == 1
    assert view.meter.value == view.meter.max  # the budget defaults to the whole sequence
    for style in re.findall(r"style='([^']*)'", view.grid.value):  # tokens on the block colours read (>= 4.5:1)
        bg, fg = re.search(r"background:([^;]+)", style), re.search(r"(?:^|;)color:([^;]+)", style)
        if fg:
            assert contrast_ratio(fg.group(1), bg.group(1) if bg else "white") >= 4.5, style
