"""Disaggregated prefill: a prefill engine in another process, its K/V sent over torch.distributed (gloo) to the
decode engine here, which loads the prompt's full blocks as external hits and decodes. Same tokens as one engine.
"""

from __future__ import annotations

import pytest

from minipaged.disagg import DisaggregatedLLM
from minipaged.engine import LLM
from minipaged.model_loader import chat_prompt_ids, load_tokenizer
from minipaged.sampling_params import SamplingParams

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
    assert done == [rid] and "Paris" in disagg.get_output(rid).outputs[0].text


def test_engines_must_agree_on_block_size_and_be_single_rank():
    with pytest.raises(ValueError, match="same block_size"):
        DisaggregatedLLM(prefill={"block_size": 32}, decode={"block_size": 16})
    with pytest.raises(ValueError, match="single-rank engines"):
        DisaggregatedLLM(tensor_parallel_size=3)


def test_a_dead_prefill_process_is_an_error_not_a_hang(prompt_ids):
    engine = DisaggregatedLLM(dtype="float32", threads=(1, 1), timeout_s=30)
    try:
        engine._proc.kill()
        engine._proc.join()
        with pytest.raises(RuntimeError, match="prefill engine's process is gone"):
            engine.generate(prompt_ids[:1], GREEDY)
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request(prompt_ids[0], GREEDY)


def test_abort_reaches_both_engines_and_leaves_nothing(disagg, prompt_ids):
    gone = disagg.add_request(prompt_ids[2], GREEDY)
    disagg.abort([gone])  # still in the prefill engine: it is told to drop it
    kept = disagg.add_request(prompt_ids[0], GREEDY)
    while disagg.has_unfinished():
        disagg.step()
    assert disagg.get_output(kept).finished and not disagg._waiting and not disagg._prefilled
    with pytest.raises(ValueError, match="unknown request id"):
        disagg.get_output(gone)
    assert disagg.llm.kv_cache_manager.get_num_free_blocks() == disagg.llm.num_blocks - 1
