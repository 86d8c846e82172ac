"""Exercise 07 — preemption by recompute: wrong solutions a learner writes."""

from __future__ import annotations

from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request, RequestStatus

from . import mutant

CHECKS = {"preempt_recompute": ["check_preempt_recompute"], "schedule_running": ["check_schedule_running"]}
HELPERS: dict = {}


# ---- part 1: preempt_recompute ----------------------------------------------------------------
@mutant("preempt_recompute", "does not reset num_computed_tokens: the victim claims K/V it no longer has")
def keeps_computed_tokens(victim: Request, kv: KVCacheManager, waiting) -> None:
    kv.free(victim)
    # MISTAKE: victim.num_computed_tokens is not set back to 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    waiting.appendleft(victim)


@mutant("preempt_recompute", "does not count the preemption (num_preemptions unchanged)")
def preemption_not_counted(victim: Request, kv: KVCacheManager, waiting) -> None:
    kv.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    # MISTAKE: victim.num_preemptions is not increased
    waiting.appendleft(victim)


@mutant("preempt_recompute", "puts the victim at the back of the waiting queue, behind newer requests")
def appends_at_back(victim: Request, kv: KVCacheManager, waiting) -> None:
    kv.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    waiting.append(victim)  # MISTAKE


@mutant("preempt_recompute", "forgets to give the victim's blocks back to the pool")
def blocks_not_freed(victim: Request, kv: KVCacheManager, waiting) -> None:
    # MISTAKE: no kv.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    waiting.appendleft(victim)


@mutant("preempt_recompute", "forgets the state transition: the victim stays RUNNING")
def status_unchanged(victim: Request, kv: KVCacheManager, waiting) -> None:
    kv.free(victim)
    victim.num_computed_tokens = 0
    # MISTAKE: victim.status is not set to RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    waiting.appendleft(victim)


# ---- part 2: schedule_running -----------------------------------------------------------------
@mutant("schedule_running", "preempts the oldest running request instead of the newest")
def preempts_oldest(running: list, waiting, kv: KVCacheManager, token_budget: int, preempt):
    scheduled, preempted = [], []
    i = 0
    while i < len(running) and token_budget > 0:
        req = running[i]
        num_new = min(req.num_tokens - req.num_computed_tokens, token_budget)
        while kv.allocate_slots(req, num_new) is None:
            victim = running.pop(0)  # MISTAKE
            preempt(victim, kv, waiting)
            preempted.append(victim.request_id)
            if victim is req:
                break
        if req.status is not RequestStatus.RUNNING:
            break
        scheduled.append((req.request_id, num_new))
        token_budget -= num_new
        i += 1
    return scheduled, preempted


@mutant("schedule_running", "gives every running request one token (decode only): a mid-prompt one is not chunked")
def one_token_each(running: list, waiting, kv: KVCacheManager, token_budget: int, preempt):
    scheduled, preempted = [], []
    i = 0
    while i < len(running) and token_budget > 0:
        req = running[i]
        num_new = 1  # MISTAKE: a request still in its prompt needs the rest of it, capped by the budget
        while kv.allocate_slots(req, num_new) is None:
            victim = running.pop()
            preempt(victim, kv, waiting)
            preempted.append(victim.request_id)
            if victim is req:
                break
        if req.status is not RequestStatus.RUNNING:
            break
        scheduled.append((req.request_id, num_new))
        token_budget -= num_new
        i += 1
    return scheduled, preempted


@mutant("schedule_running", "never spends the token budget: every running request runs, whatever the budget")
def budget_not_spent(running: list, waiting, kv: KVCacheManager, token_budget: int, preempt):
    scheduled, preempted = [], []
    i = 0
    while i < len(running) and token_budget > 0:
        req = running[i]
        num_new = min(req.num_tokens - req.num_computed_tokens, token_budget)
        while kv.allocate_slots(req, num_new) is None:
            victim = running.pop()
            preempt(victim, kv, waiting)
            preempted.append(victim.request_id)
            if victim is req:
                break
        if req.status is not RequestStatus.RUNNING:
            break
        scheduled.append((req.request_id, num_new))
        # MISTAKE: token_budget is not decreased by num_new
        i += 1
    return scheduled, preempted


@mutant("schedule_running", "a request that preempted itself is still scheduled (and the loop goes on)")
def schedules_itself_after_preemption(running: list, waiting, kv: KVCacheManager, token_budget: int, preempt):
    scheduled, preempted = [], []
    i = 0
    while i < len(running) and token_budget > 0:
        req = running[i]
        num_new = min(req.num_tokens - req.num_computed_tokens, token_budget)
        while kv.allocate_slots(req, num_new) is None:
            victim = running.pop()
            preempt(victim, kv, waiting)
            preempted.append(victim.request_id)
            if victim is req:
                break
        # MISTAKE: no check that req is still RUNNING (it may have just been preempted)
        scheduled.append((req.request_id, num_new))
        token_budget -= num_new
        i += 1
    return scheduled, preempted
