"""The scheduler: every step, decide again who runs and with how many tokens.

Static batching picks a batch and runs it until its *longest* member finishes.
Iteration-level scheduling (Orca; vLLM) re-decides at every step, so a request
that finishes leaves at once and a waiting one takes its place the same step::

    step   1    2    3    4    5    6    7
    A      P    d    d    d    ✓                      P  prefill (chunk)
    B      P    d    ✓                               d  one decode token
    C           P    P    d    d    d    ✓           ✓  finished: blocks freed
    D                     P    d    ✓                   (C's prompt is chunked over 2 steps)

One ``schedule()`` call, in vLLM v1's order:

1. **Running requests first**, oldest first. Each gets what it still needs (the
   rest of its prompt, or one decode token), capped by the step's token budget
   ``max_num_batched_tokens``, so a long prompt is *chunked* across steps and
   mixes with other requests' decodes. Their blocks come from
   ``allocate_slots``; when it answers None the pool is dry and the *newest*
   running request is preempted (recompute: drop its KV, re-run it later;
   swap: copy its blocks to CPU) until the allocation succeeds.
2. **Then swapped, then waiting requests**, each queue in order, while budget,
   ``max_num_seqs`` and the pool allow — but not in a step that had to preempt.
   Swapped requests (their blocks on the CPU) have a queue of their own, as in
   vLLM v0, and while any waits nobody new is admitted (the PagedAttention paper,
   §4.5); a waiting request first looks for its prompt in the prefix cache.
   Admission checks room for what the request computes this step: with chunked
   prefill, the first chunk of its prompt, not the whole prompt (chapter 07).

Steps 1 and 2 are plain functions of the queues, ``schedule_running`` and
``admit_waiting`` (with ``preempt_recompute``): exercises 06 and 07 write them,
and ``minipaged.classroom.parts`` can run a learner's version in their place.

``update_from_output`` then appends each sampled token, finishes requests
(EOS unless ignored, a stop token, ``max_tokens``, ``max_model_len``), frees
their blocks, forgets them (it returns them; the scheduler keeps only unfinished
requests, so its state stays bounded however long it runs), and forks the extra samples of an ``n > 1`` request, which share
the prompt's blocks until they write (copy-on-write).

What ``schedule()`` returns is plain data (``scheduler_output.SchedulerOutput``): request ids, token ids,
positions, block ids, and the ids that finished since the last step, never a live ``Request``, so it can be sent
to another process as it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import hooks
from ..config import Config, SchedulerConfig
from .kv_cache_coordinator import KVCacheGroupSpec
from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnector, OffloadingConnector
from .request import Request, RequestStatus
from .scheduler_output import ScheduledRequest, SchedulerOutput
from .spec_decode import NgramProposer, SpecDecodingStats
from .step_commit import forget_computed


def num_seqs_when_running(req: Request) -> int:
    """Seats a request takes in a step: a not-yet-forked n > 1 request becomes n sequences after its
    first sample, so it counts as n from the start."""
    return req.sampling_params.n if req.num_output_tokens == 0 and req.parent_id is None else 1


# The three pieces of one step that the exercises build (06 and 07). Each is a plain function of the
# queues and the KV cache manager, so a learner's own version can stand in for it, through ``SEAM``.
#
# Three decisions of a step are a *policy* (the open capstone, exercise 10b, writes its own): the order waiting
# requests are tried in, the order running requests give way when the pool is dry, and how many prompt tokens a
# prefill may take in one step. The package's policy is vLLM's default: first come first served, the newest
# running request preempted first, a prompt chunked only by the budget left. A plugged policy is asked once per
# step, *before* the step changes anything, and answers with plain data (``Policy``); the rest of the step
# (allocation, the budget, the seats) stays the package's: a policy can make serving slower or faster, never
# wrong. How a learner's policy is asked (read-only views of the requests, a time limit) is the classroom's:
# ``minipaged/classroom/policy.py``.
SEAM = hooks.Seam(
    "scheduler",
    admit_waiting="Scheduler.schedule, step 2: admit waiting requests",
    schedule_running="Scheduler.schedule, step 1: serve running requests, preempt the newest",
    preempt_recompute="Scheduler.preempt: undo a victim's allocation (recompute)",
    policy="Scheduler.schedule: a policy's answers for the step, asked before it changes anything "
    "(running, waiting, free_seats) -> (Policy, the waiting queue's new order or None)",
)
ADVISORY_PARTS = frozenset({"policy"})  # parts that only answer: a step they run in needs no snapshot to undo


@dataclass
class Policy:
    """One step's answers from a plugged policy (None: the package's rule)."""

    victims: dict[str, int] | None = None  # request id -> rank: the lowest rank gives way first
    caps: dict[str, int] = field(default_factory=dict)  # request id -> most prompt tokens this step


_POLICY = Policy()  # no policy plugged: the package's rules


def prefill_chunk(req: Request, computed: int, token_budget: int, policy: Policy = _POLICY) -> int:
    """New tokens for ``req`` (``computed`` of its tokens in the cache) this step: all it still needs (with
    speculative decoding, its drafts too), capped by the budget, and by the policy's cap for it if there is one."""
    return min(req.num_tokens_with_spec - computed, token_budget, policy.caps.get(req.request_id, token_budget))


def take_victim(running: list[Request], first: int, policy: Policy = _POLICY) -> Request:
    """Remove and return the request to preempt: the newest (vLLM's FCFS rule), or the one the policy ranks first
    among those not served yet this step (``running[first:]``: a request already given its tokens this step
    cannot give its blocks back)."""
    if policy.victims is None:
        return running.pop()
    rank = policy.victims
    victim = min(running[first:], key=lambda r: rank.get(r.request_id, len(rank)))
    running.remove(victim)
    return victim


def schedule_running(
    running: list[Request],
    waiting: deque[Request],
    kv: KVCacheManager,
    token_budget: int,
    preempt: Callable[[Request, KVCacheManager, deque[Request]], None],
    policy: Policy = _POLICY,
) -> tuple[list[tuple[str, int]], list[str]]:
    """Step 1: serve the running requests, oldest first, while the token budget lasts.

    Each gets what it still needs (the rest of its prompt, capped by the budget, or one decode
    token). When ``allocate_slots`` answers None the pool is dry: the *newest* running request
    is taken off (``running.pop()``) and ``preempt``-ed, until the allocation succeeds. A request
    that had to preempt itself ends the step: nobody older can be helped either::

        running  [a, b, c]   a needs a block, pool dry   ->  c preempted, a served
                 [a, b]      b needs a block, pool dry   ->  b preempts itself; stop

    Returns ``(scheduled, preempted)``: ``[(request_id, num_new_tokens)]`` and victims' ids.
    """
    scheduled: list[tuple[str, int]] = []
    preempted: list[str] = []
    i = 0
    while i < len(running) and token_budget > 0:
        req = running[i]
        num_new = prefill_chunk(req, req.num_computed_tokens, token_budget, policy)
        while kv.allocate_slots(req, num_new) is None:
            victim = take_victim(running, i, policy)
            preempt(victim, kv, waiting)
            preempted.append(victim.request_id)
            if victim is req:
                break
        if req.status is not RequestStatus.RUNNING:
            break  # it preempted itself
        scheduled.append((req.request_id, num_new))
        token_budget -= num_new
        i += 1
    return scheduled, preempted


def preempt_recompute(victim: Request, kv: KVCacheManager, waiting: deque[Request]) -> None:
    """Preemption by recompute: forget the victim's KV but keep its tokens; it waits at the *front*
    of the queue and re-prefills prompt + outputs so far when it is admitted again."""
    kv.free(victim)
    victim.num_computed_tokens = 0
    victim.status = RequestStatus.PREEMPTED
    victim.num_preemptions += 1
    waiting.appendleft(victim)


def admit_waiting(
    waiting: deque[Request], kv: KVCacheManager, token_budget: int, free_seats: int, policy: Policy = _POLICY
) -> list[tuple[str, int]]:
    """Step 2: admit waiting requests in arrival order while the budget, the seats and the pool allow.

    A request first looks for its prompt in the prefix cache, then (with a KV connector) for the
    blocks after those outside the pool; only the rest is computed, chunked by the budget. First
    come, first served: when the head of the queue does not fit, nobody behind it is admitted, not
    even a small request that would (no starvation of long prompts).
    Returns ``[(request_id, num_new_tokens)]`` in admission order.
    """
    admitted: list[tuple[str, int]] = []
    while waiting and token_budget > 0:
        req = waiting[0]
        seats = num_seqs_when_running(req)
        if seats > free_seats:
            break
        hits, num_hit_tokens = kv.get_computed_blocks(req)
        num_external = kv.get_num_external_tokens(req, num_hit_tokens)  # 0 without a KV connector
        num_new = prefill_chunk(req, num_hit_tokens + num_external, token_budget, policy)
        if num_hit_tokens + num_external >= req.num_tokens:  # vLLM's invariant: its logits are the first output
            raise RuntimeError(
                f"request {req.request_id!r}: {num_hit_tokens} cached and {num_external} external tokens cover all "
                f"{req.num_tokens} of its prompt, leaving nothing to compute: the last prompt token must always be"
            )
        if kv.allocate_slots(req, num_new, num_hit_tokens, hits, num_external_computed_tokens=num_external) is None:
            break
        req.num_computed_tokens = num_hit_tokens + num_external
        req.status = RequestStatus.RUNNING
        waiting.popleft()
        admitted.append((req.request_id, num_new))
        token_budget -= num_new
        free_seats -= seats
    return admitted


class Scheduler:
    """Continuous batching over one ``KVCacheManager`` (which also holds the CPU swap space)."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        if config.preemption_mode == "swap" and kv_cache_manager.swap.cpu_pool is None:
            raise ValueError(
                "preemption_mode='swap' needs swap space: give the KVCacheManager num_cpu_blocks >= 2 "
                "(block 0 is unused, as on the device)"
            )
        self.block_size = kv_cache_manager.block_size
        self.waiting: deque[Request] = deque()  # new and recompute-preempted requests, in arrival order
        self.swapped: deque[Request] = deque()  # swap-preempted requests: their blocks wait on the CPU
        self.running: list[Request] = []
        # Unfinished requests only: a request is forgotten the moment it finishes (its id may be used
        # again); whoever added it keeps the Request object, which holds its tokens and finish reason.
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests that left since the last step, and their random streams: sent with the next step, for the
        # runner to drop what it keeps for them (bounded by the requests that finish between two steps).
        self.finished_req_ids: dict[str, tuple[str, int]] = {}
        # Speculative decoding (spec_decode.py): drafts by prompt lookup, proposed at the start of each step.
        spec = config.speculative_config
        assert spec is None or not isinstance(spec, (dict, str))  # SchedulerConfig parsed it
        self.proposer = None if spec is None else NgramProposer(spec)
        self.spec_decoding_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)

    @classmethod
    def from_config(
        cls,
        config: Config,
        num_blocks: int,
        max_model_len: int | None = None,
        num_cpu_blocks: int = 0,
        num_offload_blocks: int = 0,
        connector: KVConnector | None = None,
        kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> Scheduler:
        """A scheduler and its KV cache manager, as a ``Config`` describes them (the engine and the simulator);
        with ``num_offload_blocks``, an ``OffloadingConnector`` keeps evicted prefix blocks in that many CPU
        blocks, unless another ``connector`` is given."""
        if connector is None and num_offload_blocks:
            connector = OffloadingConnector(num_offload_blocks, config.block_size)
        kv = KVCacheManager(
            config.block_size,
            num_blocks,
            enable_caching=config.enable_prefix_caching,
            watermark=config.watermark,
            num_cpu_blocks=num_cpu_blocks,
            connector=connector,
            kv_cache_groups=kv_cache_groups,
        )
        return cls(config.scheduler_config(max_model_len), kv)

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request, or finish it at once as *rejected* if it can never run.

        A prompt longer than ``max_model_len``, or a request whose longest possible
        life needs more blocks than the pool will ever have, is rejected with a
        message on that request alone: the others are not affected.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        max_len = min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.config.max_model_len)
        capacity = (
            self.kv_cache_manager.num_blocks
            - 1
            - self.kv_cache_manager.reserved_blocks
            - self.kv_cache_manager.watermark_blocks
        )
        # Blocks it may hold at once, all KV cache groups together (a sliding window's stay bounded).
        num_needed = self.kv_cache_manager.max_num_blocks(max_len, self.config.max_num_batched_tokens)
        if request.sampling_params.n > self.config.max_num_seqs:
            self._reject(
                request, f"n={request.sampling_params.n} samples exceed max_num_seqs={self.config.max_num_seqs}"
            )
        elif request.num_prompt_tokens > self.config.max_model_len:
            self._reject(
                request,
                f"prompt of {request.num_prompt_tokens} tokens is longer than "
                f"max_model_len={self.config.max_model_len}",
            )
        elif num_needed > capacity:
            self._reject(
                request,
                f"needs up to {num_needed} blocks ({max_len} tokens) but the "
                f"KV pool can give one request at most {capacity}",
            )
        else:
            request.status = RequestStatus.WAITING
            self.requests[request.request_id] = request
            self.waiting.append(request)

    def _reject(self, request: Request, why: str) -> None:
        request.status, request.finish_reason = RequestStatus.FINISHED, "rejected"
        request.error = f"request {request.request_id!r} rejected: {why}"
        request.finish_time = request.arrival_time

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def bookkeeping(self) -> Iterator[Any]:
        """Every object a step changes: the scheduler, the KV manager and its pools, every request (see
        ``snapshot``: ``step.run_step`` restores them all when a step that runs a learner's part fails)."""
        yield self
        yield from self.kv_cache_manager.bookkeeping()
        for req in (*self.requests.values(), *self.waiting, *self.swapped, *self.running):
            yield req
            yield from req.children

    # ---- one step --------------------------------------------------------------------------
    def schedule(self, ahead: bool = False, held_seats: int = 0) -> SchedulerOutput:
        """The next step. ``ahead``: scheduled while the last step still runs (``async_scheduler.py``), whose
        requests that end with it hold ``held_seats`` seats outside ``running`` until then."""
        # A new step: the blocks hashed for the last one hold their K/V now (a driver whose step
        # failed has rolled them back already, see step.run_step), so the manager stops tracking them;
        # scheduled ahead, the last step has not run yet: they stay tracked until its result is in.
        seats = self.config.max_num_seqs - held_seats
        free_seats = seats - sum(num_seqs_when_running(r) for r in self.running)
        ask = SEAM.plugged("policy")  # before anything changes
        policy, order = ask(self.running, self.waiting, free_seats) if ask is not None else (_POLICY, None)
        if ahead:
            self.kv_cache_manager.hold_step()
        else:
            self.kv_cache_manager.commit_step()
        self.propose_drafts()
        out = SchedulerOutput(block_size=self.block_size)
        budget = self.config.max_num_batched_tokens
        if order is not None:
            self.waiting.clear()
            self.waiting.extend(order)

        # 1. running requests, oldest first; preempt the newest when the pool runs dry
        def preempt(victim: Request, kv: KVCacheManager, waiting: deque[Request]) -> None:
            self.preempt(victim, out)

        running_fn = SEAM.plugged("schedule_running")  # a learner's own (exercise 07) applies no policy
        if running_fn is not None:
            scheduled, _ = running_fn(self.running, self.waiting, self.kv_cache_manager, budget, preempt)
        else:
            scheduled, _ = schedule_running(self.running, self.waiting, self.kv_cache_manager, budget, preempt, policy)
        budget -= self._add_to_step(out, scheduled)

        # 2. swapped, then waiting requests, in arrival order, unless this step had to preempt
        if not out.preempted:
            free_seats = seats - sum(num_seqs_when_running(r) for r in self.running)
            while self.swapped and budget > 0:
                req = self.swapped[0]
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if num_seqs_when_running(req) > free_seats or not self._swap_in(req, num_new, out):
                    break
                self.swapped.popleft()
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                free_seats -= num_seqs_when_running(req)
                budget -= self._add_to_step(out, [(req.request_id, num_new)])
            if not self.swapped and budget > 0 and free_seats > 0:
                admit_fn = SEAM.plugged("admit_waiting")  # a learner's own (exercise 06) applies no policy
                if admit_fn is not None:
                    admitted = admit_fn(self.waiting, self.kv_cache_manager, budget, free_seats)
                else:
                    admitted = admit_waiting(self.waiting, self.kv_cache_manager, budget, free_seats, policy)
                self.running.extend(self.requests[rid] for rid, _ in admitted)
                budget -= self._add_to_step(out, admitted)

        out.copy_blocks = self.kv_cache_manager.take_pending_copies()
        out.kv_connector_metadata = self.kv_cache_manager.take_connector_meta()
        out.finished_req_ids, out.finished_sample_keys = self.take_finished()
        return out

    def propose_drafts(self) -> None:
        """Speculative decoding: each running request past its prompt gets drafts for this step (vLLM proposes
        them at the end of the step before; the tokens are the same). Capped so that all of them and the token
        after them stay within ``max_tokens`` and ``max_model_len``."""
        if self.proposer is None:
            return
        for req in self.running:
            decoding = req.num_output_tokens > 0 and req.num_computed_tokens == req.num_tokens - 1
            room = min(
                req.sampling_params.max_tokens - req.num_output_tokens, self.config.max_model_len - req.num_tokens
            )
            drafts = self.proposer.propose_for(req.request_id, req, req.all_token_ids, room - 1) if decoding else []
            req.spec_token_ids = drafts
        self.proposer.keep_only({req.request_id for req in self.running})

    def take_finished(self) -> tuple[list[str], list[tuple[str, int]]]:
        """The requests that left since the last call, and their random streams; forgets them. ``schedule`` sends
        them with the next step; an engine with nothing left to schedule hands them to its runner itself."""
        ids, keys = list(self.finished_req_ids), list(self.finished_req_ids.values())
        self.finished_req_ids.clear()
        return ids, keys

    def _add_to_step(self, out: SchedulerOutput, scheduled: list[tuple[str, int]]) -> int:
        """Put each ``(request id, new tokens)`` in the step; return the tokens they use."""
        parts_plugged = hooks.active(ignore=ADVISORY_PARTS)
        take_block_updates = self.kv_cache_manager.take_block_updates
        for rid, num_new in scheduled:
            req = self.requests[rid]
            tokens = req.all_token_ids
            num_tokens, start = len(tokens), req.num_computed_tokens
            end = start + num_new
            if num_new < 1:  # a row with no token would sample another request's logits
                raise RuntimeError(
                    f"request {rid!r} scheduled with {num_new} new tokens ({start} "
                    f"of {num_tokens} computed): scheduler state is broken"
                )
            if end > num_tokens + len(req.spec_token_ids):
                raise RuntimeError(
                    f"request {rid!r} scheduled with {num_new} new tokens ({start} of {num_tokens} computed, "
                    f"{len(req.spec_token_ids)} drafts): scheduler state is broken"
                )
            samples = end >= num_tokens  # every known token computed (drafts too, if any)
            first = not req.output_token_ids and req.parent_id is None
            spec = req.spec_token_ids[: end - num_tokens] if end > num_tokens else []
            params = req.sampling_params
            out.scheduled.append(
                ScheduledRequest(
                    request_id=rid,
                    num_new_tokens=num_new,
                    start=start,
                    # a learner's part may have changed a table in place: then the whole table, every step
                    block_updates=take_block_updates(rid, resend=parts_plugged),
                    num_samples=(params.n if first else 1) if samples else 0,
                    token_ids=tokens[start:end] + spec if spec else tokens[start:end],
                    sampling_params=params,
                    sample_key=req.sample_key,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    spec_token_ids=spec,
                )
            )
        return sum(n for _, n in scheduled)

    # ---- preemption --------------------------------------------------------------------------
    def preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Take ``req`` off the device: swap its blocks to CPU if there is room, else recompute later."""
        self.num_preemptions += 1
        out.preempted.append(req.request_id)
        req.spec_token_ids = []  # drafts are proposed again once it decodes again
        copies = self.kv_cache_manager.swap.swap_out(req) if self.config.preemption_mode == "swap" else None
        if copies is not None:
            out.swap_out.extend(copies)
            req.status = RequestStatus.SWAPPED
            req.num_preemptions += 1
            self.swapped.appendleft(req)
        else:
            SEAM.pick("preempt_recompute", preempt_recompute)(req, self.kv_cache_manager, self.waiting)

    def _swap_in(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocate device blocks for a swapped request and schedule the CPU → device copies."""
        copies = self.kv_cache_manager.swap.swap_in(req, num_new)
        if copies is None:
            return False
        out.swap_in.extend(copies)
        return True

    # ---- after the model ran -----------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], now: float = 0.0
    ) -> list[Request]:
        """Advance every scheduled request; ``sampled`` maps a request id to its new token(s).

        A request that samples gets exactly one token, except the first sample of
        an ``n > 1`` request, which gets ``n``: one for itself and one for each
        sibling forked from it here, and a request with drafts, which gets the drafts
        the model accepted and one token of the model's own (``worker.sampler.verify``).
        Returns the requests that finished this step.
        """
        # Check everything first, change nothing until it all holds: a step happens or it does not.
        # A request that finished with an error mid-step is gone from ``requests``: skip it.
        live = [(s, self.requests[s.request_id]) for s in out.scheduled if s.request_id in self.requests]
        for s, req in live:
            tokens = sampled.get(req.request_id)
            if not s.samples:
                if tokens is not None:
                    raise ValueError(f"request {req.request_id!r} got a token in a step that does not sample")
            elif s.spec_token_ids:
                spec = s.spec_token_ids
                if tokens is None or not 1 <= len(tokens) <= len(spec) + 1 or tokens[:-1] != spec[: len(tokens) - 1]:
                    raise ValueError(
                        f"request {req.request_id!r} verified drafts {spec}: it needs the accepted drafts and one "
                        f"token of the model's own, got {tokens!r}"
                    )
            elif tokens is None or len(tokens) != s.num_samples:
                raise ValueError(f"request {req.request_id!r} needs {s.num_samples} sampled token(s), got {tokens!r}")
        finished: list[Request] = []
        for s, req in live:
            if s.spec_token_ids:
                finished += self._accept(s.spec_token_ids, req, sampled[req.request_id], s.num_new_tokens, now)
                continue
            req.num_computed_tokens += s.num_new_tokens
            if not s.samples:
                continue
            tokens = sampled[req.request_id]
            if s.num_samples > 1:
                for j, token in enumerate(tokens[1:], start=1):
                    finished += self._fork(req, j, token, now)
            finished += self._append_token(req, tokens[0], now)
        return finished

    def _accept(self, spec: list[int], req: Request, tokens: list[int], num_new: int, now: float) -> list[Request]:
        """A verification step's result: the accepted drafts and the model's token, appended one at a time (a
        stop token or ``max_tokens`` among them ends the request there); the K/V of the real tokens and the
        accepted drafts count as computed, and the blocks that held only rejected drafts go back to the pool."""
        assert self.spec_decoding_stats is not None  # drafts come from the proposer
        self.spec_decoding_stats.observe(len(spec), len(tokens) - 1)
        req.num_computed_tokens += num_new - len(spec)  # the real tokens fed this step
        req.spec_token_ids = []  # checked: the next step proposes again
        for j, token in enumerate(tokens):
            if j:  # the draft before this token was accepted: its K/V, written this step, is the right one
                req.num_computed_tokens += 1
            if done := self._append_token(req, token, now):
                return done
        self.kv_cache_manager.trim(req, req.num_tokens)
        return []

    def _fork(self, parent: Request, index: int, token: int, now: float) -> list[Request]:
        child = Request(
            request_id=f"{parent.request_id}#{index}",
            prompt_token_ids=parent.prompt_token_ids,
            num_computed_tokens=parent.num_computed_tokens,
            cache_salt=parent.cache_salt,
            sampling_params=parent.sampling_params,
            eos_token_id=parent.eos_token_id,
            arrival_time=parent.arrival_time,
            parent_id=parent.request_id,
            sample_index=index,
            status=RequestStatus.RUNNING,
        )
        self.requests[child.request_id] = child
        parent.children.append(child)
        self.kv_cache_manager.fork(parent, child)
        self.running.append(child)
        return self._append_token(child, token, now)

    def rollback_step(self) -> None:
        """A step failed (and, with async scheduling, the one scheduled after it): no block hashed for it stays
        findable, and what it was to write counts as not computed: a request holding such a block (a prefix hit
        on a block the step was to write, a copy-on-write or swap-in copy it was to make) computes it again, and
        a request it swapped out is recomputed instead."""
        kv = self.kv_cache_manager
        rolled = kv.rollback_step()
        for rid in rolled.swapped_out:  # its swap space may hold nothing: it computes again, first in line
            req = self.requests.get(rid)
            if req is not None and req in self.swapped:
                self.swapped.remove(req)
                kv.swap.free_swapped(rid)
                req.num_computed_tokens, req.status = 0, RequestStatus.PREEMPTED
                self.waiting.appendleft(req)
        for req in list(self.running):
            computed = forget_computed(kv.managers, req, rolled, kv.block_size)
            if computed is None:  # it must start again: as a preemption by recompute does
                self.running.remove(req)
                preempt_recompute(req, kv, self.waiting)
            else:
                req.num_computed_tokens = computed

    def _append_token(self, req: Request, token: int, now: float) -> list[Request]:
        req.append_output_token_ids(token)
        return self.finish_if_done(req, token, now)

    def finish_if_done(self, req: Request, token: int, now: float) -> list[Request]:
        """A request's newest token is in (``token``): time it, and finish the request if it is done."""
        if req.first_token_time is None:
            req.first_token_time = now
        req.token_times.append(now)
        p = req.sampling_params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token == req.eos_token_id):
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        if reason is None:
            return []
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, now
        self._leave(req)
        del self.requests[req.request_id]
        self.finished_req_ids[req.request_id] = req.sample_key
        return [req]

    def _leave(self, req: Request) -> None:
        """Take a request out of whichever queue holds it and give back its blocks (device and CPU). Running
        is the usual place; scheduled ahead (async scheduling), it may have been preempted since its token."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.swapped:
            self.swapped.remove(req)
        self.kv_cache_manager.free(req)
        self.kv_cache_manager.swap.free_swapped(req.request_id)

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> Request | None:
        """Stop a request wherever it is and give back its blocks (device and CPU); None if it is unknown
        (finished requests are forgotten)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._leave(req)
        req.status, req.finish_reason, req.error = RequestStatus.FINISHED, reason, error
        del self.requests[request_id]
        self.finished_req_ids[request_id] = req.sample_key
        return req

    def finish_with_error(self, request_id: str, error: str) -> Request | None:
        """A request that cannot go on (its sampling failed) finishes alone, with ``error`` set."""
        return self.abort(request_id, reason="error", error=error)


def check_invariants(sched: Scheduler) -> None:
    """Block-pool and swap-space bookkeeping after a step: no leak, no double free, consistent ref counts.
    ``assert`` statements, for tests and the simulator's ``check=True`` (do not run them under ``python -O``)."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = {b.block_id for b in free}
    assert len(free_ids) == len(free) == pool.get_num_free_blocks()
    refs: dict[int, int] = {}
    for manager, _, blocks in kv.held_blocks():
        for b in blocks:
            # Only a sliding window's table holds the null block: in place of blocks behind the window.
            assert not b.is_null or manager.sliding_window is not None, f"null block in group {manager.group_id}"
            if not b.is_null:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id}: ref_cnt {b.ref_cnt}"
        assert (b.block_id in free_ids) == (b.ref_cnt == 0)
    assert 0 not in free_ids and 0 not in refs  # the null block is never handed out
    live = {r.request_id for r in sched.running}
    assert all(set(m.req_to_blocks) <= live | {r.request_id for r in sched.swapped} for m in kv.managers)
    assert all(r.status is RequestStatus.SWAPPED for r in sched.swapped)
    assert not any(r.status is RequestStatus.SWAPPED for r in sched.waiting)
    if kv.swap.cpu_pool is not None:
        in_cpu = sum(len(v) for v in kv.swap.swapped_blocks.values())
        assert in_cpu + kv.swap.cpu_pool.get_num_free_blocks() == kv.swap.num_cpu_blocks - 1
