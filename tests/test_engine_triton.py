"""The Triton attention backend drives the whole engine (interpreter on CPU, compiled on a GPU).

A tiny random Llama keeps the interpreter fast; greedy tokens must equal the PyTorch backend's.
"""

import pytest
import torch

from minipaged.engine.llm import LLM
from minipaged.sampling_params import SamplingParams


def test_triton_backend_matches_torch_backend(tiny_model):
    prompts = [[5, 17, 3, 9, 40, 2, 8, 61, 33, 12, 7, 1, 90, 4, 4, 22, 13, 50], [7, 7, 30]]  # 18 and 3 tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(
        model=tiny_model, block_size=16, num_gpu_blocks_override=16, max_model_len=64, max_num_batched_tokens=16
    )  # the long prompt is chunked: prefill over a cached context
    torch_out = LLM(attention_backend="torch", **kw).generate(prompts, params)
    triton_llm = LLM(attention_backend="triton", **kw)
    assert triton_llm.model.attention.backend == "triton"
    triton_out = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in triton_out] == [o.outputs[0].token_ids for o in torch_out]
    assert all(len(o.outputs[0].token_ids) == 6 for o in triton_out)
    with pytest.raises(ValueError, match="no tokenizer"):
        triton_llm.generate("text needs a tokenizer", params)


def test_triton_backend_verifies_drafts(tiny_model):
    """Speculative decoding on the Triton kernels: a decode with drafts is a short prefill over a cached context
    (the prefill kernel), and its greedy tokens are the PyTorch backend's without speculation."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 3, 9, 3, 9, 3]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    kw = dict(model=tiny_model, block_size=16, num_gpu_blocks_override=16, max_model_len=64)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    want = [o.outputs[0].token_ids for o in LLM(attention_backend="torch", **kw).generate(prompts, params)]
    llm = LLM(attention_backend="triton", speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.scheduler.spec_decoding_stats
    assert stats is not None and stats.num_draft_tokens > 0


def test_triton_backend_checks_and_plans_once_per_step(tiny_model, monkeypatch):
    """Thirty layers read the same metadata: the Triton backend validates it on the first layer only,
    and reads no q_len back from the device per layer (the plan carries max_query_len)."""
    from minipaged.kernels import validation

    # Eager: on a GPU the decode steps replay CUDA graphs, which run no Python at all (one call, the prefill's, there).
    llm = LLM(model=tiny_model, attention_backend="triton", block_size=16, num_gpu_blocks_override=16, max_model_len=64,
              enforce_eager=True)  # fmt: skip
    calls = []
    real = validation.check_paged_prefill
    monkeypatch.setattr(validation, "check_paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = llm.generate([[5, 17, 3, 9], [7, 7, 30]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    steps = len(llm.step_stats)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert llm.model.config.num_hidden_layers == 2 and len(calls) == steps  # once per step, not once per layer


def test_runner_reuses_its_input_buffers(tiny_model):
    llm = LLM(model=tiny_model, block_size=16, num_gpu_blocks_override=16, max_model_len=64)
    buffers = llm.executor.runner.buffers
    addresses = {
        name: getattr(buffers, name).data_ptr()
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q", "block_tables")
    }
    seen = []
    real = llm.executor.runner.prepare_inputs

    def spy(out):
        ids, pos, meta, rows = real(out)
        seen.append((ids.data_ptr(), pos.data_ptr(), meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr()))
        return ids, pos, meta, rows

    llm.executor.runner.prepare_inputs = spy
    llm.generate([[5, 17, 3, 9, 40, 2], [7, 7, 30]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(seen) >= 4 and set(seen) == {
        (addresses["input_ids"], addresses["positions"], addresses["slot_mapping"], addresses["block_tables"])
    }
    assert {name: getattr(buffers, name).data_ptr() for name in addresses} == addresses


def test_dtype_auto_follows_vllm(tiny_model, monkeypatch):
    from minipaged.config import resolve_dtype

    assert LLM(model=tiny_model, num_gpu_blocks_override=16, device="cpu").dtype == torch.float32  # CPU: float32
    cuda = torch.device("cuda")
    # The capability decides (config.cuda_computes_bf16), on a machine with a GPU or without one: an H100 ...
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    assert resolve_dtype("auto", "float32", cuda) == torch.bfloat16  # fp32 checkpoint (our SmolLM2 cache)
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("auto", "float16", cuda) == torch.float16
    assert resolve_dtype("auto", None, cuda) == torch.bfloat16
    assert resolve_dtype("float32", "bfloat16", cuda) == torch.float32  # asked for explicitly
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))  # ... and a T4 (sm_75)
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", None, cuda)
