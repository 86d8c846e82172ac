"""The Triton attention backend drives the whole engine (interpreter on CPU, compiled on a GPU).

A tiny random Llama keeps the interpreter fast; greedy tokens must equal the PyTorch backend's.
"""
import pytest
import torch

from minipaged.engine import LLM
from minipaged.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_triton_backend_matches_torch_backend(tiny_model):
    prompts = [[5, 17, 3, 9, 40, 2, 8, 61, 33, 12, 7, 1, 90, 4, 4, 22, 13, 50], [7, 7, 30]]  # 18 and 3 tokens
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(model=tiny_model, block_size=16, num_gpu_blocks_override=16, max_model_len=64,
              max_num_batched_tokens=16)  # the long prompt is chunked: prefill over a cached context
    torch_out = LLM(attention_backend="torch", **kw).generate(prompts, params)
    triton_llm = LLM(attention_backend="triton", **kw)
    assert triton_llm.model.attention.backend == "triton"
    triton_out = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in triton_out] == [o.outputs[0].token_ids for o in torch_out]
    assert all(len(o.outputs[0].token_ids) == 6 for o in triton_out)
    with pytest.raises(ValueError, match="no tokenizer"):
        triton_llm.generate("text needs a tokenizer", params)
