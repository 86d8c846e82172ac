"""The paged scatter-write: put each new token's K and V into its slot.

Before attention can read a token's key and value through the block table, someone
has to write them there. The model computes K and V for the new tokens as one dense
``[num_tokens, num_kv_heads, head_dim]`` tensor; the scheduler has already chosen a
slot for each (``slot = block * block_size + offset``). The kernel is a scatter:

    key  (dense, one row per new token)          key_cache  [num_blocks, block_size, ...]
    t0 ──── slot 13 = block 3, offset 1  ──►     block 3: [ . t0 . . ]
    t1 ──── slot 14 = block 3, offset 2  ──►     block 3: [ . t0 t1 . ]
    t2 ──── slot -1 (padding)            ──✗     (nothing written)
    t3 ──── slot  4 = block 1, offset 0  ──►     block 1: [ t3 . . . ]

One program per token. It loads the token's whole ``[num_kv_heads, head_dim]`` tile
of K and of V, and stores both at ``cache[block, offset]``. A padding token (slot -1)
returns before touching anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, TileConfig
from .validation import check_last_dim_contiguous, check_reshape_and_cache, check_triton_runtime

# One program per token moves [num_kv_heads, head_dim] elements twice: a few registers; 4 warps, no loop.
RESHAPE_AND_CACHE_CONFIG = TileConfig(tile_n=0, num_warps=4, num_stages=1)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # new K/V: token, head (head_dim stride is 1)
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,  # caches: block, offset, head
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    t = t.to(tl.int64)
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims, k, mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims, v, mask=mask)


def plan_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[Launch]:
    """The launch of one scatter-write. Checks nothing: the wrapper has."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return []
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    cfg = RESHAPE_AND_CACHE_CONFIG
    return [
        Launch(
            _reshape_and_cache_kernel,
            (num_tokens,),
            (
                key,
                value,
                key_cache,
                value_cache,
                slot_mapping,
                key.stride(0),
                key.stride(1),
                value.stride(0),
                value.stride(1),
                key_cache.stride(0),
                key_cache.stride(1),
                key_cache.stride(2),
                value_cache.stride(0),
                value_cache.stride(1),
                value_cache.stride(2),
            ),
            dict(
                NUM_KV_HEADS=num_kv_heads,
                HEAD_DIM=head_dim,
                HEADS_P2=triton.next_power_of_2(num_kv_heads),
                HEAD_DIM_P2=triton.next_power_of_2(head_dim),
                BLOCK_SIZE=block_size,
            ),
            cfg.num_warps,
            cfg.num_stages,
        )
    ]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    checked: bool = False,
) -> None:
    """Triton twin of :func:`minipaged.kernels.reference.reshape_and_cache` (same arguments, in place).

    ``checked=True`` skips the argument checks (the engine checks a step once, not once per layer).
    """
    if not checked:
        check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, check_values=key.device.type == "cpu")
        check_triton_runtime(key.dtype, key.device)
        check_last_dim_contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    for launch in plan_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
        launch.run()
