"""The inner step both paged-attention kernels share: one K/V tile read through the block table.

Decode and prefill differ in which queries a program holds (the G heads of one KV
head for one token, or BLOCK_M new tokens of one head) and in which keys each query
may see; the tile itself is the same::

    pos      start … start+BLOCK_N-1         token positions of this tile
    block    block_table[pos // BLOCK_SIZE]  one lookup per token (tokens of a block share it)
    K, V     cache[block, pos % BLOCK_SIZE, kv_head, :]
    s        q · Kᵀ · scale·log2(e), -inf where not visible
    online softmax: rescale what was summed so far by 2^(m_old - m_new), add this tile

Kept as a ``@triton.jit`` function so there is one copy of the gather and the
online-softmax update; Triton inlines it into each kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_ptr, pos, tok_mask, visible, kv_head,
                stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, dims, dim_mask, scale_log2,
                BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of keys (``pos``, visible where ``visible``) into the running (acc, m_i, l_i)."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    offset = pos % BLOCK_SIZE
    kv_mask = tok_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ko
                + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2        # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)                                                  # rescales the sums so far
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
