"""One step of continuous batching, in nano-vllm's three calls: schedule, execute, update.

The engine, the simulator and the tests' driver all step through ``run_step``; what differs is the
*executor*, the part that turns a ``SchedulerOutput`` into sampled tokens::

                    ┌──────────── executor.execute(output) ────────────┐
    scheduler.schedule() ─▶ SchedulerOutput ─▶  engine:    ModelRunner (forward + sample)  ─▶ RunnerOutput
                                                simulator: a cost model's clock + fake tokens
                                                tests:     a fake model that writes and checks the cache
    scheduler.update_from_output(output, sampled) ◀────────────────────────────────────────────┘

Both messages are plain data (``scheduler_output``): the executor may live in another process.
A request whose row fails in the executor (NaN logits, say) finishes with an error; the others go on.

A step happens or it does not: any other exception leaves the scheduler as it was (the scheduler applies a
step's results only once they are all in, and ``rollback_step`` unhashes what the step's allocation hashed).
A learner's plugged-in part (``parts``) gives no such promise, so while parts are plugged in the whole
bookkeeping is saved first and put back if the step fails (``snapshot``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .. import hooks
from ..core.kv_cache_manager import KVCacheManager
from ..core.request import Request
from ..core.scheduler import ADVISORY_PARTS, Scheduler
from ..core.scheduler_output import RunnerOutput, SchedulerOutput
from .snapshot import Snapshot


class Executor(Protocol):
    """What runs a step's work: the model runner, or a stand-in for it."""

    def execute(self, out: SchedulerOutput) -> RunnerOutput: ...

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        """Drop what it keeps for requests that left (the runner: their block tables, their random streams)."""
        ...


@dataclass
class StepResult:
    """What one step did: the scheduler's output, the requests that finished in it (failed ones included),
    the seconds spent in each of the three calls, the prompt tokens its admissions looked up in the prefix
    cache and found there, and (speculative decoding) the drafts it checked and accepted."""

    output: SchedulerOutput
    finished: list[Request]
    schedule_s: float
    execute_s: float
    update_s: float
    prefix_queries: int = 0
    prefix_hits: int = 0
    drafts: int = 0
    accepted: int = 0

    def stats(self, scheduler: Scheduler, now: float) -> dict[str, Any]:
        """The step as one row of ``LLM.step_stats`` (what the widgets and benchmarks plot)."""
        kv = scheduler.kv_cache_manager
        return dict(
            time=now,
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(scheduler.swapped),
            blocks_used=kv.num_blocks - 1 - kv.get_num_free_blocks(),
            tokens=self.output.total_num_scheduled_tokens,
            preempted=len(self.output.preempted),
            drafts=self.drafts,
            accepted=self.accepted,
        )


def run_step(
    scheduler: Scheduler, executor: Executor, now: Callable[[], float], step_index: int | None = None
) -> StepResult:
    """Schedule, execute, update, or nothing at all (see the module docstring). ``now()`` is read after the
    executor ran: the time the step's tokens exist. ``step_index`` names the step in a part's error."""
    # A learner's part may fail halfway through the step: keep what to restore. A policy (exercise 10b) needs
    # nothing kept: the scheduler asks it before the step changes anything, and it cannot touch the cache.
    saved = Snapshot.take(scheduler.bookkeeping()) if hooks.active(ignore=ADVISORY_PARTS) else None
    if saved is not None:
        hooks.at_exit(id(scheduler.kv_cache_manager), _forget_prefix_cache(scheduler.kv_cache_manager))
    try:
        return schedule_execute_update(scheduler, executor, now)
    except BaseException as exc:  # the step did not happen
        if saved is not None:
            saved.restore()
        else:  # no block hashed for it stays findable
            scheduler.rollback_step()
        if isinstance(exc, hooks.PartError) and step_index is not None:
            exc.in_step(step_index)
        raise


def _forget_prefix_cache(kv: KVCacheManager) -> Callable[[], None]:
    """What the end of a ``parts.use`` block does to a KV cache manager a step ran on with parts plugged in:
    forget every prefix-cache entry, since a learner's code may have computed, hashed or (unchecked) written
    any of them. Holds the manager weakly."""
    ref = weakref.ref(kv)

    def forget() -> None:
        manager = ref()
        if manager is not None:
            manager.forget_prefix_cache()

    return forget


def schedule_execute_update(scheduler: Scheduler, executor: Executor, now: Callable[[], float]) -> StepResult:
    """The three calls, each timed. Rows the executor could not sample finish their requests with an error
    before the update, which then skips them; the update applies everything else at once."""
    kv, spec = scheduler.kv_cache_manager, scheduler.spec_decoding_stats
    queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
    drafts, accepted = (0, 0) if spec is None else (spec.num_draft_tokens, spec.num_accepted_tokens)
    t0 = time.perf_counter()
    out = scheduler.schedule()
    t1 = time.perf_counter()
    result = executor.execute(out)
    t2 = time.perf_counter()
    finished = apply_result(scheduler, out, result, now())
    release_if_idle(scheduler, executor)
    t3 = time.perf_counter()
    if spec is not None:
        drafts, accepted = spec.num_draft_tokens - drafts, spec.num_accepted_tokens - accepted
    return StepResult(
        out, finished, t1 - t0, t2 - t1, t3 - t2, kv.prefix_cache_queries - queries, kv.prefix_cache_hits - hits,
        drafts, accepted,
    )  # fmt: skip


def apply_result(scheduler: Scheduler, out: SchedulerOutput, result: RunnerOutput, now: float) -> list[Request]:
    """A step's result into the scheduler: the requests whose rows failed finish with their error, then the
    update applies the rest at once. Returns the requests that finished."""
    failed = [scheduler.finish_with_error(rid, f"request {rid!r}: {why}") for rid, why in result.errors.items()]
    return [r for r in failed if r is not None] + scheduler.update_from_output(out, result.sampled, now=now)


def release_if_idle(scheduler: Scheduler, executor: Executor) -> None:
    """Requests that left are told to the executor with the next step; with nothing left to schedule there
    is no next step, so tell it now."""
    if not scheduler.has_unfinished():
        executor.release(*scheduler.take_finished())
