"""The puzzle ladder's harness (``minipaged.puzzles``) and the access trace it stands on (``kernels.trace``).

Right kernels, written here the way a learner would, get "right" on every case; kernels with a learner's
mistake get a verdict that names it: a stray read in the trace, a store outside every tensor (refused before
the interpreter touches memory), a wrong number. The figure shows the same.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from minipaged import puzzles
from minipaged.kernels.trace import AccessTrace
from minipaged.viz.layout import check_layout
from minipaged.viz.trace_viz import trace_figure


@triton.jit
def scatter_kernel(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        tl.store(cache + slot * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))  # the flat slot is the row


@triton.jit
def scatter_writes_padding(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    d = tl.arange(0, HEAD_DIM)
    tl.store(cache + slot * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))  # slot -1 too


@triton.jit
def gather_kernel(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    block = tl.load(block_table + i)
    s = tl.arange(0, BLOCK_SIZE)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = i * BLOCK_SIZE + s
    x = tl.load(cache + (block * BLOCK_SIZE + s) * HEAD_DIM + d, mask=pos < seq_len)
    tl.store(out + pos * HEAD_DIM + d, x, mask=pos < seq_len)


@triton.jit
def gather_reads_block_tail(cache, block_table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    block = tl.load(block_table + i)
    s = tl.arange(0, BLOCK_SIZE)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = i * BLOCK_SIZE + s
    x = tl.load(cache + (block * BLOCK_SIZE + s) * HEAD_DIM + d)  # no mask: the last block's unused slots too
    tl.store(out + pos * HEAD_DIM + d, x, mask=pos < seq_len)


@triton.jit
def gather_wrong_params(cache, table, out, seq_len, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    pass


@triton.jit
def _decode(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
            BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, RESCALE: tl.constexpr):  # fmt: skip
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
        alpha = tl.exp(m - m_new) if RESCALE else 1.0
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out + i * HEAD_DIM + d, acc / total)


def decode_kernel(rescale: bool):
    """``_decode`` with the puzzle's parameters (RESCALE fixed), as a learner's kernel would have them."""

    class Bound:
        arg_names = puzzles.PUZZLES["decode"].params

        def __getitem__(self, grid):
            return lambda **kw: _decode[grid](**kw, RESCALE=rescale)

    return Bound()


@triton.jit
def split_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    part_max,
    part_sum,
    part_out,
    scale,
    table_stride,
    BLOCKS_PER_SPLIT: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
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
    last = tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(n, BLOCK_SIZE))
    for b in range(first, last):
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
    tl.store(part_out + (i * NUM_SPLITS + seg) * HEAD_DIM + d, tl.where(total > 0, acc / tl.maximum(total, 1e-30), 0.0))


@triton.jit
def merge_kernel(part_max, part_sum, part_out, out, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
    i = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    segs = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_max + i * NUM_SPLITS + segs)
    total = tl.load(part_sum + i * NUM_SPLITS + segs)
    o = tl.load(part_out + (i * NUM_SPLITS + segs[:, None]) * HEAD_DIM + d[None, :])
    w = total * tl.exp(m - tl.max(m, axis=0))
    tl.store(out + i * HEAD_DIM + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0))


@triton.jit
def gqa_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    out,
    scale,
    table_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    G: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    n = tl.load(seq_lens + i)
    r = tl.arange(0, Q_ROWS)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    rows = r < G
    q_offs = (i * NUM_Q_HEADS + kvh * G + r[:, None]) * HEAD_DIM + d[None, :]
    q = tl.load(query + q_offs, mask=rows[:, None], other=0.0)
    m = tl.full([Q_ROWS], float("-inf"), tl.float32)
    total = tl.zeros([Q_ROWS], dtype=tl.float32)
    acc = tl.zeros([Q_ROWS, HEAD_DIM], dtype=tl.float32)
    for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
        block = tl.load(block_tables + i * table_stride + b)
        live = b * BLOCK_SIZE + s < n
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kvh) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])


@triton.jit
def prefill_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    cu_seqlens_q,
    out,
    scale,
    table_stride,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (NUM_Q_HEADS // NUM_KV_HEADS)
    n = tl.load(seq_lens + i)
    start = tl.load(cu_seqlens_q + i)
    q_len = tl.load(cu_seqlens_q + i + 1) - start
    ctx = n - q_len
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
        offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kvh) * HEAD_DIM + d[None, :]
        k = tl.load(key_cache + offs, mask=live[:, None], other=0.0)
        v = tl.load(value_cache + offs, mask=live[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale
        seen = live[None, :] & (pos[None, :] <= ctx + r[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m = m_new
    tl.store(out + q_offs, acc / total[:, None], mask=rows[:, None])


@pytest.mark.parametrize(
    "name, kernel",
    [
        ("scatter", scatter_kernel),
        ("gather", gather_kernel),
        ("decode", decode_kernel(True)),
        ("split", split_kernel),
        ("merge", merge_kernel),
        ("gqa", gqa_kernel),
        ("prefill", prefill_kernel),
    ],
    ids=["scatter", "gather", "decode", "split", "merge", "gqa", "prefill"],
)
def test_right_kernels_are_right_on_every_case(name, kernel) -> None:
    for case in puzzles.PUZZLES[name].cases():
        result = puzzles.run(name, kernel, case)
        assert puzzles.verdict(result) == "right", case.label


def test_a_wrong_address_is_refused_before_the_interpreter_touches_it() -> None:
    result = puzzles.run("scatter", scatter_writes_padding, 1)  # slot -1 between two real tokens
    assert result.error.startswith("OutOfBounds: program (1, 0, 0): 16 lane(s) of a store fall outside")
    assert "element -16 of cache" in result.error
    assert puzzles.verdict(result) == result.error


def test_a_stray_read_is_named_and_drawn() -> None:
    result = puzzles.run("gather", gather_reads_block_tail, 0)  # 10 tokens: the last block holds 2 of 4
    assert result.max_error("out") == 0.0  # the output alone looks right: only the trace shows the mistake
    assert puzzles.verdict(result).startswith("loads 2 cache cell(s) a right kernel never touches")
    fig = trace_figure(result)
    assert check_layout(fig) == []
    stray = [t for t in fig.data if t.name == "✗ a right kernel never touches it"]
    assert len(stray) == 1 and len(stray[0].x) == 2
    assert "loads 2 cache cell(s)" in fig.layout.title.text


def test_a_missing_rescale_is_a_wrong_number() -> None:
    verdict = puzzles.verdict(puzzles.run("decode", decode_kernel(False), 0))
    assert verdict.startswith("out differs from the reference by up to")


def test_wrong_parameters_and_a_plain_function_are_named() -> None:
    got = puzzles.verdict(puzzles.run("gather", gather_wrong_params, 0))
    assert got == (
        "the kernel's parameters must be (cache, block_table, out, seq_len, BLOCK_SIZE, HEAD_DIM); yours are "
        "(cache, table, out, seq_len, BLOCK_SIZE, HEAD_DIM)"
    )
    assert "not a @triton.jit kernel" in puzzles.verdict(puzzles.run("gather", lambda *a: None, 0))


def test_the_trace_records_per_program_cells_and_counts() -> None:
    case = puzzles.PUZZLES["gather"].cases()[0]
    result = puzzles.run("gather", gather_kernel, case)
    by_program = result.trace.by_program("cache", "load")
    table = case.tensors["block_table"].tolist()
    assert by_program == {
        (0, 0, 0): {(table[0], s) for s in range(4)},
        (1, 0, 0): {(table[1], s) for s in range(4)},
        (2, 0, 0): {(table[2], s) for s in range(2)},
    }
    assert result.trace.count("cache", "load") == 10 * 16  # every element once, masked lanes not counted
    assert result.trace.count("out", "store") == 10 * 16


def test_traces_refuse_bad_tensors_and_nesting() -> None:
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        AccessTrace(x=torch.zeros(4, 4).T)
    with AccessTrace(x=torch.zeros(4)), pytest.raises(RuntimeError, match="cannot nest"):
        with AccessTrace(y=torch.zeros(4)):
            pass
    with AccessTrace(x=torch.zeros(4)):  # released after the error: a new trace starts
        pass


def test_a_store_into_an_input_is_named() -> None:
    @triton.jit
    def scatter_into_key(key, cache, slot_mapping, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(slot_mapping + t)
        d = tl.arange(0, HEAD_DIM)
        tl.store(cache + slot * HEAD_DIM + d, tl.load(key + t * HEAD_DIM + d))
        tl.store(key + t * HEAD_DIM + d, tl.zeros([HEAD_DIM], tl.float32))

    assert puzzles.verdict(puzzles.run("scatter", scatter_into_key, 0)) == (
        "stores into key, which the kernel must only read"
    )


@triton.jit
def gqa_head_by_head(query, key_cache, value_cache, block_tables, seq_lens, out, scale, table_stride,
                     NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_ROWS: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    """Right numbers, no packing: the program walks the sequence once for each of its G query heads."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    G: tl.constexpr = NUM_Q_HEADS // NUM_KV_HEADS
    n = tl.load(seq_lens + i)
    d = tl.arange(0, HEAD_DIM)
    s = tl.arange(0, BLOCK_SIZE)
    for g in tl.static_range(G):
        h = kvh * G + g
        q = tl.load(query + (i * NUM_Q_HEADS + h) * HEAD_DIM + d)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for b in range(0, tl.cdiv(n, BLOCK_SIZE)):
            block = tl.load(block_tables + i * table_stride + b)
            live = b * BLOCK_SIZE + s < n
            offs = ((block * BLOCK_SIZE + s[:, None]) * NUM_KV_HEADS + kvh) * HEAD_DIM + d[None, :]
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


def test_a_kernel_that_does_not_pack_is_right_but_reads_k_and_v_g_times() -> None:
    result = puzzles.run("gqa", gqa_head_by_head, 0)  # 8 query heads over 2 KV heads: G = 4
    assert result.max_error("out") < 1e-4
    once = (20 + 5 + 33) * 2 * 16
    assert puzzles.verdict(result) == (
        f"loads {4 * once:,} elements of key_cache, 4x the {once:,} a kernel reading each element once needs"
    )


def test_puzzles_5_and_6_serve_smollm2_token_for_token() -> None:
    """The GQA decode kernel and the prefill kernel, plugged into the real engine through ``parts`` (checked:
    the probes run first), give the package's own greedy tokens, prefix-cache hit and chunked prefill included."""
    from minipaged import LLM, SamplingParams, parts

    llm = LLM(dtype="float32", block_size=16, max_model_len=128, max_num_batched_tokens=32,
              enable_prefix_caching=True)  # fmt: skip
    shared = list(range(100, 120))  # one full block of 16 shared: the second prompt hits the prefix cache
    prompts = [shared + [7, 8, 9], shared + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26]]
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    llm.reset()
    plugged = dict(
        paged_decode_attention=puzzles.decode_part(gqa_kernel),
        paged_prefill_attention=puzzles.prefill_part(prefill_kernel),
    )
    with parts.use(**plugged) as calls:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert got == want
    assert llm.kv_cache_manager.prefix_cache_hits > 0
    assert calls["paged_decode_attention"].calls > 0 and calls["paged_prefill_attention"].calls > 0
