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
tiles of ``TILE_N``, keeping an online softmax (running max ``m``, running sum ``l``,
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
triangle of the picture is never loaded. As in the decode kernel, each key tile of
``TILE_N`` tokens lies inside one block and costs one block-table lookup
(``paged_tile.py``); the tile sizes and warps come from ``PREFILL_TABLE``. Grouped-
query attention maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``.
Unlike decode, prefill does not pack a group's query heads into one program: ``BLOCK_M``
new tokens already give ``tl.dot`` its 16+ rows, and prefill is limited by arithmetic,
not by reading K/V (the ``G`` programs sharing a KV head mostly hit in L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import Launch, TileConfig, check_tile_n, dot_precision, is_half, kv_tile_n
from .paged_decode import head_dim_p2
from .paged_tile import attend_tile, tile_offsets
from .validation import check_last_dim_contiguous, check_paged_prefill, check_triton_runtime

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_bt"])
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    scale_log2,  # scale * log2(e)
    stride_qt,
    stride_qh,  # query/out [total_new_tokens, num_q_heads, head_dim]
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ko,
    stride_kh,  # key_cache [num_blocks, block_size, kv_heads, head_dim]
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,  # block_tables [num_seqs, max_blocks]
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    seq = tl.program_id(0)
    q_head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_tile * BLOCK_M >= q_len:  # this sequence has fewer new tokens than the longest
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # tokens cached before this step
    kv_head = q_head // QUERIES_PER_KV

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this sequence's new tokens
    row_mask = rows < q_len
    q_pos = ctx_len + rows  # absolute positions of the new tokens
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + q_head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Loop invariants: this KV head's slice of each cache, the int32 offsets of a tile inside a block.
    tok, inner_k, inner_v = tile_offsets(dims, stride_ko, stride_vo, TILE_N)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    kv_end = tl.minimum(seq_len, ctx_len + (m_tile + 1) * BLOCK_M)  # causal: later keys are never needed
    for start in range(0, kv_end, TILE_N):
        pos = start + tok
        visible = (pos < kv_end)[None, :] & (pos[None, :] <= q_pos[:, None])  # causal by absolute position
        acc, m_i, l_i = attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_head_ptr,
            v_head_ptr,
            table_ptr,
            start,
            kv_end,
            visible,
            inner_k,
            inner_v,
            tok,
            dims,
            dim_mask,
            stride_kb,
            stride_ko,
            stride_vb,
            stride_vo,
            scale_log2,
            TILE_N,
            BLOCK_SIZE,
            DOT_PRECISION,
            PER_TOKEN,
        )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + q_head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


# (half precision?, head_dim padded to a power of two) -> largest query tile, key tile cap, warps, stages.
# Prefill is limited by arithmetic: big query tiles on the tensor cores in fp16/bf16; fp32 ("ieee",
# no tensor cores) multiplies on the CUDA cores and needs smaller tiles to stay out of spills.
PREFILL_TABLE: dict[tuple[bool, int], TileConfig] = {
    (True, 64): TileConfig(block_m=64, tile_n=32, num_warps=4, num_stages=3),
    (True, 128): TileConfig(block_m=64, tile_n=32, num_warps=8, num_stages=3),
    (True, 256): TileConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2),
    (False, 64): TileConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2),
    (False, 128): TileConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2),
    (False, 256): TileConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2),
}


def prefill_config(dtype: torch.dtype, head_dim: int, block_size: int, max_q_len: int) -> TileConfig:
    """The prefill kernel's tiles and warps (PREFILL_TABLE); the query tile shrinks to the longest new run.

    Unlike decode's, prefill's key tile stays inside one block (blocks under 16 tokens aside): prefill is bound
    by arithmetic, not by bytes in flight, and a 32-key tile at block 16 costs registers (on sm_75 it spills)."""
    hd = head_dim_p2(head_dim)
    if hd > 256:
        raise ValueError(f"the Triton attention kernels support head_dim up to 256, got {head_dim}")
    row = PREFILL_TABLE[(is_half(dtype), max(64, hd))]
    block_m = min(row.block_m, max(16, triton.next_power_of_2(max_q_len)))
    return TileConfig(kv_tile_n(block_size, row.tile_n, span_blocks=False), row.num_warps, row.num_stages, block_m)


def plan_paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_query_len: int,
    *,
    per_token: bool = False,
    tile_n: int | None = None,
) -> list[Launch]:
    """The launch of one prefill call, writing into ``out``. Checks nothing: the wrapper has.

    For comparisons: ``per_token=True`` plans the first version's addressing (a table lookup per
    token), ``tile_n`` another key tile than the table's.
    """
    total_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if total_tokens == 0:
        return []
    cfg = prefill_config(query.dtype, head_dim, block_size, max_query_len)
    if tile_n is not None:
        cfg = TileConfig(check_tile_n(tile_n, block_size), cfg.num_warps, cfg.num_stages, cfg.block_m)
    args = (
        out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
    )  # fmt: skip
    consts = dict(
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m,
        TILE_N=cfg.tile_n,
        DOT_PRECISION=dot_precision(query.dtype),
        PER_TOKEN=per_token,
    )
    grid = (cu_seqlens_q.shape[0] - 1, num_q_heads, triton.cdiv(max_query_len, cfg.block_m))
    return [Launch(_paged_prefill_kernel, grid, args, consts, cfg.num_warps, cfg.num_stages)]


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Triton twin of :func:`minipaged.kernels.reference.paged_prefill_attention`.

    The grid's third dimension needs the longest ``q_len``: the engine passes it
    (``max_query_len``, known to the scheduler, as in vLLM); without it the wrapper reads
    ``cu_seqlens_q`` back to the host once. ``checked=True`` skips the argument checks.
    """
    if not checked:
        check_paged_prefill(
            query,
            key_cache,
            value_cache,
            block_tables,
            cu_seqlens_q,
            seq_lens,
            scale,
            check_values=query.device.type == "cpu",
        )
        check_triton_runtime(query.dtype, query.device)
        check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if query.shape[0] else 0
    for launch in plan_paged_prefill(
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, max_query_len
    ):
        launch.run()
    return out
