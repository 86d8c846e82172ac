"""Shared test set-up (keep it small)."""
# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines its own
# helpers (tl.zeros, tl.sum, ...) when triton is first imported: the variable must be set before any test module
# imports triton. minipaged.kernels sets it on import when there is no CUDA GPU, so import it first.
import minipaged.kernels  # noqa: F401
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama saved as a model folder (no tokenizer: prompts are token ids), for fast engine tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(config).save_pretrained(path)
    return path
