"""Paged decode attention: one new token per sequence, split-KV ("flash-decoding").

At decode time each sequence brings a single query token, which must attend to all of
its ``seq_len`` cached tokens. There is almost no arithmetic per byte read: the kernel
is a race to stream K and V out of HBM. Two ideas keep every SM streaming.

**1. Pack the query heads of one KV head into one program (GQA packing).** With
grouped-query attention, ``G = num_q_heads // num_kv_heads`` query heads read the same
KV head. One program loads a K/V tile once and multiplies it against all ``G`` query
rows. ``tl.dot`` on an NVIDIA GPU wants tiles of at least 16 in every dimension, so
the ``G`` rows are padded to ``GROUP_P2 = max(16, next_pow2(G))`` with zero rows that
are masked out on the way back (SmolLM2: G = 3, so 13 of 16 rows are padding — free,
since the kernel is limited by bandwidth, not by tensor-core FLOPs)::

    q rows (one sequence, kv head h)     K tile (TILE_N tokens)
    ┌──────────────┐                     ┌──────────────┐
    │ q head h·G+0 │                     │ token  p     │
    │ q head h·G+1 │     S = q · Kᵀ      │ token  p+1   │
    │ q head h·G+2 │  ───────────────►   │   ...        │
    │ 0 (padding)  │  [GROUP_P2,TILE_N]  │ token  p+N-1 │
    │   ...        │                     └──────────────┘
    └──────────────┘

**2. Split the sequence into segments (split-KV).** A batch of 4 sequences × 2 KV
heads is 8 programs — a handful of the GPU's 132 SMs, which want several programs
each. So each sequence's tokens are cut into segments of ``segment_len`` tokens and
each (sequence, KV head, segment) gets its own program. Each program runs an online
softmax over its segment and writes a *partial* result: the running max ``m``, the
sum of exponentials ``l`` and the normalised output ``o = acc / l``. A second, tiny
kernel combines the segments::

    m* = max_g m_g      w_g = l_g · 2^(m_g − m*)      out = Σ_g w_g · o_g / Σ_g w_g

    decode grid = (num_seqs, num_kv_heads, num_segments)      reduce grid = (num_seqs, num_q_heads)

Which physical blocks one program reads — block_size 4, segment_len 8 (tiny numbers for
the picture: real segments are a whole number of tiles of TILE_N >= 16 tokens), a sequence of 19
tokens whose block table is [7, 2, 5, 0, 3]::

    logical block       0     1   │   2     3   │   4
    physical block      7     2   │   5     0   │   3
    tokens            0..3  4..7  │ 8..11 12..15│ 16..18
                      └ segment 0 ┘ └ segment 1 ┘ └ segment 2 (3 tokens, masked tail) ┘
    program (seq, h, 1) reads only physical blocks 5 and 0.

Inside a program the segment is read one tile of ``TILE_N`` tokens at a time. A tile is
a slice of one block or a run of whole blocks (32 keys at block size 16: two blocks), so
it costs one block-table lookup per block, and a ``[TILE_N, head_dim]`` tile of int32
offsets, computed once before the loop, gives every element (``paged_tile.py`` draws
both). ``TILE_N``, ``num_warps`` and ``num_stages`` come from a small table per dtype and
head_dim (``decode_config``), chosen so that no configuration spills registers on sm_80
or sm_90 (``python -m minipaged kernels`` prints them); the block size does not cap the
tile, because a bandwidth-bound loop wants as many bytes in flight per iteration as its
registers allow. When the whole sequence fits in one segment, the partial output *is*
the output: the kernel writes it directly and the reduce kernel is skipped.

Softmax runs in base 2 (``exp2``, scores pre-multiplied by ``scale · log2 e``), in
float32 whatever the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..utils import check_int
from .launch import Launch, TileConfig, check_tile_n, cuda_arch, dot_precision, has_tensor_cores, is_half, kv_tile_n
from .paged_tile import attend_tile, tile_offsets
from .validation import check_last_dim_contiguous, check_paged_decode, check_triton_runtime

LOG2E = 1.4426950408889634
MIN_SEGMENT_LEN = 256  # the default split never makes a segment shorter than this
PROGRAMS_PER_SM = 4  # the default split aims at this many decode programs on each SM (default_num_splits)
MAX_SPLITS = 64  # the reduce kernel holds all segments of one head in one tile


@triton.jit(do_not_specialize=["segment_len", "stride_bt"])
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale_log2,  # scale * log2(e)
    segment_len,  # tokens per segment, a multiple of TILE_N
    stride_qs,
    stride_qh,  # query [num_seqs, num_q_heads, head_dim]
    stride_kb,
    stride_ko,
    stride_kh,  # key_cache [num_blocks, block_size, kv_heads, head_dim]
    stride_vb,
    stride_vo,
    stride_vh,
    stride_bt,  # block_tables [num_seqs, max_blocks]
    stride_pos,
    stride_poh,
    stride_pog,  # part_out [num_seqs, num_q_heads, num_segments, head_dim]
    stride_pms,
    stride_pmh,  # part_max/sum [num_seqs, num_q_heads, num_segments]
    QUERIES_PER_KV: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    seg_start = segment * segment_len
    if seg_start >= seq_len:  # this sequence is shorter than the longest: nothing to do
        return
    seg_end = tl.minimum(seg_start + segment_len, seq_len)

    # The G query heads that share this KV head, padded to GROUP_P2 >= 16 rows.
    rows = tl.arange(0, GROUP_P2)
    row_mask = rows < QUERIES_PER_KV
    q_heads = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + q_heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # Loop invariants: this KV head's slice of each cache, the int32 offsets of a tile inside a block.
    tok, inner_k, inner_v = tile_offsets(dims, stride_ko, stride_vo, TILE_N)
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)  # running max (log2 units)
    l_i = tl.zeros([GROUP_P2], tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)  # running sum of 2^(s - m) * v
    for start in range(seg_start, seg_end, TILE_N):
        visible = (start + tok < seg_end)[None, :]
        acc, m_i, l_i = attend_tile(
            q,
            acc,
            m_i,
            l_i,
            k_head_ptr,
            v_head_ptr,
            table_ptr,
            start,
            seg_end,
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

    # This segment's partial result (or, with one segment, the final output).
    out = acc / l_i[:, None]
    tl.store(
        part_out_ptr
        + seq.to(tl.int64) * stride_pos
        + q_heads[:, None] * stride_poh
        + segment * stride_pog
        + dims[None, :],
        out.to(part_out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    stat = seq.to(tl.int64) * stride_pms + q_heads * stride_pmh + segment
    tl.store(part_max_ptr + stat, m_i, mask=row_mask)
    tl.store(part_sum_ptr + stat, l_i, mask=row_mask)


@triton.jit(do_not_specialize=["segment_len"])
def _reduce_segments_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    segment_len,
    stride_os,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pog,
    stride_pms,
    stride_pmh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SEGMENTS_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_segments = tl.cdiv(seq_len, segment_len)
    segs = tl.arange(0, NUM_SEGMENTS_P2)
    seg_mask = segs < num_segments
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_mask = dims < HEAD_DIM

    stat = seq * stride_pms + head * stride_pmh + segs
    m = tl.load(part_max_ptr + stat, mask=seg_mask, other=float("-inf"))
    sums = tl.load(part_sum_ptr + stat, mask=seg_mask, other=0.0)
    w = sums * tl.exp2(m - tl.max(m, 0))  # each segment's share, up to a common factor
    o = tl.load(
        part_out_ptr + seq * stride_pos + head * stride_poh + segs[:, None] * stride_pog + dims[None, :],
        mask=seg_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


# (half precision?, head_dim padded to a power of two) -> keys per tile, warps, stages. Decode is a race to
# stream K/V: 4 warps and tiles of 16-32 keys keep registers under ~100 (many resident warps per SM hide
# latency) and num_stages keeps tiles in flight. Every row compiles without spills on sm_80 and sm_90 at every
# block size (a tile may span blocks); fp32 at head_dim 128 and 32 keys spills on sm_90, hence 16.
DECODE_TABLE: dict[tuple[bool, int], TileConfig] = {
    (True, 64): TileConfig(tile_n=32, num_warps=4, num_stages=3),
    (True, 128): TileConfig(tile_n=32, num_warps=4, num_stages=3),
    (True, 256): TileConfig(tile_n=16, num_warps=4, num_stages=3),
    (False, 64): TileConfig(tile_n=32, num_warps=4, num_stages=3),
    (False, 128): TileConfig(tile_n=16, num_warps=4, num_stages=2),
    (False, 256): TileConfig(tile_n=16, num_warps=8, num_stages=2),
}
REDUCE_CONFIG = TileConfig(tile_n=0, num_warps=4, num_stages=1)


def head_dim_p2(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def decode_config(dtype: torch.dtype, head_dim: int, block_size: int, arch: str | None = None) -> TileConfig:
    """The decode kernel's tiles and warps for this dtype, head_dim and block size (DECODE_TABLE), on ``arch``.

    A tile spans blocks where the GPU has tensor cores (sm_80 on); on sm_75 (T4) ``tl.dot`` is made of FMA
    instructions whose registers grow with the tile (200+ at 32 keys), so there it stays inside one block."""
    hd = head_dim_p2(head_dim)
    if hd > 256:
        raise ValueError(f"the Triton attention kernels support head_dim up to 256, got {head_dim}")
    row = DECODE_TABLE[(is_half(dtype), max(64, hd))]
    tile_n = kv_tile_n(block_size, row.tile_n, span_blocks=has_tensor_cores(arch))
    return TileConfig(tile_n, row.num_warps, row.num_stages)


def default_num_splits(num_seqs: int, num_kv_heads: int, capacity: int, device: torch.device) -> int:
    """Enough segments for PROGRAMS_PER_SM programs on every SM of the GPU, none shorter than MIN_SEGMENT_LEN tokens.

    One program's loop waits on each tile (its table entries, then K, then V), so a program alone streams far
    less than an SM can: bandwidth comes from several programs resident on each SM at once. The decode
    configurations leave room for 5-8 programs of 4 warps per SM (``python -m minipaged kernels``), so 4 per SM
    fill the GPU in one wave, with no second, partly empty one."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        want = triton.cdiv(PROGRAMS_PER_SM * sms, num_seqs * num_kv_heads)
    else:  # the interpreter runs programs one after another: fewer, longer segments
        want = 1
    return max(1, min(want, triton.cdiv(capacity, MIN_SEGMENT_LEN), MAX_SPLITS))


def plan_paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    num_splits: int | None = None,
    per_token: bool = False,
    tile_n: int | None = None,
    arch: str | None = None,
) -> list[Launch]:
    """The launches of one decode call (the attention kernel, then the reduce kernel when a sequence
    has several segments), writing into ``out``. Checks nothing: the wrapper has.

    For comparisons (chapter 05, ``python -m minipaged kernels``): ``per_token=True`` plans the first
    version's addressing (a table lookup per token), ``tile_n`` another key tile than the table's.
    ``arch`` (``sm_75``, ...) plans for that GPU instead of the query's device (the compile report).
    """
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_seqs == 0:
        return []
    capacity = block_tables.shape[1] * block_size  # no sequence is longer: no need to read seq_lens
    split = _split(query, block_size, num_kv_heads, capacity, num_splits, tile_n, arch)
    parts = _Partials.make(out, num_seqs, num_q_heads, split.num_segments, head_dim)
    args = (
        query, key_cache, value_cache, block_tables, seq_lens, parts.out, parts.max, parts.sum,
        scale * LOG2E, split.segment_len,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), *parts.out_strides, parts.max.stride(0), parts.max.stride(1),
    )  # fmt: skip
    group = num_q_heads // num_kv_heads
    consts = dict(
        QUERIES_PER_KV=group,
        GROUP_P2=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=split.cfg.tile_n,
        DOT_PRECISION=dot_precision(query.dtype),
        PER_TOKEN=per_token,
    )
    grid = (num_seqs, num_kv_heads, split.num_segments)
    attend = Launch(_paged_decode_kernel, grid, args, consts, split.cfg.num_warps, split.cfg.num_stages)
    if split.num_segments == 1:
        return [attend]
    return [attend, _reduce_launch(out, parts, seq_lens, split, head_dim)]


@dataclass
class _Split:
    """How a decode call cuts every sequence's keys: segments of ``segment_len`` tokens (whole key tiles), one
    program each; more than one segment needs the reduce kernel after."""

    cfg: TileConfig
    segment_len: int
    num_segments: int


def _split(
    query: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    capacity: int,
    num_splits: int | None,
    tile_n: int | None,
    arch: str | None,
) -> _Split:
    cfg = decode_config(query.dtype, query.shape[2], block_size, arch or cuda_arch(query.device))
    if tile_n is not None:
        cfg = TileConfig(check_tile_n(tile_n, block_size), cfg.num_warps, cfg.num_stages)
    if num_splits is None:
        num_splits = default_num_splits(query.shape[0], num_kv_heads, capacity, query.device)
    check_int("num_splits", num_splits, 1, MAX_SPLITS)
    segment_len = triton.cdiv(triton.cdiv(capacity, num_splits), cfg.tile_n) * cfg.tile_n  # whole tiles
    return _Split(cfg, segment_len, triton.cdiv(capacity, segment_len))


@dataclass
class _Partials:
    """Each segment's output, running max and sum, for the reduce; with one segment the output is ``out``."""

    out: torch.Tensor
    out_strides: tuple[int, int, int]
    max: torch.Tensor
    sum: torch.Tensor

    @classmethod
    def make(cls, out: torch.Tensor, num_seqs: int, num_q_heads: int, num_segments: int, head_dim: int) -> _Partials:
        shape, f32, device = (num_seqs, num_q_heads, num_segments), torch.float32, out.device
        if num_segments == 1:  # the partial output is the output
            part_out, strides = out, (out.stride(0), out.stride(1), 0)
        else:
            part_out = torch.empty((*shape, head_dim), dtype=f32, device=device)
            strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        part_max = torch.empty(shape, dtype=f32, device=device)
        return cls(part_out, strides, part_max, torch.empty_like(part_max))


def _reduce_launch(out: torch.Tensor, parts: _Partials, seq_lens: torch.Tensor, split: _Split, head_dim: int) -> Launch:
    """The reduce kernel's launch: each (sequence, query head) folds its segments' partial outputs into ``out``."""
    args = (
        out, parts.out, parts.max, parts.sum, seq_lens, split.segment_len,
        out.stride(0), out.stride(1), *parts.out_strides, parts.max.stride(0), parts.max.stride(1),
    )  # fmt: skip
    consts = dict(
        HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2(head_dim), NUM_SEGMENTS_P2=triton.next_power_of_2(split.num_segments)
    )
    grid = (out.shape[0], out.shape[1])
    return Launch(_reduce_segments_kernel, grid, args, consts, REDUCE_CONFIG.num_warps, REDUCE_CONFIG.num_stages)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    checked: bool = False,
) -> torch.Tensor:
    """Triton twin of :func:`minipaged.kernels.reference.paged_decode_attention`.

    ``num_splits`` (keyword only, like flash-attn's) caps the number of KV segments per
    sequence; ``None`` picks one from the GPU's SM count. Segments are a whole number of
    tiles, so fewer segments than asked may be used. ``checked=True`` skips the argument
    checks: the engine validates a step's metadata once, not once per layer.
    """
    if not checked:
        check_paged_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale, check_values=query.device.type == "cpu"
        )
        check_triton_runtime(query.dtype, query.device)
        check_last_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for launch in plan_paged_decode(
        query, key_cache, value_cache, block_tables, seq_lens, scale, out, num_splits=num_splits
    ):
        launch.run()
    return out
