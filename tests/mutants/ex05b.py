"""Exercise 05b — the paged scatter-write as a Triton kernel: wrong kernels a learner writes.

Each mutant is the solution's launcher around a wrong ``@triton.jit`` kernel. Every wrong write
here stays inside the buffers the checks hand over (the guard blocks included): under the
interpreter a store outside them would scribble over the process's memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

import minipaged.kernels  # noqa: F401  (first: turns the Triton interpreter on where there is no GPU)

from . import mutant

CHECKS = {"reshape_and_cache": ["check_scatter_write", "check_scatter_edges"]}
HELPERS: dict = {}


def _launch(kernel, key, value, key_cache, value_cache, slot_mapping) -> None:
    """The exercise's launcher (given to the learner), with the kernel as a parameter."""
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    kernel[(key.shape[0],)](
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
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_P2=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )


@triton.jit
def _writes_padding_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # MISTAKE: no early return for a padding token (slot -1)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims, k, mask=mask)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims, v, mask=mask)


@mutant(
    "reshape_and_cache",
    "no early return for a padding token: slot -1 is written (just before the pool)",
    checks=["check_scatter_edges"],
)
def writes_padding(key, value, key_cache, value_cache, slot_mapping) -> None:
    _launch(_writes_padding_kernel, key, value, key_cache, value_cache, slot_mapping)


@triton.jit
def _shape_addresses_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    # MISTAKE: addresses from the shapes, as if every tensor were contiguous in its logical layout
    src = t * NUM_KV_HEADS * HEAD_DIM + heads * HEAD_DIM + dims
    dst = ((block * BLOCK_SIZE + offset) * NUM_KV_HEADS + heads) * HEAD_DIM + dims
    k = tl.load(key_ptr + src, mask=mask)
    v = tl.load(value_ptr + src, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


@mutant(
    "reshape_and_cache",
    "addresses built from the shapes, not the strides (assumes contiguous tensors)",
    checks=["check_scatter_edges"],
)
def shape_addresses(key, value, key_cache, value_cache, slot_mapping) -> None:
    _launch(_shape_addresses_kernel, key, value, key_cache, value_cache, slot_mapping)


@triton.jit
def _flat_slot_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P2)[:, None]
    dims = tl.arange(0, HEAD_DIM_P2)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    # MISTAKE: the slot times the offset stride, as if the pool were one flat run of slots (never split
    # into block and offset, so the block stride is never used)
    tl.store(key_cache_ptr + slot * stride_kco + heads * stride_kch + dims, k, mask=mask)
    tl.store(value_cache_ptr + slot * stride_vco + heads * stride_vch + dims, v, mask=mask)


@mutant(
    "reshape_and_cache",
    "indexes the pool as a flat run of slots (slot × offset stride), no block/offset split",
    checks=["check_scatter_edges"],
)
def flat_slot_index(key, value, key_cache, value_cache, slot_mapping) -> None:
    _launch(_flat_slot_kernel, key, value, key_cache, value_cache, slot_mapping)


@triton.jit
def _unpadded_tiles_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kco,
    stride_kch,
    stride_vcb,
    stride_vco,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, NUM_KV_HEADS)[:, None]  # MISTAKE: tiles the real sizes, which need not be powers of 2
    dims = tl.arange(0, HEAD_DIM)[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims)
    v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims)
    tl.store(key_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims, k)
    tl.store(value_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims, v)


@mutant(
    "reshape_and_cache",
    "tiles of NUM_KV_HEADS × HEAD_DIM, unmasked: breaks on 3 heads or head_dim 80",
    checks=["check_scatter_write"],
)
def unpadded_tiles(key, value, key_cache, value_cache, slot_mapping) -> None:
    _launch(_unpadded_tiles_kernel, key, value, key_cache, value_cache, slot_mapping)
