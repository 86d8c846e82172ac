"""Paged prefill attention: a packed batch of new tokens over a partly cached context.

A prefill step brings many new tokens per sequence. They arrive packed, with no
padding, as ``query [total_new_tokens, num_q_heads, head_dim]``; ``cu_seqlens_q`` says
where each sequence's rows start. Sequence ``i`` has ``q_len`` new tokens and
``seq_len`` tokens in all; its first ``ctx_len = seq_len - q_len`` tokens were cached
earlier (a prefix-cache hit, or the previous chunk of a chunked prefill). The new
tokens' own K/V have already been written by ``reshape_and_cache``, so the kernel
reads *every* key through the block table, old and new alike.

This is FlashAttention over a paged K/V. One program owns a tile of ``BLOCK_M`` new
tokens of one sequence and one query head, and walks over the sequence's keys in
tiles of ``BLOCK_N``, keeping an online softmax (running max ``m``, running sum ``l``,
running output ``acc``) so no ``[q_len, seq_len]`` score matrix is ever stored::

    grid = (num_seqs, num_q_heads, cdiv(max q_len, BLOCK_M))

    sequence i: seq_len = 11, q_len = 5, block_size 4, block table [6, 1, 4]
                 key position  0 1 2 3 │ 4 5 6 7 │ 8 9 10
                 physical block   6    │    1    │   4
                 cached (ctx_len = 6)  0..5,  new  6..10
    new token j (position 6+j)
      j=0  (pos 6)              ■ ■ ■ ■ ■ ■ ■ · · · ·
      j=1  (pos 7)              ■ ■ ■ ■ ■ ■ ■ ■ · · ·      ■ attends   · masked (future)
      j=2  (pos 8)              ■ ■ ■ ■ ■ ■ ■ ■ ■ · ·
      j=3  (pos 9)              ■ ■ ■ ■ ■ ■ ■ ■ ■ ■ ·
      j=4  (pos 10)             ■ ■ ■ ■ ■ ■ ■ ■ ■ ■ ■

Causality in absolute positions: new token ``j`` sits at ``ctx_len + j`` and sees keys
``0..ctx_len + j``. A query tile therefore stops reading at the last key its last
row may see, ``min(seq_len, ctx_len + (tile + 1) * BLOCK_M)``: the upper-right
triangle of the picture is never loaded. As in the decode kernel, each key tile is
gathered token by token through the block table (any block size works), and grouped-
query attention maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``.
Unlike decode, prefill does not pack a group's query heads into one program: ``BLOCK_M``
new tokens already give ``tl.dot`` its 16+ rows, and prefill is limited by arithmetic,
not by reading K/V (the ``G`` programs sharing a KV head mostly hit in L2).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_tile import attend_tile
from .validation import check_last_dim_contiguous, check_paged_prefill, check_triton_runtime

LOG2E = 1.4426950408889634
BLOCK_N = 64           # keys per K/V tile
MAX_BLOCK_M = 64       # new tokens per query tile (smaller when every sequence brings fewer)


@triton.jit
def _paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    scale_log2,                                            # scale * log2(e)
    stride_qt, stride_qh,                                  # query/out [total_new_tokens, num_q_heads, head_dim]
    stride_ot, stride_oh,
    stride_kb, stride_ko, stride_kh,                       # key_cache [num_blocks, block_size, kv_heads, head_dim]
    stride_vb, stride_vo, stride_vh,
    stride_bt,                                             # block_tables [num_seqs, max_blocks]
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:     # this sequence has fewer new tokens than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len         # tokens cached before this step
    kv_head = q_head // QUERIES_PER_KV

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)    # index among this sequence's new tokens
    row_mask = rows < q_len
    q_pos = ctx_len + rows                             # absolute positions of the new tokens
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (m_tile + 1) * BLOCK_M)   # causal: later keys are never needed
    for start in range(0, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        tok_mask = pos < kv_end
        visible = tok_mask[None, :] & (pos[None, :] <= q_pos[:, None])            # causal by absolute position
        acc, m_i, l_i = attend_tile(q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt,
                                    pos, tok_mask, visible, kv_head, stride_kb, stride_ko, stride_kh,
                                    stride_vb, stride_vo, stride_vh, dims, dim_mask, scale_log2,
                                    BLOCK_SIZE, DOT_PRECISION)

    out = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + q_head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Triton twin of :func:`minipaged.kernels.reference.paged_prefill_attention`.

    Reads ``cu_seqlens_q`` back to the host once, for the longest ``q_len`` (the grid's
    third dimension); vLLM gets that number from its scheduler instead.
    """
    check_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                        check_values=query.device.type == "cpu")
    check_triton_runtime(query.dtype, query.device)
    check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
    total_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if total_tokens == 0:
        return out
    max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(max_q_len)))
    _paged_prefill_kernel[(num_seqs, num_q_heads, triton.cdiv(max_q_len, block_m))](
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
