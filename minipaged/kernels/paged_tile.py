"""The inner step both paged-attention kernels share: one K/V tile read through the block table.

Decode and prefill differ in which queries a program holds (the G heads of one KV
head for one token, or BLOCK_M new tokens of one head) and in which keys each query
may see; the tile of keys itself is read the same way.

**Addressing: one table lookup per block, int32 offsets.** A tile holds ``TILE_N``
consecutive tokens of one sequence and one KV head, and starts on a multiple of
``TILE_N``. When ``TILE_N`` divides the block size the tile lies inside one block and
needs *one* block-table entry. Its address splits in two::

    start = 48, TILE_N = 16, BLOCK_SIZE = 32, block_table = [7, 2, 5]

    block  = block_table[48 // 32] = block_table[1] = 2     one scalar load per tile
    base   = cache + 2·stride_b + (48 % 32 = 16)·stride_o + kv_head·stride_h
                                                             one 64-bit scalar per tile
    inner  = token·stride_o + dim   for token < TILE_N, dim < HEAD_DIM
                                                             int32 [TILE_N, HEAD_DIM], the same
                                                             for every tile: computed once
    K tile = load(base + inner)

The alternative — look up ``block_table[pos // BLOCK_SIZE]`` for every token and build
a ``[TILE_N, HEAD_DIM]`` tile of 64-bit addresses in each iteration — reads the same
bytes but keeps a 64-bit address per element live and recomputes it every tile: on
an NVIDIA GPU that is what pushed the first version of these kernels to 200+
registers per thread and into spills (chapter 05 compiles both). Here the only
per-tile work is one load and one 64-bit add; the compiler keeps ``inner`` in
registers and can prove that ``dim`` is contiguous, so each thread issues wide,
coalesced loads.

**A tile of several blocks.** A tile is also allowed to be a run of whole blocks
(``TILE_N`` a multiple of the block size): the 16-token blocks the engine uses, read 32
keys at a time, and the 1–8-token blocks of the pictures, which cannot hold a ``tl.dot``
tile of 16 at all. Then one vector load reads the tile's ``TILE_N // BLOCK_SIZE`` table
entries (still one per block), and each token's row adds its block's 64-bit base to the
same int32 ``inner``::

    start = 32, TILE_N = 32, BLOCK_SIZE = 16, block_table = [7, 2, 5, 0]

    blocks = block_table[2:4] = [5, 0]                       one vector load per tile
    row[t] = blocks[t // 16]·stride_b + (t % 16 − t)·stride_o     t < 32: 64-bit, per token
    K tile = load(cache + kv_head·stride_h + row[:, None] + inner)

Why bother: decode streams K/V from memory, and a program that reads 16 keys per loop
iteration keeps too few bytes in flight to reach the memory's bandwidth (on an H100,
block 16 read 16 keys at a time measured 71 % of peak, block 32 read 32 at a time 81 %:
``assets/benchmarks/gpu/``). With tiles that span blocks the tile size is the kernel
table's choice, whatever the block size (on sm_75, a T4, whose ``tl.dot`` has no tensor
cores, decode keeps its tiles inside a block: ``decode_config``).

Online softmax over the tile (base 2: scores were scaled by ``scale·log2 e``)::

    s      = q · Kᵀ · scale·log2(e),  -inf where not visible
    m_new  = max(m, max_j s)
    acc    = acc · 2^(m - m_new) + 2^(s - m_new) · V
    l      = l · 2^(m - m_new) + Σ_j 2^(s - m_new)

Kept as ``@triton.jit`` functions so there is one copy of the gather and of the
online-softmax update; Triton inlines them into each kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_offsets(dims, stride_ko, stride_vo, TILE_N: tl.constexpr):
    """The loop invariants of a kernel's key loop: ``tok`` and the int32 ``tok·stride_o + dim`` tiles of K and V."""
    tok = tl.arange(0, TILE_N)
    return tok, tok[:, None] * stride_ko + dims[None, :], tok[:, None] * stride_vo + dims[None, :]


@triton.jit
def load_kv_tile(
    head_ptr,
    table_ptr,
    start,
    end,
    inner,
    tok,
    dims,
    dim_mask,
    stride_b,
    stride_o,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Tokens ``start .. start+TILE_N-1`` (those ``< end``) of one KV head: ``[TILE_N, HEAD_DIM_P2]``.

    ``head_ptr`` points at the KV head's slice of the cache; ``inner`` is the int32
    ``tok·stride_o + dim`` tile; masked-off tokens load 0. ``PER_TOKEN`` selects the first
    version's addressing, kept so that chapter 05 can compile both and compare them.
    """
    mask = (start + tok < end)[:, None] & dim_mask[None, :]
    if PER_TOKEN:
        # One lookup and one 64-bit address per token, rebuilt every tile.
        pos = start + tok
        blocks = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos < end, other=0).to(tl.int64)
        ptrs = head_ptr + blocks[:, None] * stride_b + (pos % BLOCK_SIZE)[:, None] * stride_o + dims[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)
    elif TILE_N <= BLOCK_SIZE:
        # The tile lies inside one block: one lookup, one 64-bit base, int32 offsets.
        block = tl.load(table_ptr + start // BLOCK_SIZE).to(tl.int64)
        base = head_ptr + block * stride_b + (start % BLOCK_SIZE) * stride_o
        return tl.load(base + inner, mask=mask, other=0.0)
    else:
        # A run of TILE_N // BLOCK_SIZE whole blocks: one lookup each, broadcast to their tokens.
        NUM_BLOCKS: tl.constexpr = TILE_N // BLOCK_SIZE
        first = start // BLOCK_SIZE + tl.arange(0, NUM_BLOCKS)
        blocks = tl.load(table_ptr + first, mask=first * BLOCK_SIZE < end, other=0)
        per_token = tl.reshape(tl.broadcast_to(blocks[:, None], (NUM_BLOCKS, BLOCK_SIZE)), (TILE_N,))
        # inner already holds tok·stride_o; the tile's tokens sit at offset tok % BLOCK_SIZE of their block
        row = per_token.to(tl.int64) * stride_b + ((tok % BLOCK_SIZE) - tok) * stride_o
        return tl.load(head_ptr + row[:, None] + inner, mask=mask, other=0.0)


@triton.jit
def attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_head_ptr,
    v_head_ptr,
    table_ptr,
    start,
    end,
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
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    """Fold one tile of keys into the running (acc, m_i, l_i); ``visible`` is [rows, TILE_N]."""
    k = load_kv_tile(
        k_head_ptr,
        table_ptr,
        start,
        end,
        inner_k,
        tok,
        dims,
        dim_mask,
        stride_kb,
        stride_ko,
        TILE_N,
        BLOCK_SIZE,
        PER_TOKEN,
    )
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [rows, TILE_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)  # rescales the sums so far
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(
        v_head_ptr,
        table_ptr,
        start,
        end,
        inner_v,
        tok,
        dims,
        dim_mask,
        stride_vb,
        stride_vo,
        TILE_N,
        BLOCK_SIZE,
        PER_TOKEN,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
