"""Shared test set-up (keep it small)."""
# Triton reads TRITON_INTERPRET when a @triton.jit function is defined, and triton.language defines its own
# helpers (tl.zeros, tl.sum, ...) when triton is first imported: the variable must be set before any test module
# imports triton. minipaged.kernels sets it on import when there is no CUDA GPU, so import it first.
import minipaged.kernels  # noqa: F401
import pytest  # noqa: E402
import torch  # noqa: E402


def save_tiny_llama(path, num_attention_heads: int = 4, num_key_value_heads: int = 2, hidden_size: int = 64,
                    intermediate_size: int = 96):
    """A tiny random Llama (seeded) saved as a model folder, no tokenizer: prompts are token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=2, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama saved as a model folder (no tokenizer: prompts are token ids), for fast engine tests."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny"))
