"""Checks for exercise 02: the free holes of a contiguous arena, and how much of it is wasted.

The arena states are made by the package's own ``ContiguousAllocator`` (seeded
allocate/free sequences, and steps of a simulated trace), and the expected
values are read from it: ``free_extents``, ``num_reserved_slots``,
``unusable_free_slots``. A learner's function gets only the reservations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...lab.contiguous import ContiguousAllocator, simulate_trace
from ...lab.workloads import sharegpt_like_trace
from .core import Check, CheckOutcome, report

Reservations = dict[str, tuple[int, int]]
FRAGMENTATION_KEYS = ("live", "internal", "external", "free", "utilisation")


def _arena(num_slots: int, ops: list[tuple[str, str, int]]) -> ContiguousAllocator:
    """Run ``("alloc", id, size)`` / ``("free", id, 0)`` operations on a fresh arena."""
    arena = ContiguousAllocator(num_slots)
    for op, rid, size in ops:
        if op == "alloc":
            if arena.allocate(rid, size) is None:
                raise RuntimeError(f"test arena: {rid} ({size} slots) does not fit")
        else:
            arena.free(rid)
    return arena


def _random_arena(seed: int, num_slots: int = 256, steps: int = 40) -> tuple[ContiguousAllocator, dict[str, int]]:
    """A seeded mix of allocations and frees, and a live token count inside each reservation."""
    rng = np.random.default_rng(seed)
    arena = ContiguousAllocator(num_slots)
    n = 0
    for _ in range(steps):
        if arena.reservations and rng.random() < 0.4:
            arena.free(str(rng.choice(sorted(arena.reservations))))
        else:
            size = int(rng.integers(4, 48))
            if arena.allocate(f"r{n}", size) is not None:
                n += 1
    live = {rid: int(rng.integers(1, length + 1)) for rid, (_, length) in arena.reservations.items()}
    return arena, live


def _cases() -> list[tuple[str, int, ContiguousAllocator, dict[str, int], int]]:
    """(label, num_slots, arena, live tokens per request, size of the next request)."""
    cases = []
    # The capacity article's four chat requests (600, 1250, 4000, 128 live tokens), each reserving max_model_len =
    # 8192 slots in a full arena.
    chat_tokens = [600, 1250, 4000, 128]
    arena = _arena(4 * 8192, [("alloc", f"q{i}", 8192) for i in range(4)])
    cases.append(
        (
            "four requests reserving 8192 slots each, arena full",
            4 * 8192,
            arena,
            {f"q{i}": n for i, n in enumerate(chat_tokens)},
            8192,
        )
    )
    cases.append(("an empty arena", 64, ContiguousAllocator(64), {}, 16))
    # b and c are neighbours: freeing both must give ONE hole; e's hole merges with the free end.
    ops = [("alloc", x, s) for x, s in zip("abcdef", (8, 6, 10, 4, 7, 5))]
    ops += [("free", "b", 0), ("free", "c", 0), ("free", "e", 0), ("free", "f", 0)]
    cases.append(
        ("holes in the middle (two neighbours freed) and at the end", 48, _arena(48, ops), {"a": 3, "d": 4}, 17)
    )
    ops = [("alloc", x, 8) for x in "abcd"] + [("free", "a", 0), ("free", "c", 0)]
    cases.append(
        ("a hole at the very start, one in the middle, none at the end", 32, _arena(32, ops), {"b": 1, "d": 8}, 9)
    )
    for seed in (1, 2, 3):
        arena, live = _random_arena(seed)
        cases.append((f"seeded allocate/free mix (seed {seed})", 256, arena, live, 24))
    return cases


def _as_extents(got: Any) -> list[tuple[int, int]]:
    return [(int(s), int(n)) for s, n in got]


def check_free_extents(free_extents: Callable[[int, Reservations], list[tuple[int, int]]]) -> list[CheckOutcome]:
    """``free_extents(num_slots, reservations) -> [(start, length), ...]``, sorted, neighbours merged."""
    checks = []
    for label, num_slots, arena, _live, _next in _cases():
        res = dict(arena.reservations)
        checks.append(
            Check(
                f"free_extents({num_slots}, {res})  # {label}",
                lambda n=num_slots, r=res: _as_extents(free_extents(n, dict(r))),
                list(arena.free_extents),
                hint="compare your holes with the expected ones from the start of the arena: look at "
                "its two ends as well as the gaps between reservations, at where a reservation "
                "ends, and at the order the dict gives you (none in particular); two free slots "
                "side by side always belong to one hole (chapter 02, section 4)",
            )
        )
    return report("free_extents", checks)


def _same_report(got: Any, expected: dict[str, float]) -> bool:
    if not isinstance(got, dict) or set(got) != set(expected):
        return False
    return all(math.isclose(float(got[k]), float(v), rel_tol=1e-9, abs_tol=1e-12) for k, v in expected.items())


def _expected(arena: ContiguousAllocator, live: dict[str, int], next_size: int) -> dict[str, float]:
    total_live = sum(live.values())
    return {
        "live": total_live,
        "internal": arena.num_reserved_slots - total_live,
        "external": arena.unusable_free_slots(next_size),
        "free": arena.num_free_slots,
        "utilisation": total_live / arena.num_slots,
    }


def _boundary_case() -> tuple[str, int, ContiguousAllocator, dict[str, int], int]:
    """Holes of 8 and 7 slots and a next request of exactly 8: the boundary of "too small to use"."""
    ops = [("alloc", x, s) for x, s in zip("abcde", (6, 8, 4, 7, 7))] + [("free", "b", 0), ("free", "d", 0)]
    return (
        "holes of 8 and 7 slots, and a next request of exactly 8 slots",
        32,
        _arena(32, ops),
        {"a": 2, "c": 4, "e": 5},
        8,
    )


def _trace_cases() -> list[tuple[str, int, Reservations, dict[str, int], int, dict[str, float]]]:
    """Three steps of a simulated trace, the expected numbers taken from the simulation itself."""
    from ...lab.contiguous import contiguous_layouts, reservation_size

    trace = sharegpt_like_trace(60, seed=4, arrival_rate=0.5, max_model_len=1024)
    num_slots = 8 * 1024
    res = simulate_trace(trace, num_slots, "contiguous", 1024, "pow2")
    layouts = contiguous_layouts(trace, res, 1024, "pow2")
    by_id = {r.req_id: r for r in trace}
    picked = [i for i in np.flatnonzero(res.external_waste > 0)][::7][:3]
    out = []
    for i in picked:
        lay = layouts[i]
        reservations = {rid: (start, length) for rid, start, length, _ in lay["reservations"]}
        live = {rid: n for rid, _, _, n in lay["reservations"]}
        size = reservation_size(by_id[lay["waiting_head"]], "pow2", 1024)
        expected = {
            "live": int(res.live_tokens[i]),
            "internal": int(res.internal_waste[i]),
            "external": int(res.external_waste[i]),
            "free": int(res.free_slots[i]),
            "utilisation": float(res.utilisation[i]),
        }
        out.append(
            (
                f"step {int(res.step[i])} of a simulated trace (pow2 reservations)",
                num_slots,
                reservations,
                live,
                size,
                expected,
            )
        )
    return out


def check_fragmentation(
    fragmentation: Callable[[int, Reservations, dict[str, int], int], dict[str, float]],
) -> list[CheckOutcome]:
    """``fragmentation(num_slots, reservations, live_tokens, next_request_size) -> dict`` with
    ``live``, ``internal``, ``external``, ``free`` (slots) and ``utilisation`` (live / num_slots)."""
    cases = [
        (label, n, dict(arena.reservations), live, nxt, _expected(arena, live, nxt))
        for label, n, arena, live, nxt in [*_cases(), _boundary_case()]
    ]
    cases += _trace_cases()
    checks = []
    for label, num_slots, reservations, live, nxt, expected in cases:
        tried = (
            f"fragmentation({num_slots}, {reservations}, {live}, {nxt})"
            if len(reservations) <= 6
            else f"fragmentation({num_slots}, <{len(reservations)} reservations>, <live tokens>, {nxt})"
        )
        checks.append(
            Check(
                f"{tried}  # {label}",
                lambda a=(num_slots, reservations, live, nxt): fragmentation(a[0], dict(a[1]), dict(a[2]), a[3]),
                expected,
                same=_same_report,
                hint="compare key by key. internal: reserved but empty; external: only the free slots "
                "the next request cannot use (a hole it fits into, even exactly, is usable); "
                "free: every slot outside a reservation; utilisation: a share of the whole arena "
                "(chapter 02, section 4). "
                f"Return a dict with exactly the keys {list(FRAGMENTATION_KEYS)}",
            )
        )
    return report("fragmentation", checks)
