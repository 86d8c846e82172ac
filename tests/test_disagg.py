"""Disaggregated prefill: a prefill engine in another process, its K/V sent over torch.distributed (gloo) to the
decode engine here, which loads the prompt's full blocks as external hits and decodes. Same tokens as one engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import weakref

import pytest
import torch

from minipaged.engine.disagg import DisaggregatedLLM, engine_kwargs, process_state
from minipaged.engine.llm import LLM
from minipaged.model_loader import chat_prompt_ids, load_tokenizer, weights_are_random
from minipaged.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # two engine processes, prefill and decode: make test-slow

PROMPTS = [
    "What is the capital of France?",
    "Tell me a fun fact about octopuses.",
    "Write two lines about a quiet winter morning in the mountains, with snow on the pines.",
    "Hi",
    "Explain in one sentence why paging the KV cache lets a server hold more requests at once.",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def prompt_ids():
    tok = load_tokenizer()
    return [chat_prompt_ids(tok, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def disagg():
    engine = DisaggregatedLLM(dtype="float32", max_num_batched_tokens=64, threads=(1, 1))
    yield engine
    engine.shutdown()


def test_disaggregated_tokens_equal_one_engines(disagg, prompt_ids):
    one = LLM(dtype="float32", max_num_batched_tokens=64).generate(prompt_ids, GREEDY)
    outs = disagg.generate(prompt_ids, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in one]
    assert all(o.finished and o.error is None for o in outs)
    kv = disagg.llm.kv_cache_manager
    # The decode engine computed little of the prompts: their full blocks came from the prefill engine (the
    # chat template's first blocks, shared by all, from its own prefix cache after the first request).
    prompt_tokens = sum(map(len, prompt_ids))
    assert kv.external_hits > 0 and kv.connector.num_received > 0
    assert kv.external_hits + kv.prefix_cache_hits > prompt_tokens // 2
    computed = sum(s["tokens"] for s in disagg.llm.step_stats) - sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert computed == prompt_tokens - kv.external_hits - kv.prefix_cache_hits
    assert all(o.metrics.ttft is not None and o.metrics.ttft > 0 for o in outs)  # from when prefill was asked
    assert kv.get_num_free_blocks() == disagg.llm.num_blocks - 1


def test_streaming_style_use_and_ids(disagg, prompt_ids):
    rid = disagg.add_request(prompt_ids[0], GREEDY, request_id="mine")
    with pytest.raises(ValueError, match="already in use"):
        disagg.add_request(prompt_ids[1], GREEDY, request_id="mine")
    done: list[str] = []
    while disagg.has_unfinished():
        done += disagg.step()
    assert done == [rid] and ("Paris" in disagg.get_output(rid).outputs[0].text or weights_are_random())


def test_abort_reaches_both_engines_and_leaves_nothing(disagg, prompt_ids):
    gone = disagg.add_request(prompt_ids[2], GREEDY)
    disagg.abort([gone])  # still in the prefill engine: it is told to drop it
    kept = disagg.add_request(prompt_ids[0], GREEDY)
    while disagg.has_unfinished():
        disagg.step()
    assert disagg.get_output(kept).finished and not disagg._waiting and not disagg._link.prefilled
    with pytest.raises(ValueError, match="unknown request id"):
        disagg.get_output(gone)
    assert disagg.llm.kv_cache_manager.get_num_free_blocks() == disagg.llm.num_blocks - 1


# ---- faults, lifetime and arguments, on the tiny model (an engine starts in a few seconds) --------------------
TOKENS = [[5, 17, 3, 9, 40, 2, 8, 61, 33, 12, 7, 1, 90, 4], [7, 7, 30, 11, 12, 13]]
SHORT = SamplingParams(max_tokens=6, temperature=0)
TINY = dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=64, threads=(1, 1))
TINY_SIDES = dict(prefill={"block_size": 4}, decode={"block_size": 4, "kv_offloading_size": "1MiB"})


def stop(pid):
    """SIGSTOP, and wait until the process is stopped (a signal is delivered when the process next runs)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while process_state(pid) != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.01)


def tiny_engine(model, **kw):
    return DisaggregatedLLM(model, **{**TINY, **TINY_SIDES, **kw})


def serve(engine, prompts):
    """add_request + step, each wait bounded by 30 s (not timeout_s: a busy CI machine may be slow to prefill)."""
    ids = [engine.add_request(p, SHORT) for p in prompts]
    deadline = time.monotonic() + 60
    while engine.has_unfinished():
        assert time.monotonic() < deadline, "serving the tiny prompts took over a minute"
        engine.step(wait_s=30)
    return [engine.get_output(r).outputs[0].token_ids for r in ids]


@pytest.fixture(scope="module")
def tiny_disagg(tiny_model):
    engine = tiny_engine(tiny_model, timeout_s=1)  # the block size given on both sides, the same
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tiny_tokens(tiny_model):
    llm = LLM(tiny_model, dtype="float32", block_size=4, num_gpu_blocks_override=64, max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(TOKENS, SHORT)]


def test_an_idle_engine_outlives_timeout_s(tiny_disagg, tiny_tokens):
    # timeout_s bounds a wait for an answer the engine asked for, not the gap between two calls
    assert serve(tiny_disagg, TOKENS) == tiny_tokens
    time.sleep(2.0)
    assert serve(tiny_disagg, TOKENS) == tiny_tokens
    assert tiny_disagg.llm.kv_cache_manager.connector.num_received > 0


def test_a_stopped_prefill_process_is_reported_stopped_and_goes_on_when_continued(tiny_disagg, tiny_tokens):
    pid = tiny_disagg.prefill_pid
    stop(pid)
    try:
        rid = tiny_disagg.add_request(TOKENS[0], SHORT)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"pid {pid}\) is stopped \(SIGSTOP.*1 request\(s\) still wait"):
            tiny_disagg.step()
        assert time.monotonic() - t0 < 3.0  # timeout_s=1, not a hang
        waiting = tiny_disagg.get_output(rid)  # still there, no tokens yet
        assert not waiting.finished and waiting.outputs[0].token_ids == []
    finally:
        os.kill(pid, signal.SIGCONT)
    while tiny_disagg.has_unfinished():
        tiny_disagg.step(wait_s=30)
    assert tiny_disagg.get_output(rid).outputs[0].token_ids == tiny_tokens[0]
    assert tiny_disagg.llm.kv_cache_manager.get_num_free_blocks() == tiny_disagg.llm.num_blocks - 1


def test_a_bad_request_is_refused_at_the_call_and_sends_nothing(tiny_disagg):
    e = tiny_disagg
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams"):
        e.add_request(TOKENS[0], "greedy")
    with pytest.raises(ValueError, match="request_id must be a non-empty string without '#'"):
        e.add_request(TOKENS[0], request_id="a#b")
    with pytest.raises(ValueError, match="arrival_time must be a number"):
        e.add_request(TOKENS[0], arrival_time="soon")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.add_request([1, 10_000])
    with pytest.raises(ValueError, match="wait_s must be"):
        e.step(wait_s=float("inf"))
    assert not e.has_unfinished()
    rid = e.add_request(TOKENS[1], SHORT, request_id="waiting-one")
    assert not e.get_output(rid).finished
    e.abort(rid)  # one id, as LLM.abort takes it
    assert not e.has_unfinished() and e.step(wait_s=0) == []


def test_a_dropped_engine_ends_its_process_and_frees_its_decode_engine(tiny_model):
    before = torch.get_num_threads()
    engine = tiny_engine(tiny_model, threads=(1, before + 1))  # this process's torch threads, while it lives
    assert torch.get_num_threads() == before + 1
    serve(engine, TOKENS[:1])
    proc, runner, ref = engine._link.proc, engine.llm.executor.runner, weakref.ref(engine)
    del engine
    assert ref() is None  # no cycle and no thread (the receiver's) keeps it: collected at once
    proc.join(5.0)
    assert not proc.is_alive() and runner.released and torch.get_num_threads() == before


def test_a_dead_prefill_process_is_an_error_not_a_hang(tiny_model):
    engine = tiny_engine(tiny_model, timeout_s=30)
    try:
        pid = engine.prefill_pid
        stop(pid)  # it will not answer this one ...
        engine.add_request(TOKENS[0], SHORT)
        os.kill(pid, signal.SIGKILL)  # ... and dies while the step waits for it
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"process \(pid {pid}\) is gone: it was killed by SIGKILL"):
            engine.step()
        assert time.monotonic() - t0 < 5.0  # not timeout_s
        with pytest.raises(RuntimeError, match="is gone"):
            engine.generate(TOKENS[:1], SHORT)
    finally:
        engine.shutdown()
    assert engine.llm.executor.released
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request(TOKENS[0])


def test_a_block_size_given_the_same_on_both_sides_is_accepted_the_default_included(tiny_model, monkeypatch):
    assert engine_kwargs(None, {}, {"block_size": 16}, None)[0]["block_size"] == 16  # 16 is the default
    assert engine_kwargs(None, {"block_size": 8}, None, {"block_size": 8})[1]["block_size"] == 8
    with pytest.raises(
        ValueError,
        match=r"block_size differs: the prefill engine's is 32 \(prefill=\{'block_size': 32\}\), the decode "
        r"engine's 16 \(the default\)",
    ):
        engine_kwargs(None, {}, {"block_size": 32}, None)
    with pytest.raises(ValueError, match=r"the decode engine's 8 \(block_size=8\)"):
        engine_kwargs(None, {"block_size": 8}, {"block_size": 4}, None)

    class Started(Exception):
        pass

    def start(self):
        raise Started

    monkeypatch.setattr(mp.get_context("spawn").Process, "start", start)
    with pytest.raises(Started):  # every check passed: the prefill process was about to start
        DisaggregatedLLM(tiny_model, prefill={"block_size": 16}, decode={"kv_offloading_size": "1MiB"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(threads=(0, 1)), r"threads\[0\] \(the prefill process's\) must be a positive integer"),
        (dict(threads=2), "threads must be a pair"),
        (dict(timeout_s=0), "timeout_s must be a positive number of seconds, got 0"),
        (dict(timeout_s=float("nan")), "timeout_s must be"),
        (dict(start_timeout_s=-1), "start_timeout_s must be"),
        (dict(prefill="fast"), "prefill must be a dict"),
        (dict(decode={"block_size": 0}), "the decode engine's arguments: block_size must be"),
        (dict(prefill={"max_num_seqs": "many"}), "the prefill engine's arguments: max_num_seqs must be"),
        (dict(prefill={"blocksize": 16}), "the prefill engine's arguments: unknown engine argument.*'blocksize'"),
        (dict(decode={"kv_offloading_size": 0}), r"kv_offloading_size=0 \(decode=.*needs a KV store"),
        (dict(prefill={"enable_prefix_caching": False}), "enable_prefix_caching=False"),
        (dict(prefill={"dtype": "float16"}, decode={"dtype": "float32"}), "dtype differs"),
        (dict(tensor_parallel_size=3), "single-rank engines"),
        (dict(model="/no/such/model"), "model='/no/such/model' is not a model folder"),
    ],
)
def test_a_bad_argument_is_refused_before_any_process_starts(kwargs, match, monkeypatch):
    def start(self):
        raise AssertionError("a process started before the arguments were checked")

    monkeypatch.setattr(mp.get_context("spawn").Process, "start", start)
    with pytest.raises(ValueError, match=match):
        DisaggregatedLLM(**kwargs)


def test_shutdown_of_a_stopped_prefill_process_is_bounded(tiny_disagg):
    # the last test of tiny_disagg (pytest keeps the file's order): it shuts the engine down
    engine = tiny_disagg
    pid = engine.prefill_pid
    stop(pid)
    try:
        t0 = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - t0 < 3.0  # killed at once: a stopped process cannot leave on its own
    finally:
        if process_state(pid):
            os.kill(pid, signal.SIGKILL)
    assert process_state(pid) == "" and engine.llm.executor.released
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request(TOKENS[0])
