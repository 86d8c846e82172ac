"""Checks for exercise 04: the slot mapping, and the admission inequality of ``allocate_slots``.

Expected slot mappings come from ``block_table.slot_mapping``; expected
admission answers from calling the real ``KVCacheManager.allocate_slots`` on a
deep copy of the same manager and request (``None`` means "not now").
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request
from ...worker.block_table import slot_mapping as reference_slot_mapping
from .core import Check, CheckOutcome, report

SlotMapping = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]], int, Any], Any]


def _as_ints(got: Any) -> list[int]:
    values = got.tolist() if hasattr(got, "tolist") else got
    return [int(x) for x in values]


def _raises_index_error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except IndexError:
        return "IndexError"
    return "no error"


def check_slot_mapping(slot_mapping: SlotMapping) -> list[CheckOutcome]:
    """``slot_mapping(block_tables, positions, block_size, pad_to=None) -> list[int]``."""
    cases = [
        ("chapter 04's table [19, 18, 5], block size 4: position 10", [[19, 18, 5]], [[10]], 4, None),
        ("chapter 03's A/B trace: A writes positions 0..4 into blocks [19, 18]", [[19, 18]], [list(range(5))], 4, None),
        (
            "prefill of a 50-token request, table [42, 17, 88, 5], block size 16",
            [[42, 17, 88, 5]],
            [list(range(50))],
            16,
            None,
        ),
        ("one decode step of a batch of three", [[19, 18, 5], [7], [3, 8]], [[10], [2], [5]], 4, None),
        ("a prefill chunk next to two decodes", [[2, 9, 4], [7], [3, 8]], [[4, 5, 6, 7, 8], [3], [6]], 4, None),
        ("a request with nothing to write this step", [[5], [6, 1]], [[], [4]], 4, None),
        ("padded to 8 tokens (fixed shapes)", [[19, 18, 5], [7]], [[9, 10], [2]], 4, 8),
    ]
    hint = (
        "a slot names a physical block and an offset inside it: which block does the table give for this "
        "position, and where does that block's first slot sit in the flat pool? The slots go request after "
        "request, and padding is the value that means 'write nowhere' (chapter 04, section 3)"
    )
    checks = [
        Check(
            f"slot_mapping({t}, {p if len(p[0]) < 12 else '[[0, 1, ..., 49]]'}, {bs}, pad_to={pad})  # {label}",
            lambda a=(t, p, bs, pad): _as_ints(slot_mapping(a[0], a[1], a[2], a[3])),
            reference_slot_mapping(t, p, bs, pad_to=pad).tolist(),
            hint=hint,
        )
        for label, t, p, bs, pad in cases
    ]
    expected = _raises_index_error(lambda: reference_slot_mapping([[19, 18]], [[8]], 4))
    checks.append(
        Check(
            "slot_mapping([[19, 18]], [[8]], 4, pad_to=None)  # position 8 is past 2 blocks of 4",
            lambda: _raises_index_error(lambda: slot_mapping([[19, 18]], [[8]], 4, None)),
            expected,
            hint="a position past the end of the block table must raise IndexError, not write somewhere else",
        )
    )
    return report("slot_mapping", checks)


# ---- the admission inequality ----------------------------------------------------------------
def _scenario(
    watermark_blocks: int,
    reserved_blocks: int,
    others: Sequence[int],
    held_tokens: int,
    computed: int,
    block_size: int = 16,
    num_blocks: int = 21,
) -> tuple[KVCacheManager, Request]:
    """A manager whose pool other requests fill with ``others`` tokens each, and the request to ask about.

    ``held_tokens`` > 0 makes the request a running one holding blocks for that many tokens (``computed``
    of them computed); 0 makes it a new admission.
    """
    # Built without a watermark, which is set once the pool is filled: the requests already running were
    # admitted when the pool was emptier, and the watermark only ever applies to a new admission.
    mgr = KVCacheManager(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_caching=False,
        watermark_blocks=0,
        reserved_blocks=reserved_blocks,
    )
    for i, n in enumerate(others):
        other = Request(f"other{i}", [1] * n)
        if mgr.allocate_slots(other, n) is None:
            raise RuntimeError("scenario: the other requests do not fit")
        other.num_computed_tokens = n
    req = Request("req", [2] * max(held_tokens, 1))
    if held_tokens:
        if mgr.allocate_slots(req, held_tokens) is None:
            raise RuntimeError("scenario: the request does not fit")
        req.num_computed_tokens = computed
    mgr.watermark_blocks = watermark_blocks
    return mgr, req


# (label, watermark, reserved, other requests' tokens, held tokens, computed, new tokens); block 16, 20 usable
_ADMISSIONS: list[tuple[str, int, int, list[int], int, int, int]] = [
    ("new request, 64 tokens, empty pool", 2, 1, [], 0, 0, 64),
    ("new request needing 8 blocks with 10 free, 1 reserved, watermark 2", 2, 1, [160], 0, 0, 128),
    ("new request needing 7 blocks with 10 free, 1 reserved, watermark 2: exactly enough", 2, 1, [160], 0, 0, 112),
    ("new request needing 1 block with 3 free, 1 reserved, watermark 2", 2, 1, [272], 0, 0, 10),
    (
        "running request (32 tokens in 2 full blocks) + 1 token: 1 new block with 2 free, 1 reserved, watermark 2",
        2,
        1,
        [256],
        32,
        32,
        1,
    ),
    (
        "running request (20 of 32 slots used) + 1 token: fits in its last block, no block free beyond reserved",
        2,
        1,
        [272],
        32,
        20,
        1,
    ),
    ("running request (16 tokens) + a 40-token chunk: 3 new blocks with 3 free, 1 reserved", 0, 1, [256], 16, 16, 40),
    ("running request (16 tokens) + a 40-token chunk: 3 new blocks with 4 free, 1 reserved", 0, 1, [240], 16, 16, 40),
]


def _real_answer(watermark: int, reserved: int, others: list[int], held: int, computed: int, new: int) -> bool:
    mgr, req = _scenario(watermark, reserved, others, held, computed)
    return copy.deepcopy(mgr).allocate_slots(copy.deepcopy(req), new) is not None


def _ask(
    would_allocate: Callable[[KVCacheManager, Request, int], bool],
    watermark: int,
    reserved: int,
    others: list[int],
    held: int,
    computed: int,
    new: int,
) -> Any:
    mgr, req = _scenario(watermark, reserved, others, held, computed)
    return would_allocate(mgr, req, new)


def _untouched(would_allocate: Callable[[KVCacheManager, Request, int], bool]) -> tuple[int, dict[str, int], int]:
    """Ask about every scenario, then report (free blocks, blocks per request, computed tokens) of the last one."""
    for admission in _ADMISSIONS:
        args = admission[1:]
        mgr, req = _scenario(*args[:5])
        would_allocate(mgr, req, args[5])
    return mgr.get_num_free_blocks(), mgr.num_blocks_per_request, req.num_computed_tokens


def check_would_allocate(would_allocate: Callable[[KVCacheManager, Request, int], bool]) -> list[CheckOutcome]:
    """``would_allocate(manager, request, num_new_tokens) -> bool``: would ``allocate_slots`` give blocks now?"""
    hint = (
        "compare with the numbers in brackets: how many blocks the request needs beyond the ones it holds "
        "(a part-full block has room; a part-filled new one still takes a whole block), which blocks no "
        "request may take, whom the watermark is kept against (new admissions, not running requests), and "
        "what happens when the request needs exactly what is left (chapter 04, section 5)"
    )
    checks = []
    for admission in _ADMISSIONS:
        label, args = admission[0], admission[1:]
        mgr, req = _scenario(*args[:5])
        state = (
            f"block_size {mgr.block_size}, free {mgr.get_num_free_blocks()}, reserved {mgr.reserved_blocks}, "
            f"watermark {mgr.watermark_blocks}, request holds {mgr.get_num_blocks(req.request_id)} blocks and "
            f"{req.num_computed_tokens} computed tokens"
        )
        checks.append(
            Check(
                f"would_allocate(manager, request, {args[5]})  # {label} [{state}]",
                lambda a=args: _ask(would_allocate, *a),
                _real_answer(*args),
                hint=hint,
            )
        )
    last = _ADMISSIONS[-1]
    mgr, req = _scenario(*last[1:6])
    checks.append(
        Check(
            "would_allocate only looks: after asking, the pool, the block tables and the request are as before",
            lambda: _untouched(would_allocate),
            (mgr.get_num_free_blocks(), mgr.num_blocks_per_request, req.num_computed_tokens),
            hint="read the numbers, do not call allocate_slots or take blocks from the pool",
        )
    )
    return report("would_allocate", checks)
