"""Sliding-window attention: the kernels' masks against a written-out loop, and tiny Qwen2 (sliding-window layers
beside full-attention ones) and Mistral (every layer windowed) models token for token against transformers.

A test that the window matters: the same weights with the window switched off give other tokens, so equality
with transformers here is not equality of two engines that both ignore the window.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from minipaged.engine.llm import LLM
from minipaged.kernels import reference, torch_backend
from minipaged.model.llama import sliding_windows
from minipaged.model_loader import hf_greedy_token_ids, save_tiny_llama
from minipaged.sampling_params import SamplingParams

WINDOW = 6
PROMPTS = [list(range(3, 3 + n)) for n in (5, 11, 17, 26)] + [[7, 9, 11, 7, 9, 11, 40, 41, 42, 43, 44, 45, 2]]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# Larger weights than transformers' default 0.02: logits far apart, so two correct engines never tie.
TINY = dict(num_hidden_layers=4, initializer_range=0.2, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    return save_tiny_llama(path / "m", model_type="qwen2", use_sliding_window=True, max_window_layers=2, **TINY)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("mistral") / "m", model_type="mistral", **TINY)


def transformers_tokens(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf_greedy_token_ids(hf, PROMPTS, GREEDY.max_tokens)


def test_the_config_says_which_layers_are_windowed(qwen2, mistral):
    from minipaged.model.llama import read_config

    assert sliding_windows(read_config(qwen2)) == [None, None, WINDOW, WINDOW]
    assert sliding_windows(read_config(mistral)) == [WINDOW] * 4


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(max_num_batched_tokens=8, num_gpu_blocks_override=13, max_model_len=48, watermark=0.0)],
    ids=["plain", "chunked-preempting-prefix-cached"],
)
@pytest.mark.parametrize("which", ["qwen2", "mistral"])
def test_windowed_models_match_transformers(request, which, kw):
    path = request.getfixturevalue(which)
    if which == "qwen2" and kw:  # two KV cache groups: a request's longest life takes 12 + 5 blocks, not 12
        kw = {**kw, "num_gpu_blocks_override": 20}
    llm = LLM(model=path, dtype="float32", block_size=4, **kw)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert ours == transformers_tokens(path)
    if "num_gpu_blocks_override" in kw:
        assert llm.scheduler.num_preemptions > 0 and max(s["tokens"] for s in llm.step_stats) <= 8
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[3:4], GREEDY)]  # its prefix now cached
    assert again == ours[3:4] and llm.kv_cache_manager.prefix_cache_hits > 0


def test_the_window_changes_the_tokens(qwen2, tmp_path):
    """Without its window the same model says something else: the equality above tests the window."""
    plain = tmp_path / "no-window"
    shutil.copytree(qwen2, plain)
    config = json.loads((plain / "config.json").read_text())
    config.update(use_sliding_window=False, layer_types=["full_attention"] * 4)
    (plain / "config.json").write_text(json.dumps(config))
    assert transformers_tokens(plain) != transformers_tokens(qwen2)
    # and the engine, whose step program (no window: the compiled CPU path) adds Qwen2's q/k/v biases too
    from minipaged.model.step_program import StepProgram

    llm = LLM(model=plain, dtype="float32", block_size=4)
    ours = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert isinstance(llm.model.model._program, StepProgram)  # that path ran the steps
    assert ours == transformers_tokens(plain)


@pytest.mark.parametrize("window", [1, 3, 5, 40])
def test_windowed_kernels_match_a_written_out_loop(window):
    torch.manual_seed(window)
    bs, heads, kv_heads, d = 4, 4, 2, 8
    key_cache, value_cache = torch.randn(12, bs, kv_heads, d), torch.randn(12, bs, kv_heads, d)
    seq_lens = torch.tensor([9, 3, 14], dtype=torch.int32)
    tables = torch.tensor([[5, 2, 9, 0], [7, 0, 0, 0], [1, 3, 4, 6]], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)  # prefill 4 of 9, decode 1 of 3, prefill 6 of 14
    q = torch.randn(11, heads, d)
    want = torch.empty_like(q)
    for i in range(3):  # one token at a time: softmax over the positions it sees
        n, first = int(seq_lens[i]), int(cu[i])
        for r in range(int(cu[i + 1]) - first):
            pos = n - (int(cu[i + 1]) - first) + r
            seen = [p for p in range(n) if pos - window < p <= pos]
            slots = [(int(tables[i, p // bs]), p % bs) for p in seen]
            k = torch.stack([key_cache[b, o] for b, o in slots]).repeat_interleave(heads // kv_heads, 1)
            v = torch.stack([value_cache[b, o] for b, o in slots]).repeat_interleave(heads // kv_heads, 1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[first + r], k) * 0.5, -1)
            want[first + r] = torch.einsum("hn,nhd->hd", w, v)
    args = (key_cache, value_cache, tables, cu, seq_lens, 0.5)
    for attend in (reference.paged_prefill_attention, torch_backend.paged_prefill_attention):
        torch.testing.assert_close(attend(q, *args, sliding_window=window), want, rtol=1e-5, atol=1e-5)
    decode_rows = torch.tensor([3, 4, 10])  # the last token of each: the decode kernels, all batched
    for attend in (reference.paged_decode_attention, torch_backend.paged_decode_attention):
        got = attend(q[decode_rows], key_cache, value_cache, tables, seq_lens, 0.5, sliding_window=window)
        torch.testing.assert_close(got, want[decode_rows], rtol=1e-5, atol=1e-5)


def test_windows_need_the_pytorch_backend(qwen2):
    with pytest.raises(ValueError, match="PyTorch backend"):
        LLM(model=qwen2, dtype="float32", block_size=16, attention_backend="triton")
