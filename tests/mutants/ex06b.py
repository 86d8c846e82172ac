"""Exercise 06b — the scheduler from its spec: schedulers a learner gets wrong, each one mistake from a right one.

``PhaseScheduler`` is a right answer written differently from the solution notebook's: each phase of a step is a
method, the running phase walks a copy of the queue and looks victims up from the back, and finishing is one
predicate. It is graded for full marks as the mutants' helper. Each mutant below changes one method of it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from minipaged.core.request import Request, RequestStatus

from . import mutant

CHECKS = {"Scheduler": ["check_scheduler_spec", "check_scheduler_twin"]}


class PhaseScheduler:
    def __init__(self, kv_cache_manager: Any, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int):
        self.kv_cache_manager = kv_cache_manager
        self.seats, self.budget, self.max_model_len = max_num_seqs, max_num_batched_tokens, max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return len(self.waiting) + len(self.running) > 0

    # ---- one step ----
    def schedule(self) -> tuple[list[tuple[str, int]], list[str]]:
        plan: list[tuple[str, int]] = []
        victims: list[str] = []
        left = self.serve_running(plan, victims, self.budget)
        if self.may_admit(victims):
            self.admit(plan, left)
        return plan, victims

    def chunk(self, req: Request, computed: int, left: int) -> int:
        return min(req.num_tokens - computed, left)

    def serve_running(self, plan: list[tuple[str, int]], victims: list[str], left: int) -> int:
        for req in list(self.running):
            if left <= 0 or req not in self.running:
                break
            n = self.chunk(req, req.num_computed_tokens, left)
            while self.kv_cache_manager.allocate_slots(req, n) is None:
                victim = self.pick_victim()
                self.preempt(victim)
                victims.append(victim.request_id)
                if victim is req:
                    return left
            plan.append((req.request_id, n))
            left -= n
        return left

    def pick_victim(self) -> Request:
        return self.running[-1]

    def preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.requeue(victim)

    def requeue(self, victim: Request) -> None:
        self.waiting.appendleft(victim)

    def may_admit(self, victims: list[str]) -> bool:
        return not victims

    def lookup(self, req: Request) -> tuple[Any, int]:
        return self.kv_cache_manager.get_computed_blocks(req)

    def seats_free(self) -> int:
        return self.seats - len(self.running)

    def admit(self, plan: list[tuple[str, int]], left: int) -> None:
        while self.waiting and left > 0 and self.seats_free() > 0:
            req = self.waiting[0]
            hits, num_hit = self.lookup(req)
            n = self.chunk(req, num_hit, left)
            if self.kv_cache_manager.allocate_slots(req, n, num_hit, hits) is None:
                return
            self.waiting.popleft()
            req.num_computed_tokens, req.status = num_hit, RequestStatus.RUNNING
            self.running.append(req)
            plan.append((req.request_id, n))
            left -= self.cost(n, num_hit)

    def cost(self, computed: int, num_hit: int) -> int:
        return computed  # the budget counts tokens computed: a prefix hit is read from the cache

    # ---- after the step ----
    def finish_reason(self, req: Request, token: int) -> str | None:
        if token == req.eos_token_id:
            return "stop"
        if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def update_from_output(self, scheduled: list[tuple[str, int]], sampled: dict[str, int]) -> list[Request]:
        done = []
        for rid, n in scheduled:
            (req,) = [r for r in self.running if r.request_id == rid]
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(sampled[rid])
                reason = self.finish_reason(req, sampled[rid])
                if reason:
                    req.finish_reason, req.status = reason, RequestStatus.FINISHED
                    self.running.remove(req)
                    self.kv_cache_manager.free(req)
                    done.append(req)
        return done


HELPERS: dict = {"Scheduler": PhaseScheduler}


@mutant("Scheduler", "the oldest running request is preempted: the one closest to done loses its work")
class PreemptsTheOldest(PhaseScheduler):
    def pick_victim(self) -> Request:
        return self.running[0]  # MISTAKE: the newest, running[-1]


@mutant("Scheduler", "a preempted request goes to the back of waiting: it starves behind newcomers")
class VictimToTheBack(PhaseScheduler):
    def requeue(self, victim: Request) -> None:
        self.waiting.append(victim)  # MISTAKE: appendleft: it was admitted before everyone waiting


@mutant("Scheduler", "a waiting request that does not fit is skipped: long prompts starve")
class SkipsTheHead(PhaseScheduler):
    def admit(self, plan: list[tuple[str, int]], left: int) -> None:
        for req in list(self.waiting):
            if left <= 0 or self.seats_free() <= 0:
                return
            hits, num_hit = self.lookup(req)
            n = self.chunk(req, num_hit, left)
            if self.kv_cache_manager.allocate_slots(req, n, num_hit, hits) is None:
                continue  # MISTAKE: first come, first served: stop at the head
            self.waiting.remove(req)
            req.num_computed_tokens, req.status = num_hit, RequestStatus.RUNNING
            self.running.append(req)
            plan.append((req.request_id, n))
            left -= n


@mutant("Scheduler", "no prefix-cache lookup at admission: every prompt is computed in full")
class NoLookup(PhaseScheduler):
    def lookup(self, req: Request) -> tuple[Any, int]:
        return [], 0  # MISTAKE: get_computed_blocks(req)


@mutant("Scheduler", "a prompt's chunk not capped by the budget left: the step exceeds max_num_batched_tokens")
class IgnoresTheBudget(PhaseScheduler):
    def chunk(self, req: Request, computed: int, left: int) -> int:
        return req.num_tokens - computed  # MISTAKE: min(..., left)


@mutant("Scheduler", "max_num_seqs ignored: more requests run at once than the engine has rows for")
class NoSeatLimit(PhaseScheduler):
    def seats_free(self) -> int:
        return 1 << 30  # MISTAKE: max_num_seqs - len(running)


@mutant("Scheduler", "the stop token is ignored: a request runs on to max_tokens")
class IgnoresStop(PhaseScheduler):
    def finish_reason(self, req: Request, token: int) -> str | None:
        if req.num_output_tokens >= req.sampling_params.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None  # MISTAKE: eos_token_id ends it ("stop")


@mutant("Scheduler", "max_model_len ignored: a request grows past the model's context")
class IgnoresMaxModelLen(PhaseScheduler):
    def finish_reason(self, req: Request, token: int) -> str | None:
        if token == req.eos_token_id:
            return "stop"
        return "length" if req.num_output_tokens >= req.sampling_params.max_tokens else None  # MISTAKE: or len


@mutant("Scheduler", "a preempted request keeps its computed count: its blocks are gone, its count says otherwise")
class KeepsTheCount(PhaseScheduler):
    def preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED  # MISTAKE: num_computed_tokens = 0 (recompute from scratch)
        victim.num_preemptions += 1
        self.requeue(victim)


@mutant("Scheduler", "a token appended after every chunk: a prompt still being prefilled 'samples' mid-prompt")
class SamplesEveryChunk(PhaseScheduler):
    def update_from_output(self, scheduled: list[tuple[str, int]], sampled: dict[str, int]) -> list[Request]:
        done = []
        for rid, n in scheduled:
            (req,) = [r for r in self.running if r.request_id == rid]
            req.num_computed_tokens += n
            token = sampled.get(rid, 0)  # MISTAKE: only a request whose every token is computed samples
            req.append_output_token_ids(token)
            reason = self.finish_reason(req, token)
            if reason:
                req.finish_reason, req.status = reason, RequestStatus.FINISHED
                self.running.remove(req)
                self.kv_cache_manager.free(req)
                done.append(req)
        return done


@mutant("Scheduler", "admits in a step that preempted: the request just preempted is admitted again at once")
class AdmitsAfterPreemption(PhaseScheduler):
    def may_admit(self, victims: list[str]) -> bool:
        return True  # MISTAKE: not victims (a step that preempted admits nobody: the pool is short)


@mutant("Scheduler", "the prefix hits charged to the step's token budget: they cost no compute")
class HitsChargedToBudget(PhaseScheduler):
    def cost(self, computed: int, num_hit: int) -> int:
        return computed + num_hit  # MISTAKE: computed (a hit is read from the cache, not computed)
