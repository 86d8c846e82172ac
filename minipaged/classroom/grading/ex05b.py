"""Checks for exercise 05b: the paged scatter-write (``reshape_and_cache``) as a Triton kernel.

The learner's ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)`` launches
their ``@triton.jit`` kernel; each check builds a small pool, runs it, and compares the whole
cache, byte for byte, with what ``minipaged.kernels.reference.reshape_and_cache`` writes. The
caches handed over are views into a larger buffer with one guard block on each side, so a
write before the first slot (a padding token's slot -1 taken for a real one) or past the last
one is caught too. A check's result is one sentence: the expected one says how many tokens
were written and skipped; a wrong one names the first slot that differs and why.

Where the learner's kernel runs is ``kernels.launch.kernel_device()``: on a CUDA GPU it is compiled and every
tensor a check hands to the wrapper is on ``cuda``; elsewhere Triton's interpreter runs it on CPU tensors (import
``minipaged.kernels`` before ``triton``), one program after another in numpy, so the pools are kept small. The
reference always runs on the CPU and the caches come back with ``.cpu()`` to be compared. A launch that fails
because a tensor is on the wrong device is reported as that, without the hints about addressing.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...kernels import launch, reference
from ...utils import cdiv
from ...worker.block_table import slot_mapping as reference_slot_mapping
from .core import Check, CheckOutcome, report

ReshapeAndCache = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16"}
_HINT_WRITE = (
    "'got' names the first wrong slot and what it holds (never written, another token's K or V, some "
    "heads wrong): look at how a token's slot becomes a place in the pool, at which program handles "
    "which token, and at tiles when the heads or head_dim are not powers of two (chapter 05, section "
    "3)"
)
_HINT_EDGES = (
    "the label says what is special: a padding token must not touch memory at all, not even to compute "
    "an address; here key/value or the caches are views (a slice of a fused qkv tensor, a heads-major "
    "cache), so ask which of the numbers passed to your kernel describe their layout in memory (chapter 05, section 3)"
)


@dataclass
class _Case:
    """One scatter-write to try: the new tokens' K/V, their slots, and the pool's shape."""

    label: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    slots: list[int]
    seed: int
    slot_dtype: torch.dtype = torch.int64
    fused_q_heads: int = 0  # > 0: key/value are views into a fused [tokens, q + 2·kv heads, d] tensor
    heads_major_cache: bool = False  # the cache lives as [blocks, heads, block_size, d] and is viewed permuted
    notes: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.slots)

    def describe(self) -> str:
        dt = _DTYPE_NAMES[self.dtype]
        n, h, d = self.num_tokens, self.num_kv_heads, self.head_dim
        kv = f"key/value [{n}, {h}, {d}] {dt}" + (" (views of a fused qkv tensor)" if self.fused_q_heads else "")
        cache = f"caches [{self.num_blocks}, {self.block_size}, {h}, {d}]" + (
            " stored heads-major" if self.heads_major_cache else ""
        )
        sm = "int32" if self.slot_dtype == torch.int32 else "int64"
        return f"reshape_and_cache({kv}, {cache}, slot_mapping {sm} [{n}])  # {self.label}"

    def inputs(
        self, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """key, value, the two guarded cache buffers (num_blocks + 2 blocks) and the slot mapping, on ``device``:
        drawn on the CPU (the same numbers everywhere), then moved whole, so views stay views there."""
        g = torch.Generator().manual_seed(self.seed)
        n, h, d = self.num_tokens, self.num_kv_heads, self.head_dim
        if self.fused_q_heads:
            qkv = torch.randn(n, self.fused_q_heads + 2 * h, d, generator=g).to(device, self.dtype)
            key = qkv[:, self.fused_q_heads : self.fused_q_heads + h]
            value = qkv[:, self.fused_q_heads + h :]
        else:
            key = torch.randn(n, h, d, generator=g).to(device, self.dtype)
            value = torch.randn(n, h, d, generator=g).to(device, self.dtype)
        # Whatever the pool held before: values far from the new tokens' (randn), so no write goes unseen.
        shape = (
            (self.num_blocks + 2, h, self.block_size, d)
            if self.heads_major_cache
            else (self.num_blocks + 2, self.block_size, h, d)
        )
        k_buf = (torch.rand(shape, generator=g) * 10 + 20).to(device, self.dtype)
        v_buf = (torch.rand(shape, generator=g) * 10 - 30).to(device, self.dtype)
        return key, value, k_buf, v_buf, torch.tensor(self.slots, dtype=self.slot_dtype, device=device)

    def cache_view(self, buf: torch.Tensor) -> torch.Tensor:
        """The cache the kernel sees: the buffer minus its two guard blocks, [blocks, block_size, heads, d]."""
        inner = buf[1:-1]
        return inner.permute(0, 2, 1, 3) if self.heads_major_cache else inner


def _logical(case: _Case, buf: torch.Tensor) -> torch.Tensor:
    """The whole buffer (guards included) as [num_blocks + 2, block_size, heads, d]."""
    return buf.permute(0, 2, 1, 3) if case.heads_major_cache else buf


@dataclass
class _Launches:
    """What :func:`_count_triton_launches` saw: the grids launched, and whether it could see at all.

    ``unavailable`` is empty when a launch would have been counted; otherwise it says why not (this
    Triton has neither hook), and the check fails saying so: without a count it cannot tell a Triton
    kernel from PyTorch indexing, and a check must never pass on a count that was never taken."""

    grids: list[Any] = field(default_factory=list)
    hook: str = ""  # what counted: "run" (the usual hook), "__getitem__" (the fallback), "" (nothing patched)
    unavailable: str = ""

    def __len__(self) -> int:
        return len(self.grids)


def _run_hook_classes() -> list[Any]:
    """The kernel classes whose ``run`` every launch goes through: interpreted and compiled kernels.

    Private Triton API (``triton.runtime.interpreter.InterpretedFunction``, ``JITFunction.run``): an
    empty list when either class or its ``run`` is gone, and :func:`_count_triton_launches` falls back."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    classes = [InterpretedFunction, JITFunction]
    # Each must define run itself: patching an inherited stub (KernelInterface.run) would count nothing.
    return classes if all(callable(cls.__dict__.get("run")) for cls in classes) else []


def _getitem_hook_class() -> Any:
    """The base class whose ``__getitem__`` makes ``kernel[grid]`` (Triton's ``KernelInterface``), or None."""
    import triton.runtime

    cls = getattr(triton.runtime, "KernelInterface", None)
    return cls if isinstance(cls, type) and callable(getattr(cls, "__getitem__", None)) else None


def _counting_run(original: Any, seen: _Launches) -> Any:
    """``run`` that records the launch's grid, then launches."""

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.grids.append(kwargs.get("grid"))
        return original(self, *args, **kwargs)

    return run


def _counting_getitem(original: Any, seen: _Launches) -> Any:
    """``__getitem__`` whose launcher (``kernel[grid]``) records the grid when it is called, then launches."""

    def getitem(self: Any, grid: Any) -> Any:
        launcher = original(self, grid)

        def launch(*args: Any, **kwargs: Any) -> Any:
            seen.grids.append(grid)
            return launcher(*args, **kwargs)

        return launch

    return getitem


@contextmanager
def _count_triton_launches() -> Iterator[_Launches]:
    """Count kernel launches (``kernel[grid](...)``), interpreted or compiled, while the block runs.

    The usual hook wraps ``run`` of both kernel classes (``kernel[grid](...)`` calls ``run``); where
    Triton no longer has them, ``KernelInterface.__getitem__`` (the ``kernel[grid]`` itself); where
    that is gone too, ``unavailable`` says so. Without triton installed nothing can launch: zero
    launches is then a true count."""
    seen = _Launches()
    wrappers: list[tuple[Any, str, Any]] = []  # (class, attribute, its counting replacement)
    try:
        import triton
    except ImportError:
        triton = None
    if triton is not None:
        run_classes = _run_hook_classes()
        getitem_class = None if run_classes else _getitem_hook_class()
        if run_classes:
            seen.hook = "run"
            wrappers = [(cls, "run", _counting_run(cls.run, seen)) for cls in run_classes]
        elif getitem_class is not None:
            seen.hook = "__getitem__"
            wrappers = [(getitem_class, "__getitem__", _counting_getitem(getitem_class.__getitem__, seen))]
        else:
            seen.unavailable = (
                f"this Triton ({getattr(triton, '__version__', '?')}) has neither InterpretedFunction/JITFunction"
                ".run nor KernelInterface.__getitem__ to count launches with"
            )
    # What each class held itself (an inherited attribute is restored by deleting the patch, not copying it).
    saved = [(cls, name, cls.__dict__.get(name)) for cls, name, _ in wrappers]
    try:
        for cls, name, wrapper in wrappers:
            setattr(cls, name, wrapper)
        yield seen
    finally:
        for cls, name, own in saved:
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)


def _learner_frame(exc: BaseException) -> str:
    """' (line N of f: `code`)' for the deepest frame outside triton, torch and minipaged, if any."""
    skip = [
        os.sep + "triton" + os.sep,
        os.sep + "torch" + os.sep,
        os.sep + "minipaged" + os.sep,
        "site-packages",
        os.sep + "lib" + os.sep + "python",
    ]
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(s in f.filename for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    code = f" `{f.line.strip()}`" if f.line else ""
    return f" (line {f.lineno} of {f.name}:{code})"


def _unwrap(exc: BaseException) -> BaseException:
    """The interpreter wraps an error raised inside a kernel in an InterpreterError: find the original."""
    seen = 0
    while type(exc).__name__ == "InterpreterError" and exc.__cause__ is not None and seen < 10:
        exc, seen = exc.__cause__, seen + 1
    return exc


def _holds_instead(tile: torch.Tensor, before: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str:
    """What a wrong [heads, d] tile holds, when it is something recognisable."""
    if torch.equal(tile, before):
        return "it was never written"
    for name, src in (("key", key), ("value", value)):
        same = (src == tile).flatten(1).all(-1).nonzero().flatten().tolist()
        if same:
            return f"it holds token {same[0]}'s {name}"
    return ""


def _verdict(
    case: _Case,
    new: tuple[torch.Tensor, torch.Tensor],
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    before: tuple[torch.Tensor, torch.Tensor],
    untouched_inputs: bool = True,
) -> str:
    """One sentence: the expected one when the buffers equal the reference's, else the first difference."""
    real = sum(s >= 0 for s in case.slots)
    if not untouched_inputs:
        return "the inputs key/value were modified: the kernel must only read them"
    key, value = new
    by_slot = {s: t for t, s in enumerate(case.slots) if s >= 0}
    padded = [t for t, s in enumerate(case.slots) if s < 0]
    problems: list[tuple[int, str]] = []
    for name, got_buf, want_buf, before_buf in zip(("key", "value"), got, want, before):
        got_l, want_l, before_l = (_logical(case, x) for x in (got_buf, want_buf, before_buf))
        diff = (got_l != want_l).any(-1)  # [blocks + 2, block_size, heads]
        for block, offset in diff.any(-1).nonzero().tolist():  # every (buffer block, offset) that differs
            g, w = got_l[block, offset], want_l[block, offset]
            instead = _holds_instead(g, before_l[block, offset], key, value)
            if block == 0:
                where = (
                    f"the guard block just before {name}_cache (offset {offset}) was written: that is slot -1 "
                    f"and below, so a padding token was stored" + (f" (padding tokens: {padded})" if padded else "")
                )
                problems.append((case.num_tokens, where + (f"; {instead}" if instead else "")))
                continue
            if block == case.num_blocks + 1:
                problems.append(
                    (
                        case.num_tokens,
                        f"the guard block just after {name}_cache (offset {offset}) was "
                        f"written: past the last slot of the pool",
                    )
                )
                continue
            slot = (block - 1) * case.block_size + offset
            cell = f"{name}_cache[{block - 1}, {offset}] (slot {slot})"
            if slot in by_slot:
                t = by_slot[slot]
                heads = diff[block, offset].nonzero().flatten().tolist()
                h = heads[0]
                d = int((g[h] != w[h]).nonzero()[0, 0])
                msg = (
                    f"{cell} should hold token {t}'s {name}: KV head(s) {heads} differ, e.g. [{h}, {d}] is "
                    f"{float(g[h, d]):.4g} instead of {float(w[h, d]):.4g}"
                )
                problems.append((t, msg + (f"; {instead}" if instead else "")))
            else:
                problems.append(
                    (
                        case.num_tokens,
                        f"{cell} was changed but no token maps there" + (f"; {instead}" if instead else ""),
                    )
                )
    if not problems:
        return (
            f"all {real} token(s) written to their slots, {case.num_tokens - real} padding token(s) skipped, "
            f"nothing else touched"
        )
    problems.sort(key=lambda p: p[0])
    more = f" (and {len(problems) - 1} more wrong slot(s))" if len(problems) > 1 else ""
    return problems[0][1] + more


def _run(fn: ReshapeAndCache, case: _Case) -> str:
    key0, value0, k_before, v_before, slots0 = case.inputs()  # on the CPU: the reference's inputs, and the baseline
    before = (k_before, v_before)
    want = (k_before.clone(), v_before.clone())
    reference.reshape_and_cache(key0, value0, case.cache_view(want[0]), case.cache_view(want[1]), slots0)
    key, value, k_buf, v_buf, slots = case.inputs(launch.kernel_device())  # where the learner's kernel runs
    try:
        with _count_triton_launches() as launches:
            fn(key, value, case.cache_view(k_buf), case.cache_view(v_buf), slots)
    except Exception as exc:
        inner = _unwrap(exc)
        if isinstance(inner, NotImplementedError):
            raise NotImplementedError from None  # core.report explains the stub
        return launch.device_problem(inner) or f"{type(inner).__name__}: {inner}{_learner_frame(inner)}"
    got = (k_buf.cpu(), v_buf.cpu())
    untouched = torch.equal(key.cpu(), key0) and torch.equal(value.cpu(), value0)
    if launches.unavailable:  # never a pass: the check cannot see whether a Triton kernel did the writing
        verdict = _verdict(case, (key0, value0), got, want, before, untouched)
        return (
            f"launch counting is unavailable ({launches.unavailable}), so this check cannot pass; the caches: {verdict}"
        )
    if not launches:
        return "no Triton kernel ran: write the @triton.jit kernel and launch it (not PyTorch indexing)"
    return _verdict(case, (key0, value0), got, want, before, untouched)


def _check(fn: ReshapeAndCache, case: _Case, hint: str) -> Check:
    """One case as a check. Its hint is dropped when the launch failed over where a tensor lives: padding and
    strides have nothing to do with it, and would send a learner with a right kernel hunting for a bug."""
    check = Check(case.describe(), lambda: None, _expected(case), hint=hint)

    def run() -> str:
        got = _run(fn, case)
        if got.startswith(launch.DEVICE_PROBLEM):
            check.hint = ""
        return got

    check.run = run
    return check


def _expected(case: _Case) -> str:
    """The reference's own verdict on itself: what a correct kernel produces."""
    key, value, k_buf, v_buf, slots = case.inputs()
    before = (k_buf.clone(), v_buf.clone())
    reference.reshape_and_cache(key, value, case.cache_view(k_buf), case.cache_view(v_buf), slots)
    return _verdict(case, (key, value), (k_buf, v_buf), (k_buf, v_buf), before)


def _shuffled_slots(
    num_blocks: int, block_size: int, lens: list[int], seed: int, skip_blocks: int = 1
) -> tuple[list[list[int]], list[int]]:
    """Prefill ``lens`` tokens per sequence through block tables drawn as a shuffled permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    free = (torch.randperm(num_blocks - skip_blocks, generator=g) + skip_blocks).tolist()
    tables = []
    for n in lens:
        need = cdiv(n, block_size)
        tables.append(free[:need])
        free = free[need:]
    slots = reference_slot_mapping(tables, [list(range(n)) for n in lens], block_size).tolist()
    return tables, slots


def _write_cases() -> list[_Case]:
    cases = []
    cases.append(
        _Case(
            "one decode token at block 5, offset 9; block_size 16, 1 KV head",
            8,
            16,
            1,
            64,
            torch.float32,
            [5 * 16 + 9],
            seed=1,
        )
    )
    seed_tables, seed_positions = [[19, 18, 5], [7], [3, 8]], [[8, 9, 10], [2], [5]]
    cases.append(
        _Case(
            "chapter 04's batch: a 3-token prefill chunk and two decodes, tables [[19, 18, 5], [7], "
            "[3, 8]], block_size 4",
            20,
            4,
            2,
            16,
            torch.float32,
            reference_slot_mapping(seed_tables, seed_positions, 4).tolist(),
            seed=2,
        )
    )
    cases.append(
        _Case(
            "a 50-token prefill through table [42, 17, 88, 5], block_size 16 (the last block part-full)",
            96,
            16,
            4,
            32,
            torch.float16,
            reference_slot_mapping([[42, 17, 88, 5]], [list(range(50))], 16).tolist(),
            seed=3,
        )
    )
    _, slots = _shuffled_slots(12, 16, [21, 16, 9], seed=4)
    cases.append(
        _Case(
            "SmolLM2's layer: 3 KV heads (not a power of 2), 3 prompts of 21, 16 and 9 tokens over a shuffled pool",
            12,
            16,
            3,
            64,
            torch.float16,
            slots,
            seed=4,
        )
    )
    _, slots = _shuffled_slots(6, 32, [40, 33], seed=5)
    cases.append(
        _Case(
            "8 KV heads, head_dim 128, block_size 32 (Llama-3-8B's layer), prompts of 40 and 33 tokens",
            6,
            32,
            8,
            128,
            torch.float32,
            slots,
            seed=5,
        )
    )
    _, slots = _shuffled_slots(8, 16, [30, 7], seed=6)
    cases.append(
        _Case("head_dim 80 (not a power of 2), 2 KV heads, block_size 16", 8, 16, 2, 80, torch.float16, slots, seed=6)
    )
    g = torch.Generator().manual_seed(7)
    cases.append(
        _Case(
            "block_size 1: every token in its own block, 24 tokens, shuffled",
            32,
            1,
            2,
            32,
            torch.float32,
            (torch.randperm(31, generator=g)[:24] + 1).tolist(),
            seed=7,
        )
    )
    g = torch.Generator().manual_seed(8)
    cases.append(
        _Case(
            "64 tokens sent to random slots of the pool (any slot, any order), block_size 8",
            16,
            8,
            2,
            32,
            torch.float16,
            torch.randperm(16 * 8, generator=g)[:64].tolist(),
            seed=8,
        )
    )
    return cases


def _edge_cases() -> list[_Case]:
    cases = []
    _, slots = _shuffled_slots(10, 16, [5], seed=11)
    cases.append(
        _Case(
            "a batch padded to 8 tokens: 5 real tokens, then 3 padding tokens (slot -1)",
            10,
            16,
            2,
            32,
            torch.float32,
            slots + [-1, -1, -1],
            seed=11,
        )
    )
    _, slots = _shuffled_slots(10, 4, [6, 3], seed=12)
    cases.append(
        _Case(
            "padding tokens in the middle of the batch, slot_mapping int32",
            10,
            4,
            2,
            32,
            torch.float16,
            slots[:3] + [-1, -1] + slots[3:7] + [-1] + slots[7:],
            seed=12,
            slot_dtype=torch.int32,
        )
    )
    cases.append(
        _Case(
            "one real token among 15 padding tokens",
            6,
            8,
            1,
            64,
            torch.float32,
            [-1] * 7 + [3 * 8 + 2] + [-1] * 8,
            seed=13,
        )
    )
    _, slots = _shuffled_slots(12, 16, [20, 11], seed=14)
    cases.append(
        _Case(
            "key and value sliced out of a fused qkv projection [31, 9 + 3 + 3 heads, 64]: token stride 960, not 192",
            12,
            16,
            3,
            64,
            torch.float32,
            slots,
            seed=14,
            fused_q_heads=9,
        )
    )
    cases.append(
        _Case(
            "a cache stored heads-major ([blocks, heads, block_size, d] in memory) and viewed as "
            "[blocks, block_size, heads, d]",
            6,
            8,
            4,
            32,
            torch.float16,
            _shuffled_slots(6, 8, [19, 6], seed=15)[1],
            seed=15,
            heads_major_cache=True,
        )
    )
    cases.append(
        _Case(
            "the pool's first and last slots (0 and num_blocks·block_size − 1) and their neighbours",
            5,
            16,
            2,
            32,
            torch.float32,
            [0, 1, 5 * 16 - 1, 5 * 16 - 2, 16, 15],
            seed=16,
        )
    )
    return cases


def check_scatter_write(reshape_and_cache: ReshapeAndCache) -> list[CheckOutcome]:
    """Block sizes 1-32, 1-8 KV heads, head_dim 16-128 (80 too), fp32 and fp16, shuffled pools."""
    checks = [_check(reshape_and_cache, c, _HINT_WRITE) for c in _write_cases()]
    return report("scatter_write", checks)


def check_scatter_edges(reshape_and_cache: ReshapeAndCache) -> list[CheckOutcome]:
    """Padding slots (-1) untouched, strided inputs and caches, the pool's first and last slots."""
    checks = [_check(reshape_and_cache, c, _HINT_EDGES) for c in _edge_cases()]
    return report("scatter_edges", checks)
