"""Checks for exercise 06b (the build track): the ``Scheduler`` — continuous batching over a KV cache manager.

The learner writes ``Scheduler(kv_cache_manager, max_num_seqs, max_num_batched_tokens, max_model_len)`` with
``add_request``, ``schedule() -> (scheduled, preempted)``, ``update_from_output(scheduled, sampled)``,
``has_unfinished`` and the queues ``waiting`` and ``running``: running requests first, chunked prefill under the
token budget, preemption by recompute of the newest running request when the pool runs dry, admission in arrival
order (prefix hits first) while the seats, the budget and the pool allow, and finishing on a stop token,
``max_tokens`` or ``max_model_len``. It works over a package ``KVCacheManager`` (exercise 04b's is graded there).

Every check runs the learner's scheduler and the package's ``Scheduler`` (the twin) over the same requests with a
fake model whose tokens depend only on the request and the position, and compares every step: what it schedules
and preempts, what finishes and why, the queues' order, each request's status and computed tokens, its block
table and the pool's free count. Nothing compares the learner's internals.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ...config import SchedulerConfig
from ...core.kv_cache_manager import KVCacheManager
from ...core.request import Request
from ...core.scheduler import Scheduler as PackageScheduler
from ...sampling_params import SamplingParams
from .core import Check, CheckOutcome, report

SchedulerClass = Callable[..., Any]
BLOCK_SIZE = 4
EOS = 2
TWIN_SEEDS = (1, 2, 3)
TWIN_STEPS = 120


class Limits:
    """One configuration: the pool (blocks, watermark) and the scheduler's limits."""

    def __init__(
        self, num_blocks: int = 32, seqs: int = 4, budget: int = 16, max_len: int = 256, watermark: int = 0
    ) -> None:
        self.num_blocks, self.seqs, self.budget, self.max_len, self.watermark = (
            num_blocks, seqs, budget, max_len, watermark,
        )  # fmt: skip

    def manager(self) -> KVCacheManager:
        return KVCacheManager(BLOCK_SIZE, self.num_blocks, watermark_blocks=self.watermark)

    def describe(self) -> str:
        return (
            f"{self.num_blocks - 1} usable blocks, watermark {self.watermark}, max_num_seqs {self.seqs}, "
            f"budget {self.budget}"
        )


class Side:
    """One scheduler behind one calling convention: the learner's (a tuple out of ``schedule``) or the package's
    (a ``SchedulerOutput``), so every check drives both the same way."""

    def __init__(self, sched: Any, package: bool) -> None:
        self.sched, self.package = sched, package
        self.kv: KVCacheManager = sched.kv_cache_manager
        self.requests: dict[str, Request] = {}
        self._last: Any = None

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.sched.add_request(request)

    def schedule(self) -> tuple[list[tuple[str, int]], list[str]]:
        out = self.sched.schedule()
        self._last = out
        if self.package:
            return [(s.request_id, s.num_new_tokens) for s in out.scheduled], list(out.preempted)
        scheduled, preempted = out
        return [(rid, int(n)) for rid, n in scheduled], list(preempted)

    def update(self, sampled: dict[str, int]) -> list[tuple[str, str | None]]:
        if self.package:
            finished = self.sched.update_from_output(self._last, {rid: [t] for rid, t in sampled.items()})
        else:
            finished = self.sched.update_from_output(self._last[0], dict(sampled))
        return [(r.request_id, r.finish_reason) for r in finished]

    def state(self) -> dict[str, Any]:
        """Everything observable from outside: queues in order, each request's status and computed tokens, block
        tables, the pool's free count."""
        return {
            "running": [r.request_id for r in self.sched.running],
            "waiting": [r.request_id for r in self.sched.waiting],
            "requests": {
                rid: (str(r.status.value), r.num_computed_tokens, r.num_tokens, self.kv.get_block_ids(rid))
                for rid, r in sorted(self.requests.items())
            },
            "free blocks": self.kv.block_pool.get_num_free_blocks(),
        }


def package_side(limits: Limits) -> Side:
    config = SchedulerConfig(
        max_num_seqs=limits.seqs, max_num_batched_tokens=limits.budget, max_model_len=limits.max_len
    )
    return Side(PackageScheduler(config, limits.manager()), package=True)


def learner_side(cls: SchedulerClass, limits: Limits) -> Side:
    sched = cls(limits.manager(), max_num_seqs=limits.seqs, max_num_batched_tokens=limits.budget,
                max_model_len=limits.max_len)  # fmt: skip
    return Side(sched, package=False)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 16, arrival: float = 0.0) -> Request:
    return Request(
        request_id, list(prompt), sampling_params=SamplingParams(max_tokens=max_tokens), eos_token_id=EOS,
        arrival_time=arrival,
    )  # fmt: skip


def fake_token(request: Request, stop_at: int | None = None) -> int:
    """The fake model's next token for ``request``: a function of the request and its position only (so both
    schedulers see the same tokens whatever they batch), ``EOS`` as output number ``stop_at``."""
    k = request.num_output_tokens
    if stop_at is not None and k == stop_at:
        return EOS
    return 10 + (sum(map(ord, request.request_id)) * 7 + request.num_tokens * 13) % 50


def run_one_step(side: Side, stops: dict[str, int]) -> list[Any]:
    """schedule, then the fake model's tokens for the requests that sample, then update: what can be seen."""
    scheduled, preempted = side.schedule()
    sampled = {}
    for rid, n in scheduled:
        r = side.requests[rid]
        if r.num_computed_tokens + n >= r.num_tokens:  # its last known token is computed: it samples
            sampled[rid] = fake_token(r, stops.get(rid))
    return [scheduled, preempted, side.update(sampled)]


Script = list[list[tuple[str, list[int], int]]]  # per step: the requests that arrive before it (id, prompt, max)


def _trace(side: Side, script: Script, steps: int, stops: dict[str, int] | None = None) -> list[Any]:
    out: list[Any] = []
    for i in range(steps):
        for rid, prompt, max_tokens in script[i] if i < len(script) else []:
            side.add(make_request(rid, prompt, max_tokens, arrival=float(i)))
        out.append(run_one_step(side, stops or {}))
    return [out, side.state()]


def _p(start: int, n: int) -> list[int]:
    """A prompt of ``n`` tokens that shares nothing with another start's."""
    return [100 * start + 3 + i for i in range(n)]


SpecCase = tuple[str, Limits, Script, int, dict[str, int], str]
SPEC_CASES: list[SpecCase] = [
    (
        "one 10-token request, max_tokens 3, budget 16: [scheduled, preempted, finished] per step, then the state",
        Limits(),
        [[("a", _p(1, 10), 3)]],
        4,
        {},
        "the whole prompt in one step, then one token a step; max_tokens outputs end it ('length'), blocks freed",
    ),
    (
        "a 20-token prompt under a budget of 8: chunked prefill",
        Limits(budget=8),
        [[("a", _p(1, 20), 2)]],
        5,
        {},
        "each step takes min(tokens still to compute, budget left); a chunk short of the end samples nothing",
    ),
    (
        "a decodes while b (30 tokens) arrives: running first, then admission with what the budget leaves",
        Limits(budget=12),
        [[("a", _p(1, 6), 8)], [("b", _p(2, 30), 2)]],
        5,
        {},
        "running requests are served first, in order; a new request gets the budget they leave",
    ),
    (
        "three requests arrive, max_num_seqs 2",
        Limits(seqs=2, budget=64),
        [[("a", _p(1, 5), 3), ("b", _p(2, 5), 3), ("c", _p(3, 5), 3)]],
        6,
        {},
        "at most max_num_seqs requests run; the third is admitted when a seat frees",
    ),
    (
        "a stop token as b's second output",
        Limits(),
        [[("a", _p(1, 5), 4), ("b", _p(2, 5), 4)]],
        4,
        {"b": 1},
        "the request's eos_token_id ends it at once ('stop'), its blocks freed",
    ),
    (
        "an 11-block pool, three 12-token prompts decoding 12 tokens each: the pool runs dry",
        Limits(num_blocks=12, budget=64, seqs=4),
        [[("a", _p(1, 12), 12), ("b", _p(2, 12), 12), ("c", _p(3, 12), 12)]],
        14,
        {},
        "no block for a running request: preempt the newest running one (free it, computed 0, status preempted, "
        "front of waiting) and retry; no admission in a step that preempted",
    ),
    (
        "head of line: x holds 5-7 of 11 blocks; a (36 tokens, 9 blocks) does not fit yet, b (4 tokens) would",
        Limits(num_blocks=12, budget=64),
        [[("x", _p(1, 20), 6)], [("a", _p(2, 36), 2), ("b", _p(3, 4), 2)]],
        10,
        {},
        "admission is first come, first served: when the head of waiting does not fit, nobody behind it is admitted",
    ),
    (
        "b shares a's first 8 tokens and arrives after a finished",
        Limits(),
        [[("a", _p(1, 10), 1)], [], [("b", _p(1, 8) + _p(2, 5), 1)]],
        4,
        {},
        "admission starts from the prefix hits (get_computed_blocks): b computes only the 5 tokens after them",
    ),
    (
        "b (8 tokens shared with a, which finished, + 5) and c (10) arrive together under a budget of 16",
        Limits(),
        [[("a", _p(1, 10), 1)], [], [("b", _p(1, 8) + _p(2, 5), 1), ("c", _p(3, 10), 1)]],
        4,
        {},
        "a prefix hit is read from the cache, not computed: it costs no budget, so b takes 5 and c the 11 left",
    ),
    (
        "an 8-block pool, three 10-token prompts under a budget of 8: the newest is preempted mid-prefill",
        Limits(num_blocks=9, budget=8),
        [[("a", _p(2, 10), 8), ("b", _p(3, 10), 8), ("c", _p(4, 10), 8)]],
        6,
        {},
        "no admission in a step that preempted: the pool is short, and the request just preempted would be "
        "admitted again and preempted again",
    ),
    (
        "max_model_len 12: a 9-token prompt with max_tokens 10",
        Limits(max_len=12),
        [[("a", _p(1, 9), 10)]],
        5,
        {},
        "a request whose tokens reach max_model_len finishes ('length')",
    ),
]


def _spec_run(make: Callable[[Limits], Side], case: SpecCase) -> list[Any]:
    _, limits, script, steps, stops, _ = case
    return _trace(make(limits), script, steps, stops)


SAME_TRACE = "the package's trace, step for step, and its state after"


def _spec_compare(make: Callable[[Limits], Side], case: SpecCase) -> str:
    """``SAME_TRACE``, or the first step where the learner's scheduler parts from the package's, marked, with the
    steps before it (they agree) and the package's step beside it."""
    want = _spec_run(package_side, case)
    got = _spec_run(make, case)
    for i, (a, b) in enumerate(zip(got[0], want[0])):
        for label, x, y in zip(("scheduled", "preempted", "finished"), a, b):
            if x != y:
                agreed = f"steps 0–{i - 1} agree; " if i else ""
                return (f"{agreed}FIRST WRONG STEP {i}: {label}: yours {x}, the package's {y} (a step: [scheduled "
                        "(id, tokens), preempted, finished (id, reason)])")  # fmt: skip
    if got[1] != want[1]:
        return f"every step agrees; the state after differs: {_first_diff(got[1], want[1])}"
    return SAME_TRACE


def _not_the_package(sched: Any) -> str:
    if isinstance(sched, PackageScheduler):
        return "it is (a subclass of) the package's Scheduler"
    for v in vars(sched).values() if hasattr(sched, "__dict__") else []:
        if isinstance(v, PackageScheduler):
            return "it holds the package's Scheduler"
    return "your own"


def check_scheduler_spec(Scheduler: SchedulerClass) -> list[CheckOutcome]:
    """The spec, one behaviour at a time, each expected trace computed by the package's ``Scheduler``."""

    def mine(limits: Limits) -> Side:
        return learner_side(Scheduler, limits)

    checks = [
        Check(case[0], lambda case=case: _spec_compare(mine, case), SAME_TRACE, hint=case[5]) for case in SPEC_CASES
    ]
    checks.append(
        Check(
            "Scheduler(KVCacheManager(4, 8), 4, 16, 64) is your own: not, and holding no, Scheduler of the package",
            lambda: _not_the_package(mine(Limits(num_blocks=8, max_len=64)).sched),
            "your own",
            hint="this exercise is to write it: keep the queues and the step's decisions in code of your own",
        )
    )
    return report("scheduler_spec", checks)


# ---- the twin: random arrivals, the same fake model -------------------------------------------------------------
def _twin_run(cls: SchedulerClass, seed: int) -> str:
    rng = random.Random(seed)
    limits = Limits(num_blocks=rng.choice((20, 28, 40)), seqs=rng.randint(2, 6), budget=rng.choice((8, 16, 32)),
                    max_len=96, watermark=rng.choice((0, 1)))  # fmt: skip
    mine, ref = learner_side(cls, limits), package_side(limits)
    prefixes = [[rng.randrange(5, 60) for _ in range(n)] for n in (9, 16)]
    stops: dict[str, int] = {}
    for step in range(TWIN_STEPS):
        arrivals: list[tuple[str, list[int], int]] = []
        if step < TWIN_STEPS - 30:
            for _ in range(rng.choice((0, 0, 1, 1, 2))):
                rid = f"r{step}.{len(arrivals)}"
                head = rng.choice(prefixes) if rng.random() < 0.5 else []
                prompt = head + [rng.randrange(5, 60) for _ in range(rng.randint(1, 24))]
                max_tokens = rng.randint(1, 24)
                if rng.random() < 0.2:
                    stops[rid] = rng.randrange(max_tokens)
                arrivals.append((rid, prompt, max_tokens))
        for rid, prompt, max_tokens in arrivals:
            for side in (mine, ref):
                side.add(make_request(rid, prompt, max_tokens, arrival=float(step)))
        try:
            got = run_one_step(mine, stops)
        except Exception as exc:
            return f"step {step}: your scheduler raised {type(exc).__name__}: {exc}"
        want = run_one_step(ref, stops)
        for label, a, b in zip(("scheduled", "preempted", "finished"), got, want):
            if a != b:
                return f"step {step} ({limits.describe()}): {label}: yours {a}, the package's {b}"
        a_state, b_state = mine.state(), ref.state()
        for key in b_state:
            if a_state[key] != b_state[key]:
                diff = _first_diff(a_state[key], b_state[key])
                return f"after step {step} ({limits.describe()}): {key}: {diff}"
        if not ref.sched.has_unfinished() and step >= TWIN_STEPS - 30:
            break
    return "same" if mine.sched.has_unfinished() == ref.sched.has_unfinished() else "has_unfinished() differs"


def _first_diff(a: Any, b: Any) -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"{k}: yours {a.get(k)}, the package's {b.get(k)} (status, computed, tokens, table)"
    return f"yours {a}, the package's {b}"


def check_scheduler_twin(Scheduler: SchedulerClass) -> list[CheckOutcome]:
    """Random arrivals (shared prefixes, stop tokens, tight pools) served by the learner's scheduler and the
    package's, every step compared."""
    hint = (
        "the first step where your scheduler and the package's disagree is named: replay it with the spec "
        "(running first and in order; preempt the newest; no admission after a preemption; FCFS with prefix hits)"
    )
    checks = [
        Check(
            f"seed {seed}: up to {TWIN_STEPS} steps of random arrivals, yours and the package's; the first "
            "difference in what is scheduled, preempted or finished, the queues, a request, or the pool",
            lambda seed=seed: _twin_run(Scheduler, seed),
            "same",
            hint=hint,
        )
        for seed in TWIN_SEEDS
    ]
    return report("scheduler_twin", checks)
