"""The contiguous first-fit allocator, the trace simulator (contiguous vs paged), the curves."""

import numpy as np
import pytest

from minipaged.lab.contiguous import (
    PAPER_FIG2,
    ContiguousAllocator,
    block_size_tradeoff,
    compare_on_trace,
    contiguous_utilisation_band,
    memory_vs_generated_tokens,
    reservation_size,
    simulate_trace,
    waste_breakdown,
)
from minipaged.lab.workloads import Trace, TraceRequest, sharegpt_like_trace, static_vs_paged_lengths


# ---- the allocator ---------------------------------------------------------------------------
def test_first_fit_reuses_the_first_hole_big_enough():
    arena = ContiguousAllocator(40)
    assert [arena.allocate(r, 10) for r in "abc"] == [0, 10, 20]
    arena.free("b")
    assert arena.free_extents == [(10, 10), (30, 10)]
    assert arena.allocate("d", 5) == 10  # first fit: the hole at 10, not the tail
    assert arena.free_extents == [(15, 5), (30, 10)]
    assert arena.allocate("e", 8) == 30
    assert arena.num_free_slots == 7 and arena.num_reserved_slots == 33


def test_external_fragmentation_refuses_although_enough_is_free():
    arena = ContiguousAllocator(30)
    for r in "abc":
        arena.allocate(r, 10)
    arena.free("a")
    arena.free("c")
    assert arena.num_free_slots == 20 and arena.largest_free_extent == 10
    assert arena.allocate("big", 15) is None  # 20 free, but in two holes of 10
    assert arena.unusable_free_slots(15) == 20
    assert arena.unusable_free_slots(10) == 0


def test_free_coalesces_with_both_neighbours():
    arena = ContiguousAllocator(30)
    for r in "abc":
        arena.allocate(r, 10)
    arena.free("a")
    arena.free("c")
    arena.free("b")
    assert arena.free_extents == [(0, 30)]
    assert arena.allocate("x", 30) == 0


def test_free_coalesces_left_and_right_separately():
    arena = ContiguousAllocator(40)
    for r in "abcd":
        arena.allocate(r, 10)
    arena.free("b")
    arena.free("a")  # merges right into b's hole
    assert arena.free_extents == [(0, 20)]
    arena.free("c")  # merges left
    assert arena.free_extents == [(0, 30)]


def test_allocator_errors():
    with pytest.raises(ValueError):
        ContiguousAllocator(0)
    arena = ContiguousAllocator(10)
    arena.allocate("a", 3)
    with pytest.raises(ValueError, match="already"):
        arena.allocate("a", 3)
    with pytest.raises(ValueError, match="size"):
        arena.allocate("b", 0)
    arena.free("a")
    with pytest.raises(ValueError, match="no reservation"):
        arena.free("a")


def test_reservation_policies():
    r = TraceRequest("r", 0, 100, 200)
    assert reservation_size(r, "max", 2048) == 2048
    # pow2 rounds the output up to a power of two, as the paper's Orca (Pow2): 25 outputs reserve 32
    assert reservation_size(TraceRequest("p", 0, 10, 25), "pow2", 2048) == 10 + 32
    assert reservation_size(r, "pow2", 2048) == 100 + 256
    assert reservation_size(TraceRequest("s", 0, 100, 256), "pow2", 2048) == 100 + 256  # exactly 256
    assert reservation_size(TraceRequest("t", 0, 1600, 400), "pow2", 2048) == 2048  # 1600 + 512, capped
    assert reservation_size(r, "exact", 2048) == 300
    with pytest.raises(ValueError, match="policy"):
        reservation_size(r, "best", 2048)


# ---- the simulator ----------------------------------------------------------------------------
def test_two_requests_that_fit_side_by_side():
    trace = Trace([TraceRequest("a", 0, 2, 2), TraceRequest("b", 0, 2, 2)])
    res = simulate_trace(trace, 8, "contiguous", max_model_len=4)
    assert res.live_tokens.tolist() == [6, 8]
    assert res.allocated_slots.tolist() == [8, 8]
    assert res.internal_waste.tolist() == [2, 0]
    assert res.reservation.tolist() == [2, 0] and res.internal_fragmentation.tolist() == [0, 0]
    assert res.finish_step == {"a": 2, "b": 2}
    assert res.utilisation.tolist() == [0.75, 1.0]


def test_reserved_but_empty_splits_into_reservation_and_internal_fragmentation():
    """The paper's section 3.1: slots a request will still fill (reservation) vs slots past its final
    length (internal fragmentation). a reserves 8 and ends with 4 tokens; b reserves 8 and ends with 8."""
    trace = Trace([TraceRequest("a", 0, 2, 2), TraceRequest("b", 0, 2, 6)])
    res = simulate_trace(trace, 16, "contiguous", max_model_len=8)
    assert res.live_tokens.tolist() == [6, 8, 5, 6, 7, 8]
    assert res.reservation.tolist() == [1 + 5, 0 + 4, 3, 2, 1, 0]
    assert res.internal_fragmentation.tolist() == [4, 4, 0, 0, 0, 0]  # a's 4 slots past its end, until it leaves
    assert np.array_equal(res.internal_waste, res.reservation + res.internal_fragmentation)
    s = res.summary(saturated_only=False)
    assert s["reservation"] + s["internal_fragmentation"] == pytest.approx(s["internal_waste"])
    paged = simulate_trace(trace, 16, "paged", max_model_len=8, block_size=4, watermark=0)
    # a: 3 tokens in one block of 4 (1 reserved), then 4; b: 3 then 4 (full), then 5 in two blocks (3 reserved) ...
    assert paged.reservation.tolist() == [1 + 1, 0 + 0, 3, 2, 1, 0]
    assert paged.internal_fragmentation.sum() == 0  # every block is filled before its request ends


def test_second_request_waits_for_a_hole():
    trace = Trace([TraceRequest("a", 0, 2, 2), TraceRequest("b", 0, 2, 2)])
    res = simulate_trace(trace, 6, "contiguous", max_model_len=4)
    assert res.refused.tolist() == [1, 1, 0, 0]
    assert res.refused_fragmented.tolist() == [0, 0, 0, 0]  # 2 free slots < 4: not fragmentation
    assert res.external_waste.tolist() == [2, 2, 0, 0]  # the 2 free slots cannot take b
    assert res.admit_step == {"a": 0, "b": 2} and res.finish_step == {"a": 2, "b": 4}


def test_paged_fits_both_in_the_same_arena_and_finishes_sooner():
    trace = Trace([TraceRequest("a", 0, 2, 2), TraceRequest("b", 0, 2, 2)])
    res = simulate_trace(trace, 8, "paged", max_model_len=4, block_size=2, watermark=0)
    assert res.finish_step == {"a": 2, "b": 2}
    assert res.allocated_slots.tolist() == [8, 8] and res.internal_waste.tolist() == [2, 0]
    assert res.reservation.tolist() == [2, 0] and res.internal_fragmentation.tolist() == [0, 0]
    short = Trace([TraceRequest("a", 0, 1, 1), TraceRequest("b", 0, 1, 1)])  # 2 tokens each
    cont = simulate_trace(short, 6, "contiguous", max_model_len=4)  # reserves 4 each: one at a time
    pag = simulate_trace(short, 6, "paged", max_model_len=4, block_size=2, watermark=0)  # one block each
    assert cont.finish_step == {"a": 1, "b": 2} and pag.finish_step == {"a": 1, "b": 1}


def test_arrival_times_and_idle_gaps():
    trace = Trace([TraceRequest("a", 0, 1, 1), TraceRequest("b", 10, 1, 2)])
    res = simulate_trace(trace, 4, "contiguous", max_model_len=4)
    assert res.step.tolist() == [0, 10, 11]  # idle steps 1..9 skipped
    assert res.finish_step == {"a": 1, "b": 12} and res.admit_step["b"] == 10


def test_fragmentation_refusal_on_a_constructed_trace():
    """a, b, c of 10 slots each in a 30-slot arena; a and c finish early; d (15 slots) waits
    although 20 slots are free, until b finishes too."""
    trace = Trace(
        [
            TraceRequest("a", 0, 9, 1),
            TraceRequest("b", 0, 5, 5),
            TraceRequest("c", 0, 9, 1),
            TraceRequest("d", 1, 10, 5),
        ]
    )
    res = simulate_trace(trace, 30, "contiguous", max_model_len=15, policy="exact")
    assert res.refused_fragmented[1] == 1 and res.external_waste[1] == 20
    assert res.admit_step["d"] == 5
    paged = simulate_trace(trace, 30, "paged", max_model_len=15, block_size=5, watermark=0)
    assert paged.admit_step["d"] == 1 and paged.refused_fragmented.sum() == 0


def test_simulator_refuses_impossible_setups():
    trace = Trace([TraceRequest("a", 0, 100, 100)])
    with pytest.raises(ValueError, match="max_model_len"):
        simulate_trace(trace, 4096, max_model_len=128)
    with pytest.raises(ValueError, match="could never run"):
        simulate_trace(trace, 1024, max_model_len=2048)
    with pytest.raises(ValueError, match="allocator"):
        simulate_trace(trace, 4096, allocator="buddy")
    with pytest.raises(ValueError, match="block_size"):
        simulate_trace(trace, 4096, allocator="paged", block_size=0)


@pytest.fixture(scope="module")
def sharegpt_pair():
    trace = sharegpt_like_trace(300, seed=4, arrival_rate=2.0)
    return trace, compare_on_trace(trace, 16 * 2048, max_model_len=2048, block_size=16)


def test_accounting_identities_hold_every_step(sharegpt_pair):
    trace, results = sharegpt_pair
    for res in results:
        assert np.all(res.allocated_slots == res.live_tokens + res.internal_waste)
        assert np.all(res.internal_waste == res.reservation + res.internal_fragmentation)
        assert np.all(res.reservation >= 0) and np.all(res.internal_fragmentation >= 0)
        assert np.all(res.allocated_slots <= res.num_slots)
        assert np.all(res.external_waste <= res.free_slots)
        assert np.all(res.internal_waste >= 0) and np.all(res.live_tokens >= 0)
        assert set(res.finish_step) == {r.req_id for r in trace}
        for r in trace:  # nobody finishes before its outputs could have been generated
            assert res.finish_step[r.req_id] >= r.arrival + r.output_len


def test_paged_waste_is_under_one_block_per_request(sharegpt_pair):
    _, (cont, paged) = sharegpt_pair
    assert np.all(paged.internal_waste <= 15 * paged.num_running)
    assert np.all(paged.external_waste == 0)
    assert np.all(cont.internal_waste[cont.num_running > 0] > 15 * cont.num_running[cont.num_running > 0])
    assert paged.summary()["utilisation"] > 2 * cont.summary()["utilisation"]
    assert max(paged.finish_step.values()) < max(cont.finish_step.values())


def test_the_papers_band_for_contiguous_systems():
    """The PagedAttention paper's Fig. 2 setting (OPT-13B's 15,728 slots, ShareGPT-like, max_model_len 2048)."""
    band = contiguous_utilisation_band()
    assert 0.19 <= band["max"]["utilisation"] <= 0.382  # the paper's band is 20.4-38.2 %
    assert 0.204 <= band["pow2"]["utilisation"] <= 0.382
    assert band["max"]["utilisation"] < band["pow2"]["utilisation"] < band["exact"]["utilisation"]
    assert band["max"]["external_waste"] == band["max"]["free"]  # 7 reservations of 2048 fit, the rest is a hole
    assert band["exact"]["internal_fragmentation"] == 0  # the oracle never reserves past the end
    assert band["exact"]["refusals_fragmented"] > 0
    assert band["paged"]["utilisation"] > 0.96 and band["paged"]["external_waste"] == 0
    ours = waste_breakdown(band)
    for _name, shares in ours.items():
        assert sum(shares) == pytest.approx(100)
    # Orca (Max): every one of the paper's four bars within one point
    assert all(abs(a - b) < 1.0 for a, b in zip(ours["max"], PAPER_FIG2["Orca (Max)"]))
    assert ours["paged"][0] > PAPER_FIG2["vLLM"][0]


# ---- curves ---------------------------------------------------------------------------------
def test_memory_vs_generated_tokens():
    c = memory_vs_generated_tokens(max_model_len=8192, block_size=16, bytes_per_token=1000)
    assert len(c["generated_tokens"]) == 8192
    assert np.all(c["contiguous_bytes"] == 8192 * 1000)
    gap = c["paged_bytes"] - c["live_bytes"]
    assert np.all(gap >= 0) and np.all(gap < 16 * 1000)
    assert c["paged_bytes"][0] == 16 * 1000 and c["paged_bytes"][-1] == c["contiguous_bytes"][-1]
    assert np.all(np.diff(c["paged_bytes"]) >= 0)
    coarse = memory_vs_generated_tokens(max_model_len=1000, prompt_len=100, num_points=10)
    assert coarse["context_tokens"][0] == 101 and coarse["context_tokens"][-1] == 1000
    with pytest.raises(ValueError):
        memory_vs_generated_tokens(max_model_len=100, prompt_len=100)


def test_block_size_tradeoff():
    rows = block_size_tradeoff(static_vs_paged_lengths())
    assert [r["block_size"] for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert rows[0]["mean_waste_tokens"] == 0 and rows[0]["mean_table_entries"] == pytest.approx(193.0)
    for r in rows:
        assert r["max_waste_tokens"] < r["block_size"]
    waste = [r["waste_pct"] for r in rows]
    entries = [r["mean_table_entries"] for r in rows]
    assert waste == sorted(waste) and entries == sorted(entries, reverse=True)
    b16 = rows[4]
    assert 4 <= b16["mean_waste_tokens"] <= 11  # about half a block
    assert b16["waste_pct"] == pytest.approx(100 - 96.1, abs=0.3)  # "Inference at scale" 23.1: 96.1 % utilisation
    fifty = block_size_tradeoff([50], block_sizes=(16,))[0]
    assert fifty["max_table_entries"] == 4 and fifty["max_waste_tokens"] == 14
    with pytest.raises(ValueError):
        block_size_tradeoff([0, 5])
    with pytest.raises(ValueError):
        block_size_tradeoff([5], block_sizes=(0,))
