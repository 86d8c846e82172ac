"""Length distributions, traces, and the static-vs-paged table of "Inference at scale" (section 23.1)."""

import numpy as np
import pytest

from minipaged.kv_math import KVSpec
from minipaged.lab.workloads import (
    STATIC_VS_PAGED_BYTES_PER_TOKEN,
    STATIC_VS_PAGED_MAX_CONTEXT,
    STATIC_VS_PAGED_PRINTED,
    Trace,
    TraceRequest,
    bimodal_lengths,
    chat_mix_lengths,
    lognormal_lengths,
    make_trace,
    sharegpt_like_pairs,
    sharegpt_like_trace,
    static_vs_paged_lengths,
    static_vs_paged_table,
)


# ---- lognormal ---------------------------------------------------------------------------------
def test_lognormal_is_seeded():
    a = lognormal_lengths(50, mean=200, seed=7)
    assert np.array_equal(a, lognormal_lengths(50, mean=200, seed=7))
    assert not np.array_equal(a, lognormal_lengths(50, mean=200, seed=8))
    assert a.dtype == np.int64


def test_lognormal_mean_and_median_parameterisations():
    x = lognormal_lengths(200_000, mean=300, sigma=0.8, seed=0)
    assert x.mean() == pytest.approx(300, rel=0.02)
    y = lognormal_lengths(200_000, median=300, sigma=0.8, seed=0)
    assert np.median(y) == pytest.approx(300, rel=0.02)
    assert y.mean() == pytest.approx(300 * np.exp(0.32), rel=0.02)


def test_lognormal_is_clipped():
    x = lognormal_lengths(10_000, mean=100, sigma=1.5, lo=16, hi=512, seed=1)
    assert x.min() == 16 and x.max() == 512


@pytest.mark.parametrize(
    "kw", [dict(), dict(mean=1, median=1), dict(mean=-5), dict(mean=10, lo=5, hi=4), dict(mean=10, sigma=-1)]
)
def test_lognormal_bad_arguments(kw):
    with pytest.raises(ValueError):
        lognormal_lengths(10, **kw)


def test_negative_n():
    with pytest.raises(ValueError, match="n must"):
        lognormal_lengths(-1, mean=10)
    assert len(lognormal_lengths(0, mean=10)) == 0


# ---- the chat mix ----------------------------------------------------------------------------
def test_chat_mix_shares_and_ranges():
    x = chat_mix_lengths(40_000, seed=3)
    shares = [np.mean((x >= lo) & (x < hi)) for lo, hi in ((100, 1000), (1000, 5000), (5000, 20000), (20000, 100001))]
    assert shares == pytest.approx([0.50, 0.30, 0.15, 0.05], abs=0.01)
    assert x.min() >= 100 and x.max() <= 100_000
    assert np.median(x[(x >= 1000) & (x < 5000)]) < 3000  # log-uniform inside a bucket: skewed short
    assert np.array_equal(x, chat_mix_lengths(40_000, seed=3))


def test_chat_mix_rejects_bad_shares():
    with pytest.raises(ValueError, match="sum to 1"):
        chat_mix_lengths(10, mix=((0.5, 1, 10), (0.4, 10, 20)))


# ---- ShareGPT-like ---------------------------------------------------------------------------
def test_sharegpt_like_pairs_fit_and_look_like_sharegpt():
    p, o = sharegpt_like_pairs(20_000, seed=0, max_model_len=2048)
    assert len(p) == len(o) == 20_000
    assert (p + o).max() <= 2048 and p.min() >= 4 and o.min() >= 4
    assert p.mean() == pytest.approx(161, rel=0.08) and o.mean() == pytest.approx(338, rel=0.08)
    assert np.median(p) < p.mean() and np.median(o) < o.mean()  # long right tails
    p2, _ = sharegpt_like_pairs(20_000, seed=0, max_model_len=2048)
    assert np.array_equal(p, p2)
    short_p, short_o = sharegpt_like_pairs(500, seed=0, max_model_len=256)
    assert (short_p + short_o).max() <= 256
    with pytest.raises(ValueError):
        sharegpt_like_pairs(5, max_model_len=4)


# ---- traces ---------------------------------------------------------------------------------
def test_trace_events_and_finish_steps():
    trace = Trace([TraceRequest("b", 1, 2, 2), TraceRequest("a", 0, 3, 4)])
    assert [r.req_id for r in trace] == ["a", "b"]  # sorted by arrival
    assert trace.finish_step("a") == 4 and trace.finish_step("b") == 3
    ev = [(e.time, e.kind, e.req_id) for e in trace.events()]
    assert ev == [(0, "arrive", "a"), (1, "arrive", "b"), (3, "finish", "b"), (4, "finish", "a")]
    r = trace.requests[0]
    assert [r.context_len(k) for k in range(6)] == [3, 4, 5, 6, 7, 7]
    assert r.total_len == 7 and trace.max_total_len == 7


def test_trace_departures_sort_before_arrivals_at_the_same_step():
    trace = Trace([TraceRequest("a", 0, 1, 2), TraceRequest("b", 2, 1, 1)])
    assert [(e.time, e.kind) for e in trace.events()][1:3] == [(2, "finish"), (2, "arrive")]


def test_trace_rejects_bad_requests():
    with pytest.raises(ValueError, match="unique"):
        Trace([TraceRequest("a", 0, 1, 1), TraceRequest("a", 1, 1, 1)])
    with pytest.raises(ValueError, match="output_len"):
        Trace([TraceRequest("a", 0, 1, 0)])


def test_make_trace_poisson_arrivals():
    trace = make_trace([10] * 4000, [5] * 4000, arrival_rate=0.5, seed=2)
    arrivals = np.array([r.arrival for r in trace])
    assert np.all(np.diff(arrivals) >= 0)
    assert arrivals[-1] / 4000 == pytest.approx(2.0, rel=0.05)  # mean gap 1 / rate
    assert all(r.arrival == 0 for r in make_trace([1, 2], [3, 4]))
    with pytest.raises(ValueError):
        make_trace([1], [1, 2])
    with pytest.raises(ValueError):
        make_trace([1], [1], arrival_rate=0)


def test_sharegpt_like_trace_is_seeded():
    a = sharegpt_like_trace(30, seed=5, arrival_rate=0.2)
    b = sharegpt_like_trace(30, seed=5, arrival_rate=0.2)
    assert a.requests == b.requests


# ---- static vs paged, 100 lognormal requests ----------------------------------------------------
def test_static_vs_paged_constants_reproduce_the_printed_gigabytes():
    """The text prints GB, not the model; 131072 B/token and MAX_CONTEXT 8192 give its figures back."""
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    assert spec.bytes_per_token == STATIC_VS_PAGED_BYTES_PER_TOKEN == 131072
    f = STATIC_VS_PAGED_PRINTED
    bpt, ctx = STATIC_VS_PAGED_BYTES_PER_TOKEN, STATIC_VS_PAGED_MAX_CONTEXT
    assert round(100 * ctx * bpt / 1e9, 2) == f["static_allocated_gb"]
    assert round(f["total_tokens"] * bpt / 1e9, 2) == f["static_used_gb"]
    assert round(f["paged_blocks"] * 16 * bpt / 1e9, 2) == f["paged_allocated_gb"]
    assert round(100 * ctx / (f["paged_blocks"] * 16), 1) == f["ratio"]


def test_static_vs_paged_table_lands_on_the_printed_one():
    ours = static_vs_paged_table()
    printed = STATIC_VS_PAGED_PRINTED
    assert set(ours) == set(printed)
    assert abs(ours["min"] - printed["min"]) <= 2 and abs(ours["max"] - printed["max"]) <= 10
    assert round(ours["mean"]) == printed["mean"]
    assert abs(ours["paged_blocks"] - printed["paged_blocks"]) <= 5
    assert round(ours["static_utilisation_pct"], 1) == printed["static_utilisation_pct"]
    assert round(ours["paged_utilisation_pct"], 1) == printed["paged_utilisation_pct"]
    assert abs(ours["ratio"] - printed["ratio"]) < 0.3
    assert ours["static_allocated_gb"] == pytest.approx(107.37, abs=0.005)
    # internal consistency of the table
    assert ours["total_tokens"] == int(static_vs_paged_lengths().sum())
    assert ours["paged_utilisation_pct"] == pytest.approx(100 * ours["total_tokens"] / (ours["paged_blocks"] * 16))
    assert ours["saved_gb"] == pytest.approx(ours["static_allocated_gb"] - ours["paged_allocated_gb"])


def test_static_vs_paged_waste_is_under_one_block_per_request():
    ours = static_vs_paged_table()
    assert ours["paged_blocks"] * 16 - ours["total_tokens"] < 100 * 16
    other = static_vs_paged_table(seed=1)
    assert other["static_utilisation_pct"] < 3.5 and other["paged_utilisation_pct"] > 94


def test_bimodal_lengths_two_kinds_in_their_ranges():
    p, o = bimodal_lengths(4000, rng=3, long_share=0.2)
    long_ = p >= 1500
    assert abs(long_.mean() - 0.2) < 0.03 and p.dtype == o.dtype == np.int64
    assert p[long_].min() >= 1500 and p[long_].max() < 3500 and o[long_].max() < 128
    assert p[~long_].min() >= 64 and p[~long_].max() < 400 and o[~long_].min() >= 16 and o[~long_].max() < 256
    assert np.array_equal(bimodal_lengths(50, rng=7)[0], bimodal_lengths(50, rng=7)[0])  # seeded
    assert (bimodal_lengths(100, long_share=0.0)[0] < 400).all() and (
        bimodal_lengths(100, long_share=1.0)[0] >= 1500
    ).all()
    for bad in (dict(long_share=1.5), dict(short_prompt=(400, 64)), dict(long_output=(0, 10))):
        with pytest.raises(ValueError):
            bimodal_lengths(10, **bad)
