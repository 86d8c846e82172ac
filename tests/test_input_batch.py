"""The persistent input batch (worker/input_batch.py) against the one-token-at-a-time specification.

Every step of random workloads (chunked prefills, decodes, preemptions, prefix hits, forks, a sliding-window
group beside a full one) is turned into inputs twice: by ``InputBatch`` with array operations, and by
``step_inputs``, ``slot_mapping`` and ``make_block_table_tensor`` over a dict of tables kept with
``apply_block_updates``. They must agree exactly.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from minipaged.core.kv_cache_coordinator import KVCacheGroupSpec
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput, apply_block_updates
from minipaged.engine.step import run_step
from minipaged.lab.simulator import fake_samples
from minipaged.sampling_params import SamplingParams
from minipaged.worker.block_table import make_block_table_tensor, slot_mapping
from minipaged.worker.input_batch import InputBatch, InputBuffers
from minipaged.worker.step_inputs import step_inputs


class BothWays:
    """An executor that builds each step's inputs both ways and compares them."""

    def __init__(self, block_size: int, num_groups: int) -> None:
        self.block_size, self.num_groups = block_size, num_groups
        self.batch = InputBatch(num_groups, 2, 2, block_size)  # tiny on purpose: rows and columns must grow
        self.tables: dict[str, list[list[int]]] = {}
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps += 1
        apply_block_updates(self.tables, out)
        self.batch.apply(out)
        assert self.batch.as_dict() == self.tables
        if out.scheduled:
            a = self.batch.step_arrays(out)
            ids, positions, cu, seq_lens, sample_rows = step_inputs(out.scheduled)
            assert a.input_ids.tolist() == ids and a.positions.tolist() == positions
            assert a.cu_seqlens_q.tolist() == cu and a.seq_lens.tolist() == seq_lens
            assert a.sample_rows.tolist() == sample_rows
            assert a.max_query_len == max(s.num_new_tokens for s in out.scheduled)
            for g in range(self.num_groups):
                tables = [self.tables[s.request_id][g] for s in out.scheduled]
                assert a.slot_mappings[g].tolist() == slot_mapping(tables, out.positions(), self.block_size).tolist()
                ref = make_block_table_tensor(tables).numpy()
                assert np.array_equal(a.block_tables[g][:, : ref.shape[1]], ref)
                assert not a.block_tables[g][:, ref.shape[1] :].any()  # past every table: zeros, never a stale id
        return RunnerOutput(fake_samples(out, lambda s: 1 + (s.start * 7 + len(s.request_id)) % 50))

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        for rid in request_ids:
            self.tables.pop(rid, None)
        self.batch.drop(request_ids)


@pytest.mark.parametrize("seed", range(6))
def test_input_batch_matches_the_specification(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 16])
    window = rng.choice([None, 5, 9])
    groups = None if window is None else [KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), window)]
    kv = KVCacheManager(bs, rng.randint(12, 60), enable_caching=True, watermark=0.0, kv_cache_groups=groups)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=rng.randint(3, 6), max_num_batched_tokens=rng.choice([4, 16, 64]), max_model_len=96
        ),
        kv,
    )
    ex = BothWays(bs, 1 if window is None else 2)
    shared = [rng.randrange(1, 50) for _ in range(rng.randint(0, 20))]
    for i in range(10):
        prompt = shared + [rng.randrange(1, 50) for _ in range(rng.randint(1, 30))]
        n = rng.choice([1, 1, 2]) if window is None else 1
        sched.add_request(Request(f"q{i}", prompt, sampling_params=SamplingParams(max_tokens=rng.randint(1, 20), n=n)))
    while sched.has_unfinished():
        run_step(sched, ex, lambda: 0.0)
        assert ex.steps < 5_000
    assert len(ex.batch) == 0 and not ex.batch.tables.any()  # every row given back, zeroed


def test_rows_and_columns_grow_and_rows_are_reused():
    batch = InputBatch(1, 1, 1, 4)
    steps = [ScheduledRequest(r, 1, 0, 1, [1], block_updates=[(0, [2 + i, 9, 10 + i])]) for i, r in enumerate("abc")]
    batch.apply(SchedulerOutput(steps, block_size=4))
    assert batch.tables.shape[1:] == (4, 3) and batch.as_dict()["c"] == [[4, 9, 12]]
    row_b = batch.rows["b"]
    batch.apply(
        SchedulerOutput([ScheduledRequest("d", 1, 0, 1, [1], block_updates=[(0, [7])])], finished_req_ids=["b"])
    )
    assert batch.rows["d"] == row_b and batch.as_dict() == {"a": [[2, 9, 10]], "c": [[4, 9, 12]], "d": [[7]]}
    assert not batch.tables[0, row_b, 1:].any()  # the row's old ids are gone, not shadowed by a shorter table


def test_a_position_past_the_table_is_refused_by_name():
    batch = InputBatch(1, 4, 4, 4)
    s = ScheduledRequest("a", num_new_tokens=2, start=3, num_samples=1, token_ids=[5, 6], block_updates=[(0, [7])])
    out = SchedulerOutput([s], block_size=4)
    batch.apply(out)
    with pytest.raises(IndexError, match=r"request 'a': position 4 is past its block table \(1 blocks x 4 slots\)"):
        batch.step_arrays(out)


def test_buffers_fill_in_place_and_grow():
    buf = InputBuffers(4, 2, 3, torch.device("cpu"))
    address = buf.input_ids.data_ptr()
    view = buf.fill("input_ids", np.array([3, 4, 5]))
    assert view.tolist() == [3, 4, 5] and buf.input_ids.data_ptr() == address  # the same memory every step
    grown = buf.fill("input_ids", np.arange(6))
    assert grown.tolist() == list(range(6)) and buf.input_ids.shape[0] == 6  # more than planned: grown, not refused
    assert buf.fill("slot_mapping_1", np.array([9])).tolist() == [9]  # a second group's buffer, made at first use
