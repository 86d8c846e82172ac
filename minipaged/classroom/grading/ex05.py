"""Checks for exercise 05: paged decode attention in plain PyTorch.

The learner's ``paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)``
is run on seeded batches and compared, sequence by sequence, with
``minipaged.kernels.reference.paged_decode_attention`` on the same inputs. Each batch lives in a
shuffled pool whose block 0 is the null block (never given to a sequence, like vLLM's); a sequence's
spare block-table columns hold 0, a stale id or an id outside the pool, and every slot that no
sequence owns (free blocks, the null block, the unwritten tail of each last block) holds random
values, NaN or ±60000, so reading one shows in the result.

A check's result is one sentence: the expected one says the output matched; a wrong one names the
first sequence that differs (its ``seq_len``, the query heads, one element) or what else went wrong
(shape, dtype, NaN, modified inputs). Tolerances, elementwise ``|got − want| <= atol + rtol·|want|``,
the reference's output being float32 math rounded to the query's dtype:

    float32   atol 1e-5, rtol 1e-5   (summing in another order moves the last few bits)
    float16   atol 1e-3, rtol 1e-3   (one fp16 unit in the last place is 2^-11 below 1.0, 2^-10 up to 2)
    bfloat16  atol 1e-2, rtol 1e-2   (one bf16 unit is 2^-8 below 1.0, 2^-7 up to 2)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ...kernels import reference
from ...utils import cdiv
from .core import Check, CheckOutcome, report

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_FILL_NAMES = {"random": "random values", "nan": "NaN", "huge": "±60000"}

_HINT_DECODE = (
    "'got' names the first wrong sequence and its wrong query heads: if only some heads differ, look "
    "at which KV head each query head reads when several share one (GQA); if whole sequences differ, "
    "look at which tokens they read through their table (how many, and the last block's unwritten "
    "tail) and at where the softmax runs (chapter 05, sections 2 and 5)"
)
_HINT_EDGES = (
    "the label says what is special: read only what the sequence owns, table columns and slots alike "
    "(a masked score does not stop a NaN value), use the scale you are given, mind how far fp16 "
    "reaches, and return the query's dtype and shape, also for an empty batch (chapter 05, section 2)"
)


@dataclass(frozen=True)
class _Case:
    """One decode batch: the sequences' lengths, the pool's shape, and what fills everything else."""

    label: str
    seq_lens: tuple[int, ...]
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int
    spare: str = "null"  # unused table columns: "null" (block 0), "stale" (any block id), "out_of_range"
    fill: str = "random"  # slots no sequence owns: "random", "nan" or "huge" (±60000)
    extra_cols: int = 2  # table columns beyond the longest sequence's blocks
    free_blocks: int = 3  # blocks of the pool nobody holds, besides the null block
    scale: float | None = None  # None: head_dim ** -0.5
    shift: float = 0.0  # added to query and keys (large activations)

    @property
    def the_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def num_blocks(self) -> int:
        return 1 + sum(cdiv(n, self.block_size) for n in self.seq_lens) + self.free_blocks

    @property
    def max_blocks(self) -> int:
        return max((cdiv(n, self.block_size) for n in self.seq_lens), default=0) + self.extra_cols

    def describe(self, tables: torch.Tensor | None = None) -> str:
        dt = _DTYPE_NAMES[self.dtype]
        s, hq, hk, d = len(self.seq_lens), self.num_q_heads, self.num_kv_heads, self.head_dim
        bt = (
            f"block_tables {tables.tolist()}"
            if tables is not None and tables.numel() <= 16
            else f"block_tables int32 [{s}, {self.max_blocks}]"
        )
        return (
            f"paged_decode_attention(query [{s}, {hq}, {d}] {dt}, caches [{self.num_blocks}, {self.block_size}, "
            f"{hk}, {d}] {dt}, {bt}, seq_lens {list(self.seq_lens)}, scale {self.the_scale:.4g})  # {self.label}"
        )

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """query, key_cache, value_cache, block_tables (int32), seq_lens (int32), scale."""
        g = torch.Generator().manual_seed(self.seed)
        bs, nb = self.block_size, self.num_blocks
        free = (torch.randperm(nb - 1, generator=g) + 1).tolist()  # block 0 is the null block
        tables = torch.zeros(len(self.seq_lens), self.max_blocks, dtype=torch.int32)
        owned = torch.zeros(nb, bs, dtype=torch.bool)
        for i, n in enumerate(self.seq_lens):
            need = cdiv(n, bs)
            ids, free = free[:need], free[need:]
            tables[i, :need] = torch.tensor(ids, dtype=torch.int32)
            for p in range(n):
                owned[ids[p // bs], p % bs] = True
            spare = self.max_blocks - need
            if spare and self.spare == "stale":
                tables[i, need:] = torch.randint(0, nb, (spare,), generator=g, dtype=torch.int32)
            elif spare and self.spare == "out_of_range":
                tables[i, need:] = torch.tensor(
                    [-1 if j % 2 == 0 else nb + 1000 for j in range(spare)], dtype=torch.int32
                )
        shape = (nb, bs, self.num_kv_heads, self.head_dim)
        query = torch.randn(len(self.seq_lens), self.num_q_heads, self.head_dim, generator=g) + self.shift
        key_cache = torch.randn(shape, generator=g) + self.shift
        value_cache = torch.randn(shape, generator=g)
        if self.fill == "nan":
            key_cache[~owned] = float("nan")
            value_cache[~owned] = float("nan")
        elif self.fill == "huge":  # drawn after everything else: the owned slots are the same as with "random"
            key_cache[~owned] = 6e4 * torch.randn(shape, generator=g).sign()[~owned]
            value_cache[~owned] = 6e4 * torch.randn(shape, generator=g).sign()[~owned]
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        return (
            query.to(self.dtype),
            key_cache.to(self.dtype),
            value_cache.to(self.dtype),
            tables,
            seq_lens,
            self.the_scale,
        )


def _verdict(case: _Case, got: object, want: torch.Tensor, untouched: bool = True) -> str:
    """One sentence: the expected one when ``got`` matches ``want``, else the first thing that is wrong."""
    atol, rtol = TOLERANCES[case.dtype]
    if not isinstance(got, torch.Tensor):
        return f"returned a {type(got).__name__}, not a torch.Tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"output shape {list(got.shape)}, expected {list(want.shape)} ([num_seqs, num_q_heads, head_dim])"
    if got.dtype != want.dtype:
        return (
            f"output dtype {str(got.dtype).replace('torch.', '')}, expected "
            f"{str(want.dtype).replace('torch.', '')}: the query's dtype (compute in float32, then cast back)"
        )
    if not untouched:
        return "the inputs were modified: attention must only read query, the caches, block_tables and seq_lens"
    wrong = []
    for i, n in enumerate(case.seq_lens):
        g, w = got[i].float(), want[i].float()
        bad = ~torch.isclose(g, w, rtol=rtol, atol=atol)
        if not bool(bad.any()):
            continue
        heads = bad.any(-1).nonzero().flatten().tolist()
        h = heads[0]
        d = int(bad[h].nonzero()[0, 0])
        msg = (
            f"sequence {i} (seq_len {n}): query head(s) {heads} differ from the reference, e.g. "
            f"out[{i}, {h}, {d}] is {float(g[h, d]):.4g} instead of {float(w[h, d]):.4g}"
        )
        if not bool(torch.isfinite(g).all()):
            msg += (
                "; NaN or inf came out: a slot the sequence does not own was read, or a score overflowed "
                "(float16 tops out at 65504)"
            )
        wrong.append(msg)
    if wrong:
        more = f" (and {len(wrong) - 1} more sequence(s) wrong)" if len(wrong) > 1 else ""
        return wrong[0] + more
    return (
        f"output {list(want.shape)} {str(want.dtype).replace('torch.', '')}: all {len(case.seq_lens)} "
        f"sequence(s) match the reference (atol {atol:g}, rtol {rtol:g})"
    )


def _run(fn: PagedDecode, case: _Case) -> str:
    """Run ``fn`` on the case's inputs and judge its output against the reference's."""
    inputs = case.inputs()
    query, key_cache, value_cache, block_tables, seq_lens, scale = inputs
    want = reference.paged_decode_attention(
        query.clone(), key_cache.clone(), value_cache.clone(), block_tables.clone(), seq_lens.clone(), scale
    )
    before = [x.clone() for x in inputs[:5]]
    got = fn(*inputs)  # an exception is a failed check: core.run_check reports it
    untouched = all(
        torch.equal(a, b)
        or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
        for a, b in zip(inputs[:5], before)
    )
    return _verdict(case, got, want, untouched)


def _run_fills(fn: PagedDecode, case: _Case, fills: tuple[str, ...]) -> str:
    """The same batch with its unowned slots filled differently each time: the output must not change."""
    for fill in fills:
        verdict = _run(fn, replace(case, fill=fill))
        expected = _expected(replace(case, fill=fill))
        if verdict != expected:
            return f"with the unowned slots holding {_FILL_NAMES[fill]}: {verdict}"
    return (
        f"the same output, matching the reference, whether the unowned slots hold "
        f"{', '.join(_FILL_NAMES[f] for f in fills)}"
    )


def _expected(case: _Case) -> str:
    """The reference's verdict on itself: what a correct function produces."""
    return _run(reference.paged_decode_attention, case)


def _decode_cases() -> list[_Case]:
    f32, f16 = torch.float32, torch.float16
    return [
        _Case(
            "one sequence holding just its new token: one score, softmax 1, the output is that token's V",
            (1,),
            4,
            2,
            2,
            8,
            f32,
            seed=1,
        ),
        _Case(
            "lengths 1, 4, 5, 13 with block_size 4: a full block, one token into the next, a longer one; "
            "4 query heads over 4 KV heads (MHA)",
            (1, 4, 5, 13),
            4,
            4,
            4,
            16,
            f32,
            seed=2,
        ),
        _Case(
            "lengths 1, 16, 17, 50 with block_size 16, MHA, stale ids in the spare table columns",
            (1, 16, 17, 50),
            16,
            4,
            4,
            32,
            f16,
            seed=3,
            spare="stale",
        ),
        _Case(
            "SmolLM2's layer: 9 query heads over 3 KV heads (G = 3), head_dim 64, block_size 16",
            (1, 16, 17, 61),
            16,
            9,
            3,
            64,
            f32,
            seed=4,
        ),
        _Case(
            "SmolLM2's layer in fp16, stale ids in the spare table columns",
            (33, 5, 16, 120),
            16,
            9,
            3,
            64,
            f16,
            seed=5,
            spare="stale",
        ),
        _Case("MQA: 8 query heads over 1 KV head, block_size 4", (3, 4, 5, 22), 4, 8, 1, 32, f32, seed=6),
        _Case("MQA in fp16, block_size 16", (2, 31, 47), 16, 8, 1, 64, f16, seed=7),
        _Case(
            "a long sequence (300 tokens over 19 blocks of 16) beside a 1-token one; 8 query heads over 2 KV "
            "heads (G = 4), head_dim 128",
            (300, 1),
            16,
            8,
            2,
            128,
            f16,
            seed=8,
        ),
    ]


def _edge_cases() -> list[_Case]:
    f32, f16 = torch.float32, torch.float16
    return [
        _Case(
            "spare table columns point at the null block 0, which holds NaN, as does every slot no sequence owns "
            "(free blocks, the tails of last blocks)",
            (1, 3, 4, 9),
            4,
            9,
            3,
            16,
            f32,
            seed=11,
            fill="nan",
        ),
        _Case(
            "spare table columns hold ids outside the pool (-1 and num_blocks + 1000); unowned slots hold NaN",
            (16, 5, 40),
            16,
            4,
            2,
            32,
            f16,
            seed=12,
            spare="out_of_range",
            fill="nan",
        ),
        _Case(
            "a sequence using every column of its table (no spare column), block_size 1: every token in its own "
            "block; unowned slots hold NaN",
            (7, 3),
            1,
            4,
            2,
            16,
            f32,
            seed=13,
            extra_cols=0,
            fill="nan",
        ),
        _Case(
            "fp16 activations near 30, head_dim 128: q·k ≈ 115000 overflows fp16 (max 65504), so compute the "
            "scores in float32",
            (5, 20, 37),
            16,
            4,
            2,
            128,
            f16,
            seed=14,
            shift=30.0,
            scale=0.005,
        ),
        _Case(
            "scale 0.05, not head_dim ** -0.5: use the scale passed in", (6, 11), 4, 2, 2, 16, f32, seed=15, scale=0.05
        ),
        _Case("bfloat16 query and caches: the output is bfloat16 too", (9, 2), 4, 6, 2, 32, torch.bfloat16, seed=16),
        _Case(
            "an empty batch (num_seqs 0): an empty [0, num_q_heads, head_dim] tensor of the query's dtype",
            (),
            4,
            4,
            2,
            16,
            f16,
            seed=17,
            extra_cols=1,
        ),
    ]


_INDEPENDENCE = _Case(
    "the result does not depend on the garbage: one batch, its unowned slots (null block, free "
    "blocks, tails of last blocks) random, then NaN, then ±60000",
    (1, 15, 17, 33),
    16,
    9,
    3,
    32,
    torch.float16,
    seed=18,
)
_FILLS = ("random", "nan", "huge")


def _check(fn: PagedDecode, case: _Case, hint: str) -> Check:
    tables = case.inputs()[3]
    return Check(case.describe(tables), lambda: _run(fn, case), _expected(case), hint=hint)


def check_paged_decode(paged_decode_attention: PagedDecode) -> list[CheckOutcome]:
    """Lengths 1 to 300, block sizes 4 and 16, MHA, GQA (9 over 3, 8 over 2) and MQA, fp32 and fp16."""
    return report("paged_decode", [_check(paged_decode_attention, c, _HINT_DECODE) for c in _decode_cases()])


def check_paged_decode_edges(paged_decode_attention: PagedDecode) -> list[CheckOutcome]:
    """Garbage (NaN, out-of-range ids) that must not be read, overflow, scale, bf16, an empty batch."""
    checks = [_check(paged_decode_attention, c, _HINT_EDGES) for c in _edge_cases()]
    case = _INDEPENDENCE
    checks.append(
        Check(
            case.describe(case.inputs()[3]),
            lambda: _run_fills(paged_decode_attention, case, _FILLS),
            _run_fills(reference.paged_decode_attention, case, _FILLS),
            hint=_HINT_EDGES,
        )
    )
    return report("paged_decode_edges", checks)
