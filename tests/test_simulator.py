"""The model-free simulator: continuous batching on the real scheduler vs the static-batching baseline."""

import time

import numpy as np
import pytest

from minipaged.kv_math import KVSpec
from minipaged.lab.simulator import (
    HARDWARE,
    CostModel,
    SimConfig,
    SimRequest,
    compare,
    kv_pool_blocks,
    requests_from_trace,
    shared_prefix_requests,
    simulate_continuous,
    simulate_static,
    swap_vs_recompute,
)
from minipaged.lab.workloads import make_trace, sharegpt_like_trace

# Every step takes exactly one second: time counts steps, which makes schedules easy to predict.
UNIT = CostModel(
    weight_bytes=1.0,
    kv_bytes_per_token=0.0,
    flops_per_token=0.0,
    mem_bandwidth=1.0,
    flops=1.0,
    swap_bandwidth=1.0,
    name="one second per step",
)
H100 = CostModel.for_model("llama-3-8b", "h100")


def skewed(n=200, seed=0, rate=None):
    """Mostly short outputs, a few very long ones: where static batching waits for its longest member."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(16, 200, n)
    outputs = np.where(rng.random(n) < 0.1, rng.integers(600, 1000, n), rng.integers(8, 64, n))
    return requests_from_trace(make_trace(prompts, outputs, arrival_rate=rate, seed=seed), time_unit=0.01)


def test_cost_model_is_a_roofline_plus_swaps():
    spec = KVSpec.from_preset("llama-3-8b")
    hw = HARDWARE["h100"]
    weights = spec.num_params * 2
    # one decode of one short request: reading the weights dominates
    assert H100.step_time(100, 1) == pytest.approx((weights + 100 * spec.bytes_per_token) / hw.mem_bandwidth)
    # a 2048-token prefill chunk: arithmetic dominates
    assert H100.step_time(2048, 2048) == pytest.approx(2 * spec.num_params * 2048 / hw.flops)
    # swapping 10 blocks adds their bytes over PCIe, and a fixed cost for each of their copies:
    # one per layer for K and one for V (vLLM v0's swap_blocks), 5 µs each on the H100 entry
    assert H100.copies_per_block == 2 * spec.num_layers == 64 and H100.swap_latency == hw.copy_latency == 5e-6
    data = 10 * 16 * spec.bytes_per_token / hw.swap_bandwidth
    fixed = 10 * 64 * 5e-6
    assert H100.step_time(100, 1, 10 * 16 * spec.bytes_per_token) == pytest.approx(H100.step_time(100, 1) + data)
    assert H100.step_time(100, 1, 10 * 16 * spec.bytes_per_token, 10 * 64) == pytest.approx(
        H100.step_time(100, 1) + data + fixed
    )
    assert H100.swap_time(10, 16) == pytest.approx(data + fixed)
    assert H100.swap_time(10, 16, copies_per_block=1) == pytest.approx(data + 10 * 5e-6)
    assert np.allclose(
        H100.step_times(np.array([100, 2048]), np.array([1, 2048])),
        [H100.step_time(100, 1), H100.step_time(2048, 2048)],
    )
    # the memory an "80 GB" H100 reports (81,559 MiB), not 80e9 B
    assert kv_pool_blocks("llama-3-8b", "h100", 16) == int((81559 * 2**20 * 0.9 - weights) // spec.bytes_per_block(16))
    with pytest.raises(ValueError, match="num_params"):
        CostModel.for_model(KVSpec(2, 2, 8, 2))
    with pytest.raises(ValueError, match="copies_per_block"):
        CostModel.for_model("llama-3-8b", "h100", copies_per_block=0)
    with pytest.raises(ValueError, match="copy_latency"):
        CostModel.for_model("llama-3-8b", "h100", copy_latency=-1.0)


def test_swap_cost_falls_with_block_size_recompute_does_not():
    """The PagedAttention paper's §7.3 (Fig. 19): small blocks make swapping slow (many small copies,
    each with a fixed cost); recomputing does not touch the blocks, so its cost ignores the block size."""
    a100 = CostModel.for_model("llama-3-8b", "a100")
    tokens = 1024
    swap = {bs: 2 * a100.swap_time(-(-tokens // bs), bs) for bs in (1, 4, 16, 64, 256)}
    assert list(swap.values()) == sorted(swap.values(), reverse=True)  # fewer, larger copies: cheaper
    data = 2 * tokens * a100.kv_bytes_per_token / a100.swap_bandwidth
    assert swap[1] > 20 * data  # one token per block: the fixed costs dwarf the bytes
    assert swap[256] < 1.5 * data  # 256 tokens per block: the bytes dominate
    rows = swap_vs_recompute(a100, tokens, (1, 4, 16, 64, 256))
    assert [r["swap_s"] for r in rows] == pytest.approx(list(swap.values()))
    assert all(r["swap_s"] == pytest.approx(r["swap_fixed_s"] + r["swap_data_s"]) for r in rows)
    assert len({r["recompute_s"] for r in rows}) == 1 and rows[0]["recompute_s"] == a100.step_time(tokens, tokens)
    assert rows[2]["copies"] == 2 * 64 * 64  # 64 blocks of 16, 64 copies each, out and back in
    # without the fixed cost, the block size would not matter at all
    flat = CostModel.for_model("llama-3-8b", "a100", copy_latency=0.0)
    assert all(2 * flat.swap_time(-(-tokens // bs), bs) == pytest.approx(data) for bs in (1, 2, 4, 8, 16))


def test_static_vs_continuous_by_hand():
    """Outputs 4, 9, 2, 3 tokens, three seats: the fourth request waits for the whole first batch under static."""
    reqs = [SimRequest(f"r{i}", 0.0, 4, o) for i, o in enumerate([4, 9, 2, 3])]
    cfg = SimConfig(block_size=4, num_gpu_blocks_override=65, max_num_seqs=3, max_model_len=16, watermark=0.0)
    st = simulate_static(reqs, UNIT, cfg, batch_size=3)
    by = {m.req_id: m for m in st.requests}
    assert st.info["batch_size"] == 3 and st.info["batches"] == 2
    assert [by[r].finish for r in ("r0", "r1", "r2")] == [4.0, 9.0, 2.0]
    assert by["r0"].release == 9.0 and by["r3"].start == 9.0
    assert by["r3"].first_token == 10.0 and by["r3"].finish == 12.0  # a batch of one, 3 steps
    co = simulate_continuous(reqs, UNIT, cfg)
    by = {m.req_id: m for m in co.requests}
    assert by["r3"].start == 2.0 and by["r3"].first_token == 3.0  # r2's seat, the step after it finished
    assert by["r3"].finish == 5.0 and by["r1"].finish == 9.0
    assert co.summary()["makespan_s"] == 9.0 and st.summary()["makespan_s"] == 12.0
    assert list(co.steps["num_running"]) == [3, 3, 3, 3, 2, 1, 1, 1, 1]


def test_continuous_beats_static_on_a_skewed_workload():
    reqs = skewed(300)
    cfg = SimConfig(num_gpu_blocks_override=4097, max_num_seqs=64, max_model_len=2048)
    rows = compare(reqs, H100, cfg, batch_size=64)
    st, co = rows["static"], rows["continuous"]
    assert co["throughput_tok_s"] > 2 * st["throughput_tok_s"]
    assert co["latency_mean_s"] < st["latency_mean_s"] / 2
    assert co["ttft_mean_s"] < st["ttft_mean_s"]
    kind = simulate_static(reqs, H100, cfg, batch_size=64, padded=False).summary()  # no padding: still behind
    assert co["throughput_tok_s"] > 1.3 * kind["throughput_tok_s"]
    assert rows["static"]["padding_fraction"] > 0.5


def test_token_budget_seats_and_chunked_prefill():
    reqs = requests_from_trace(sharegpt_like_trace(150, seed=3))
    cfg = SimConfig(num_gpu_blocks_override=2049, max_num_seqs=32, max_num_batched_tokens=256)
    res = simulate_continuous(reqs, H100, cfg, check=True)
    s = res.steps
    assert s["tokens_scheduled"].max() == 256 and (s["tokens_scheduled"] <= 256).all()
    assert (s["num_running"] <= 32).all()
    # chunked prefill: some steps carry a prefill chunk and decodes together
    mixed = (s["prefill_tokens"] > 0) & (s["tokens_scheduled"] > s["prefill_tokens"])
    assert mixed.any()
    assert (s["blocks_in_use"] <= cfg.num_blocks - 1).all()


def test_every_request_finishes_once_with_its_tokens():
    reqs = requests_from_trace(sharegpt_like_trace(200, seed=1, arrival_rate=0.5), time_unit=0.01)
    cfg = SimConfig(num_gpu_blocks_override=513, max_num_seqs=48, max_num_batched_tokens=512)
    res = simulate_continuous(reqs, H100, cfg, check=True)
    finishes = [rid for _, kind, rid in res.events if kind == "finish"]
    assert sorted(finishes) == sorted(r.req_id for r in reqs)
    for m, r in zip(res.requests, reqs):
        assert m.req_id == r.req_id and len(m.token_times) == r.output_len
        assert m.start >= r.arrival and m.first_token > m.start and m.finish == m.token_times[-1]
        assert np.all(m.itls > 0)
    s = res.summary()
    assert s["requests"] == 200 and s["rejected"] == 0
    total = sum(r.total_len for r in reqs)
    assert s["computed_tokens"] >= total - 200  # the last sampled token is never fed back
    assert res.steps["time"][0] >= min(r.arrival for r in reqs)
    assert np.all(np.diff(res.steps["time"]) > 0)


def test_static_batch_is_capped_by_memory():
    reqs = requests_from_trace(sharegpt_like_trace(100, seed=2))
    cfg = SimConfig(
        block_size=16, num_gpu_blocks_override=1025, max_model_len=2048
    )  # 16384 slots: 8 reservations of 2048
    assert cfg.static_batch_cap() == 8
    res = simulate_static(reqs, H100, cfg, batch_size=64)
    assert res.info["batch_size"] == 8 and res.info["batches"] == 13
    assert res.steps["num_running"].max() == 8
    assert res.steps["blocks_in_use"].max() == 8 * 128  # reserved, not used
    assert (res.steps["blocks_in_use"] <= cfg.num_blocks - 1).all()
    # the same memory, paged: far more requests at once
    co = simulate_continuous(reqs, H100, cfg)
    assert co.steps["num_running"].max() > 8
    with pytest.raises(ValueError, match="cannot reserve"):
        simulate_static(reqs, H100, SimConfig(num_gpu_blocks_override=64, max_model_len=2048))


def test_too_long_requests_are_cut_or_rejected_by_both():
    reqs = [SimRequest("ok", 0.0, 10, 5), SimRequest("long", 0.0, 60, 10), SimRequest("huge", 0.0, 70, 1)]
    cfg = SimConfig(block_size=4, num_gpu_blocks_override=65, max_model_len=64)
    for res in (simulate_static(reqs, UNIT, cfg), simulate_continuous(reqs, UNIT, cfg)):
        by = {m.req_id: m for m in res.requests}
        assert by["huge"].rejected and not by["ok"].rejected and len(by["ok"].token_times) == 5
        assert len(by["long"].token_times) == 4  # stops at max_model_len = 60 + 4
        assert res.summary()["rejected"] == 1


def test_idle_engine_waits_for_arrivals():
    reqs = [SimRequest("a", 0.0, 4, 2), SimRequest("b", 100.0, 4, 2)]
    cfg = SimConfig(block_size=4, num_gpu_blocks_override=17, max_model_len=16, watermark=0.0)
    for res in (simulate_static(reqs, UNIT, cfg), simulate_continuous(reqs, UNIT, cfg)):
        by = {m.req_id: m for m in res.requests}
        assert by["b"].start == 100.0 and by["b"].ttft == 1.0 and by["a"].finish == 2.0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_small_pool_preempts_and_still_finishes(mode):
    reqs = requests_from_trace(sharegpt_like_trace(120, seed=4, max_model_len=1024))
    cfg = SimConfig(
        num_gpu_blocks_override=257,
        max_num_seqs=64,
        max_model_len=1024,
        watermark=0.0,
        preemption_mode=mode,
        num_cpu_blocks_override=4097 if mode == "swap" else 0,
    )
    res = simulate_continuous(reqs, H100, cfg, check=True)
    s = res.summary()
    assert s["preemptions"] > 0 and s["requests"] == 120
    assert sum(m.num_preemptions for m in res.requests) == s["preemptions"]
    assert [e for e in res.events if e[1] == "preempt"]
    if mode == "swap":
        assert s["swapped_blocks"] > 0
        swapping = (res.steps["swap_out_blocks"] + res.steps["swap_in_blocks"]) > 0
        # a step that swaps pays for the copies
        i = int(np.argmax(swapping))
        bytes_moved = (res.steps["swap_out_blocks"][i] + res.steps["swap_in_blocks"][i]) * 16 * H100.kv_bytes_per_token
        copies = (res.steps["swap_out_blocks"][i] + res.steps["swap_in_blocks"][i]) * H100.copies_per_block
        plain = H100.step_time(res.steps["kv_tokens"][i], res.steps["tokens_scheduled"][i])
        assert res.steps["duration"][i] == pytest.approx(
            plain + copies * H100.swap_latency + bytes_moved / H100.swap_bandwidth
        )
    else:
        assert s["swapped_blocks"] == 0
        assert s["computed_tokens"] > sum(r.total_len for r in reqs) - 120  # preempted work is recomputed


def test_prefix_caching_skips_the_shared_prompt():
    base = requests_from_trace(make_trace([20] * 100, [16] * 100, arrival_rate=0.2, seed=0), time_unit=0.01)
    reqs = shared_prefix_requests(base, prefix_len=1000)
    assert all(r.prompt_len == 1020 and r.prompt_token_ids[:1000] == reqs[0].prompt_token_ids[:1000] for r in reqs)
    on = simulate_continuous(
        reqs, H100, SimConfig(num_gpu_blocks_override=2049, enable_prefix_caching=True), check=True
    )
    off = simulate_continuous(reqs, H100, SimConfig(num_gpu_blocks_override=2049, enable_prefix_caching=False))
    assert on.info["prefix_hit_rate"] > 0.9 and off.info["prefix_hit_rate"] == 0.0
    assert on.info["prefix_hit_tokens"] == 99 * 992  # 62 full blocks of 16, for every request but the first
    assert on.summary()["computed_tokens"] < off.summary()["computed_tokens"] / 10
    assert on.summary()["ttft_mean_s"] < off.summary()["ttft_mean_s"]


def test_thousands_of_requests_in_seconds():
    reqs = requests_from_trace(sharegpt_like_trace(1000, seed=0))
    cfg = SimConfig(num_gpu_blocks_override=kv_pool_blocks() + 1)
    t0 = time.perf_counter()
    rows = compare(reqs, H100, cfg)
    elapsed = time.perf_counter() - t0
    assert rows["continuous"]["throughput_tok_s"] > rows["static"]["throughput_tok_s"]
    assert elapsed < 30, f"{elapsed:.1f} s for 1000 requests"


def test_slo_attainment_counts_each_request_against_its_own_objective():
    """A first token within ttft_s + per-token·prompt, a mean gap between tokens within tpot_s; rejected misses."""
    from dataclasses import replace

    from minipaged.core.request import RequestMetrics

    def req(i: int, arrival: float, prompt: int, times: list[float], rejected: bool = False) -> RequestMetrics:
        return RequestMetrics(f"r{i}", arrival, prompt, len(times), first_token=times[0] if times else None,
                              token_times=times, rejected=rejected)  # fmt: skip

    reqs = [
        req(0, 0.0, 100, [0.5, 0.54, 0.58]),  # ttft 0.5 <= 0.5 + 0.1; gaps 40 ms: met
        req(1, 1.0, 100, [1.7, 1.74]),  # ttft 0.7 > 0.6: missed
        req(2, 0.0, 2000, [2.4, 2.43]),  # a long prompt: ttft 2.4 <= 0.5 + 2.0 = 2.5: met
        req(3, 0.0, 10, [0.1, 0.2, 0.21]),  # mean gap 55 ms > 50 ms: missed
        req(4, 0.0, 10, [0.1]),  # one token: nothing to space out, met
        req(5, 0.0, 10, [], rejected=True),  # never served: missed
    ]
    cfg = SimConfig(num_gpu_blocks_override=8)
    res = simulate_continuous([], CostModel.for_model("llama-3-8b", "h100"), cfg)
    res = replace(res, requests=reqs)
    assert res.slo_attainment(0.5, 0.05, 0.001) == pytest.approx(3 / 6)
    assert res.slo_attainment(0.5, 0.06, 0.001) == pytest.approx(4 / 6)  # a looser gap lets r3 in
    assert res.slo_attainment(0.5, 0.05) == pytest.approx(2 / 6)  # no allowance per token: r2 misses
    with pytest.raises(ValueError, match="no request"):
        replace(res, requests=[]).slo_attainment(0.5, 0.05)
