"""Checks for exercise 01: bytes per token and block capacity.

The expected values come from ``minipaged.kv_math``, the package's own answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...kv_math import GiB, KVSpec
from .core import Check, CheckOutcome, report

# (label, num_layers, num_kv_heads, head_dim, dtype_bytes)
_MODELS = [
    ("Llama-3-70B, fp16", 80, 8, 128, 2),
    ("Llama-3-8B, bf16", 32, 8, 128, 2),
    ("Llama-2-7B (MHA), fp16", 32, 32, 128, 2),
    ("80 layers with one KV head (MQA), fp16", 80, 1, 128, 2),
    ("SmolLM2-135M, fp32", 30, 3, 64, 4),
    ("GPT-2, fp8", 12, 12, 64, 1),
]


def check_bytes_per_token(bytes_per_token: Callable[[int, int, int, int], int]) -> list[CheckOutcome]:
    checks = [
        Check(
            f"bytes_per_token({L}, {kv}, {d}, {b})  # {label}",
            lambda L=L, kv=kv, d=d, b=b: bytes_per_token(L, kv, d, b),
            KVSpec(L, kv, d, b).bytes_per_token,
            hint="count everything one token leaves in the cache: which tensors are kept per token, in how "
            "many layers, for which heads (the KV heads, not the query heads), how many numbers wide, and "
            "bytes, not numbers (chapter 01, section 2)",
        )
        for label, L, kv, d, b in _MODELS
    ]
    return report("bytes_per_token", checks)


def _raises_value_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError:
        return "ValueError"
    return "no error"


def check_block_capacity(block_capacity: Callable[[int, int, int, int], tuple[int, int]]) -> list[CheckOutcome]:
    """``block_capacity(budget_bytes, bytes_per_token, block_size, request_tokens) -> (blocks, requests)``."""
    cases = [
        ("1 GiB of SmolLM2 fp32 cache, 2k-token requests", GiB, 46_080, 16, 2048),
        ("60 GiB of Llama-3-8B bf16 cache, 8k-token requests", 60 * GiB, 131_072, 16, 8192),
        ("8 GiB per rank, Llama-3-70B at TP=2, full 8K requests", 8 * GiB, 163_840, 16, 8192),
        ("a 50-token request needs 4 blocks of 16 (tail block)", 40 * 16 * 1000, 1000, 16, 50),
        ("a budget that ends mid-block keeps whole blocks only", 100 * 32 * 10 + 5000, 10, 32, 100),
    ]
    checks = []
    for label, budget, bpt, bs, req in cases:
        cap = _capacity(budget, bpt, bs, req)
        checks.append(
            Check(
                f"block_capacity({budget}, {bpt}, {bs}, {req})  # {label}",
                lambda a=(budget, bpt, bs, req): tuple(block_capacity(*a)),
                cap,
                hint="compare the two numbers of the pair with the label: a block exists only if the "
                "budget holds all of it, and a request holds whole blocks, its last one possibly "
                "part-empty (chapter 01, section 6)",
            )
        )
    checks.append(
        Check(
            "block_capacity(1000, 46080, 16, 2048)  # smaller than one block",
            lambda: _raises_value_error(lambda: block_capacity(1000, 46_080, 16, 2048)),
            "ValueError",
            hint="a budget that cannot hold one block should raise ValueError",
        )
    )
    return report("block_capacity", checks)


def _capacity(budget: int, bytes_per_token: int, block_size: int, request_tokens: int) -> tuple[int, int]:
    # bytes/token = 2·L·n_kv·d·b; a spec with L=1, n_kv=1, b=1 and d = bytes/token / 2 reproduces it.
    spec = KVSpec(1, 1, bytes_per_token // 2, 1)
    cap = spec.capacity(budget, block_size, request_tokens)
    assert cap.full_requests is not None  # set whenever request_tokens is given
    return cap.num_blocks, cap.full_requests
