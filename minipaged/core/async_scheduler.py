"""Async scheduling, the scheduler's side: schedule step N+1 while the device still runs step N.

A GPU step of a small model takes a few milliseconds; scheduling the next one, building its inputs and reading
back the last one's tokens take about as long on the host. Done one after the other, the GPU idles for the
host's share of every step. vLLM v1's async scheduling (``AsyncScheduler``) and mini-sglang's overlap loop
hide it: while the device runs step N, the host schedules and launches step N+1, then takes step N's tokens::

    host    | schedule N+1 | launch N+1 | wait N, update N | schedule N+2 | launch N+2 | wait N+1 ...
    device  |<------------- step N ------------>|<------------- step N+1 ------------>| ...

Step N+1 is scheduled before step N's tokens are known, so the scheduler counts them without knowing them:

* ``plan_ahead`` advances every request of step N as if its tokens were in. A request that samples gets a
  *placeholder* token (``PLACEHOLDER_TOKEN_ID``) at the end of its outputs: step N+1 feeds it, and the runner
  copies the real token into that row on the device (``InputPreparer._fill_placeholders`` in
  ``worker/step_inputs.py``). The placeholder's block is not hashed, so no prefix lookup can find a block with a token nobody knows.
* A request that N's token ends for sure (``max_tokens``, ``max_model_len``) is left out of step N+1. One that
  a stop token may end cannot be told apart: it is scheduled, and if its token was a stop, what step N+1
  computed for it is thrown away (vLLM does the same).
* ``settle`` puts the real tokens in place of the placeholders, hashes the blocks they complete, and finishes
  the requests that are done, wherever they are now (step N+1 may have preempted one).
* ``undo`` is for a step that failed: the placeholders go and the requests count what they had computed
  before step N; ``Scheduler.rollback_step`` then unhashes what steps N and N+1 hashed.

Steps that cannot be planned ahead run as before, one after the other: with speculative decoding (the drafts
come from the tokens), an ``n > 1`` request's first sample (it forks on its tokens), a KV connector (its saves
follow each step), or a learner's part plugged in (``hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import hooks
from .request import Request
from .scheduler import Scheduler, num_seqs_when_running
from .scheduler_output import RunnerOutput, SchedulerOutput


@dataclass
class PlannedStep:
    """What ``plan_ahead`` did to step N's requests, for ``settle`` or ``undo``: each request with how many
    tokens it had computed before, and whether it got a placeholder; the ids that step N ends for sure."""

    output: SchedulerOutput
    requests: list[tuple[Request, int, bool]] = field(default_factory=list)
    ending: set[str] = field(default_factory=set)


def plans_ahead(scheduler: Scheduler) -> bool:
    """Whether this scheduler's steps may be scheduled ahead at all: not with speculative decoding, a KV
    connector, or a learner's part plugged in (see the module docstring)."""
    return scheduler.proposer is None and scheduler.kv_cache_manager.connector is None and not hooks.active()


def can_plan_ahead(scheduler: Scheduler, out: SchedulerOutput) -> bool:
    """Whether the step after ``out`` may be scheduled before ``out``'s tokens are in: not after an ``n > 1``
    request's first sample (it forks on its tokens)."""
    return plans_ahead(scheduler) and all(s.num_samples <= 1 and not s.spec_token_ids for s in out.scheduled)


def plan_ahead(scheduler: Scheduler, out: SchedulerOutput) -> PlannedStep:
    """Advance step ``out``'s requests as if its tokens were in: a placeholder for each sampled token."""
    planned = PlannedStep(out)
    max_model_len = scheduler.config.max_model_len
    for s in out.scheduled:
        req = scheduler.requests.get(s.request_id)
        if req is None:  # aborted, or failed, since it was scheduled
            continue
        planned.requests.append((req, req.num_computed_tokens, s.samples))
        req.num_computed_tokens += s.num_new_tokens
        if s.samples:
            req.add_placeholder()
            if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= max_model_len:
                planned.ending.add(req.request_id)
    return planned


def schedule_ahead(scheduler: Scheduler, planned: PlannedStep) -> SchedulerOutput:
    """The next step, scheduled while ``planned`` runs: without the requests it ends for sure, which keep their
    place in the running queue, and their seats, until ``settle`` finishes them."""
    before = scheduler.running
    scheduler.running = [r for r in before if r.request_id not in planned.ending]
    held = sum(num_seqs_when_running(r) for r in before if r.request_id in planned.ending)
    try:
        return scheduler.schedule(ahead=True, held_seats=held)
    finally:
        after = scheduler.running
        kept, was = {id(r) for r in after}, {id(r) for r in before}
        scheduler.running = [r for r in before if id(r) in kept or r.request_id in planned.ending]
        scheduler.running += [r for r in after if id(r) not in was]  # admitted by the step scheduled ahead


def settle(scheduler: Scheduler, planned: PlannedStep, result: RunnerOutput, now: float) -> list[Request]:
    """Step N's result, once it is in: every placeholder gets its token (or its request an error), and the
    requests that are done finish. Checks everything before changing anything, as ``update_from_output`` does.
    Returns the requests that finished."""
    sampling = [req for req, _, placeholder in planned.requests if placeholder]
    for req in sampling:
        rid, tokens = req.request_id, result.sampled.get(req.request_id)
        if rid in scheduler.requests and rid not in result.errors and (tokens is None or len(tokens) != 1):
            raise ValueError(f"request {rid!r} needs 1 sampled token, got {tokens!r}")
    finished: list[Request] = []
    for req in sampling:
        rid = req.request_id
        if rid not in scheduler.requests:  # gone since (it failed in this very loop): no token for it
            req.drop_placeholder()
            continue
        if rid in result.errors:
            req.drop_placeholder()
            failed = scheduler.finish_with_error(rid, f"request {rid!r}: {result.errors[rid]}")
            finished += [] if failed is None else [failed]
            continue
        token = result.sampled[rid][0]
        req.resolve_placeholder(token)
        finished += scheduler.finish_if_done(req, token, now)
    scheduler.kv_cache_manager.commit_in_flight()
    return finished


def undo(scheduler: Scheduler, planned: PlannedStep) -> None:
    """Step N failed: take back what ``plan_ahead`` counted (a request's placeholder, its computed tokens).
    The caller then rolls back the hashes of both steps (``Scheduler.rollback_step``)."""
    for req, computed, placeholder in planned.requests:
        if placeholder and req.num_output_placeholders:
            req.drop_placeholder()
        req.num_computed_tokens = min(req.num_computed_tokens, computed)
