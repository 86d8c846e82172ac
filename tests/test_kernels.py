"""Paged kernels (chapter 05): the references against a naive dense attention, the Triton kernels
against the references, and the clear errors.

Without CUDA the Triton kernels run in the interpreter (``minipaged.kernels``, imported first by
``tests/conftest.py``, turns ``TRITON_INTERPRET=1`` on before triton is imported); with CUDA the same
tests run compiled. Without CUDA, one more test compiles the kernels ahead of time for sm_90 and
reads their registers and spills (``python -m minipaged kernels`` does the whole matrix).
The interpreter is slow (programs run one after another in numpy), so the kernel matrix
is a covering design rather than the full product: every (head ratio, dtype), (head ratio,
block size), (head ratio, head_dim) pair and every (dtype, block size, head_dim) triple
appears in ``CASES``; each case mixes sequence lengths from 1 to a few hundred, with partial
last blocks, in one batch over a shuffled pool.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton

import minipaged.kernels as K
from minipaged.kernels import reference as R
from minipaged.kernels import torch_backend as TB

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON = K.get_attention_backend("triton")
TORCH = K.get_attention_backend("torch")
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
UNUSED = 1_000_000  # block-table padding: a block id far outside the pool, so reading it would fail loudly


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    block_size: int
    queries_per_kv: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_q_heads(self) -> int:
        return self.queries_per_kv * self.num_kv_heads

    def __str__(self) -> str:
        return f"{str(self.dtype)[6:]}-bs{self.block_size}-{self.num_q_heads}q{self.num_kv_heads}kv-d{self.head_dim}"


# A 2x2x2 factorial over (dtype, block size, head_dim), each head ratio on two complementary rows.
CASES = [
    Case(torch.float32, 16, 1, 2, 64),
    Case(torch.float16, 32, 1, 2, 128),
    Case(torch.float32, 16, 3, 3, 128),
    Case(torch.float16, 32, 3, 3, 64),  # SmolLM2: 9 q heads / 3 kv heads
    Case(torch.float32, 32, 4, 2, 64),
    Case(torch.float16, 16, 4, 2, 128),
    Case(torch.float32, 32, 8, 1, 128),
    Case(torch.float16, 16, 8, 1, 64),
]
if DEVICE.type == "cuda":  # bf16 only where it is compiled: the interpreter has no bf16 arithmetic
    CASES.append(Case(torch.bfloat16, 16, 4, 2, 128))


def paged_cache(case: Case, seq_lens: list[int], seed: int, spare_blocks: int = 3, device: torch.device = DEVICE):
    """A pool filled with NaN, each sequence's tokens written through a shuffled block table.

    Any read of a slot that is not one of a sequence's tokens (the tail of a partial last block,
    a block of the pool nobody owns) brings a NaN into the result.
    """
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    need = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(need) + 1  # one more column than anyone needs
    tables = torch.full((len(seq_lens), width), UNUSED, dtype=torch.int32)
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    kc = torch.full(shape, float("nan"), dtype=case.dtype)
    vc = torch.full(shape, float("nan"), dtype=case.dtype)
    for i, (n, nb) in enumerate(zip(seq_lens, need)):
        tables[i, :nb] = torch.tensor(perm[:nb], dtype=torch.int32)
        perm = perm[nb:]
        for p in range(n):
            blk, off = int(tables[i, p // bs]), p % bs
            kc[blk, off] = torch.randn(case.num_kv_heads, case.head_dim, generator=g).to(case.dtype)
            vc[blk, off] = torch.randn(case.num_kv_heads, case.head_dim, generator=g).to(case.dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return kc.to(device), vc.to(device), tables.to(device), lens.to(device)


def naive_attention(q: torch.Tensor, key_cache, value_cache, table, seq_len: int, q_positions: list[int], scale):
    """Dense attention of one sequence, written the obvious way: gather token by token, float64, each row masked
    to the positions it may see (no kernel code shared)."""
    bs = key_cache.shape[1]
    keys = torch.stack([key_cache[int(table[p // bs]), p % bs] for p in range(seq_len)]).double()
    values = torch.stack([value_cache[int(table[p // bs]), p % bs] for p in range(seq_len)]).double()
    num_q_heads, num_kv_heads = q.shape[1], key_cache.shape[2]
    # Row t sees positions 0 .. q_positions[t]: the rest masked out before the softmax (one head at a time).
    hidden = torch.arange(seq_len)[None, :] > torch.tensor(q_positions)[:, None]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_q_heads):
        kvh = h // (num_q_heads // num_kv_heads)
        scores = (q[:, h].double() @ keys[:, kvh].T) * scale
        out[:, h] = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1) @ values[:, kvh]
    return out


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# The references against the naive gather-token-by-token attention (PyTorch only, fast)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    [Case(torch.float32, 4, 3, 3, 16), Case(torch.float32, 16, 1, 2, 8), Case(torch.float16, 8, 4, 1, 32)],
    ids=str,
)
def test_reference_decode_matches_naive_attention(case):
    seq_lens = [1, 3, case.block_size, case.block_size + 1, 37]
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=1)
    q = torch.randn(len(seq_lens), case.num_q_heads, case.head_dim).to(case.dtype).to(DEVICE)
    scale = case.head_dim**-0.5
    out = R.paged_decode_attention(q, kc, vc, tables, lens, scale)
    for i, n in enumerate(seq_lens):
        want = naive_attention(q[i : i + 1].cpu(), kc.cpu(), vc.cpu(), tables[i].cpu(), n, [n - 1], scale)
        close(out[i : i + 1], want, case.dtype)


@pytest.mark.parametrize("with_prefill", [False, True], ids=["decode-only", "mixed"])
def test_torch_backend_groups_many_decodes_by_length(with_prefill):
    """The engine's CPU path: enough one-token sequences that the plan cuts them into length groups; results
    stay per-sequence exact, and equal to the one-sequence-at-a-time reference."""
    case = Case(torch.float32, 4, 3, 1, 8)
    g = torch.Generator().manual_seed(5)
    seq_lens = torch.randint(1, 60, (70,), generator=g).tolist()
    q_lens = [1] * 70
    if with_prefill:
        seq_lens[10], q_lens[10] = 23, 6
        seq_lens[40], q_lens[40] = 8, 8
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=6, device=torch.device("cpu"))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    plan = TB.plan_attention(tables, cu, lens, case.block_size)
    assert len(plan.decode) == TB.MAX_DECODE_GROUPS and len(plan.prefills) == (2 if with_prefill else 0)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim, generator=g)
    out = TB.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.4)
    close(out, R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.4), case.dtype)
    if not with_prefill:
        close(TB.paged_decode_attention(q, kc, vc, tables, lens, 0.4), out, case.dtype)
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        close(out[rows], naive_attention(q[rows], kc, vc, tables[i], n, list(range(n - m, n)), 0.4), case.dtype)


@pytest.mark.parametrize("case", [Case(torch.float32, 4, 3, 3, 16), Case(torch.float16, 8, 2, 2, 32)], ids=str)
def test_reference_prefill_matches_naive_attention(case):
    seq_lens, q_lens = [5, 19, 30, 9], [5, 7, 1, 0]  # fully new, partly cached, one token, nothing new
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=2)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim).to(case.dtype).to(DEVICE)
    scale = 0.3
    out = R.paged_prefill_attention(q, kc, vc, tables, cu.to(DEVICE), lens, scale)
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        want = naive_attention(q[rows].cpu(), kc.cpu(), vc.cpu(), tables[i].cpu(), n, list(range(n - m, n)), scale)
        close(out[rows], want, case.dtype)


def test_reference_reshape_and_cache_writes_slots_and_skips_padding():
    kc = torch.zeros(3, 4, 1, 2)
    vc = torch.zeros(3, 4, 1, 2)
    key = torch.arange(8.0).reshape(4, 1, 2) + 1
    slots = torch.tensor([9, -1, 0, 6])  # block 2 offset 1, padding, block 0 offset 0, block 1 offset 2
    R.reshape_and_cache(key, -key, kc, vc, slots)
    assert torch.equal(kc[2, 1], key[0]) and torch.equal(kc[0, 0], key[2]) and torch.equal(kc[1, 2], key[3])
    assert torch.equal(vc[1, 2], -key[3])
    assert int((kc != 0).any(-1).sum()) == 3  # exactly three slots written


def heads_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored [blocks, heads, block_size, d] and viewed [blocks, block_size, heads, d]:
    no [num_slots, heads, d] view of it exists, so slot numbers cannot index it directly."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def test_reference_handles_caches_with_no_slot_view():
    case = Case(torch.float32, 4, 3, 2, 8)
    seq_lens, q_lens = [6, 1, 9], [6, 1, 2]
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=3, device=torch.device("cpu"))
    hk, hv = heads_major(kc), heads_major(vc)
    assert R.slot_view(hk) is None and R.slot_view(kc) is not None
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim)
    close(
        R.paged_prefill_attention(q, hk, hv, tables, cu, lens, 0.5),
        R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.5),
        case.dtype,
    )
    key = torch.randn(3, case.num_kv_heads, case.head_dim)
    slots = torch.tensor([5, -1, 0])
    R.reshape_and_cache(key, -key, hk, hv, slots)
    R.reshape_and_cache(key, -key, kc, vc, slots)
    torch.testing.assert_close(hk, kc, rtol=0, atol=0, equal_nan=True)  # unowned slots stay NaN in both
    torch.testing.assert_close(hv, vc, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(hk[1, 1], key[0]) and torch.equal(hv[0, 0], -key[2])


def test_reference_empty_decode_batch():
    kc, vc, tables, lens = paged_cache(Case(torch.float32, 4, 1, 1, 8), [3], seed=4, device=torch.device("cpu"))
    q = torch.empty(0, 1, 8)
    none = torch.empty(0, tables.shape[1], dtype=tables.dtype)
    assert R.paged_decode_attention(q, kc, vc, none, lens[:0], 1.0).shape == (0, 1, 8)
    with pytest.raises(ValueError, match="cu_seqlens_q must have num_seqs"):  # a prefill names its sequences
        R.paged_prefill_attention(q, kc, vc, none, torch.zeros(1, dtype=torch.int32), lens[:0], 1.0)


# ---------------------------------------------------------------------------------------------
# The Triton kernels against the references
# ---------------------------------------------------------------------------------------------


def decode_lengths(bs: int) -> list[int]:
    return [1, 7, bs, bs + 1, 100, 257]  # one token, partial, exact, one over, a few hundred


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_torch_backend_matches_reference(case):
    """The engine's CPU path computes what the reference says, decode and prefill alike."""
    seq_lens, q_lens = prefill_lengths(case.block_size)
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=10)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim).to(case.dtype).to(DEVICE)
    close(
        TB.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.3),
        R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.3),
        case.dtype,
    )
    qd = q[: len(seq_lens)].contiguous()
    close(
        TB.paged_decode_attention(qd, kc, vc, tables, lens, 0.3),
        R.paged_decode_attention(qd, kc, vc, tables, lens, 0.3),
        case.dtype,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_decode_matches_reference(case):
    seq_lens = decode_lengths(case.block_size)
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=3)
    q = torch.randn(len(seq_lens), case.num_q_heads, case.head_dim).to(case.dtype).to(DEVICE)
    scale = case.head_dim**-0.5
    want = R.paged_decode_attention(q, kc, vc, tables, lens, scale)
    close(K.paged_decode_attention(q, kc, vc, tables, lens, scale), want, case.dtype)
    # split-KV: several segments per long sequence, combined by the reduce kernel
    close(K.paged_decode_attention(q, kc, vc, tables, lens, scale, num_splits=4), want, case.dtype)


def prefill_lengths(bs: int) -> tuple[list[int], list[int]]:
    """(seq_len, q_len) pairs: fully new, partly cached (prefix hit / later chunk), nothing new this step,
    one new token at the end."""
    pairs = [(1, 1), (40, 7), (9, 0), (2 * bs, bs), (100, 100), (130, 70), (257, 1)]
    return [n for n, _ in pairs], [m for _, m in pairs]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_prefill_matches_reference(case):
    seq_lens, q_lens = prefill_lengths(case.block_size)
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=4)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim).to(case.dtype).to(DEVICE)
    scale = case.head_dim**-0.5
    want = R.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale)
    close(K.paged_prefill_attention(q, kc, vc, tables, cu, lens, scale), want, case.dtype)


def test_triton_any_block_size_and_head_dim():
    """Tiles gather token by token, so tiny blocks work; head_dim 80 is padded to 128 and masked."""
    case = Case(torch.float32, 4, 2, 2, 80)
    seq_lens = [3, 4, 70]
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=7)
    q = torch.randn(sum(seq_lens), case.num_q_heads, case.head_dim, device=DEVICE)
    cu = torch.tensor([0, 3, 7, 77], dtype=torch.int32, device=DEVICE)
    close(
        K.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.1),
        R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.1),
        case.dtype,
    )
    close(
        K.paged_decode_attention(q[:3], kc, vc, tables, lens, 0.1, num_splits=2),
        R.paged_decode_attention(q[:3], kc, vc, tables, lens, 0.1),
        case.dtype,
    )


@pytest.mark.parametrize("case", CASES[:4], ids=str)
def test_triton_reshape_and_cache_matches_reference(case):
    g = torch.Generator().manual_seed(5)
    num_blocks, bs = 6, case.block_size
    shape = (num_blocks, bs, case.num_kv_heads, case.head_dim)
    kc = torch.randn(shape, generator=g).to(case.dtype).to(DEVICE)
    vc = torch.randn(shape, generator=g).to(case.dtype).to(DEVICE)
    # 2 sequences writing into shuffled blocks, partial last blocks, padding tokens between them
    slots = torch.randperm(num_blocks * bs, generator=g)[: 2 * bs + 5].tolist()
    slots = slots[:bs] + [-1, -1] + slots[bs:] + [-1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    key = torch.randn(len(slots), case.num_kv_heads, case.head_dim, generator=g).to(case.dtype).to(DEVICE)
    value = torch.randn(len(slots), case.num_kv_heads, case.head_dim, generator=g).to(case.dtype).to(DEVICE)
    want_k, want_v = kc.clone(), vc.clone()
    R.reshape_and_cache(key, value, want_k, want_v, slot_mapping)
    TRITON.reshape_and_cache(key, value, kc, vc, slot_mapping)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # a copy: bit for bit, the whole pool


def test_triton_reshape_and_cache_padding_leaves_the_cache_untouched():
    kc = torch.randn(4, 16, 2, 64, device=DEVICE)
    vc = torch.randn(4, 16, 2, 64, device=DEVICE)
    before_k, before_v = kc.clone(), vc.clone()
    key = torch.randn(5, 2, 64, device=DEVICE)
    TRITON.reshape_and_cache(key, key, kc, vc, torch.full((5,), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@pytest.mark.parametrize("backend", [TORCH, TRITON], ids=lambda b: b.name)
def test_chunked_prefill_then_decode_equals_one_dense_pass(backend):
    """The engine's flow: write a chunk's K/V, attend over the paged context, next chunk, then decode."""
    case = Case(torch.float32, 16, 3, 3, 64)
    g = torch.Generator().manual_seed(6)
    n, chunks = 45, [(0, 20), (20, 44)]  # two prefill chunks, then token 44 is decoded
    q = torch.randn(n, case.num_q_heads, case.head_dim, generator=g).to(DEVICE)
    k = torch.randn(n, case.num_kv_heads, case.head_dim, generator=g).to(DEVICE)
    v = torch.randn(n, case.num_kv_heads, case.head_dim, generator=g).to(DEVICE)
    table = torch.tensor([[5, 0, 3]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([int(table[0, p // 16]) * 16 + p % 16 for p in range(n)], device=DEVICE)
    kc = torch.zeros(6, 16, case.num_kv_heads, case.head_dim, device=DEVICE)
    vc = torch.zeros_like(kc)
    outs = []
    for a, b in chunks:
        backend.reshape_and_cache(k[a:b], v[a:b], kc, vc, slots[a:b])
        cu = torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([b], dtype=torch.int32, device=DEVICE)
        outs.append(backend.paged_prefill_attention(q[a:b], kc, vc, table, cu, lens, 0.125))
    backend.reshape_and_cache(k[44:], v[44:], kc, vc, slots[44:])
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    outs.append(backend.paged_decode_attention(q[44:], kc, vc, table, lens, 0.125))
    # dense causal attention over the contiguous sequence, GQA by repeating KV heads
    kk, vv = (x.repeat_interleave(case.queries_per_kv, 1).transpose(0, 1) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, is_causal=True, scale=0.125)
    close(torch.cat(outs), want.transpose(0, 1), torch.float32)


# ---------------------------------------------------------------------------------------------
# Errors, backends, compilation
# ---------------------------------------------------------------------------------------------


def _decode_args(**change):
    kc = torch.zeros(4, 16, 2, 32)
    args = dict(
        query=torch.zeros(2, 6, 32),
        key_cache=kc,
        value_cache=kc.clone(),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([20, 3], dtype=torch.int32),
        scale=0.1,
    )
    args.update(change)
    return args


def _prefill_args(**change):
    kc = torch.zeros(4, 16, 2, 32)
    args = dict(
        query=torch.zeros(10, 6, 32),
        key_cache=kc,
        value_cache=kc.clone(),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 7, 10], dtype=torch.int32),
        seq_lens=torch.tensor([20, 3], dtype=torch.int32),
        scale=0.1,
    )
    args.update(change)
    return args


DECODE_ERRORS = [
    (dict(query=torch.zeros(2, 5, 32)), "multiple of num_kv_heads"),
    (dict(query=torch.zeros(2, 6, 16)), "head_dim"),
    (dict(query=torch.zeros(3, 6, 32)), "one token per sequence"),
    (dict(query=torch.zeros(2, 6, 32, dtype=torch.float16)), "must match the cache dtype"),
    (dict(value_cache=torch.zeros(4, 16, 2, 32, dtype=torch.float16)), "same dtype"),
    (dict(value_cache=torch.zeros(4, 8, 2, 32)), "same shape"),
    (dict(key_cache=torch.zeros(64, 2, 32)), "4 dimensions"),
    (dict(block_tables=torch.tensor([[0, 1], [2, 3]])), "block_tables must be int32"),
    (dict(seq_lens=torch.tensor([20, 3])), "seq_lens must be int32"),
    (dict(seq_lens=torch.tensor([33, 3], dtype=torch.int32)), "exceeds the block table's capacity"),
    (dict(seq_lens=torch.tensor([20, 0], dtype=torch.int32)), "at least 1"),
    (dict(block_tables=torch.tensor([[0, 4], [2, 3]], dtype=torch.int32)), r"block_tables\[0, 1\] = 4"),
    (dict(block_tables=torch.tensor([[0, 1], [-1, 3]], dtype=torch.int32)), r"block_tables\[1, 0\] = -1"),
    # The first bad sequence is the one reported, whatever is wrong with the later ones.
    (
        dict(
            block_tables=torch.tensor([[0, 4], [2, 3]], dtype=torch.int32),
            seq_lens=torch.tensor([20, 40], dtype=torch.int32),
        ),
        r"block_tables\[0, 1\] = 4",
    ),
    (dict(scale=torch.tensor(0.1)), "scale must be a Python float"),
]


@pytest.mark.parametrize("backend", [TORCH, TRITON], ids=lambda b: b.name)
@pytest.mark.parametrize("change,match", DECODE_ERRORS, ids=[m for _, m in DECODE_ERRORS])
def test_decode_errors(backend, change, match):
    with pytest.raises(ValueError, match=match):
        backend.paged_decode_attention(**_decode_args(**change))


def test_block_table_columns_past_a_sequence_are_not_read():
    """A table row's columns past the sequence's last block are padding: any value there is fine."""
    args = _decode_args(block_tables=torch.tensor([[0, 1], [2, 99]], dtype=torch.int32))  # seq 1 reads block 2 only
    out = TORCH.paged_decode_attention(**args)
    assert out.shape == (2, 6, 32) and not out.isnan().any()


PREFILL_ERRORS = [
    (dict(cu_seqlens_q=torch.tensor([1, 7, 10], dtype=torch.int32)), "start at 0"),
    (dict(cu_seqlens_q=torch.tensor([0, 7, 9], dtype=torch.int32)), "number of query tokens"),
    (dict(cu_seqlens_q=torch.tensor([0, 11, 10], dtype=torch.int32)), "must not decrease"),
    (dict(cu_seqlens_q=torch.tensor([0, 6, 10], dtype=torch.int32)), "q_len <= seq_len"),
    (dict(cu_seqlens_q=torch.tensor([0, 10], dtype=torch.int32)), "one entry per sequence"),
    (dict(seq_lens=torch.tensor([40, 3], dtype=torch.int32)), "capacity"),
]


@pytest.mark.parametrize("backend", [TORCH, TRITON], ids=lambda b: b.name)
@pytest.mark.parametrize("change,match", PREFILL_ERRORS, ids=[m for _, m in PREFILL_ERRORS])
def test_prefill_errors(backend, change, match):
    with pytest.raises(ValueError, match=match):
        backend.paged_prefill_attention(**_prefill_args(**change))


CACHE_ERRORS = [
    (dict(slot_mapping=torch.tensor([0, 64, -1])), "outside the pool"),
    (dict(slot_mapping=torch.tensor([0, -2, 1])), "outside the pool"),
    (dict(slot_mapping=torch.tensor([5, 7, 5])), "more than once"),
    (dict(slot_mapping=torch.tensor([0, 1])), "one slot per token"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), "slot_mapping must be int64 or int32"),
    (dict(key=torch.zeros(3, 2, 16), value=torch.zeros(3, 2, 16)), "match the cache"),
    (dict(key=torch.zeros(3, 2, 16)), "key and value must have the same shape"),
    (dict(value=torch.zeros(3, 2, 32, dtype=torch.float16)), "same shape|dtype"),
]


@pytest.mark.parametrize("backend", [TORCH, TRITON], ids=lambda b: b.name)
@pytest.mark.parametrize("change,match", CACHE_ERRORS, ids=[m for _, m in CACHE_ERRORS])
def test_reshape_and_cache_errors(backend, change, match):
    kc = torch.zeros(4, 16, 2, 32)
    args = dict(
        key=torch.zeros(3, 2, 32),
        value=torch.zeros(3, 2, 32),
        key_cache=kc,
        value_cache=kc.clone(),
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        backend.reshape_and_cache(**args)


@pytest.mark.skipif(DEVICE.type == "cuda", reason="bf16 is compiled on a GPU")
def test_triton_refuses_bf16_in_the_interpreter():
    args = _decode_args(
        **{k: v.bfloat16() for k, v in _decode_args().items() if k in ("query", "key_cache", "value_cache")}
    )
    R.paged_decode_attention(**args)  # the reference is fine with bf16
    with pytest.raises(ValueError, match="bfloat16 is not supported by the Triton interpreter"):
        K.paged_decode_attention(**args)


@pytest.mark.parametrize("num_splits", [0, 65, 2.0])
def test_num_splits_is_checked(num_splits):
    with pytest.raises(ValueError, match="num_splits"):
        args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in _decode_args().items()}
        K.paged_decode_attention(**args, num_splits=num_splits)


def test_backend_dispatch():
    assert K.triton_available()
    assert K.get_attention_backend("torch").paged_decode_attention is TB.paged_decode_attention
    assert K.get_attention_backend("triton").paged_prefill_attention is K.paged_prefill_attention
    assert K.get_attention_backend("auto").name == ("triton" if DEVICE.type == "cuda" else "torch")
    assert K.triton_interpreting() == (DEVICE.type == "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        K.get_attention_backend("cuda")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the interpreter is only needed without a GPU")
def test_importing_triton_first_gives_a_clear_error():
    """triton.language defines tl.zeros & co. when triton is imported: TRITON_INTERPRET set later is too late."""
    code = textwrap.dedent("""
        import triton, torch
        import minipaged.kernels as K
        assert not K.triton_available() and K.get_attention_backend().name == "torch"
        kc = torch.zeros(2, 16, 1, 64)
        try:
            K.paged_decode_attention(torch.zeros(1, 2, 64), kc, kc, torch.zeros(1, 1, dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), 0.1)
        except RuntimeError as e:
            print(e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRITON_INTERPRET=1 must be set before triton is first imported" in proc.stdout


def test_triton_per_token_addressing_matches_reference():
    """The first version's addressing (a table lookup per token), kept for chapter 05's comparison, is still right."""
    from minipaged.kernels.paged_decode import plan_paged_decode
    from minipaged.kernels.paged_prefill import plan_paged_prefill

    case = Case(torch.float32, 16, 3, 3, 64)
    seq_lens, q_lens = prefill_lengths(case.block_size)
    kc, vc, tables, lens = paged_cache(case, seq_lens, seed=8)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]), case.num_q_heads, case.head_dim, device=DEVICE)
    out = torch.empty_like(q)
    for launch in plan_paged_prefill(q, kc, vc, tables, cu, lens, 0.125, out, max(q_lens), per_token=True):
        assert launch.constexprs["PER_TOKEN"] is True
        launch.run()
    close(out, R.paged_prefill_attention(q, kc, vc, tables, cu, lens, 0.125), case.dtype)
    qd = q[: len(seq_lens)].contiguous()
    out = torch.empty_like(qd)
    for launch in plan_paged_decode(qd, kc, vc, tables, lens, 0.125, out, num_splits=2, per_token=True):
        launch.run()
    close(out, R.paged_decode_attention(qd, kc, vc, tables, lens, 0.125), case.dtype)


@pytest.mark.parametrize("tile_n", [16, 32, 64])
def test_triton_decode_tiles_that_span_blocks(tile_n):
    """At block 16 a decode tile of 32 or 64 keys reads two or four blocks, one table entry each; segments of
    whole tiles end inside a block and sequences end mid-tile, and the table's padding is never read."""
    from minipaged.kernels.paged_decode import decode_config, plan_paged_decode

    assert decode_config(torch.float16, 128, 16).tile_n == 32  # the engine's block size, the table's tile
    case = Case(torch.float32, 16, 3, 2, 64)
    kc, vc, tables, lens = paged_cache(case, decode_lengths(16) + [33, 200], seed=12)
    q = torch.randn(len(lens), case.num_q_heads, case.head_dim, device=DEVICE)
    want = R.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    for splits in (1, 3):
        out = torch.empty_like(q)
        for launch in plan_paged_decode(q, kc, vc, tables, lens, 0.125, out, num_splits=splits, tile_n=tile_n):
            launch.run()
        assert plan_paged_decode(q, kc, vc, tables, lens, 0.125, out, tile_n=tile_n)[0].constexprs["TILE_N"] == tile_n
        close(out, want, case.dtype)


def test_decode_tiles_span_blocks_only_where_tensor_cores_are():
    """sm_80 and later read 32 keys per tile at block 16; sm_75 (T4), whose tl.dot is FMA instructions with
    registers growing with the tile, stays inside one block, and the compile report plans what a T4 launches."""
    from minipaged.classroom.kernel_report import Config, example_launches
    from minipaged.kernels.launch import has_tensor_cores
    from minipaged.kernels.paged_decode import decode_config
    from minipaged.kernels.paged_prefill import prefill_config

    assert [has_tensor_cores(a) for a in ("sm_75", "sm_80", "sm_86", "sm_90", "sm_90a", None)] == [
        False, True, True, True, True, True]  # fmt: skip
    assert [decode_config(torch.float16, 128, 16, a).tile_n for a in ("sm_75", "sm_80", "sm_90", None)] == [
        16, 32, 32, 32]  # fmt: skip
    assert decode_config(torch.float16, 128, 64, "sm_75").tile_n == 32  # a big block still holds a big tile
    assert decode_config(torch.float16, 128, 4, "sm_75").tile_n == 16  # tiny blocks: 16 keys, four blocks
    assert prefill_config(torch.float16, 128, 16, 64).tile_n == 16  # prefill's tile stays inside one block
    for arch, tile in (("sm_75", 16), ("sm_90", 32)):
        launches = example_launches(Config("paged_decode", "float16", 128, 16, 4, 2, arch))
        assert {launch.constexprs["TILE_N"] for name, launch in launches if name != "reduce_segments"} == {tile}


@pytest.mark.parametrize("block_size", [3, 12, 24])
def test_triton_refuses_block_sizes_it_cannot_tile(block_size):
    """A tile is a slice of one block or a run of whole ones, and tl.dot needs 16 keys: the block size must divide
    16 or be a multiple of 16."""
    case = Case(torch.float32, block_size, 1, 1, 16)
    kc, vc, tables, lens = paged_cache(case, [5], seed=9)
    q = torch.randn(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=f"block_size that divides 16 or is a multiple of 16, got {block_size}"):
        K.paged_decode_attention(q, kc, vc, tables, lens, 0.25)


def test_an_explicit_tile_must_fit_the_blocks():
    from minipaged.kernels.launch import check_tile_n, kv_tile_n

    assert check_tile_n(64, 16) == 64 and check_tile_n(16, 32) == 16
    for tile, bs in ((8, 16), (48, 16), (32, 48), (True, 16)):
        with pytest.raises(ValueError, match="tile_n"):
            check_tile_n(tile, bs)
    assert [kv_tile_n(bs, 32) for bs in (1, 4, 16, 32, 48, 64, 128)] == [32, 32, 32, 32, 16, 32, 32]
    assert [kv_tile_n(bs, 64) for bs in (16, 48, 80, 96)] == [64, 16, 16, 32]


def test_occupancy_follows_the_cuda_rules():
    from minipaged.classroom.kernel_report import occupancy

    assert occupancy("sm_90", 32, 0, 4) == 64  # few registers: the 64-warp limit
    assert occupancy("sm_90", 128, 0, 4) == 16  # 128 regs x 32 = 4096 per warp: 16 warps fill 65536
    assert occupancy("sm_90", 255, 0, 4) == 8  # 255 regs round up to 8192 per warp
    assert occupancy("sm_80", 64, 100_000, 4) == 4  # one 100 KB program per 164 KB SM
    assert occupancy("sm_90", 64, 100_000, 4) == 8  # two per 228 KB SM


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the tests above run the kernels compiled")
@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is missing")
def test_kernels_compile_for_h100_without_spills(tmp_path):
    """Without a GPU, compile the kernels ahead of time for sm_90 (H100), exactly as the wrappers would launch
    them, through the command line's JSON report: every kernel compiles, none spills a register, and
    decode at head_dim 128 in fp16 keeps at least 16 warps resident per SM. (The CLI covers the full matrix.)"""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minipaged",
            "kernels",
            "--arch",
            "sm_90",
            "--json",
            "--dtypes",
            "float16,float32",
            "--head-dims",
            "128",
            "--kernels",
            "reshape_and_cache,paged_decode,paged_prefill",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, (proc.stderr[-3000:], [r for r in rows if r.get("error") or r["spill_bytes"]])
    # 2 dtypes x (head_dim 128 group 4, plus SmolLM2's head_dim 64 group 3): scatter, decode x 2 + reduce, prefills
    assert {(r["dtype"], r["head_dim"], r["group"]) for r in rows} == {
        ("float16", 128, 4),
        ("float32", 128, 4),
        ("float16", 64, 3),
        ("float32", 64, 3),
    }
    assert {r["kernel"] for r in rows} == {
        "reshape_and_cache",
        "paged_decode",
        "paged_decode_split",
        "reduce_segments",
        "paged_prefill",
    }
    for r in rows:
        assert r["arch"] == "sm_90" and "error" not in r, r
        assert r["spill_bytes"] == 0 and 0 < r["registers"] <= 255, r
        assert r["occupancy"] >= 8, r
    decode = [r for r in rows if r["kernel"] == "paged_decode" and r["dtype"] == "float16" and r["head_dim"] == 128]
    assert decode and all(r["occupancy"] >= 16 for r in decode), decode


def test_occupancy_on_a_t4():
    """sm_75: 32 warps and 16 programs an SM, 64 KiB of shared memory with none reserved (a kernel without shared
    memory must not divide by zero)."""
    from minipaged.classroom.kernel_report import occupancy

    assert occupancy("sm_75", 30, 0, 4) == 32  # the 32-warp limit
    assert occupancy("sm_75", 128, 0, 4) == 16  # 4096 registers a warp: 16 warps fill 65536
    assert occupancy("sm_75", 64, 40_000, 4) == 4  # one 40 KB program per 64 KiB SM
    assert occupancy("sm_75", 32, 16_384, 4) == 16  # four 16 KiB programs: 64 KiB, no reserve on Turing


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU the tests above run the kernels compiled")
@pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is missing")
def test_kernels_compile_for_a_t4_and_say_where_tl_dot_has_no_tensor_cores(tmp_path):
    """`make kernels` covers sm_75 (T4): every kernel compiles there in every dtype, bf16 included, without spills;
    Triton gives tl.dot no tensor cores there, and each such row says so (on sm_90 fp16 and bf16 rows use them)."""
    from minipaged.classroom.kernel_report import NO_TENSOR_CORES, Row, format_table

    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "minipaged", "kernels", "--arch", "sm_75,sm_90", "--json", "--dtypes",
           "bfloat16,float16", "--head-dims", "64", "--groups", "3", "--kernels", "reshape_and_cache,paged_decode"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0, (proc.stderr[-3000:], [r for r in rows if r.get("error") or r["spill_bytes"]])
    assert {(r["arch"], r["dtype"]) for r in rows} == {
        (a, d) for a in ("sm_75", "sm_90") for d in ("bfloat16", "float16")
    }
    for r in rows:
        assert "error" not in r and r["spill_bytes"] == 0 and r["occupancy"] > 0, r
        dot = r["kernel"] in ("paged_decode", "paged_decode_split")
        assert r.get("note") == (NO_TENSOR_CORES if dot and r["arch"] == "sm_75" else None), r
    table = format_table([Row(**r) for r in rows])
    assert f"note: paged_decode, paged_decode_split bfloat16 on sm_75: {NO_TENSOR_CORES}" in table
