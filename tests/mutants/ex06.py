"""Exercise 06 — the admission loop of continuous batching: wrong solutions a learner writes."""

from __future__ import annotations

from collections import deque

from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import RequestStatus

from . import mutant

CHECKS = {"admit_waiting": ["check_admit_waiting", "check_admission_state"]}
HELPERS: dict = {}


@mutant("admit_waiting", "forgets the state transition: an admitted request keeps status WAITING")
def no_status_change(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    while waiting and token_budget > 0 and free_seats > 0:
        req = waiting[0]
        hit_blocks, hit_tokens = kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - hit_tokens, token_budget)
        if kv.allocate_slots(req, num_new, hit_tokens, hit_blocks) is None:
            break
        req.num_computed_tokens = hit_tokens
        # MISTAKE: req.status is not set to RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= 1
    return admitted


@mutant("admit_waiting", "a request that does not fit is skipped and the ones behind it go ahead (not FCFS)")
def overtakes_the_head(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    for req in list(waiting):
        if token_budget <= 0 or free_seats <= 0:
            break
        hit_blocks, hit_tokens = kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - hit_tokens, token_budget)
        if kv.allocate_slots(req, num_new, hit_tokens, hit_blocks) is None:
            continue  # MISTAKE: first come, first served means stop here
        req.num_computed_tokens = hit_tokens
        req.status = RequestStatus.RUNNING
        waiting.remove(req)
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= 1
    return admitted


@mutant("admit_waiting", "ignores the prefix cache: every prompt is computed from its first token")
def no_prefix_cache(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    while waiting and token_budget > 0 and free_seats > 0:
        req = waiting[0]
        num_new = min(req.num_tokens, token_budget)  # MISTAKE: no kv.get_computed_blocks(req)
        if kv.allocate_slots(req, num_new) is None:
            break
        req.num_computed_tokens = 0
        req.status = RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= 1
    return admitted


@mutant("admit_waiting", "looks up the prefix cache but leaves num_computed_tokens at 0 (the hit is not counted)")
def hit_not_counted_as_computed(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    while waiting and token_budget > 0 and free_seats > 0:
        req = waiting[0]
        hit_blocks, hit_tokens = kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - hit_tokens, token_budget)
        if kv.allocate_slots(req, num_new, hit_tokens, hit_blocks) is None:
            break
        # MISTAKE: req.num_computed_tokens is not set to hit_tokens
        req.status = RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= 1
    return admitted


@mutant("admit_waiting", "no chunked prefill: a prompt longer than the budget left waits instead of taking a chunk")
def no_chunking(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    while waiting and token_budget > 0 and free_seats > 0:
        req = waiting[0]
        hit_blocks, hit_tokens = kv.get_computed_blocks(req)
        num_new = req.num_tokens - hit_tokens
        if num_new > token_budget:  # MISTAKE: the budget caps a prompt, it does not refuse it
            break
        if kv.allocate_slots(req, num_new, hit_tokens, hit_blocks) is None:
            break
        req.num_computed_tokens = hit_tokens
        req.status = RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= 1
    return admitted


@mutant("admit_waiting", "forgets to count seats: admits past max_num_seqs")
def seats_not_counted(waiting: deque, kv: KVCacheManager, token_budget: int, free_seats: int):
    admitted = []
    while waiting and token_budget > 0 and free_seats > 0:
        req = waiting[0]
        hit_blocks, hit_tokens = kv.get_computed_blocks(req)
        num_new = min(req.num_tokens - hit_tokens, token_budget)
        if kv.allocate_slots(req, num_new, hit_tokens, hit_blocks) is None:
            break
        req.num_computed_tokens = hit_tokens
        req.status = RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        # MISTAKE: free_seats is not decreased
    return admitted
