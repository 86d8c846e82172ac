"""Our Llama forward on a paged cache matches transformers, prefill then decode, on a tiny random model."""

from types import SimpleNamespace

import pytest
import torch

from minipaged.model import AttentionMetadata, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    hf = HFLlama(config).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return hf, LlamaForCausalLM.from_pretrained(path)


def _step(model, caches, tokens, start, block_table, block_size):
    """Run len(tokens) new tokens of one sequence whose first `start` tokens are cached."""
    n = len(tokens)
    positions = torch.arange(start, start + n)
    slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in positions.tolist()])
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        seq_lens=torch.tensor([start + n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n,
    )
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), positions, caches, meta)
        return model.compute_logits(hidden)


def test_prefill_chunks_and_decode_match_transformers(tiny):
    hf, ours = tiny
    block_size, num_blocks = 4, 12
    caches = [
        (torch.zeros(num_blocks, block_size, 2, 16), torch.zeros(num_blocks, block_size, 2, 16)) for _ in range(2)
    ]
    block_table = [7, 2, 9, 4, 11, 1]  # scattered physical blocks
    torch.manual_seed(1)
    seq = torch.randint(0, 128, (21,)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([seq])).logits[0]
    got = [
        _step(ours, caches, seq[:7], 0, block_table, block_size),  # a prefill chunk
        _step(ours, caches, seq[7:18], 7, block_table, block_size),
    ]  # the rest of the prompt
    got += [_step(ours, caches, [seq[i]], i, block_table, block_size) for i in range(18, 21)]  # decodes
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_and_bad_configs(tmp_path):
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    HFLlama(config).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="no config.json"):
        LlamaForCausalLM.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a Llama"):
        LlamaForCausalLM(SimpleNamespace(model_type="gpt2", num_attention_heads=4, num_key_value_heads=4))


def test_packed_linear_matches_nn_linear_and_follows_weight_updates():
    """The oneDNN path (inference on a CPU) computes what nn.Linear does, and never uses a stale packed weight."""
    from minipaged.model import layers

    torch.manual_seed(0)
    layer = layers.Linear(48, 80, bias=True)
    plain = torch.nn.Linear(48, 80, bias=True)
    plain.load_state_dict(layer.state_dict())
    for rows in (1, 3, 32, 70):
        x = torch.randn(rows, 48)
        with torch.inference_mode():
            got = layer(x)
        torch.testing.assert_close(got, plain(x).detach(), atol=1e-5, rtol=1e-5)
    assert layer._packed is not None or not layers._ONEDNN  # the packed path really ran
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an in-place change must re-pack
        plain.weight.mul_(2.0)
        x = torch.randn(5, 48)
        torch.testing.assert_close(layer(x), plain(x), atol=1e-5, rtol=1e-5)
    y = layer(torch.randn(2, 48, requires_grad=True))  # with gradients on: plain nn.Linear, trainable
    y.sum().backward()
    assert layer.weight.grad is not None
