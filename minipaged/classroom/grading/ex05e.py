"""Checks for exercise 05e, the performance rung: paged decode attention for the whole batch at once.

The learner's ``batched_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)`` computes what
exercise 05's ``paged_decode_attention`` computes (the same checks grade it: ``check_paged_decode`` and
``check_paged_decode_edges`` are 05a's), with two targets on how it gets there, scored on the grader's own
measurement of the learner's code:

* ``check_launches``: the number of tensor operations a call runs does not grow with the number of sequences, nor
  with their length. On a CPU each operation costs microseconds of Python and dispatch before any arithmetic (on a
  GPU, a kernel launch): a loop over sequences or over blocks pays it per sequence or per block.
* ``check_traffic``: the bytes of every tensor the call allocates stay within ``TRAFFIC_TARGET`` times the batch's
  K and V gathered once in float32, padded to its longest sequence; and they do not depend on how big the pool is
  or how wide the block tables are. Decode reads every cached byte once per step and does a few FLOPs per byte
  (chapter 05, section 7): it is memory-bound, and a copy of the whole pool, an extra copy per query head or
  padding to the table's width multiplies its time.

Both are counted by ``CostMeter`` (a ``TorchDispatchMode``): every aten operation the call runs, and the bytes of
each result that is new memory (not a view of, or an in-place write into, a tensor that existed before). They are
properties of the code, not of the machine: the same on every CPU and every run, so the score cannot flake.
``speed_report`` times the learner's function beside the package's per-sequence reference and its batched
PyTorch path on the same batches; it prints, and scores nothing (wall time on a shared 2-core machine moves by
tens of percent between runs).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ...kernels import reference, torch_backend
from .core import Check, CheckOutcome, describe_error, report
from .ex05 import _Case, _verdict, check_paged_decode, check_paged_decode_edges

__all__ = ["check_launches", "check_paged_decode", "check_paged_decode_edges", "check_traffic", "speed_report"]

PagedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
TRAFFIC_TARGET = 3.0  # allocated bytes per byte of the batch's K and V gathered once in float32


class CostMeter(TorchDispatchMode):
    """Counts the aten operations run under it, by name, and the bytes of the new tensors they return."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket.__name__] += 1
        before = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if _dense(t)}
        for t in tree_flatten(out)[0]:
            if _dense(t) and t.untyped_storage().data_ptr() not in before:  # new memory, not a view or in place
                self.bytes += t.numel() * t.element_size()
        return out

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())


def _dense(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta"


def measure(fn: PagedDecode, case: _Case) -> tuple[int, int, Counter[str]] | str:
    """(operations, bytes allocated, operations by name) of one call on ``case``'s inputs, or what is wrong.

    Only a right answer is measured: its output is judged against the reference on the same batch first, so the
    values are checked at every length the cost checks use (up to 2,048 tokens, where exercise 05's cases stop at
    a few hundred: a split over chunks of 512 that merges them wrongly is exact below 512 and wrong beyond)."""
    args = case.inputs()
    query, key_cache, value_cache, tables, seq_lens, scale = args
    want = reference.paged_decode_attention(
        query.clone(), key_cache.clone(), value_cache.clone(), tables.clone(), seq_lens.clone(), scale
    )
    meter = CostMeter()
    try:
        with meter:
            got = fn(*args)
    except Exception as exc:  # a learner's error is an answer
        return describe_error(exc)
    verdict = _verdict(case, got, want)
    if verdict != _verdict(case, want, want):  # the sentence a right answer earns
        return f"wrong values on {case.label}, so its cost is not scored: {verdict}"
    return meter.num_ops, meter.bytes, meter.ops


def kv_bytes(case: _Case) -> int:
    """The batch's K and V gathered once in float32, padded to its longest sequence: the traffic's yardstick."""
    longest = max(case.seq_lens, default=0)
    return 2 * len(case.seq_lens) * longest * case.num_kv_heads * case.head_dim * 4


def _lengths(n: int, low: int, high: int, seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(low, high + 1, (n,), generator=g))


# SmolLM2's attention shape: 9 query heads over 3 KV heads of 64, blocks of 16.
BASE = _Case("SmolLM2's heads, 16 sequences of 64 to 512 tokens", _lengths(16, 64, 512, 1), 16, 9, 3, 64,
             torch.float32, seed=51, spare="stale", fill="random", extra_cols=2, free_blocks=3)  # fmt: skip


def _ratio(fn: PagedDecode, case: _Case) -> Any:
    m = measure(fn, case)
    return m if isinstance(m, str) else round(m[1] / kv_bytes(case), 2)


def check_launches(batched_decode: PagedDecode) -> list[CheckOutcome]:
    """Operations per call: the same for 64 sequences as for 8, and for 2,048 tokens as for 128."""
    few = replace(BASE, label="8 sequences", seq_lens=_lengths(8, 64, 512, 2))
    many = replace(BASE, label="64 sequences", seq_lens=_lengths(64, 64, 512, 3))
    short = replace(BASE, label="16 sequences of up to 128 tokens", seq_lens=_lengths(16, 16, 128, 4))
    long = replace(BASE, label="16 sequences of up to 2,048 tokens", seq_lens=_lengths(16, 256, 2048, 5))

    def grows(small: _Case, big: _Case) -> Callable[[], Any]:
        def run() -> Any:
            a, b = measure(batched_decode, small), measure(batched_decode, big)
            if isinstance(a, str) or isinstance(b, str):
                return a if isinstance(a, str) else b
            if b[0] <= a[0]:
                return "no more operations"
            extra = (b[2] - a[2]).most_common(3)
            return f"{a[0]} operations for {small.label}, {b[0]} for {big.label} (the most added: {extra})"

        return run

    return report(
        "launches",
        [
            Check("tensor operations per call: 64 sequences run no more than 8 do", grows(few, many),
                  "no more operations", hint="no Python loop over the sequences: index all of them at once"),
            Check("... and sequences of up to 2,048 tokens no more than sequences of up to 128", grows(short, long),
                  "no more operations", hint="no loop over blocks or positions: one gather for every position"),
        ],
    )  # fmt: skip


def check_traffic(batched_decode: PagedDecode) -> list[CheckOutcome]:
    """Bytes allocated per call, against the batch's K and V gathered once in float32."""
    half = replace(BASE, label="the same batch with a float16 cache", dtype=torch.float16)
    big_pool = replace(half, label="the float16 batch in a pool with 2,000 more free blocks", free_blocks=2003)
    wide = replace(BASE, label="the same batch with 96 spare block-table columns", extra_cols=96)

    def within(case: _Case) -> Callable[[], Any]:
        def run() -> Any:
            r = _ratio(batched_decode, case)
            return r if isinstance(r, str) else (f"within {TRAFFIC_TARGET:g}×" if r <= TRAFFIC_TARGET else f"{r}×")

        return run

    def same_as(tight: _Case, case: _Case) -> Callable[[], Any]:
        def run() -> Any:
            a, b = measure(batched_decode, tight), measure(batched_decode, case)
            if isinstance(a, str) or isinstance(b, str):
                return a if isinstance(a, str) else b
            return "no more bytes" if b[1] <= a[1] else f"{b[1] / a[1]:.2f}× the bytes of the tight pool"

        return run

    target = f"within {TRAFFIC_TARGET:g}×"
    return report(
        "traffic",
        [
            Check(f"{BASE.label}, float32: bytes allocated ≤ {TRAFFIC_TARGET:g}× its K and V gathered once",
                  within(BASE), target,
                  hint="gather each sequence's own K and V once; let the G query heads of a KV head share it"),
            Check(f"{big_pool.label}: no more bytes than in the tight pool", same_as(half, big_pool),
                  "no more bytes", hint="never copy or convert the whole cache: gather first, then .float()"),
            Check(f"{wide.label}: still ≤ {TRAFFIC_TARGET:g}×", within(wide), target,
                  hint="pad to the longest sequence, not to the table's width"),
            Check(f"{half.label}: still ≤ {TRAFFIC_TARGET:g}× (counted in float32)", within(half), target,
                  hint="convert what you gathered, not the cache"),
        ],
    )  # fmt: skip


def _package_batched(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The engine's PyTorch decode (its path where no compiled kernel runs), planned and batched."""
    cu = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    plan = torch_backend.plan_attention(block_tables, cu, seq_lens, key_cache.shape[1], False, None)
    return torch_backend.attend(plan, query, key_cache, value_cache, scale)


def _best_times(fns: dict[str, PagedDecode], args: tuple, reps: int) -> dict[str, float]:
    """The best time of each function over ``reps`` rounds, the functions taking turns within a round (so that a
    slow spell of the machine, or the allocator settling, touches all of them alike), after two rounds unmeasured."""
    best = dict.fromkeys(fns, float("inf"))
    for r in range(reps + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(*args)
            if r >= 2:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def speed_report(batched_decode: PagedDecode, reps: int = 5) -> dict[str, dict[str, float]]:
    """Time per call (the best of ``reps``, one thread) of yours, the package's per-sequence reference and its
    batched PyTorch path, on three batches; printed as a table and returned. Nothing here is scored."""
    cases = {
        "64 × up to 256": replace(BASE, seq_lens=_lengths(64, 16, 256, 6)),
        "16 × up to 2,048": replace(BASE, seq_lens=_lengths(16, 256, 2048, 7)),
        "4 × up to 4,096": replace(BASE, seq_lens=_lengths(4, 1024, 4096, 8)),
    }
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each, so that the three compare on equal terms
    fns: dict[str, PagedDecode] = {"yours": batched_decode, "per-sequence reference": reference.paged_decode_attention,
                                   "package, batched": _package_batched}  # fmt: skip
    inputs = {name: case.inputs() for name, case in reversed(cases.items())}
    try:
        # One unmeasured call of each on every batch, the largest first: the C allocator keeps big blocks for reuse
        # only after it has given one back, and a first call that faults in fresh pages is not the code's speed.
        for args in inputs.values():
            for fn in fns.values():
                fn(*args)
        rows = {}
        for name in cases:
            rows[name] = _best_times(fns, inputs[name], reps)
    finally:
        torch.set_num_threads(threads)
    print(f"{'batch':<18}{'yours':>10}{'per-sequence':>14}{'package batched':>17}   yours vs per-sequence")
    for name, r in rows.items():
        print(f"{name:<18}{r['yours'] * 1e3:>8.2f}ms{r['per-sequence reference'] * 1e3:>12.2f}ms"
              f"{r['package, batched'] * 1e3:>15.2f}ms   {r['per-sequence reference'] / r['yours']:.1f}× faster")  # fmt: skip
    return rows
