"""The Triton puzzle ladder (exercise 11, beside chapter 05): six small kernels up to paged decode and prefill.

Each puzzle fixes a kernel's parameters and its grid; the learner writes the body. The harness builds the
inputs, launches the learner's ``@triton.jit`` function in Triton's interpreter, compares what it wrote with
the PyTorch reference, and records an access trace (``kernels.trace``): which blocks and slots of the paged
cache each program read or wrote. ``expected_cells`` is the same picture for a right answer, computed from the
block tables, so ``draw`` can put the two side by side and a wrong address is seen, not only reported::

    1 scatter   one program per new token writes its K row into its slot          (vLLM: reshape_and_cache)
    2 gather    one program per logical block copies a sequence out of the pool    (the paged gather)
    3 decode    one program per sequence: one query, online softmax over blocks    (PagedAttention V1)
    4 split     (sequence, segment) programs keep (m, l, o); a merge kernel joins  (flash-decoding, PagedAttention V2)
    5 gqa       one program per (sequence, KV head) packs the G query heads: tl.dot (vLLM's Triton decode kernel)
    6 prefill   one program per (sequence, query head): a causal tile over a cached prefix

The layouts are the engine's, cut to what each rung needs: a cache is ``[num_blocks, block_size, head_dim]``
until puzzle 5 brings the KV-head axis back (``[num_blocks, block_size, num_kv_heads, head_dim]``); a block
table row is padded with block 0, which a right kernel never reads for a position past ``seq_len``. Head dims
are powers of two, so only sequence lengths need masks. Every case is seeded; unowned blocks hold NaN, so a
stray read shows up in the output as well as in the trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .kernels.trace import AccessTrace, Kind
from .utils import cdiv

Cells = set[tuple[int, ...]]


@dataclass
class Case:
    """One launch of a puzzle's kernel: its tensors and scalars by parameter name, its grid, what it writes."""

    label: str
    tensors: dict[str, torch.Tensor]
    scalars: dict[str, Any]
    grid: tuple[int, ...]
    outputs: tuple[str, ...]
    want: dict[str, torch.Tensor] = field(default_factory=dict)  # the reference's outputs
    # (tensor, kind) -> the cells a right kernel touches: (block, slot) of a cache, (row,) of an output
    cells: dict[tuple[str, Kind], Cells] = field(default_factory=dict)
    atol: float = 1e-5


@dataclass
class Puzzle:
    name: str
    title: str
    params: tuple[str, ...]  # the kernel's parameters, in order
    cases: Callable[[], list[Case]]
    drawn: tuple[str, Kind] = ("cache", "load")  # the (tensor, kind) that ``draw`` shows by default


@dataclass
class Result:
    puzzle: str
    case: Case
    got: dict[str, torch.Tensor]
    trace: AccessTrace | None
    error: str | None = None

    def max_error(self, name: str) -> float:
        got, want = self.got[name].float(), self.case.want[name].float()
        if got.shape != want.shape:
            return math.inf
        both_nan = got.isnan() & want.isnan()
        diff = (got - want).abs().masked_fill(both_nan, 0.0)
        return float(diff.nan_to_num(nan=math.inf).max()) if diff.numel() else 0.0


# ---- running a learner's kernel ---------------------------------------------------------------------------------
def parameter_problem(kernel: Any, puzzle: Puzzle) -> str | None:
    """None if ``kernel`` is a ``@triton.jit`` function with the puzzle's parameters, else what is wrong."""
    names = getattr(kernel, "arg_names", None)
    if names is None:
        fn = getattr(kernel, "__wrapped__", kernel)
        if callable(fn):
            return f"{getattr(fn, '__name__', 'it')} is not a @triton.jit kernel (decorate it with @triton.jit)"
        return f"expected a @triton.jit kernel, got {type(kernel).__name__}"
    if tuple(names) != puzzle.params:
        return f"the kernel's parameters must be ({', '.join(puzzle.params)}); yours are ({', '.join(names)})"
    return None


def run(puzzle: Puzzle | str, kernel: Any, case: Case | int = 0, trace: bool = True) -> Result:
    """Launch ``kernel`` on a fresh copy of one case's inputs, in the interpreter, with an access trace."""
    p = PUZZLES[puzzle] if isinstance(puzzle, str) else puzzle
    c = p.cases()[case] if isinstance(case, int) else case
    tensors = {n: _guarded(t) for n, t in c.tensors.items()}
    got = {n: tensors[n] for n in c.outputs}
    problem = parameter_problem(kernel, p)
    if problem:
        return Result(p.name, c, got, None, problem)
    args = {**tensors, **c.scalars}
    recorder = AccessTrace(**tensors) if trace else None
    try:
        if recorder is None:
            kernel[c.grid](**{n: args[n] for n in p.params})
        else:
            with recorder:
                kernel[c.grid](**{n: args[n] for n in p.params})
    except Exception as exc:  # a learner's kernel failing is a result to show, not a crash
        cause = exc.__cause__ or exc
        return Result(p.name, c, got, recorder, f"{type(cause).__name__}: {cause}")
    return Result(p.name, c, got, recorder)


GUARD_BYTES = 1 << 16


def _guarded(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with 64 KiB of our own memory on each side: an address a little off any tensor lands in
    a guard (refused by the trace, and never someone else's memory), not in the tensor allocated next to it."""
    pad = GUARD_BYTES // t.element_size()
    buffer = torch.zeros(2 * pad + t.numel(), dtype=t.dtype)
    inner = buffer[pad : pad + t.numel()].view(t.shape)
    inner.copy_(t)
    return inner


def verdict(result: Result) -> str:
    """One line: "right" or the first thing that is wrong (an error, an output, a stray or a missing access)."""
    if result.error:
        return result.error
    c = result.case
    for name in c.outputs:
        err = result.max_error(name)
        if not err <= c.atol:
            return f"{name} differs from the reference by up to {err:.3g} (tolerance {c.atol:g})"
    assert result.trace is not None
    for name in c.tensors:
        if name not in c.outputs and result.trace.count(name, "store"):
            return f"stores into {name}, which the kernel must only read"
    for (tensor, kind), want in c.cells.items():
        dims = len(next(iter(want))) if want else 2
        got = result.trace.cells(tensor, kind, dims)
        stray, missing = sorted(got - want), sorted(want - got)
        if stray:
            return f"{kind}s {len(stray)} {tensor} cell(s) a right kernel never touches, first {stray[0]}"
        if missing:
            return f"never {kind}s {len(missing)} {tensor} cell(s) it must, first {missing[0]}"
    return "right"


def signature(puzzle: str) -> str:
    """The kernel's first line, to copy: ``def gather_kernel(cache_ptr, ...):``."""
    return f"def {puzzle}_kernel({', '.join(PUZZLES[puzzle].params)}):"


# ---- the pool every case lives in -------------------------------------------------------------------------------
def _pool(gen: torch.Generator, num_blocks: int, block_size: int, head_dim: int, heads: int = 0) -> torch.Tensor:
    shape = (num_blocks, block_size, heads, head_dim) if heads else (num_blocks, block_size, head_dim)
    return torch.full(shape, float("nan"))


def _tables(gen: torch.Generator, seq_lens: list[int], num_blocks: int, block_size: int) -> list[list[int]]:
    """Each sequence's blocks, drawn without replacement from 1..num_blocks-1 (block 0 pads every row)."""
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in seq_lens:
        k = cdiv(n, block_size)
        tables.append(free[:k])
        free = free[k:]
    return tables


def _fill(cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int], gen: torch.Generator) -> None:
    """Random K or V in every owned slot; the rest of the pool stays NaN."""
    block_size = cache.shape[1]
    for row, n in zip(tables, seq_lens):
        for pos in range(n):
            cache[row[pos // block_size], pos % block_size] = torch.randn(cache.shape[2:], generator=gen)


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, *(len(r) for r in tables))
    return torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32)


def _owned(tables: list[list[int]], seq_lens: list[int], block_size: int) -> Cells:
    return {(row[p // block_size], p % block_size) for row, n in zip(tables, seq_lens) for p in range(n)}


# ---- 1. scatter ------------------------------------------------------------------------------------------------
def _scatter_cases() -> list[Case]:
    cases = []
    for label, block_size, head_dim, slots, seed in (
        ("5 tokens, blocks of 4", 4, 16, [9, 10, 11, 12, 2], 0),
        ("a padding token (slot -1) between two real ones", 4, 16, [6, -1, 7], 1),
        ("blocks of 16, head_dim 32, slots across three blocks", 16, 32, [47, 16, 17, 3, 30], 2),
        ("blocks of 1", 1, 16, [3, 1, 2], 3),
    ):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = max(s for s in slots) // block_size + 2
        key = torch.randn(len(slots), head_dim, generator=gen)
        cache = _pool(gen, num_blocks, block_size, head_dim)
        want = cache.clone()
        for t, s in enumerate(slots):
            if s >= 0:
                want[s // block_size, s % block_size] = key[t]
        cases.append(
            Case(
                label,
                dict(key=key, cache=cache, slot_mapping=torch.tensor(slots, dtype=torch.int32)),
                dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim),
                (len(slots),),
                ("cache",),
                want=dict(cache=want),
                cells={("cache", "store"): {(s // block_size, s % block_size) for s in slots if s >= 0}},
            )
        )
    return cases


# ---- 2. gather -------------------------------------------------------------------------------------------------
def _gather_cases() -> list[Case]:
    cases = []
    for label, block_size, head_dim, seq_len, seed in (
        ("10 tokens in blocks of 4: the last block holds 2", 4, 16, 10, 0),
        ("8 tokens: two full blocks", 4, 16, 8, 1),
        ("1 token", 4, 16, 1, 2),
        ("37 tokens in blocks of 16, head_dim 32", 16, 32, 37, 3),
    ):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = cdiv(seq_len, block_size) + 3
        cache = _pool(gen, num_blocks, block_size, head_dim)
        (table,) = _tables(gen, [seq_len], num_blocks, block_size)
        _fill(cache, [table], [seq_len], gen)
        want = torch.stack([cache[table[p // block_size], p % block_size] for p in range(seq_len)])
        cases.append(
            Case(
                label,
                dict(
                    cache=cache, block_table=torch.tensor(table, dtype=torch.int32), out=torch.zeros(seq_len, head_dim)
                ),
                dict(seq_len=seq_len, BLOCK_SIZE=block_size, HEAD_DIM=head_dim),
                (cdiv(seq_len, block_size),),
                ("out",),
                want=dict(out=want),
                cells={
                    ("cache", "load"): _owned([table], [seq_len], block_size),
                    ("out", "store"): {(p,) for p in range(seq_len)},
                },
            )
        )
    return cases


# ---- 3. decode -------------------------------------------------------------------------------------------------
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v for q [rows, d], k/v [n, d], in float64: the answer every kernel is checked against."""
    w = ((q.double() @ k.double().T) * scale).softmax(dim=-1)
    return (w @ v.double()).float()


def _decode_inputs(seq_lens: list[int], block_size: int, head_dim: int, seed: int, heads: tuple[int, int] = (0, 0)):
    """Caches, tables and queries for a decode batch; ``heads`` = (query heads, KV heads), (0, 0) for one head."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 2
    q_heads, kv_heads = heads
    k_cache = _pool(gen, num_blocks, block_size, head_dim, kv_heads)
    v_cache = _pool(gen, num_blocks, block_size, head_dim, kv_heads)
    tables = _tables(gen, seq_lens, num_blocks, block_size)
    _fill(k_cache, tables, seq_lens, gen)
    _fill(v_cache, tables, seq_lens, gen)
    q_shape = (len(seq_lens), q_heads, head_dim) if q_heads else (len(seq_lens), head_dim)
    query = torch.randn(q_shape, generator=gen)
    return query, k_cache, v_cache, tables


def _gathered(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    block_size = cache.shape[1]
    return torch.stack([cache[table[p // block_size], p % block_size] for p in range(n)])


DECODE_SHAPES = (
    ("3 sequences of 9, 4 and 1 tokens, blocks of 4", [9, 4, 1], 4, 16, 0),
    ("2 sequences of 33 and 16 tokens, blocks of 16, head_dim 32", [33, 16], 16, 32, 1),
    ("one sequence of 6 tokens in blocks of 2", [6], 2, 16, 2),
)


def _decode_cases() -> list[Case]:
    cases = []
    for label, seq_lens, block_size, head_dim, seed in DECODE_SHAPES:
        query, k_cache, v_cache, tables = _decode_inputs(seq_lens, block_size, head_dim, seed)
        scale = head_dim**-0.5
        want = torch.stack(
            [
                _attend(query[i : i + 1], _gathered(k_cache, t, n), _gathered(v_cache, t, n), scale)[0]
                for i, (t, n) in enumerate(zip(tables, seq_lens))
            ]
        )
        table = _padded(tables)
        owned = _owned(tables, seq_lens, block_size)
        cases.append(
            Case(
                label,
                dict(
                    query=query,
                    key_cache=k_cache,
                    value_cache=v_cache,
                    block_tables=table,
                    seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                    out=torch.zeros_like(query),
                ),
                dict(scale=scale, table_stride=table.stride(0), BLOCK_SIZE=block_size, HEAD_DIM=head_dim),
                (len(seq_lens),),
                ("out",),
                want=dict(out=want),
                cells={("key_cache", "load"): owned, ("value_cache", "load"): owned},
                atol=1e-4,
            )
        )
    return cases


PUZZLES: dict[str, Puzzle] = {
    p.name: p
    for p in (
        Puzzle(
            "scatter",
            "1. Scatter: each new token's K row into its slot",
            ("key", "cache", "slot_mapping", "BLOCK_SIZE", "HEAD_DIM"),
            _scatter_cases,
            drawn=("cache", "store"),
        ),
        Puzzle(
            "gather",
            "2. Gather: one sequence out of the pool, through its block table",
            ("cache", "block_table", "out", "seq_len", "BLOCK_SIZE", "HEAD_DIM"),
            _gather_cases,
        ),
        Puzzle(
            "decode",
            "3. Decode: one query, an online softmax over the sequence's blocks",
            (
                "query",
                "key_cache",
                "value_cache",
                "block_tables",
                "seq_lens",
                "out",
                "scale",
                "table_stride",
                "BLOCK_SIZE",
                "HEAD_DIM",
            ),
            _decode_cases,
            drawn=("key_cache", "load"),
        ),
    )
}


def describe(puzzle: str) -> str:
    """The puzzle's title, its kernel's first line and its cases: what a learner reads before writing it."""
    p = PUZZLES[puzzle]
    lines = [p.title, f"  @triton.jit\n  {signature(puzzle)}", "  cases:"]
    lines += [f"    {c.label}: grid {c.grid}" for c in p.cases()]
    return "\n".join(lines)


__all__ = ["PUZZLES", "Case", "Puzzle", "Result", "describe", "run", "signature", "verdict"]
