"""Checks for exercise 06: the admission loop of continuous batching.

The learner writes ``admit_waiting(waiting, kv, token_budget, free_seats)``: step 2
of ``Scheduler.schedule()``, which admits waiting requests in arrival order. The
expected answers come from the real ``Scheduler``: the same scenario is built
twice, once for the learner's function and once for a scheduler with no running
request, ``max_num_batched_tokens = token_budget`` and ``max_num_seqs =
free_seats``, whose ``schedule()`` then does exactly the admission loop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request
from ...core.scheduler import Scheduler, SchedulerConfig
from .core import Check, CheckOutcome, report

SYSTEM = list(range(100, 116))  # a 16-token system prompt: 4 blocks of 4


@dataclass(frozen=True)
class Scenario:
    label: str
    waiting: Sequence[Sequence[int]]  # prompts, in arrival order
    token_budget: int = 64
    free_seats: int = 8
    num_blocks: int = 33  # block size 4: 32 usable blocks
    watermark_blocks: int = 0
    others: Sequence[int] = ()  # tokens held by requests already running (they just hold blocks here)
    cached: Sequence[Sequence[int]] = field(default_factory=tuple)  # prompts of finished requests, left in the cache


def _prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


SCENARIOS = [
    Scenario("three short prompts, room for all", [_prompt(10, 1), _prompt(6, 20), _prompt(8, 30)]),
    Scenario(
        "a token budget of 24: the third prompt is chunked",
        [_prompt(10, 1), _prompt(6, 20), _prompt(20, 30)],
        token_budget=24,
    ),
    Scenario(
        "a budget of 16 used up by the first two: the others wait",
        [_prompt(8, 1), _prompt(8, 20), _prompt(8, 30), _prompt(4, 40)],
        token_budget=16,
    ),
    Scenario("only two free seats (max_num_seqs)", [_prompt(5, 1), _prompt(5, 20), _prompt(5, 30)], free_seats=2),
    Scenario(
        "6 blocks free, the head needs 10: nobody overtakes it, not even a 1-block request",
        [_prompt(40, 1), _prompt(4, 60)],
        others=[104],
    ),
    Scenario(
        "7 blocks free, a watermark of 2: the second request (6 blocks) must wait",
        [_prompt(4, 1), _prompt(24, 20)],
        others=[100],
        watermark_blocks=2,
    ),
    Scenario(
        "a cached 16-token system prompt: only the rest of the prompt is computed",
        [SYSTEM + _prompt(5, 1), SYSTEM + _prompt(9, 20)],
        cached=[SYSTEM + _prompt(3, 90)],
    ),
    Scenario(
        "a prefix hit, then a budget of 6 chunks what is left",
        [SYSTEM + _prompt(10, 1)],
        token_budget=6,
        cached=[SYSTEM + _prompt(3, 90)],
    ),
    Scenario(
        "a fully cached, block-aligned prompt still computes its last block",
        [list(SYSTEM)],
        cached=[SYSTEM + _prompt(3, 90)],
    ),
    Scenario(
        "a prefix hit takes cached-but-free blocks; then the pool says no, and the small one behind waits",
        [SYSTEM + _prompt(30, 1), _prompt(60, 40), _prompt(2, 200)],
        token_budget=40,
        cached=[SYSTEM + _prompt(3, 90)],
        others=[72],
    ),
]


def build(s: Scenario) -> tuple[deque[Request], KVCacheManager]:
    """The pool (others holding blocks, finished requests' blocks cached) and the waiting queue."""
    kv = KVCacheManager(block_size=4, num_blocks=s.num_blocks, enable_caching=True, watermark_blocks=0)
    for i, prompt in enumerate(s.cached):
        done = Request(f"done{i}", list(prompt))
        if kv.allocate_slots(done, done.num_tokens) is None:
            raise RuntimeError(f"scenario {s.label!r}: the cached prompts do not fit")
        done.num_computed_tokens = done.num_tokens
        kv.free(done)
    for i, n in enumerate(s.others):
        other = Request(f"running{i}", _prompt(n, 500 + 1000 * i))
        if kv.allocate_slots(other, n) is None:
            raise RuntimeError(f"scenario {s.label!r}: the running requests do not fit")
        other.num_computed_tokens = n
    kv.watermark_blocks = s.watermark_blocks  # running requests were admitted before the pool filled up
    waiting = deque(Request(f"w{i}", list(p)) for i, p in enumerate(s.waiting))
    return waiting, kv


def _state(waiting_before: list[Request], waiting: deque[Request], kv: KVCacheManager) -> dict[str, Any]:
    return dict(
        waiting=[r.request_id for r in waiting],
        status={r.request_id: r.status.value for r in waiting_before},
        computed={r.request_id: r.num_computed_tokens for r in waiting_before},
        blocks={r.request_id: kv.get_num_blocks(r.request_id) for r in waiting_before},
        free_blocks=kv.get_num_free_blocks(),
    )


def expected(s: Scenario) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """What the real scheduler admits, and what it leaves behind."""
    waiting, kv = build(s)
    before = list(waiting)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=s.free_seats, max_num_batched_tokens=s.token_budget, max_model_len=4096), kv
    )
    for r in before:
        sched.add_request(r)
    out = sched.schedule()
    return [(x.request_id, x.num_new_tokens) for x in out.scheduled], _state(before, sched.waiting, kv)


def _run(admit_waiting: Callable[..., Any], s: Scenario) -> tuple[Any, dict[str, Any]]:
    waiting, kv = build(s)
    before = list(waiting)
    got = admit_waiting(waiting, kv, s.token_budget, s.free_seats)
    got = [(str(rid), int(n)) for rid, n in got]
    return got, _state(before, waiting, kv)


def _describe(s: Scenario) -> str:
    return (
        f"admit_waiting(waiting={[len(p) for p in s.waiting]} tokens, kv, token_budget={s.token_budget}, "
        f"free_seats={s.free_seats})  # {s.label}"
    )


def check_admit_waiting(admit_waiting: Callable[..., Any]) -> list[CheckOutcome]:
    """What ``admit_waiting`` returns: ``[(request_id, num_new_tokens), ...]`` in admission order."""
    hint = (
        "compare the admitted list with the label: who got in, in what order, and with how many tokens. "
        "Look at the three limits (queue, token budget, seats), at what a prefix-cache hit saves, at a prompt "
        "longer than the budget left, and at what 'first come, first served' means when the head does not "
        "fit (chapter 06, sections 3 and 4)"
    )
    checks = [Check(_describe(s), lambda s=s: _run(admit_waiting, s)[0], expected(s)[0], hint=hint) for s in SCENARIOS]
    return report("admit_waiting", checks)


def check_admission_state(admit_waiting: Callable[..., Any]) -> list[CheckOutcome]:
    """What ``admit_waiting`` leaves behind: the queue, each request's status, computed tokens and blocks, the
    free pool."""
    hint = (
        "compare each part of the state: which requests are still waiting, each request's status (an "
        "admitted request has changed state), how many tokens count as already computed for a prefix hit, "
        "and the blocks held by requests that were not admitted (chapter 06, section 3)"
    )
    checks = [
        Check(
            _describe(s).replace("admit_waiting(", "state after admit_waiting(", 1),
            lambda s=s: _run(admit_waiting, s)[1],
            expected(s)[1],
            hint=hint,
        )
        for s in SCENARIOS
    ]
    return report("admission_state", checks)


def worked_examples(labels: Sequence[str] = ("a token budget of 24", "6 blocks free", "a cached 16-token")) -> str:
    """Scenarios of the checks (those whose label starts with one of ``labels``) and what the package's own
    ``Scheduler`` admits in each: the specification's examples, computed here rather than written down."""
    lines = []
    for s in (s for s in SCENARIOS if s.label.startswith(tuple(labels))):
        admitted, state = expected(s)
        lines += [
            f"{s.label}:",
            f"  waiting prompts {[len(p) for p in s.waiting]} tokens, budget {s.token_budget}, seats {s.free_seats}, "
            f"{s.num_blocks - 1 - sum(-(-n // 4) for n in s.others)} of {s.num_blocks - 1} blocks not held by "
            "running requests",
            f"  admitted {admitted}; still waiting {state['waiting']}",
            f"  computed tokens {state['computed']}; blocks {state['blocks']}; free blocks after {state['free_blocks']}",
        ]
    return "\n".join(lines)
