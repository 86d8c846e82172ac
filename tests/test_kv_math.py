"""KV byte math: the figures the course quotes come out of the package, and bad input is refused clearly."""

import json
import math

import pytest

from minipaged.kv_math import (
    PRESETS,
    GiB,
    KiB,
    KVSpec,
    MiB,
    MLASpec,
    RecurrentStateSpec,
    attention_variants,
    dtype_bytes,
    format_bytes,
    num_blocks_at_startup,
)

L80_GQA8 = KVSpec(80, 8, 128, 2, 64)  # the "80-layer, 8-KV-head" model of the capacity article, fp16


def test_llama3_70b_bytes_per_token_and_block():
    spec = KVSpec.from_preset("llama-3-70b")
    assert spec.bytes_per_token == 327_680  # "Inference at scale" 23.1: "327680 bytes ≈ 320 KB/token"
    assert spec.bytes_per_block(16) == 5 * MiB  # ibid.: "5 MB per block (for Llama 70B-class)"
    assert spec.attention_kind == "GQA"


def test_80_layer_gqa8_at_4k_and_32k():
    assert L80_GQA8.bytes_for_tokens(4096) == 1.25 * GiB
    assert L80_GQA8.bytes_for_tokens(32 * 1024) == 10 * GiB
    # "Inference at scale" 23.1: 1.3 / 10.5 / 42 GB at 4K / 32K / 128K. With K = 1,024 tokens the
    # decimal gigabytes are 1.3 / 10.7 / 42.9; with K = 1,000 tokens they are the printed ones.
    assert [round(L80_GQA8.bytes_for_tokens(n) / 1e9, 1) for n in (4096, 32768)] == [1.3, 10.7]
    assert round(L80_GQA8.bytes_for_tokens(128 * 1024) / 1e9) == 43
    assert [round(L80_GQA8.bytes_for_tokens(n) / 1e9, 1) for n in (4000, 32000, 128000)] == [1.3, 10.5, 41.9]


def test_mha_gqa_mqa_at_4k():
    got = {
        k: f"{v:.2f}"
        for k, v in (
            (kind, L80_GQA8.with_kv_heads(h).bytes_for_tokens(4096) / GiB)
            for kind, h in (("MHA-64", 64), ("GQA-8", 8), ("MQA-1", 1))
        )
    }
    assert got == {"MHA-64": "10.00", "GQA-8": "1.25", "MQA-1": "0.16"}
    assert L80_GQA8.with_kv_heads(64).bytes_per_token == 2560 * KiB
    assert L80_GQA8.with_kv_heads(1).bytes_per_token == 40 * KiB


def test_attention_variants_names_and_sizes():
    variants = attention_variants(KVSpec.from_preset("llama-3-8b"))
    assert list(variants) == ["MHA (32 KV heads)", "GQA (8 KV heads)", "MQA (1 KV head)"]
    at_2048 = [v.bytes_for_tokens(2048) for v in variants.values()]
    assert at_2048 == [1 * GiB, 256 * MiB, 32 * MiB]
    assert list(attention_variants(KVSpec.from_preset("llama-2-7b"))) == ["MHA (32 KV heads)", "MQA (1 KV head)"]


def test_llama3_8b_at_2048_and_per_block():
    spec = KVSpec.from_preset("llama-3-8b")
    assert spec.bytes_for_tokens(2048) == 256 * MiB
    assert spec.bytes_per_block(16) == 2 * MiB
    assert KVSpec.from_preset("llama-2-7b").bytes_for_tokens(2048) == 1024 * MiB  # MHA: 4× more


def test_presets_cover_the_course_models_with_sources():
    for name in ("gpt2", "llama-2-7b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b", "mistral-7b", "smollm2-135m"):
        spec = KVSpec.from_preset(name)
        assert spec.source and spec.num_params
    assert KVSpec.from_preset("GPT2").attention_kind == "MHA"
    assert KVSpec.from_preset("llama-3.1-405b").bytes_per_token == 2 * 126 * 8 * 128 * 2
    assert KVSpec.from_preset("smollm2-135m", dtype="fp32").bytes_per_token == 46_080
    assert KVSpec.from_preset("Llama_3_8B").name == "Llama-3-8B"


def test_tp2_per_rank_8k_request_and_capacity():
    rank = KVSpec.from_preset("llama-3-70b").per_rank(2)
    assert rank.num_kv_heads == 4
    per_request = rank.bytes_for_tokens(8192)
    assert per_request == 1.25 * GiB
    assert (
        f"{per_request * 1.04 / GiB:.2f}" == "1.30"
    )  # the capacity article: the paper's <4 % tail waste as an estimate
    assert math.floor(8 / (per_request * 1.04 / GiB)) == 6
    cap = rank.capacity(8 * GiB, block_size=16, request_tokens=8192)
    assert cap.full_requests == 6 and cap.blocks_per_request == 512 and cap.tail_waste_tokens == 0


def test_kv_heads_per_rank_rules():
    spec = KVSpec(80, 8, 128, 2)
    assert spec.kv_heads_per_rank(2) == (4, "evenly sharded")
    assert spec.kv_heads_per_rank(3)[0] == 8  # no clean split: replicated budget
    assert spec.kv_heads_per_rank(16) == (1, "each KV head replicated on 2 ranks")
    assert KVSpec(80, 1, 128, 2).kv_heads_per_rank(4)[0] == 1


def test_check_tp_size_refuses_what_vllm_refuses():
    """vLLM's ModelConfig.verify_with_parallel_config (vllm/config/model.py) wants the attention heads divisible by
    tensor_parallel_size; its QKVParallelLinear splits the KV heads evenly or copies each whole. TP=3 on
    Llama-3-70B (64 query heads, 8 KV heads) breaks both; a size it accepts gives kv_heads_per_rank's answer."""
    llama70 = KVSpec.from_preset("llama-3-70b")
    with pytest.raises(ValueError, match=r"refuses tensor_parallel_size=3.*64 attention heads are not divisible by 3"):
        llama70.check_tp_size(3)
    with pytest.raises(ValueError, match="Sizes it accepts: 1, 2, 4, 8, 16, 32, 64$"):
        llama70.check_tp_size(3)
    with pytest.raises(ValueError, match="64 attention heads are not divisible by 128"):
        llama70.check_tp_size(128)  # the KV heads could be copied on 128 ranks, the query heads cannot split
    assert llama70.check_tp_size(2) == llama70.kv_heads_per_rank(2) == (4, "evenly sharded")
    assert llama70.check_tp_size(16) == (1, "each KV head replicated on 2 ranks")
    with pytest.raises(ValueError, match="8 KV heads neither split evenly over 3 ranks"):
        KVSpec(80, 8, 128, 2).check_tp_size(3)  # no query heads given: checked on the KV heads alone
    smol = KVSpec.from_preset("smollm2-135m")
    assert smol.check_tp_size(3) == (1, "evenly sharded")  # chapter 12's split: 9 query heads, 3 KV heads
    with pytest.raises(ValueError, match="9 attention heads are not divisible by 2"):
        smol.check_tp_size(2)
    with pytest.raises(ValueError, match="tp_size"):
        smol.check_tp_size(0)
    assert "vLLM refuses" in llama70.kv_heads_per_rank(3)[1]  # the calculator's budget says so too


def test_capacity_counts_whole_blocks_and_tail_waste():
    spec = KVSpec.from_preset("smollm2-135m", dtype="fp32")
    cap = spec.capacity(GiB, block_size=16, request_tokens=2048)
    assert (cap.num_blocks, cap.full_requests, cap.token_slots) == (1456, 11, 1456 * 16)
    assert cap.leftover_bytes == GiB - 1456 * 720 * KiB
    tail = KVSpec(1, 1, 8, 1).capacity(16 * 16 * 40, block_size=16, request_tokens=50)
    assert (tail.blocks_per_request, tail.tail_waste_tokens, tail.full_requests) == (4, 14, 10)
    assert tail.tail_waste_fraction == pytest.approx(14 / 64)
    assert spec.paged_bytes_for_tokens(50, 16) == 4 * spec.bytes_per_block(16)
    assert spec.blocks_for_tokens(0) == 0


def test_startup_block_count():
    spec = KVSpec.from_preset("llama-3-8b")
    blocks = num_blocks_at_startup(80 * GiB, 0.9, 16 * GiB, 2 * GiB, spec, 16)
    assert blocks == int((80 * 0.9 - 18) * GiB // (2 * MiB))  # ≈ 27,600 blocks, not the site's "~4096"
    with pytest.raises(ValueError, match="less than one KV block"):
        num_blocks_at_startup(16 * GiB, 0.9, 16 * GiB, 0, spec)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        num_blocks_at_startup(80 * GiB, 1.5, 0, 0, spec)


def test_from_hf_config_dict_path_and_object(tmp_path):
    llama = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "torch_dtype": "bfloat16",
    }
    spec = KVSpec.from_hf_config(llama)
    assert (spec.head_dim, spec.num_kv_heads, spec.dtype_bytes) == (128, 8, 2)
    gpt2 = {"n_layer": 12, "n_head": 12, "n_embd": 768}  # no KV-head key: MHA
    assert KVSpec.from_hf_config(gpt2).bytes_per_token == KVSpec.from_preset("gpt2").bytes_per_token
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**llama, "head_dim": 64}))
    assert KVSpec.from_hf_config(path).head_dim == 64  # explicit head_dim wins
    assert KVSpec.from_hf_config(tmp_path, dtype="fp8").dtype_bytes == 1
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert KVSpec.from_hf_config(cfg, dtype="fp16").bytes_per_token == PRESETS["smollm2-135m"].bytes_per_token


def test_dtypes():
    assert [dtype_bytes(d) for d in ("fp32", "fp16", "bf16", "fp8", "torch.bfloat16")] == [4, 2, 2, 1, 2]
    import torch

    assert dtype_bytes(torch.float16) == 2
    assert KVSpec(1, 1, 64, "fp8").with_dtype("fp32").dtype_bytes == 4


def test_mla_and_recurrent_state_are_the_exceptions():
    mla = MLASpec(num_layers=61, kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V3 widths
    assert mla.bytes_per_token == 61 * 576 * 2
    assert mla.bytes_for_tokens(1000) == 1000 * mla.bytes_per_token
    mamba = RecurrentStateSpec.mamba2()
    assert mamba.bytes_for_tokens(100) == mamba.bytes_for_tokens(100_000) == mamba.bytes_per_request
    assert mamba.bytes_for_tokens(0) == 0 and mamba.bytes_per_token == 0
    assert mamba.ssm_state_elements == 5120 * 128


def test_format_bytes():
    assert format_bytes(1.25 * GiB) == "1.25 GiB"
    assert format_bytes(2 * MiB, "KiB", 0) == "2048 KiB"
    assert format_bytes(12) == "12 B"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: KVSpec(0, 8, 128, 2), "num_layers must be a positive integer"),
        (lambda: KVSpec(32, -1, 128, 2), "num_kv_heads must be a positive integer"),
        (lambda: KVSpec(32, 8, 128, 3), "dtype_bytes must be 1, 2 or 4"),
        (lambda: KVSpec(32, 8, 128, "int3"), "unknown KV-cache dtype"),
        (lambda: KVSpec(32, 8, 128, 2, num_attention_heads=12), "must be a multiple of num_kv_heads"),
        (lambda: KVSpec.from_preset("llama-9"), "unknown preset 'llama-9'"),
        (lambda: KVSpec.from_preset("llama-3-8b").bytes_per_block(0), "block_size must be a positive integer"),
        (lambda: KVSpec.from_preset("llama-3-8b").capacity(GiB, block_size=-16), "block_size"),
        (lambda: KVSpec.from_preset("llama-3-8b").capacity(1 * MiB), "too small for one KV block"),
        (lambda: KVSpec.from_preset("llama-3-8b").capacity(-5), "budget_bytes must be a non-negative"),
        (lambda: KVSpec.from_preset("llama-3-8b").bytes_for_tokens(-1), "num_tokens"),
        (lambda: KVSpec.from_preset("llama-3-8b").kv_heads_per_rank(0), "tp_size"),
        (lambda: KVSpec.from_hf_config({"hidden_size": 10}), "num_hidden_layers"),
        (
            lambda: KVSpec.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 10}),
            "not divisible",
        ),
        (lambda: KVSpec.from_hf_config("/nonexistent/config.json"), "no config.json"),
    ],
)
def test_bad_input_raises_clear_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
