"""The engine on SmolLM2: greedy output token for token equal to transformers' own generate.

Floating-point sums depend on batch shape, so two correct greedy runs may part
where the top two logits are all but tied. Where a sequence differs, every token
of ours must be transformers' greedy choice given our tokens before it, or a near
tie the dtype cannot break (``minipaged.model_loader.greedy_agreement``). Anything
else is a real bug.
"""

from __future__ import annotations

import os

import pytest
import torch

from minipaged.engine.llm import LLM
from minipaged.model_loader import (
    chat_prompt_ids,
    greedy_agreement,
    hf_greedy_token_ids,
    load_hf_model,
    weights_are_random,
)
from minipaged.sampling_params import SamplingParams

MAX_TOKENS = 20
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List the days of the week.",
    "What is 12 times 12?",
    "Hi",
    "Summarise the plot of Romeo and Juliet for a child, in two short sentences, using simple words only.",
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
# `make gpu-check` runs these tests again on the Triton backend (MINIPAGED_TEST_BACKEND=triton), on the GPU.
BACKEND = os.environ.get("MINIPAGED_TEST_BACKEND", "auto")
# The real SmolLM2 knows that Paris is France's capital; random SmolLM2-shaped weights (a GPU lease, where the real
# ones cannot travel) repeat one token for ever: every equality with transformers still holds, the text does not.
REAL = not weights_are_random()


def engine(**kw) -> LLM:
    """The engine under test: float32 like the transformers reference, on the backend asked for."""
    return LLM(dtype="float32", attention_backend=BACKEND, **kw)


@pytest.fixture(scope="module")
def hf():
    return load_hf_model()


@pytest.fixture(scope="module")
def prompt_ids():
    from minipaged.model_loader import load_tokenizer

    tok = load_tokenizer()
    ids = [chat_prompt_ids(tok, p) for p in PROMPTS]
    assert len({len(i) for i in ids}) >= 6  # different lengths
    return ids


@pytest.fixture(scope="module")
def reference(hf, prompt_ids):
    """transformers greedy generate, one prompt at a time (no batching effects at all)."""
    return hf_greedy_token_ids(hf, prompt_ids, MAX_TOKENS)


def assert_same_greedy(hf, prompt: list[int], ours: list[int], ref: list[int]) -> None:
    """Equal to transformers' greedy output, or each token its greedy choice up to a near tie (``greedy_agreement``)."""
    if ours == ref:
        return
    verdict = greedy_agreement(hf, prompt, ours)
    assert verdict.ok, f"{verdict}\nours:         {ours}\ntransformers: {ref}"


def check_all(llm: LLM, hf, prompt_ids, reference) -> list:
    outs = llm.generate(prompt_ids, GREEDY)
    for ids, out, ref in zip(prompt_ids, outs, reference):
        assert out.finished and out.error is None
        assert_same_greedy(hf, ids, out.outputs[0].token_ids, ref)
    return outs


@pytest.mark.parametrize("block_size", [16, 32])
def test_batch_of_eight_matches_transformers(hf, prompt_ids, reference, block_size):
    llm = engine(block_size=block_size)
    outs = check_all(llm, hf, prompt_ids, reference)
    assert "Paris" in outs[0].outputs[0].text or not REAL
    assert max(s["running"] for s in llm.step_stats) == 8  # all eight were served together


def test_bfloat16_matches_transformers_in_bfloat16(prompt_ids):
    """dtype="bfloat16" (fast on CPUs with AVX512-BF16 or AMX): the bf16 engine against transformers in bf16."""
    hf16 = load_hf_model(dtype=torch.bfloat16)
    ids = prompt_ids[:4]
    ref = hf_greedy_token_ids(hf16, ids, 12)
    llm = LLM(dtype="bfloat16", attention_backend=BACKEND)
    assert llm.kv_cache_manager is not None and next(llm.model.parameters()).dtype == torch.bfloat16
    outs = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0))
    for p, out, r in zip(ids, outs, ref):
        assert out.finished and out.error is None
        assert_same_greedy(hf16, p, out.outputs[0].token_ids, r)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_does_not_change_outputs(hf, prompt_ids, reference, mode):
    llm = engine(
        num_gpu_blocks_override=14,
        max_model_len=160,
        preemption_mode=mode,
        swap_space="32MiB" if mode == "swap" else 0,
        watermark=0.0,
    )
    check_all(llm, hf, prompt_ids, reference)
    assert llm.scheduler.num_preemptions > 0
    assert llm.kv_cache_manager.get_num_free_blocks() == llm.num_blocks - 1


def test_prefix_caching_and_chunked_prefill_match(hf, prompt_ids, reference):
    llm = engine(enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=4)
    check_all(llm, hf, prompt_ids, reference)
    assert max(s["tokens"] for s in llm.step_stats) <= 24
    again = llm.generate(prompt_ids[:2], GREEDY)  # the same prompts again: served from the prefix cache
    for ids, out, ref in zip(prompt_ids, again, reference):
        assert_same_greedy(hf, ids, out.outputs[0].token_ids, ref)
    pool = llm.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) > 0


@pytest.mark.slow  # three rank processes: make test-slow (chapter 12's notebook serves TP 3 in make test)
def test_tensor_parallel_3_matches_transformers(hf, prompt_ids, reference):
    """SmolLM2 split over three processes (3 of its 9 query heads and 1 of its 3 KV heads each), with chunked
    prefill: the greedy tokens of one process (tests/test_tensor_parallel.py covers the rest on a tiny model).

    On CUDA each rank needs a GPU of its own; with fewer than three (a one-GPU `make gpu-check`) the ranks share
    the CPU over gloo, where the PyTorch backend serves them (the Triton kernels would need the interpreter)."""
    kw: dict = dict(tensor_parallel_size=3, max_num_batched_tokens=64, kv_cache_memory="32MiB", max_model_len=1024)
    if torch.cuda.is_available() and torch.cuda.device_count() < 3:
        kw.update(device="cpu", attention_backend="torch")
    llm = LLM(dtype="float32", **{"attention_backend": BACKEND, **kw})
    try:
        assert [r["num_kv_heads"] for r in llm.executor.ranks()] == [1, 1, 1]
        check_all(llm, hf, prompt_ids[:4], reference[:4])  # four prompts: three ranks on two cores cost 20 s for eight
        assert max(s["tokens"] for s in llm.step_stats) == 64  # prefills were chunked
    finally:
        llm.shutdown()


def test_a_request_does_not_depend_on_its_batch(prompt_ids):
    llm = engine()
    alone = llm.generate([prompt_ids[3]], GREEDY)[0].outputs[0].token_ids
    crowd = llm.generate(prompt_ids, GREEDY)[3].outputs[0].token_ids
    assert alone == crowd


def test_sampling_is_reproducible_with_seeds_and_n(prompt_ids):
    llm = engine()
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=7, n=3)
    a = llm.generate([prompt_ids[2]], p)[0]
    b = llm.generate([prompt_ids[2], prompt_ids[0]], [p, SamplingParams(max_tokens=5, temperature=1.0)])[0]
    assert len(a.outputs) == 3 and [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the three samples differ


def test_inputs_rejections_and_streaming(prompt_ids):
    llm = engine(max_model_len=256)
    text = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))[0]
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert ("Paris" in chat.outputs[0].text or not REAL) and text.outputs[0].token_ids
    too_long = list(range(1, 300))
    outs = llm.generate([too_long, prompt_ids[0]], GREEDY)
    assert outs[0].outputs[0].finish_reason == "rejected" and "max_model_len=256" in outs[0].error
    assert outs[1].finished and ("Paris" in outs[1].outputs[0].text or not REAL)
    snapshots = list(llm.stream([prompt_ids[0]], SamplingParams(max_tokens=6, temperature=0)))
    lengths = [len(s.outputs[0].token_ids) for s in snapshots]
    assert lengths == sorted(lengths) and snapshots[-1].finished and len(snapshots) >= 6
    ttft = snapshots[-1].metrics.ttft
    assert ttft is not None and ttft >= 0 and len(snapshots[-1].metrics.inter_token_latencies) == 5
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], GREEDY)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int8")
    with pytest.raises(ValueError, match="max_model_len=8192 needs 512 blocks"):
        LLM(num_gpu_blocks_override=10, max_model_len=8192)
    with pytest.warns(UserWarning, match="max_model_len lowered from 8192 to 144"):  # unasked: it fits the pool
        assert LLM(num_gpu_blocks_override=10).max_model_len == 9 * 16  # (null block aside)
    with pytest.raises(ValueError, match="too small for one KV block"):
        LLM(kv_cache_memory="100KiB")


# ---- speculative decoding by prompt lookup (spec_decode.py) ---------------------------------------------
# prompt_lookup_min=1: drafts at almost every step, most of them wrong: the accept, reject and trim paths all run.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXT_TO_REPEAT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold."
)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(num_gpu_blocks_override=14, max_model_len=160, watermark=0.0),
        dict(num_gpu_blocks_override=14, max_model_len=160, watermark=0.0, preemption_mode="swap", swap_space="32MiB"),
        dict(max_num_batched_tokens=24, max_num_seqs=4),
    ],
    ids=["plain", "recompute", "swap", "chunked-prefix-cached"],
)
def test_speculative_decoding_matches_transformers(hf, prompt_ids, reference, kw):
    llm = engine(speculative_config=SPEC, **kw)
    check_all(llm, hf, prompt_ids, reference)
    stats = llm.scheduler.spec_decoding_stats
    # Some drafts rejected too (a text that repeats one token accepts them all: random weights)
    assert (
        stats.num_drafts > 0
        and 0 < stats.num_accepted_tokens
        and (stats.num_accepted_tokens < stats.num_draft_tokens or not REAL)
    )
    assert sum(s["drafts"] for s in llm.step_stats) == stats.num_draft_tokens
    if "num_gpu_blocks_override" in kw:
        assert llm.scheduler.num_preemptions > 0
    if "max_num_batched_tokens" in kw:
        assert max(s["tokens"] for s in llm.step_stats) <= 24
        again = llm.generate(prompt_ids[:2], GREEDY)  # served from the prefix cache, drafts and all
        for ids, out, ref in zip(prompt_ids, again, reference):
            assert_same_greedy(hf, ids, out.outputs[0].token_ids, ref)
    assert llm.kv_cache_manager.get_num_free_blocks() == llm.num_blocks - 1


@pytest.mark.real_weights
def test_speculation_pays_on_a_text_to_repeat(hf):
    from minipaged.model_loader import load_tokenizer

    ids = chat_prompt_ids(load_tokenizer(), f"Repeat the following text exactly, word for word:\n\n{TEXT_TO_REPEAT}")
    (ref,) = hf_greedy_token_ids(hf, [ids], 40)
    llm = engine(speculative_config={**SPEC, "prompt_lookup_min": 2})
    out = llm.generate([ids], SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    assert_same_greedy(hf, ids, out.token_ids, ref)
    assert "thousand miles" in out.text
    stats = llm.scheduler.spec_decoding_stats
    assert stats.acceptance_rate > 0.3 and stats.mean_acceptance_length > 1.5
    assert llm.num_steps < len(out.token_ids)  # one prefill step, then fewer decode steps than tokens
    from minipaged.serving.metrics import engine_snapshot

    snap = engine_snapshot(llm)  # what /metrics shows
    assert snap["spec_decode_num_drafts_total"] == stats.num_drafts
    assert snap["spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens > 0


def test_speculation_keeps_seeded_samples(prompt_ids):
    """Each emitted token costs one draw from its request's stream, as without speculation: same seed, same
    tokens (n = 3 samples included)."""
    p = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, seed=5, n=3)
    plain = engine().generate([prompt_ids[2], prompt_ids[7]], p)
    spec = engine(speculative_config=SPEC)
    ours = spec.generate([prompt_ids[2], prompt_ids[7]], p)
    assert [[o.token_ids for o in r.outputs] for r in ours] == [[o.token_ids for o in r.outputs] for r in plain]
    assert spec.scheduler.spec_decoding_stats.num_drafts > 0


# ---- KV offloading: evicted prefix blocks kept in CPU memory, loaded back as external hits (kv_connector.py) ---
def test_an_offloaded_prefix_is_loaded_back(hf, prompt_ids, reference):
    llm = engine(kv_offloading_size="16MiB", num_gpu_blocks_override=20, max_model_len=160, watermark=0.0)
    kv = llm.kv_cache_manager
    check_all(llm, hf, prompt_ids[-1:], reference[-1:])  # the longest prompt: its own blocks get cached
    check_all(llm, hf, prompt_ids[:-1], reference[:-1])  # seven others push them out of the 19-block pool
    # No hits from the store yet, with the real model's answers (their lengths decide which blocks were evicted)
    assert kv.connector.num_saved > 0 and (kv.external_hits == 0 or not REAL)
    check_all(llm, hf, prompt_ids[-1:], reference[-1:])  # back: its evicted blocks come from the CPU store
    assert kv.external_hits >= 16 and kv.connector.num_loaded >= 1
    assert kv.get_num_free_blocks() == llm.num_blocks - 1
