"""Exercise 05d — the Triton puzzle ladder's hard rungs (puzzles 4-6): wrong kernels a learner writes, one mistake each (``# MISTAKE``).

The harness runs every kernel in guarded buffers with an access trace, so a wrong address is refused before the
interpreter touches memory; several of these are caught only by the trace (their outputs are right).
"""

from __future__ import annotations

import triton
import triton.language as tl

import minipaged.kernels  # noqa: F401  (first: turns the Triton interpreter on where there is no GPU)

from . import mutant

CHECKS = {
    "split_kernel": ["check_split"],
    "merge_kernel": ["check_merge"],
    "gqa_kernel": ["check_gqa"],
    "prefill_kernel": ["check_prefill"],
}
HELPERS: dict = {}


# ---- 4a. split -------------------------------------------------------------------------------------------------
@mutant("split_kernel", "an empty segment divides 0 by 0: its output is NaN, not zeros")
@triton.jit
def split_empty_segment_nan(query, key_cache, value_cache, block_tables, seq_lens, part_max, part_sum, part_out, scale, table_stride,
           BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    seg = tl.program_id(1)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    first = seg * BLOCKS_PER_SPLIT
    for b in range(first, tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(n, BLOCK_SIZE))):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(part_max + i * NUM_SPLITS + seg, m)
    tl.store(part_sum + i * NUM_SPLITS + seg, total)
    out = acc / total  # MISTAKE: an empty segment has total 0
    tl.store(part_out + (i * NUM_SPLITS + seg) * HEAD_DIM + d, out)


@mutant("split_kernel", "stores the accumulator, not the accumulator divided by the sum")
@triton.jit
def split_not_normalised(query, key_cache, value_cache, block_tables, seq_lens, part_max, part_sum, part_out, scale, table_stride,
           BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    seg = tl.program_id(1)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    first = seg * BLOCKS_PER_SPLIT
    for b in range(first, tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(n, BLOCK_SIZE))):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(part_max + i * NUM_SPLITS + seg, m)
    tl.store(part_sum + i * NUM_SPLITS + seg, total)
    out = acc  # MISTAKE: o_s is normalised, acc / total
    tl.store(part_out + (i * NUM_SPLITS + seg) * HEAD_DIM + d, out)


@mutant("split_kernel", "each segment runs one block into the next: the segments overlap")
@triton.jit
def split_overlapping_segments(query, key_cache, value_cache, block_tables, seq_lens, part_max, part_sum, part_out, scale, table_stride,
           BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    seg = tl.program_id(1)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    first = seg * BLOCKS_PER_SPLIT
    for b in range(first, tl.minimum(first + BLOCKS_PER_SPLIT + 1, tl.cdiv(n, BLOCK_SIZE))):  # MISTAKE
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(part_max + i * NUM_SPLITS + seg, m)
    tl.store(part_sum + i * NUM_SPLITS + seg, total)
    out = tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(part_out + (i * NUM_SPLITS + seg) * HEAD_DIM + d, out)


# ---- 4b. merge -------------------------------------------------------------------------------------------------
@mutant("merge_kernel", "averages the segments' outputs, ignoring how much weight each carried")
@triton.jit
def merge_plain_average(part_max, part_sum, part_out, out, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    segs = tl.arange(0, NUM_SPLITS)
    total = tl.load(part_sum + i * NUM_SPLITS + segs)
    o = tl.load(part_out + (i * NUM_SPLITS + segs[:, None]) * HEAD_DIM + d[None, :])
    w = tl.where(total > 0, 1.0, 0.0)  # MISTAKE: the weight is l_s * exp(m_s - m*)
    tl.store(out + i * HEAD_DIM + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0))


@mutant("merge_kernel", "weights each segment by its sum alone, without rescaling to the common maximum")
@triton.jit
def merge_no_rescale(part_max, part_sum, part_out, out, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    segs = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_max + i * NUM_SPLITS + segs)
    total = tl.load(part_sum + i * NUM_SPLITS + segs)
    o = tl.load(part_out + (i * NUM_SPLITS + segs[:, None]) * HEAD_DIM + d[None, :])
    w = total + 0.0 * tl.max(m, axis=0)  # MISTAKE: total * exp(m - max(m))
    tl.store(out + i * HEAD_DIM + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0))


# ---- 5. gqa ----------------------------------------------------------------------------------------------------
@mutant("gqa_kernel", "the program takes query heads kv_head, kv_head + NUM_KV_HEADS, ... (h % NUM_KV_HEADS)")
@triton.jit
def gqa_heads_by_modulo(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    G: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    n = tl.load(seq_lens + i)
    r = tl.arange(0, Q_ROWS)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < G
    q_offs = (i * NUM_Q_HEADS + kv_head + r[:, None] * NUM_KV_HEADS) * HEAD_DIM + d[None, :]  # MISTAKE
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([Q_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([Q_ROWS], dtype=tl.float32)
    acc = tl.zeros([Q_ROWS, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])


@mutant("gqa_kernel", "stores all Q_ROWS rows: the padding rows overwrite other heads' outputs")
@triton.jit
def gqa_stores_padded_rows(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    G: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    n = tl.load(seq_lens + i)
    r = tl.arange(0, Q_ROWS)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < G
    q_offs = (i * NUM_Q_HEADS + kv_head * G + r[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([Q_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([Q_ROWS], dtype=tl.float32)
    acc = tl.zeros([Q_ROWS, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None])  # MISTAKE: mask=rows[:, None]


@mutant("gqa_kernel", "no packing: the program walks the sequence once for each of its G query heads")
@triton.jit
def gqa_head_by_head(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
                     NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    G: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    for g in tl.static_range(G):  # MISTAKE: one walk over K and V for all G heads
        h = kv_head * G + g
        q = tl.load(query + (i * NUM_Q_HEADS + h) * HEAD_DIM + d)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
            block = tl.load(block_tables + i * table_stride + b)
            live = b * BLOCK_SIZE + s < n
            offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
            k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
            v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
            scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new)
            total = total * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        tl.store(out + (i * NUM_Q_HEADS + h) * HEAD_DIM + d, acc / total)


# ---- 6. prefill ------------------------------------------------------------------------------------------------
@mutant("prefill_kernel", "no causal mask: every new token sees the keys after it")
@triton.jit
def prefill_not_causal(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, table_stride,
           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // (NUM_Q_HEADS // NUM_KV_HEADS)
    n = tl.load(seq_lens + i)
    start = tl.load(cu_seqlens_q + i)
    q_len = tl.load(cu_seqlens_q + i + 1) - start
    cached = n - q_len
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < q_len
    q_offs = ((start + r[:, None]) * NUM_Q_HEADS + h) * HEAD_DIM + d[None, :]
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        pos = b * BLOCK_SIZE + s
        live = pos < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        seen = live[None, :] & (cached >= 0)  # MISTAKE: & (pos <= cached + r)
        scores = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])


@mutant("prefill_kernel", "new token j taken for position j: the cached prefix is forgotten")
@triton.jit
def prefill_ignores_cached_prefix(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, table_stride,
           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // (NUM_Q_HEADS // NUM_KV_HEADS)
    n = tl.load(seq_lens + i)
    start = tl.load(cu_seqlens_q + i)
    q_len = tl.load(cu_seqlens_q + i + 1) - start
    cached = 0 * n  # MISTAKE: n - q_len tokens are cached before the new ones
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < q_len
    q_offs = ((start + r[:, None]) * NUM_Q_HEADS + h) * HEAD_DIM + d[None, :]
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        pos = b * BLOCK_SIZE + s
        live = pos < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        seen = live[None, :] & (pos[None, :] <= cached + r[:, None])
        scores = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])


@mutant("prefill_kernel", "query head h reads KV head h % NUM_KV_HEADS")
@triton.jit
def prefill_kv_head_modulo(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, table_stride,
           NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h % NUM_KV_HEADS  # MISTAKE: h // G
    n = tl.load(seq_lens + i)
    start = tl.load(cu_seqlens_q + i)
    q_len = tl.load(cu_seqlens_q + i + 1) - start
    cached = n - q_len
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < q_len
    q_offs = ((start + r[:, None]) * NUM_Q_HEADS + h) * HEAD_DIM + d[None, :]
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        pos = b * BLOCK_SIZE + s
        live = pos < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        seen = live[None, :] & (pos[None, :] <= cached + r[:, None])
        scores = tl.where(seen, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])
