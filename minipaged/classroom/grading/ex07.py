"""Checks for exercise 07: preemption by recompute — undoing a victim's allocation, and choosing victims.

Part 1, ``preempt_recompute(victim, kv, waiting)``: what ``Scheduler.preempt``
does in recompute mode. Part 2, ``schedule_running(running, waiting, kv,
token_budget, preempt)``: step 1 of ``Scheduler.schedule()``, which serves the
running requests oldest first and preempts the newest when the pool runs dry.

Each scenario is built twice: once for the learner's function, once for the
real scheduler (``preempt`` for part 1; ``schedule()`` for part 2, with
``max_num_seqs`` equal to the running count so that step 2 admits nobody), and
the two end states are compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request, RequestStatus
from ...core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, preempt_recompute
from .core import Check, CheckOutcome, report

SHARED = list(range(300, 308))  # an 8-token prompt prefix: 2 blocks of 4


@dataclass(frozen=True)
class Running:
    """A running request: ``prompt`` tokens, ``outputs`` sampled so far, ``computed`` tokens in the cache."""

    rid: str
    prompt: int
    outputs: int = 0
    computed: int | None = None  # default: all but the last sampled token (a decoding request)
    shared_prefix: bool = False
    preempted_before: int = 0


@dataclass(frozen=True)
class Scenario:
    label: str
    running: Sequence[Running]  # oldest first
    waiting: Sequence[int] = ()  # prompt lengths of requests waiting (never admitted here)
    num_blocks: int = 25  # block size 4: 24 usable blocks
    caching: bool = False
    token_budget: int = 64


def build(s: Scenario) -> Scheduler:
    """A scheduler whose running requests hold blocks for their computed tokens, as after a real step."""
    kv = KVCacheManager(block_size=4, num_blocks=s.num_blocks, enable_caching=s.caching, watermark_blocks=0)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max(1, len(s.running)), max_num_batched_tokens=s.token_budget, max_model_len=1024),
        kv,
    )
    for i, r in enumerate(s.running):
        own = list(range(1000 * (i + 1), 1000 * (i + 1) + r.prompt - (len(SHARED) if r.shared_prefix else 0)))
        prompt = (SHARED + own) if r.shared_prefix else own
        req = Request(r.rid, prompt, output_token_ids=[7] * r.outputs, status=RequestStatus.RUNNING)
        computed = r.computed if r.computed is not None else req.num_tokens - (1 if r.outputs else 0)
        hits, n_hit = kv.get_computed_blocks(req)
        if kv.allocate_slots(req, computed - n_hit, n_hit, hits) is None:
            raise RuntimeError(f"scenario {s.label!r}: the running requests do not fit")
        req.num_computed_tokens = computed
        req.num_preemptions = r.preempted_before
        sched.requests[r.rid] = req
        sched.running.append(req)
    for j, n in enumerate(s.waiting):
        sched.add_request(Request(f"w{j}", list(range(90_000 + 100 * j, 90_000 + 100 * j + n))))
    return sched


def _state(sched: Scheduler, reqs: list[Request]) -> dict[str, Any]:
    kv = sched.kv_cache_manager
    return dict(
        running=[r.request_id for r in sched.running],
        waiting=[r.request_id for r in sched.waiting],
        requests={
            r.request_id: (
                r.status.value,
                r.num_computed_tokens,
                r.num_output_tokens,
                r.num_preemptions,
                kv.get_num_blocks(r.request_id),
            )
            for r in reqs
        },
        free_blocks=kv.get_num_free_blocks(),
        ref_counts=sorted((b.block_id, b.ref_cnt) for b in kv.block_pool.blocks[1:] if b.ref_cnt),
    )


# ---- part 1: undo one victim's allocation ----------------------------------------------------
PREEMPT_SCENARIOS = [
    Scenario("a decoding victim: 12 prompt tokens, 5 outputs", [Running("a", 12, 3), Running("b", 12, 5)]),
    Scenario(
        "a victim halfway through its prompt (chunked prefill)", [Running("a", 12, 3), Running("b", 30, 0, computed=14)]
    ),
    Scenario(
        "two requests waiting: the victim goes to the front of the queue",
        [Running("a", 12, 3), Running("b", 9, 2)],
        waiting=[5, 6],
    ),
    Scenario(
        "a victim preempted once before", [Running("a", 12, 3), Running("b", 10, 4, preempted_before=1)], waiting=[4]
    ),
    Scenario(
        "prefix caching: the victim shares its first 2 blocks with another request",
        [Running("a", 14, 2, shared_prefix=True), Running("b", 13, 6, shared_prefix=True)],
        caching=True,
    ),
]


def expected_preempt(s: Scenario) -> dict[str, Any]:
    sched = build(s)
    reqs = list(sched.requests.values())
    victim = sched.running.pop()
    sched.preempt(victim, SchedulerOutput())
    return _state(sched, reqs)


def _run_preempt(preempt_recompute: Callable[..., Any], s: Scenario) -> dict[str, Any]:
    sched = build(s)
    reqs = list(sched.requests.values())
    victim = sched.running.pop()
    preempt_recompute(victim, sched.kv_cache_manager, sched.waiting)
    return _state(sched, reqs)


def check_preempt_recompute(preempt_recompute: Callable[..., Any]) -> list[CheckOutcome]:
    """``preempt_recompute(victim, kv, waiting)``: the victim gives back its blocks and waits to be recomputed."""
    hint = (
        "compare the victim's tuple (status, computed, outputs, preemptions, blocks), then the queues and the "
        "pool: recompute means its K/V is gone but its tokens are kept, its blocks go back, its new state and "
        "its preemption are recorded, and it was admitted before everyone still waiting (chapter 07, section 2)"
    )
    checks = []
    for s in PREEMPT_SCENARIOS:
        victim = s.running[-1]
        checks.append(
            Check(
                f"preempt_recompute({victim.rid}, kv, waiting)  # {s.label}; then: (status, computed, "
                f"outputs, preemptions, blocks) per request, queues, free blocks, ref counts",
                lambda s=s: _run_preempt(preempt_recompute, s),
                expected_preempt(s),
                hint=hint,
            )
        )
    return report("preempt_recompute", checks)


# ---- part 2: serve the running requests, preempting the newest --------------------------------
RUNNING_SCENARIOS = [
    Scenario(
        "room for everyone: one decode token each, nobody preempted",
        [Running("a", 8, 1), Running("b", 12, 1), Running("c", 4, 1)],
    ),
    Scenario(
        "the pool is dry: the newest request makes room for the older ones",
        [Running("a", 28, 1), Running("b", 28, 1), Running("c", 28, 1)],
        num_blocks=23,
    ),
    Scenario(
        "one victim is not enough: the two newest go",
        [Running("a", 44, 1), Running("b", 20, 1), Running("c", 4, 1), Running("d", 4, 1)],
        num_blocks=19,
    ),
    Scenario(
        "the newest request is the one that needs a block: it preempts itself",
        [Running("a", 10, 2), Running("b", 13, 2), Running("c", 35, 2)],
        num_blocks=17,
    ),
    Scenario(
        "a token budget of 2: only the two oldest run this step",
        [Running("a", 8, 1), Running("b", 12, 1), Running("c", 4, 1)],
        token_budget=2,
    ),
    Scenario(
        "a running request mid-prompt takes a chunk of what the budget leaves",
        [Running("a", 8, 1), Running("b", 40, 0, computed=8), Running("c", 4, 1)],
        token_budget=20,
    ),
    Scenario(
        "victims go to the front of the queue, ahead of requests that were already waiting",
        [Running("a", 28, 1), Running("b", 28, 1), Running("c", 28, 1)],
        waiting=[5],
        num_blocks=23,
    ),
]


def expected_running(s: Scenario) -> tuple[list[tuple[str, int]], list[str], dict[str, Any]]:
    sched = build(s)
    reqs = list(sched.requests.values())
    out = sched.schedule()
    return ([(x.request_id, x.num_new_tokens) for x in out.scheduled], list(out.preempted), _state(sched, reqs))


def _run_running(schedule_running: Callable[..., Any], s: Scenario) -> tuple[Any, Any, dict[str, Any]]:
    sched = build(s)
    reqs = list(sched.requests.values())
    scheduled, preempted = schedule_running(
        sched.running, sched.waiting, sched.kv_cache_manager, s.token_budget, preempt_recompute
    )  # part 1's answer: part 2 is not failed for a bug there
    return [(str(r), int(n)) for r, n in scheduled], [str(r) for r in preempted], _state(sched, reqs)


def check_schedule_running(schedule_running: Callable[..., Any]) -> list[CheckOutcome]:
    """``schedule_running(running, waiting, kv, token_budget, preempt) -> (scheduled, preempted)``."""
    hint = (
        "compare the scheduled and preempted lists: who is served first, who gives way when the pool runs "
        "dry (chapter 07: which end of the running list), how many tokens a request still in its prompt gets "
        "from the budget, and what becomes of the step once a request had to preempt itself (chapter 07, section 1)"
    )
    checks = []
    for s in RUNNING_SCENARIOS:
        desc = ", ".join(f"{r.rid}: {r.prompt}+{r.outputs} tokens" for r in s.running)
        checks.append(
            Check(
                f"schedule_running([{desc}], waiting, kv, token_budget={s.token_budget}, preempt)"
                f"  # {s.label} ({s.num_blocks - 1} usable blocks of 4); then (scheduled, preempted, "
                f"state)",
                lambda s=s: _run_running(schedule_running, s),
                expected_running(s),
                hint=hint,
            )
        )
    return report("schedule_running", checks)


def worked_examples(part: str) -> str:
    """Two scenarios of the checks of ``part`` ("preempt" or "running") and what the package's own scheduler
    does in them: the specification's examples, computed here rather than written down."""
    lines = []
    if part == "preempt":
        for s in PREEMPT_SCENARIOS[2:4]:
            state, victim = expected_preempt(s), s.running[-1].rid
            status, computed, outputs, preemptions, blocks = state["requests"][victim]
            lines += [
                f"{s.label} (the victim: {victim}, {s.running[-1].prompt}+{s.running[-1].outputs} tokens):",
                f"  after: waiting {state['waiting']}; {victim} is {status}, {computed} tokens computed, {outputs} "
                f"outputs kept, {preemptions} preemption(s), {blocks} blocks; {state['free_blocks']} blocks free",
            ]
    elif part == "running":
        for s in RUNNING_SCENARIOS[2:4]:
            scheduled, preempted, state = expected_running(s)
            desc = ", ".join(f"{r.rid} {r.prompt}+{r.outputs}" for r in s.running)
            lines += [
                f"{s.label} (running, oldest first: {desc} tokens; {s.num_blocks - 1} blocks of 4):",
                f"  scheduled {scheduled}; preempted {preempted}; waiting after {state['waiting']}",
            ]
    else:
        raise ValueError(f"part must be 'preempt' or 'running', got {part!r}")
    return "\n".join(lines)
