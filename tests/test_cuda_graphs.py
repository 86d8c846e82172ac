"""Decode steps replayed from CUDA graphs (``model/cuda_graphs.py``): the buckets, the padding of the static
inputs and when a step runs eagerly, checked everywhere; the replayed steps themselves on a CUDA machine only
(``make gpu-check`` runs this file there), against the same engine with ``enforce_eager=True``."""

from __future__ import annotations

import pytest
import torch
from conftest import small_engine

from minipaged import LLM, SamplingParams, hooks
from minipaged.config import Config
from minipaged.model import AttentionMetadata
from minipaged.model.cuda_graphs import CUDAGraphRunner, StaticInputs, capture_sizes
from minipaged.model.layers import packed_rows

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def test_the_buckets_are_the_step_programs_row_counts():
    sizes = capture_sizes(256)
    assert sizes[:16] == list(range(1, 17)) and sizes[16:20] == [18, 20, 22, 24] and sizes[-1] == 256
    assert len(sizes) == 48 and all(packed_rows(s) == s for s in sizes)
    assert all(packed_rows(n) in sizes for n in range(1, 257))  # every batch size has its graph
    assert capture_sizes(5) == [1, 2, 3, 4, 5] and capture_sizes(20)[-2:] == [18, 20]


def decode_meta(tables: list[list[int]], lens: list[int], block_size: int = 4) -> AttentionMetadata:
    slots = [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.arange(len(lens) + 1, dtype=torch.int32),
        max_query_len=1,
    )


def test_static_inputs_hold_the_step_then_padding_that_writes_nothing():
    inputs = StaticInputs(8, 5, torch.device("cpu"))
    wide = decode_meta([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], [17, 20])
    inputs.fill(torch.tensor([11, 12]), torch.tensor([16, 19]), wide, rows=2)
    narrow = decode_meta([[3, 4], [5, 0], [9, 2]], [6, 2, 8])
    inputs.fill(torch.tensor([7, 8, 9]), torch.tensor([5, 1, 7]), narrow, rows=4)
    meta = inputs.metadata(4)
    assert inputs.input_ids[:4].tolist() == [7, 8, 9, 0] and inputs.positions[:4].tolist() == [5, 1, 7, 0]
    assert meta.slot_mapping.tolist() == [*narrow.slot_mapping.tolist(), -1]  # padding: no K/V written
    assert meta.seq_lens.tolist() == [6, 2, 8, 1] and meta.max_query_len == 1
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]
    # The first step's wider tables are gone: rows hold this step's blocks, then zeros (the null block).
    assert meta.block_tables.tolist() == [[3, 4, 0, 0, 0], [5, 0, 0, 0, 0], [9, 2, 0, 0, 0], [0, 0, 0, 0, 0]]


def test_when_a_step_runs_eagerly():
    runner = CUDAGraphRunner(None, [], max_num_seqs=20, max_blocks_per_seq=3, device=torch.device("cpu"))  # type: ignore[arg-type]
    ids = torch.zeros(3, dtype=torch.long)
    assert runner.why_not(ids, decode_meta([[1], [2], [3]], [2, 3, 4])) is None
    assert runner.bucket(17) == 18 and runner.bucket(20) == 20 and runner.bucket(21) is None
    assert "more than the largest" in runner.why_not(
        torch.zeros(21, dtype=torch.long), decode_meta([[1]] * 21, [2] * 21)
    )
    prefill = decode_meta([[1], [2], [3]], [2, 3, 4])
    prefill.max_query_len = 2
    assert runner.why_not(ids, prefill) == "not a decode-only step"
    assert "wider" in runner.why_not(ids, decode_meta([[1, 2, 3, 4]] * 3, [2, 3, 4]))
    hooks.push({"paged_decode_attention": lambda *a, **k: None})
    try:
        assert "learner" in runner.why_not(ids, decode_meta([[1], [2], [3]], [2, 3, 4]))
    finally:
        hooks.pop()
    runner.off_reason = "capture failed (test)"
    assert runner.why_not(ids, decode_meta([[1], [2], [3]], [2, 3, 4])) == "capture failed (test)"


def test_enforce_eager_is_a_checked_knob_and_a_cpu_engine_has_no_graphs(tiny_model):
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        Config(enforce_eager="yes")  # type: ignore[arg-type]
    llm = small_engine(tiny_model, device="cpu")  # on a CUDA machine the default device would have graphs
    assert llm.executor.runner.graph_runner is None


@needs_cuda
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_replayed_decode_steps_give_the_eager_tokens(tiny_model, enable_prefix_caching):
    """Batch sizes that cross buckets (requests finish at different steps), chunked prefills between decodes
    (eager), and a pool small enough to preempt: the same greedy tokens with and without graphs."""
    prompts = [[(7 * i + j) % 90 + 3 for j in range(5 + 3 * i)] for i in range(19)]
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0, ignore_eos=True) for i in range(19)]

    def run(enforce_eager: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            str(tiny_model),
            device="cuda",
            dtype="float32",
            max_num_seqs=19,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=40,
            block_size=16,
            enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager,
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm

    eager, eager_llm = run(True)
    graphed, llm = run(False)
    assert eager_llm.executor.runner.graph_runner is None
    runner = llm.executor.runner.graph_runner
    assert runner is not None and runner.off_reason is None, runner and runner.off_reason
    assert graphed == eager
    assert runner.replays > 0 and len(runner.graphs) >= 3  # several buckets captured and replayed
    assert set(runner.graphs) <= set(runner.sizes)


@needs_cuda
def test_a_failed_capture_turns_graphs_off_and_the_step_still_runs(tiny_model, monkeypatch, caplog):
    def refuse(self, rows):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CUDAGraphRunner, "_capture", refuse)
    llm = LLM(str(tiny_model), device="cuda", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32)
    prompts = [[5, 9, 2, 7], [4, 4, 8]]
    out = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 and o.error is None for o in out)
    assert "capture failed" in (llm.executor.runner.graph_runner.off_reason or "")
    assert sum("CUDA graphs off" in r.getMessage() for r in caplog.records) == 1


# ---- warm start: every bucket captured when the engine starts ---------------------------------------------
class _RecordingRunner(CUDAGraphRunner):
    """A graph runner whose capture records what it was given (no CUDA here): the start-up logic alone."""

    def __init__(self, sizes_for: int, fail_at: int | None = None, seconds: float = 0.0) -> None:
        super().__init__(None, [], sizes_for, 4, torch.device("cpu"))  # type: ignore[arg-type]
        self.fail_at, self.seconds, self.seen = fail_at, seconds, []

    def _capture(self, rows: int) -> None:
        import time

        time.sleep(self.seconds)
        meta = self.inputs.metadata(rows)
        assert (meta.slot_mapping == -1).all() and (meta.block_tables == 0).all()  # padding only: writes nothing
        self.seen.append(rows)
        if rows == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.graphs[rows] = (None, None)  # type: ignore[assignment]


def test_start_up_captures_every_bucket_largest_first():
    runner = _RecordingRunner(40)
    count, _ = runner.capture_all()
    assert runner.seen == sorted(capture_sizes(40), reverse=True) and count == len(capture_sizes(40))
    assert runner.capture_all()[0] == count and runner.seen == sorted(capture_sizes(40), reverse=True)  # once


def test_a_failed_start_up_capture_turns_graphs_off_as_a_step_capture_does(caplog):
    runner = _RecordingRunner(20, fail_at=16)
    count, _ = runner.capture_all()
    assert runner.seen == [20, 18, 16] and count == 2  # stops at the failure
    assert runner.off_reason is not None and "capture failed (RuntimeError" in runner.off_reason
    assert runner.why_not(torch.zeros(1), decode_meta([[1]], [3])) == runner.off_reason  # every step eager now
    assert "CUDA graphs off" in caplog.text


def test_start_up_capture_is_bounded_in_time():
    runner = _RecordingRunner(8, seconds=0.02)
    count, seconds = runner.capture_all(budget_s=0.05)
    assert 1 <= count < 8 and seconds < 0.2  # the rest are captured on their first step, as before


def test_warm_up_runs_every_kind_of_step_without_touching_the_cache(tiny_model):
    """The start-up steps (on a GPU: Triton compiles their kernels) are valid inputs for the model, and write
    nothing: every slot is -1. Run here on the CPU runner, which does not warm up by itself."""
    llm = small_engine(tiny_model, max_num_seqs=5, device="cpu")
    runner = llm.executor.runner
    assert runner.warm_up_s is None  # a CPU engine starts as it is
    before = [(k.clone(), v.clone()) for k, v in runner.cache.gpu_cache]
    note = runner.warm_up(5, 16)
    assert note.startswith("compiled the kernels of 5 kinds of step and no CUDA graphs") and runner.warm_up_s > 0
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.cache.gpu_cache, before))
    assert llm.generate([[5, 17, 3]], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


@needs_cuda
def test_a_gpu_engine_starts_with_its_graphs_captured(tiny_model, capsys):
    llm = LLM(model=tiny_model, device="cuda", max_num_seqs=20, kv_cache_memory="64MiB")
    assert len(llm.executor.runner.graph_runner.graphs) == len(capture_sizes(20))
    assert f"captured {len(capture_sizes(20))} CUDA graphs" in capsys.readouterr().out
    llm.shutdown()
