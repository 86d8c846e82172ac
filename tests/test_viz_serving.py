"""Chapter 11's load-test figure (minipaged/classroom/viz/serving_viz.py) and the load generator's arithmetic
(minipaged/serving/load.py), on made-up records: no server needed."""

from __future__ import annotations

import math

import pytest

from minipaged.classroom.viz.layout import check_layout
from minipaged.classroom.viz.serving_viz import serving_figure
from minipaged.serving.load import LoadResult, RequestRecord, kv_usage, percentile, poisson_gaps


def result(rate: float, ttft: float, itl: float, hang_ups: int = 0) -> LoadResult:
    records = [RequestRecord(i, False, ok=True, ttft=ttft * (1 + i / 10), itls=[itl] * 3, output_tokens=4,
                             finish_reason="length", end=2.0) for i in range(5)]  # fmt: skip
    records += [RequestRecord(5 + i, True, ttft=ttft, end=1.0) for i in range(hang_ups)]  # left after one token
    records.append(RequestRecord(99, False, error="HTTP 500: boom", end=1.5))
    return LoadResult(rate, records, 2.0, [(0.0, 0.0), (1.0, 0.5), (2.0, 0.25)])


def test_summary_counts_and_percentiles() -> None:
    r = result(4.0, 0.1, 0.02, hang_ups=2)
    s = r.summary()
    assert (s["requests"], s["completed"], s["hung_up"], s["failed"]) == (8, 5, 2, 1)
    assert s["output_tok_per_s"] == 10.0  # 5 completed x 4 tokens in 2 s; the hung-up ones do not count
    assert s["ttft_ms_p50"] == 110.0 and s["itl_ms_p99"] == 20.0  # TTFTs 100, 100, 100, 110, ..., 140 ms
    assert [x.index for x in r.failed] == [99]
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0


def test_gaps_and_metric_names() -> None:
    gaps = poisson_gaps(2000, 8.0, seed=3)
    assert gaps == poisson_gaps(2000, 8.0, seed=3) and abs(sum(gaps) / len(gaps) - 1 / 8) < 0.01
    assert poisson_gaps(3, math.inf) == [0.0, 0.0, 0.0]
    assert kv_usage({"minipaged:kv_cache_usage_perc": 0.3}) == 0.3
    assert kv_usage({"vllm:gpu_cache_usage_perc": 0.4}) == 0.4 and kv_usage({}) is None


def test_serving_figure_follows_the_layout_rules() -> None:
    runs = [result(8.0, 0.4, 0.05), result(1.0, 0.1, 0.02), result(math.inf, 0.9, 0.06)]
    fig = serving_figure(runs, title="three rates")
    assert check_layout(fig) == []
    ttft_p50 = next(t for t in fig.data if t.name == "p50" and t.xaxis == "x")
    assert list(ttft_p50.x) == [1.0, 8.0, math.inf]  # sorted by rate
    assert list(ttft_p50.y) == [r.summary()["ttft_ms_p50"] for r in sorted(runs, key=lambda r: r.rate)]
    kv = [t for t in fig.data if t.name.endswith("req/s")]
    assert [t.name for t in kv] == ["1 req/s", "8 req/s", "inf req/s"] and list(kv[0].y) == [0.0, 50.0, 25.0]
    with pytest.raises(ValueError, match="at least one"):
        serving_figure([])
