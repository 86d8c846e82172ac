"""The Triton puzzle ladder (exercise 05c, beside chapter 05): seven small kernels up to paged decode and prefill.

Each puzzle fixes a kernel's parameters and its grid; the learner writes the body. ``run`` builds the inputs in
guarded buffers, launches the learner's ``@triton.jit`` function in Triton's interpreter and records an access
trace (``classroom/kernel_trace.py``): which blocks and slots of the paged cache each program read or wrote.
``Case.cells`` is the same picture for a right answer, worked out from the block tables, so ``verdict`` names the
first stray or missing access and ``trace_figure`` (``classroom/viz/trace_viz.py``) puts the two side by side: a
wrong address is seen, not only reported.

On a CUDA GPU (``kernels.launch.kernel_device()``) the kernel is compiled instead, on CUDA copies of the inputs,
and there is no trace: the verdict rests on the outputs, the inputs left as they were and the guards around every
tensor left untouched (a float guard holds NaN, so a stray read shows in the output); a read of a slot a right
kernel never reads, and how often K and V are loaded, are checked only in the interpreter::

    1  scatter  one program per new token writes its K row into its slot          (vLLM: reshape_and_cache)
    2  gather   one program per logical block copies a sequence out of the pool    (the paged gather)
    3  decode   one program per sequence: one query, online softmax over blocks    (PagedAttention V1)
    4a split    (sequence, segment) programs keep (m, l, o)                        (flash-decoding, PagedAttention V2)
    4b merge    one program per sequence joins the segments
    5  gqa      one program per (sequence, KV head) packs the G query heads: tl.dot (vLLM's Triton decode kernel)
    6  prefill  one program per (sequence, query head): a causal tile over a cached prefix

Puzzles 5 and 6 plug into the engine (``decode_part``, ``prefill_part``), and ``compile_kernels`` compiles any of
them for sm_80 / sm_90 (``classroom/kernel_report.py``). The layouts are the engine's, cut to what each rung needs:
a cache is ``[num_blocks, block_size, head_dim]`` until puzzle 5 brings the KV-head axis back (``[num_blocks,
block_size, num_kv_heads, head_dim]``); a block table row is padded with block 0, which a right kernel never reads
for a position past ``seq_len``. Head dims are powers of two, so only sequence lengths need masks. Every case is
seeded; unowned blocks hold NaN, so a stray read shows up in the output as well as in the trace.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import launch
from ..utils import cdiv
from .kernel_trace import AccessTrace, Kind

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
    # tensor -> the most element loads a right kernel makes (puzzle 5: each K/V element once per KV head)
    max_loads: dict[str, int] = field(default_factory=dict)


@dataclass
class Puzzle:
    name: str
    title: str
    params: tuple[str, ...]  # the kernel's parameters, in order
    cases: Callable[[], list[Case]]
    drawn: tuple[str, Kind] = ("cache", "load")  # the (tensor, kind) that ``trace_figure`` shows by default
    axes: tuple[str, str] = ("physical block", "slot in block")  # what the drawn tensor's first two dims are


@dataclass
class Result:
    puzzle: str
    case: Case
    got: dict[str, torch.Tensor]
    trace: AccessTrace | None  # None where the kernel ran compiled (on a GPU), or was not traced
    error: str | None = None
    stray: str | None = None  # without a trace: the first store outside the outputs (a guard, an input), if any

    def max_error(self, name: str) -> float:
        got, want = self.got[name].float(), self.case.want[name].float()
        if got.shape != want.shape:
            return math.inf
        same = (got == want) | (got.isnan() & want.isnan())  # -inf == -inf: an empty segment's maximum
        diff = (got - want).abs().masked_fill(same, 0.0)
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
    """Launch ``kernel`` on a fresh copy of one case's inputs on ``kernel_device()``: in the interpreter with an
    access trace (unless ``trace`` is False), or compiled on a GPU, where no trace can be recorded."""
    p = PUZZLES[puzzle] if isinstance(puzzle, str) else puzzle
    c = p.cases()[case] if isinstance(case, int) else case
    device = launch.kernel_device()
    buffers = {n: _guarded(t, device) for n, t in c.tensors.items()}
    tensors = {n: _inner(buffers[n], t) for n, t in c.tensors.items()}
    got = {n: tensors[n] for n in c.outputs}
    problem = parameter_problem(kernel, p)
    if problem:
        return Result(p.name, c, got, None, problem)
    args = {**tensors, **c.scalars}
    recorder = AccessTrace(**tensors) if trace and device.type == "cpu" else None
    before = {n: b.clone() for n, b in buffers.items()} if recorder is None else {}
    try:
        with launch.learner_dots(device) as options:  # fp32 tl.dot in fp32 on a GPU too, as in the interpreter
            if recorder is None:
                kernel[c.grid](**{n: args[n] for n in p.params}, **options)
            else:
                with recorder:
                    kernel[c.grid](**{n: args[n] for n in p.params}, **options)
    except Exception as exc:  # a learner's kernel failing is a result to show, not a crash
        cause = exc.__cause__ or exc
        return Result(p.name, c, got, recorder, launch.device_problem(cause) or f"{type(cause).__name__}: {cause}")
    stray = _stray_store(c, buffers, before) if recorder is None else None
    return Result(p.name, c, {n: t.cpu() for n, t in got.items()}, recorder, stray=stray)


GUARD_BYTES = 1 << 16


def _guarded(t: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat buffer on ``device`` holding ``t`` with 64 KiB of our own memory on each side (``_inner`` is the
    copy of ``t`` in it): an address a little off any tensor lands in a guard (refused by the trace, and never
    someone else's memory), not in the tensor allocated next to it. A float guard holds NaN: without a trace, a
    stray read shows in the output. An index guard holds 0, a block that exists: a stray read of it on a GPU
    must not send the kernel to an address that would crash the device."""
    pad = GUARD_BYTES // t.element_size()
    fill = float("nan") if t.dtype.is_floating_point else 0
    buffer = torch.full((2 * pad + t.numel(),), fill, dtype=t.dtype, device=device)
    _inner(buffer, t).copy_(t)
    return buffer


def _inner(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The view of a ``_guarded`` buffer that is the tensor itself, shaped like ``t``."""
    pad = GUARD_BYTES // t.element_size()
    return buffer[pad : pad + t.numel()].view(t.shape)


def _stray_store(c: Case, buffers: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> str | None:
    """Without a trace, the stores a right kernel never makes, seen afterwards: a guard or an input whose bytes
    changed (compared as bytes, so a NaN left as it was is unchanged)."""
    for name, buffer in buffers.items():
        changed = (buffer.view(torch.uint8) != before[name].view(torch.uint8)).cpu()
        pad, size = GUARD_BYTES, c.tensors[name].numel() * buffer.element_size()
        if changed[:pad].any() or changed[pad + size :].any():
            side = "before" if changed[:pad].any() else "after"
            return f"stores outside every tensor: into the memory just {side} {name}"
    for name, buffer in buffers.items():
        if name not in c.outputs and not torch.equal(buffer.view(torch.uint8), before[name].view(torch.uint8)):
            return f"stores into {name}, which the kernel must only read"
    return None


def verdict(result: Result) -> str:
    """One line: "right" or the first thing that is wrong (an error, an output, a stray or a missing access)."""
    if result.error:
        return result.error
    c = result.case
    if result.trace is None and result.stray and result.stray.startswith("stores outside"):
        return result.stray  # the untraced twin of an OutOfBounds error: first, as the trace would have it
    for name in c.outputs:
        err = result.max_error(name)
        if not err <= c.atol:
            return f"{name} differs from the reference by up to {err:.3g} (tolerance {c.atol:g})"
    if result.trace is None:  # compiled on a GPU (or not traced): only what the buffers show afterwards
        return result.stray or "right"
    for name in c.tensors:
        if name not in c.outputs and result.trace.count(name, "store"):
            return f"stores into {name}, which the kernel must only read"
    for tensor, most in c.max_loads.items():
        loads = result.trace.count(tensor, "load")
        if loads > most:
            return (
                f"loads {loads:,} elements of {tensor}, {loads / most:.3g}x the {most:,} a kernel reading each "
                "element once needs"
            )
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


def _inputs(
    seq_lens: list[int], block_size: int, head_dim: int, seed: int, heads: tuple[int, int] = (0, 0), q_lens=None
):
    """Caches, tables and queries of a batch: ``q_lens[i]`` new tokens for sequence i (one each: a decode batch);
    ``heads`` = (query heads, KV heads), or (0, 0) for the one-head layouts of puzzles 3 and 4."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + 2
    q_heads, kv_heads = heads
    k_cache = _pool(gen, num_blocks, block_size, head_dim, kv_heads)
    v_cache = _pool(gen, num_blocks, block_size, head_dim, kv_heads)
    tables = _tables(gen, seq_lens, num_blocks, block_size)
    _fill(k_cache, tables, seq_lens, gen)
    _fill(v_cache, tables, seq_lens, gen)
    rows = sum(q_lens) if q_lens else len(seq_lens)
    query = torch.randn((rows, q_heads, head_dim) if q_heads else (rows, head_dim), generator=gen)
    return query, k_cache, v_cache, tables


def _attention_case(
    label: str,
    seq_lens: list[int],
    block_size: int,
    head_dim: int,
    seed: int,
    heads: tuple[int, int],
    grid: tuple[int, ...],
    constexprs: dict[str, int],
    q_lens: list[int] | None = None,
    loads_per_element: int = 0,
) -> Case:
    """A decode (``q_lens`` None: one new token a sequence) or prefill batch, with the reference's output: each
    new token at position ``seq_len - q_len + j`` attends to the keys up to its own, query head h to KV head
    h // G. ``loads_per_element``: how often a right kernel loads each K/V element (0: not counted)."""
    query, k_cache, v_cache, tables = _inputs(seq_lens, block_size, head_dim, seed, heads, q_lens)
    new = q_lens or [1] * len(seq_lens)
    cu = [0, *itertools.accumulate(new)]
    scale = head_dim**-0.5
    q3 = query if heads[0] else query[:, None]  # [rows, heads, d]
    k_heads = k_cache if heads[0] else k_cache[:, :, None]
    v_heads = v_cache if heads[0] else v_cache[:, :, None]
    group = q3.shape[1] // k_heads.shape[2]
    want = torch.zeros_like(q3)
    for i, (t, n, q_len) in enumerate(zip(tables, seq_lens, new)):
        k, v = _gathered(k_heads, t, n), _gathered(v_heads, t, n)  # [n, kv_heads, d]
        for j in range(q_len):
            pos = n - q_len + j
            for h in range(q3.shape[1]):
                row = q3[cu[i] + j, h : h + 1]
                want[cu[i] + j, h] = _attend(row, k[: pos + 1, h // group], v[: pos + 1, h // group], scale)[0]
    table = _padded(tables)
    owned = _owned(tables, seq_lens, block_size)
    tensors = dict(
        query=query,
        key_cache=k_cache,
        value_cache=v_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )
    if q_lens:
        tensors["cu_seqlens_q"] = torch.tensor(cu, dtype=torch.int32)
    once = sum(seq_lens) * k_heads.shape[2] * head_dim
    return Case(
        label,
        {**tensors, "out": torch.zeros_like(query)},
        dict(scale=scale, table_stride=table.stride(0), **constexprs, BLOCK_SIZE=block_size, HEAD_DIM=head_dim),
        grid,
        ("out",),
        want=dict(out=want.reshape(query.shape)),
        cells={("key_cache", "load"): owned, ("value_cache", "load"): owned},
        atol=1e-4,
        max_loads={c: once * loads_per_element for c in ("key_cache", "value_cache")} if loads_per_element else {},
    )


def _gathered(cache: torch.Tensor, table: list[int], n: int) -> torch.Tensor:
    block_size = cache.shape[1]
    return torch.stack([cache[table[p // block_size], p % block_size] for p in range(n)])


DECODE_SHAPES = (
    ("3 sequences of 9, 4 and 1 tokens, blocks of 4", [9, 4, 1], 4, 16, 0),
    ("2 sequences of 33 and 16 tokens, blocks of 16, head_dim 32", [33, 16], 16, 32, 1),
    ("one sequence of 6 tokens in blocks of 2", [6], 2, 16, 2),
)


def _decode_cases() -> list[Case]:
    return [
        _attention_case(label, seq_lens, block_size, head_dim, seed, (0, 0), (len(seq_lens),), {})
        for label, seq_lens, block_size, head_dim, seed in DECODE_SHAPES
    ]


# ---- 4. split-KV and the merge -----------------------------------------------------------------------------------
# NUM_SPLITS is a power of two (the merge loads all of them with one tl.arange) and NUM_SPLITS x BLOCKS_PER_SPLIT
# covers the longest sequence; the segments past a shorter sequence's end are empty.
SPLIT_SHAPES = (
    ("3 sequences of 9, 4 and 1 tokens, blocks of 4, 2 blocks a segment, 4 segments", [9, 4, 1], 4, 16, 2, 4, 0),
    ("2 sequences of 40 and 7 tokens, blocks of 8, 1 block a segment, 8 segments", [40, 7], 8, 16, 1, 8, 1),
    ("one sequence of 33 tokens, blocks of 16, 2 blocks a segment, 2 segments, head_dim 32", [33], 16, 32, 2, 2, 2),
)


def _partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bounds: list[tuple[int, int]]):
    """Each segment's (max score, sum of exp(score - max), normalised output); (-inf, 0, 0) for an empty one."""
    rows = []
    for lo, hi in bounds:
        if hi <= lo:
            rows.append((-math.inf, 0.0, torch.zeros(q.shape[-1])))
            continue
        scores = (k[lo:hi].double() @ q.double()) * scale
        m = float(scores.max())
        w = (scores - m).exp()
        rows.append((m, float(w.sum()), ((w @ v[lo:hi].double()) / w.sum()).float()))
    return rows


def _split_inputs(shape: tuple) -> tuple[dict[str, torch.Tensor], dict[str, Any], list, list[list[int]]]:
    """The decode batch of one split shape, its scalars, each sequence's partials, and the block tables."""
    _, seq_lens, block_size, head_dim, per_split, num_splits, seed = shape
    query, k_cache, v_cache, tables = _inputs(seq_lens, block_size, head_dim, seed)
    scale = head_dim**-0.5
    span = per_split * block_size
    partials = []
    for i, (t, n) in enumerate(zip(tables, seq_lens)):
        k, v = _gathered(k_cache, t, n), _gathered(v_cache, t, n)
        bounds = [(min(s * span, n), min((s + 1) * span, n)) for s in range(num_splits)]
        partials.append(_partials(query[i], k, v, scale, bounds))
    table = _padded(tables)
    tensors = dict(
        query=query,
        key_cache=k_cache,
        value_cache=v_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )
    scalars = dict(scale=scale, table_stride=table.stride(0), BLOCKS_PER_SPLIT=per_split, NUM_SPLITS=num_splits)
    return tensors, {**scalars, "BLOCK_SIZE": block_size, "HEAD_DIM": head_dim}, partials, tables


def _split_cases() -> list[Case]:
    cases = []
    for shape in SPLIT_SHAPES:
        label, seq_lens, block_size, _, _, num_splits, _ = shape
        tensors, scalars, partials, tables = _split_inputs(shape)
        owned = _owned(tables, seq_lens, block_size)
        num_seqs = len(seq_lens)
        want = dict(
            part_max=torch.tensor([[m for m, _, _ in p] for p in partials]),
            part_sum=torch.tensor([[s for _, s, _ in p] for p in partials]),
            part_out=torch.stack([torch.stack([o for _, _, o in p]) for p in partials]),
        )
        cases.append(
            Case(
                label,
                {**tensors, **{n: torch.zeros_like(t) for n, t in want.items()}},
                scalars,
                (num_seqs, num_splits),
                ("part_max", "part_sum", "part_out"),
                want=want,
                cells={("key_cache", "load"): owned, ("value_cache", "load"): owned},
                atol=1e-4,
            )
        )
    return cases


def _merge_cases() -> list[Case]:
    cases = []
    for shape in SPLIT_SHAPES:
        label, seq_lens, _, head_dim, _, num_splits, _ = shape
        _, _, partials, _ = _split_inputs(shape)
        m = torch.tensor([[x for x, _, _ in p] for p in partials])
        total = torch.tensor([[x for _, x, _ in p] for p in partials])
        o = torch.stack([torch.stack([x for _, _, x in p]) for p in partials])
        # The merge as chapter 05 writes it: rescale every segment to the common maximum, weight by its sum.
        weight = total.double() * (m.double() - m.double().max(dim=1, keepdim=True).values).exp()
        out = ((weight[..., None] * o.double()).sum(dim=1) / weight.sum(dim=1, keepdim=True)).float()
        every: Cells = {(i, s) for i in range(len(seq_lens)) for s in range(num_splits)}
        cases.append(
            Case(
                f"the partials of {label}",
                dict(part_max=m, part_sum=total, part_out=o, out=torch.zeros(len(seq_lens), head_dim)),
                dict(NUM_SPLITS=num_splits, HEAD_DIM=head_dim),
                (len(seq_lens),),
                ("out",),
                want=dict(out=out),
                cells={("part_max", "load"): every, ("part_sum", "load"): every},
                atol=1e-4,
            )
        )
    return cases


# ---- 5. GQA packing ----------------------------------------------------------------------------------------------
# tl.dot wants every tile dimension >= 16: blocks of 16 or more, and Q_ROWS = max(16, next power of 2 >= G) rows,
# of which the first G are the query heads that share the program's KV head.
GQA_SHAPES = (
    ("3 sequences of 20, 5 and 33 tokens, 8 query heads over 2 KV heads, blocks of 16", [20, 5, 33], 16, 16, 8, 2, 0),
    (
        "2 sequences of 40 and 17 tokens, SmolLM2's 9 query heads over 3 KV heads, blocks of 32",
        [40, 17],
        32,
        16,
        9,
        3,
        1,
    ),
    ("one sequence of 16 tokens, 4 heads each with its own KV head (G = 1), head_dim 32", [16], 16, 32, 4, 4, 2),
)


def tile_rows(n: int) -> int:
    """Rows of a query tile holding ``n`` rows: the next power of two, and at least tl.dot's 16."""
    return max(16, 1 << (n - 1).bit_length())


def q_rows(num_q_heads: int, num_kv_heads: int) -> int:
    """Rows of the query tile one puzzle-5 program packs: its G query heads."""
    return tile_rows(num_q_heads // num_kv_heads)


def _gqa_cases() -> list[Case]:
    return [
        _attention_case(
            label,
            seq_lens,
            block_size,
            head_dim,
            seed,
            (q_heads, kv_heads),
            (len(seq_lens), kv_heads),
            dict(NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, Q_ROWS=q_rows(q_heads, kv_heads)),
            loads_per_element=1,  # once per KV head's program: the G query heads share the load
        )
        for label, seq_lens, block_size, head_dim, q_heads, kv_heads, seed in GQA_SHAPES
    ]


def _launch(kernel: Any, grid: tuple[int, ...], tensors: list[torch.Tensor], scale: float, **constexprs: int):
    """Launch a puzzle-5 or -6 kernel on the engine's tensors ``[query, key_cache, value_cache, block_tables,
    seq_lens, (cu_seqlens_q)]``: float32 data and int32 indices for the kernel, its answer in the query's dtype."""
    query, key_cache, value_cache, tables, *indices = tensors
    _, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    q, kc, vc = (t.float().contiguous() for t in (query, key_cache, value_cache))
    tables, *indices = (t.to(torch.int32).contiguous() for t in (tables, *indices))
    out = torch.empty_like(q)
    with launch.learner_dots(q.device) as options:
        kernel[grid](q, kc, vc, tables, *indices, out, float(scale), tables.stride(0), NUM_Q_HEADS=num_q_heads,
                     NUM_KV_HEADS=num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, **constexprs, **options)  # fmt: skip
    return out.to(query.dtype)


def decode_part(kernel: Any) -> Callable[..., torch.Tensor]:
    """The engine's ``paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)``
    launching a puzzle-5 kernel: plug it in with ``parts.use(paged_decode_attention=decode_part(my_kernel))``.
    The kernel sees float32 (the engine's fp16 and bf16 are converted for it, and its answer back)."""

    def paged_decode_attention(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        q_heads, kv_heads = query.shape[1], key_cache.shape[2]
        tensors = [query, key_cache, value_cache, block_tables, seq_lens]
        return _launch(kernel, (query.shape[0], kv_heads), tensors, scale, Q_ROWS=q_rows(q_heads, kv_heads))

    return paged_decode_attention


# ---- 6. prefill over a cached prefix ------------------------------------------------------------------------------
# (seq_lens, q_lens): the last q_len tokens of each sequence are new, the rest were cached by an earlier step.
PREFILL_SHAPES = (
    ("a fresh 20-token prompt, 13 new after 24 cached, one decode row: 4 query heads over 2 KV heads, blocks of 16",
     [20, 37, 9], [20, 13, 1], 16, 16, 4, 2, 0),
    ("a 40-token prompt whose first 32 are cached, and a 5-token chunk after 44: SmolLM2's 9 over 3, blocks of 32",
     [40, 49], [8, 5], 32, 16, 9, 3, 1),
    ("one 16-token prompt from scratch, head_dim 32, 2 heads each with its own KV head",
     [16], [16], 16, 32, 2, 2, 2),
)  # fmt: skip


def _prefill_cases() -> list[Case]:
    return [
        _attention_case(
            label,
            seq_lens,
            block_size,
            head_dim,
            seed,
            (q_heads, kv_heads),
            (len(seq_lens), q_heads),
            dict(NUM_Q_HEADS=q_heads, NUM_KV_HEADS=kv_heads, BLOCK_M=tile_rows(max(q_lens))),
            q_lens=q_lens,
            loads_per_element=q_heads // kv_heads,  # once per query head's program
        )
        for label, seq_lens, q_lens, block_size, head_dim, q_heads, kv_heads, seed in PREFILL_SHAPES
    ]


def prefill_part(kernel: Any) -> Callable[..., torch.Tensor]:
    """The engine's ``paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q,
    seq_lens, scale)`` launching a puzzle-6 kernel (float32 for the kernel, like ``decode_part``)."""

    def paged_prefill_attention(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if cu_seqlens_q.numel() > 1 else 1
        tensors = [query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q]
        grid = (seq_lens.shape[0], query.shape[1])
        return _launch(kernel, grid, tensors, scale, BLOCK_M=tile_rows(max_q_len))

    return paged_prefill_attention


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
        Puzzle(
            "split",
            "4a. Split-KV: each (sequence, segment) program keeps its segment's max, sum and output",
            (
                "query",
                "key_cache",
                "value_cache",
                "block_tables",
                "seq_lens",
                "part_max",
                "part_sum",
                "part_out",
                "scale",
                "table_stride",
                "BLOCKS_PER_SPLIT",
                "NUM_SPLITS",
                "BLOCK_SIZE",
                "HEAD_DIM",
            ),
            _split_cases,
            drawn=("key_cache", "load"),
        ),
        Puzzle(
            "merge",
            "4b. Merge: one program per sequence joins its segments' partial results",
            ("part_max", "part_sum", "part_out", "out", "NUM_SPLITS", "HEAD_DIM"),
            _merge_cases,
            drawn=("part_sum", "load"),
            axes=("sequence", "segment"),
        ),
        Puzzle(
            "gqa",
            "5. GQA packing: one program per (sequence, KV head) serves the G query heads with tl.dot",
            (
                "query",
                "key_cache",
                "value_cache",
                "block_tables",
                "seq_lens",
                "out",
                "scale",
                "table_stride",
                "NUM_Q_HEADS",
                "NUM_KV_HEADS",
                "Q_ROWS",
                "BLOCK_SIZE",
                "HEAD_DIM",
            ),
            _gqa_cases,
            drawn=("key_cache", "load"),
        ),
        Puzzle(
            "prefill",
            "6. Prefill: a causal tile of new tokens over the sequence's cached prefix",
            (
                "query",
                "key_cache",
                "value_cache",
                "block_tables",
                "seq_lens",
                "cu_seqlens_q",
                "out",
                "scale",
                "table_stride",
                "NUM_Q_HEADS",
                "NUM_KV_HEADS",
                "BLOCK_M",
                "BLOCK_SIZE",
                "HEAD_DIM",
            ),
            _prefill_cases,
            drawn=("key_cache", "load"),
        ),
    )
}


# ---- what a GPU would make of it ----------------------------------------------------------------------------------
# The shape every puzzle kernel is compiled for: SmolLM2's head_dim 64 and 9 query heads over 3 KV heads, blocks
# of 16, a 64-row prefill tile, 8 segments of 4 blocks (the engine's own shapes; the cases above are smaller).
COMPILE_SHAPE = dict(
    HEAD_DIM=64, BLOCK_SIZE=16, NUM_Q_HEADS=9, NUM_KV_HEADS=3, Q_ROWS=16, BLOCK_M=64, BLOCKS_PER_SPLIT=4, NUM_SPLITS=8
)


def compile_kernels(kernels: dict[str, Any], archs: tuple[str, ...] = ("sm_80", "sm_90")) -> list[Any]:
    """Compile each puzzle's kernel (``{"gqa": gqa_kernel, ...}``) for an NVIDIA GPU, without one: its registers,
    spills, shared memory and occupancy, with ``kernel_report``'s compiler in a fresh process (the interpreter
    stays on here). A kernel that does not compile gets a row with its error."""
    import textwrap

    from .kernel_report import SourceJob, compile_sources

    jobs = []
    for puzzle, kernel in kernels.items():
        p, fn = PUZZLES[puzzle], getattr(kernel, "fn", None)
        if fn is None:
            raise TypeError(f"{puzzle}: expected a @triton.jit kernel, got {type(kernel).__name__}")
        case = p.cases()[0]
        args: dict[str, Any] = {n: {"tensor": str(t.dtype).removeprefix("torch.")} for n, t in case.tensors.items()}
        args.update(case.scalars)
        args.update({k: v for k, v in COMPILE_SHAPE.items() if k in p.params})
        group = args["NUM_Q_HEADS"] // args["NUM_KV_HEADS"] if "NUM_Q_HEADS" in args else 1
        source = textwrap.dedent(inspect.getsource(fn))
        for arch in archs:
            jobs.append(SourceJob(fn.__name__, source, args, arch, head_dim=args["HEAD_DIM"],
                                  block_size=args.get("BLOCK_SIZE", 0), group=group))  # fmt: skip
    return compile_sources(jobs)


def describe(puzzle: str) -> str:
    """The puzzle's title, its kernel's first line and its cases: what a learner reads before writing it."""
    p = PUZZLES[puzzle]
    lines = [p.title, f"  @triton.jit\n  {signature(puzzle)}", "  cases:"]
    lines += [f"    {c.label}: grid {c.grid}" for c in p.cases()]
    return "\n".join(lines)


__all__ = ["PUZZLES", "Case", "Puzzle", "Result", "describe", "run", "signature", "verdict"]
