"""Exercise 05c — the Triton puzzle ladder's core (puzzles 1-3): wrong kernels a learner writes, one mistake each (``# MISTAKE``).

The harness runs every kernel in guarded buffers with an access trace, so a wrong address is refused before the
interpreter touches memory; several of these are caught only by the trace (their outputs are right).
"""

from __future__ import annotations

import triton
import triton.language as tl

import minipaged.kernels  # noqa: F401  (first: turns the Triton interpreter on where there is no GPU)

from . import mutant

CHECKS = {
    "scatter_kernel": ["check_scatter"],
    "gather_kernel": ["check_gather"],
    "decode_kernel": ["check_decode"],
}
HELPERS: dict = {}


# ---- 1. scatter ------------------------------------------------------------------------------------------------
@mutant("scatter_kernel", "no test for slot -1: a padding token writes just before the cache")
@triton.jit
def scatter_writes_padding(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)  # MISTAKE: no `if slot >= 0`
    d = tl.arange(0, HEAD_DIM)
    tl.store(
        cache + (slot // BLOCK_SIZE * BLOCK_SIZE + slot % BLOCK_SIZE) * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d)
    )


@mutant("scatter_kernel", "block and offset swapped in the address")
@triton.jit
def scatter_swaps_block_and_offset(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        tl.store(cache + (offset * BLOCK_SIZE + block) * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))  # MISTAKE


@mutant("scatter_kernel", "reads key row `slot` instead of row `t`")
@triton.jit
def scatter_reads_key_by_slot(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        tl.store(cache + slot * HEAD_DIM + d, tl.load(key + slot * HEAD_DIM + d))  # MISTAKE: key row t


# ---- 2. gather -------------------------------------------------------------------------------------------------
@mutant("gather_kernel", "no mask on the load: the last block is read whole (the output alone looks right)")
@triton.jit
def gather_reads_block_tail(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    block = tl.load(block_table + i)
    s = tl.arange(0, BLOCK_SIZE)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = i * BLOCK_SIZE + s
    rows = tl.load(cache + (block * BLOCK_SIZE + s) * HEAD_DIM + d)  # MISTAKE: mask=pos < seq_len
    tl.store(out + pos * HEAD_DIM + d, rows, mask=pos < seq_len)


@mutant("gather_kernel", "the program id taken for the physical block: the table is never read")
@triton.jit
def gather_ignores_table(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    block = i  # MISTAKE: tl.load(block_table + i)
    s = tl.arange(0, BLOCK_SIZE)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = i * BLOCK_SIZE + s
    rows = tl.load(cache + (block * BLOCK_SIZE + s) * HEAD_DIM + d, mask=pos < seq_len)
    tl.store(out + pos * HEAD_DIM + d, rows, mask=pos < seq_len)


# ---- 3. decode -------------------------------------------------------------------------------------------------
@mutant("decode_kernel", "no rescale of the running sums when the maximum grows")
@triton.jit
def decode_no_rescale(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
                      BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        total = total + tl.sum(p, axis=0)  # MISTAKE: total * exp(m - m_new) + ...
        acc = acc + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out + i * HEAD_DIM + d, acc / total)


@mutant("decode_kernel", "masked slots score 0 instead of -inf: the empty tail of the last block gets weight")
@triton.jit
def decode_masks_with_zero(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    q = tl.load(query + i * HEAD_DIM + d)
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = (block * BLOCK_SIZE + s[:, None]) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.sum(k * q[None, :], axis=1) * scale  # MISTAKE: tl.where(live, ..., -inf)
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out + i * HEAD_DIM + d, acc / total)
