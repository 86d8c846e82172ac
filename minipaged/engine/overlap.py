"""The overlap loop: the engine's step with the host's work hidden under the device's (async scheduling).

``run_step`` does schedule, execute, update one after the other, so the device idles while the host schedules
and the host idles while the device computes. ``StepPipeline.step`` keeps one step in flight::

    call 1:  schedule 1, launch 1 ─┬─ plan ahead of 1, schedule 2, launch 2 ─┬─ wait 1, settle 1   → 1's tokens
    call 2:                        │  plan ahead of 2, schedule 3, launch 3 ─┼─ wait 2, settle 2   → 2's tokens
                                   └─ the device runs 1 meanwhile             └─ then 2, already queued

Each call returns one step's results, as ``run_step`` does, and synchronises with the device once: when it
waits for that step's tokens (one copy of every sampled row, ``sampler.DeviceSamples``). A step in flight is
never dropped while a request it serves is still there: when the next step cannot be planned ahead, it is
waited for and applied as ``run_step`` applies a step. The scheduler's side
(placeholders for the tokens still on the device, what a failed step takes back) is ``core/async_scheduler.py``;
the runner's (the last step's tokens copied into this step's inputs on the device) is
``InputPreparer._fill_placeholders`` (``worker/step_inputs.py``).

A step that cannot be planned ahead (``can_plan_ahead``: an ``n > 1`` request's first sample) is waited for
and updated as ``run_step`` does. An engine with speculative decoding or a KV connector, or with a learner's
part plugged in, steps through ``run_step`` itself (drafts come from the tokens, a connector's saves follow
each step, a part's step is snapshotted).

A failure anywhere (the launch, the wait, the update) rolls back the step that was in flight and the one
scheduled ahead of it: placeholders dropped, computed tokens as before the step, their hashes gone
(``Scheduler.rollback_step``). The scheduler is then as ``run_step`` leaves it after a failed step, and the
next call starts again from a plain schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..config import Config
from ..core.async_scheduler import PlannedStep, can_plan_ahead, plan_ahead, plans_ahead, schedule_ahead, settle, undo
from ..core.scheduler import Scheduler
from ..core.scheduler_output import PendingOutput, SchedulerOutput
from .step import Executor, StepResult, apply_result, release_if_idle, run_step


@dataclass
class InFlight:
    """A step launched and not yet waited for, with what its scheduling took and found in the prefix cache."""

    output: SchedulerOutput
    pending: PendingOutput
    schedule_s: float
    prefix_queries: int
    prefix_hits: int


class StepPipeline:
    """Keeps at most one step on the device while the host prepares the next (see the module docstring).
    ``overlap=False``: every step is ``run_step``'s, one after the other (a CPU engine's default)."""

    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap
        self.in_flight: InFlight | None = None
        self.num_overlapped = 0  # steps scheduled while the one before still ran
        self.hidden_s = 0.0  # host seconds spent while a step was in flight (schedule + launch of the next)

    def step(self, scheduler: Scheduler, executor: LaunchingExecutor, now: Callable[[], float],
             step_index: int | None = None) -> StepResult:  # fmt: skip
        """One step's results (the oldest in flight), with the next step launched before waiting for them."""
        if self.in_flight is None and not (self.overlap and plans_ahead(scheduler)):
            return run_step(scheduler, executor, now, step_index)  # the plain step (a learner's part: snapshot)
        current = self.in_flight or self._launch(scheduler, executor, ahead=None)
        self.in_flight = None
        planned: PlannedStep | None = None
        try:
            t0 = time.perf_counter()
            if self.overlap and can_plan_ahead(scheduler, current.output) and scheduler.has_unfinished():
                planned = plan_ahead(scheduler, current.output)
                self.in_flight = self._launch(scheduler, executor, ahead=planned)
                self.num_overlapped += 1
                self.hidden_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            result = current.pending.result()
            t2 = time.perf_counter()
            if planned is not None:
                finished = settle(scheduler, planned, result, now())
            else:  # nothing scheduled ahead of it (a fork, the end, a part just plugged in): the plain update
                finished = apply_result(scheduler, current.output, result, now())
        except BaseException:
            self._fail(scheduler, current, planned)
            raise
        release_if_idle(scheduler, executor)
        if self.in_flight is not None and not scheduler.has_unfinished():
            self.drain(scheduler)  # nothing left that the step ahead could serve: wait for it, keep nothing
        t3 = time.perf_counter()
        return StepResult(
            current.output, finished, current.schedule_s, t2 - t1, t3 - t2, current.prefix_queries,
            current.prefix_hits,
        )  # fmt: skip

    def _launch(self, scheduler: Scheduler, executor: LaunchingExecutor, ahead: PlannedStep | None) -> InFlight:
        """Schedule a step (ahead of ``ahead``'s tokens, if given) and start it on the executor."""
        kv = scheduler.kv_cache_manager
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        t0 = time.perf_counter()
        try:
            out = scheduler.schedule() if ahead is None else schedule_ahead(scheduler, ahead)
            t1 = time.perf_counter()
            pending = executor.launch(out)
        except BaseException:
            if ahead is None:  # the plain step failed: as run_step rolls back (a step ahead: the caller does)
                scheduler.rollback_step()
            raise
        return InFlight(out, pending, t1 - t0, kv.prefix_cache_queries - queries, kv.prefix_cache_hits - hits)

    def _fail(self, scheduler: Scheduler, current: InFlight, planned: PlannedStep | None) -> None:
        """A step failed (waiting for it, applying it, or scheduling or launching the one after): both are
        dropped unread once the device is done with them, what was counted ahead is taken back, and the hashes
        of both steps go."""
        ahead, self.in_flight = self.in_flight, None
        for step in (current, ahead):
            if step is not None:
                try:
                    step.pending.result()  # let it finish: its buffers are the next step's
                except BaseException:  # dropped: the first failure is the one to report
                    pass
        if planned is not None:
            undo(scheduler, planned)
        scheduler.rollback_step()

    @classmethod
    def for_engine(cls, config: Config, device_type: str) -> StepPipeline:
        """An engine's: overlapped if asked (``async_scheduling``), or, not asked (None), for one process on a GPU.
        A CPU runs the forward itself (nothing to hide the host's work under), and tensor-parallel workers would
        need rank 0's tokens before they could run a step scheduled ahead."""
        asked = config.async_scheduling
        return cls(asked if asked is not None else device_type == "cuda" and config.tensor_parallel_size == 1)

    def forget(self) -> None:
        """Drop the step in flight unread: the engine drops every request it served (``reset``, ``shutdown``)."""
        self.in_flight = None

    def release_if_idle(self, scheduler: Scheduler, executor: Executor) -> None:
        """After an abort (``step.release_if_idle``): with nothing left to schedule, the executor hears of the
        requests that left now, and the step in flight, which serves nobody, is waited for and dropped."""
        release_if_idle(scheduler, executor)
        if not scheduler.has_unfinished():
            self.drain(scheduler)

    def drain(self, scheduler: Scheduler) -> None:
        """Wait for the step in flight and drop its result: every request it served has left (aborted, or
        finished by the step before). Its hashes are kept if it ran; if it failed, they go, and so does the
        failure: no request was waiting for it."""
        ahead, self.in_flight = self.in_flight, None
        if ahead is None:
            return
        try:
            ahead.pending.result()
        except Exception:  # an interrupt still interrupts; a failed step nobody needs is rolled back quietly
            scheduler.rollback_step()
            return
        scheduler.kv_cache_manager.commit_step()


class LaunchingExecutor(Executor, Protocol):
    """An executor that can start a step without waiting for it (``ExecutorBase.launch``)."""

    def launch(self, out: SchedulerOutput) -> PendingOutput: ...
