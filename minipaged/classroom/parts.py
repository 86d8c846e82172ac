"""Parts: run the real engine with a learner's own piece in place of the package's.

Exercises 03–09 (and two of exercise 05d's Triton puzzles) each build one piece of the engine, with the same
signature as the package's own. ``use`` plugs them in, without editing the package, for as long as a
``with`` block lasts::

    from minipaged import LLM, parts

    with parts.use(slot_mapping=my_slot_mapping, free_queue_remove=my_remove):
        outputs = llm.generate(prompts)          # the engine calls *your* functions

Each engine component declares the parts a learner may write in its place once, as its seam (``hooks.Seam``:
``minipaged.hooks`` imports nothing from the package; this module fills it), and runs the learner's function where
one is plugged in. The three functions of a policy (exercise 10b) are asked through the scheduler's one ``policy``
part (``policy.py``)::

    ex03  free_queue_remove       BlockPool.touch: a cached block leaves the middle of the free queue
    ex04  slot_mapping            ModelRunner.prepare_inputs: the slot of every new token
    ex04  would_allocate          KVCacheManager.allocate_slots: "are there blocks now?" (no prefix hit)
    ex05  paged_decode_attention  PagedAttention: a decode-only step's attention (or puzzle 5's Triton kernel)
    ex05b reshape_and_cache       PagedAttention: write this step's K/V into the paged cache
    ex05d paged_prefill_attention PagedAttention: a step with new prompt tokens (puzzle 6's Triton kernel)
    ex06  admit_waiting           Scheduler.schedule, step 2: admit waiting requests
    ex07  schedule_running        Scheduler.schedule, step 1: serve running requests, preempt
    ex07  preempt_recompute       Scheduler.preempt: undo a victim's allocation
    ex08  chain_block_hashes      Request.block_hashes: the chained hash of every full block
    ex08  find_prefix_hits        KVCacheManager.get_computed_blocks: the longest cached prefix
    ex08  get_new_blocks          BlockPool.get_new_blocks: the least recently freed blocks, hashes evicted
    ex08  free_blocks             BlockPool.free_blocks: blocks reaching ref count 0 join the back of the queue
    ex09  step_inputs             ModelRunner.prepare_inputs: the flat inputs of a mixed prefill + decode step
    ex10b prefill_cap             Scheduler.schedule: the most prompt tokens a prefill takes this step (a policy)

**Checked by default.** With ``check=True`` every call of a plugged part is checked
as it returns: the pure parts against the package's own function on the same
arguments, the parts that change state (the free queue, the scheduler's queues)
against the conditions their result must meet. The first wrong call raises
``PartError``, naming the part, its exercise, the call and what was wrong; an
``LLM`` adds the engine step (``step.run_step``). ``check=False`` runs the parts as they are, to see
what a bug does to the output (the capstone's report card does both). Whatever
the mode, a part that raises, or returns something of the wrong kind, is a
``PartError`` naming it, never a traceback from deep inside the engine.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import hooks
from ..core import block_pool as package_pool
from ..core.block_budget import block_need
from ..core.block_pool import BlockHash, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, chain_block_hashes
from ..core.kv_cache_manager import KVCacheManager, find_prefix_hits
from ..core.request import Request, RequestStatus
from ..core.scheduler import num_seqs_when_running
from ..hooks import PartError
from ..kernels import reference
from ..model import attention as _attention_seam  # noqa: F401 (its seam, for _where)
from ..worker import step_inputs as _step_inputs_seam  # noqa: F401
from ..worker.block_table import slot_mapping as package_slot_mapping
from .policy import POLICY_PARTS, PolicyAsker


@dataclass(frozen=True)
class Part:
    name: str
    exercise: str  # "ex04"
    signature: str
    where: str  # where the engine calls it
    # before(args) -> what the check needs to know from before the call (None when unchecked)
    before: Callable[[tuple[Any, ...]], Any] | None
    # accept(args, result) -> the result as the engine uses it; raises ValueError naming what is wrong
    accept: Callable[[tuple[Any, ...], Any], Any]
    # verify(args, result, before) -> None if right, else what was wrong
    verify: Callable[[tuple[Any, ...], Any, Any], str | None]
    # probes() -> [(what the probe is, args)]: calls on shapes the engine under test may never make (checked mode,
    # when the block is entered), each verified like an engine call
    probes: Callable[[], list[tuple[str, tuple[Any, ...]]]] | None = None
    # sandbox(args) -> (args to hand the part, commit): a checked call writes to scratch copies, and ``commit``
    # puts what it wrote in place only once the call is verified
    sandbox: Callable[[tuple[Any, ...]], tuple[tuple[Any, ...], Callable[[], None]]] | None = None


# ---- what each part must return, and how a call is checked --------------------------------------------
def _none(args: tuple[Any, ...], result: Any) -> None:
    if result is not None:
        raise ValueError(f"returned {type(result).__name__}; it changes its arguments in place and returns None")


def _int_list(result: Any, what: str) -> list[int]:
    values = result.tolist() if hasattr(result, "tolist") else result
    if not isinstance(values, (list, tuple)) or not all(
        hasattr(v, "__index__") and not isinstance(v, bool) for v in values
    ):
        raise ValueError(f"returned {type(result).__name__} {result!r:.80}; expected {what}")
    return [int(v) for v in values]


def _pairs(result: Any, what: str) -> list[tuple[str, int]]:
    try:
        pairs = [(rid, n) for rid, n in result]
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}; expected {what}") from None
    if not all(isinstance(rid, str) and isinstance(n, int) for rid, n in pairs):
        raise ValueError(f"returned {pairs!r:.80}; expected {what}")
    return pairs


def _first_difference(got: list[Any], want: list[Any]) -> str:
    if len(got) != len(want):
        return f"returned {len(got)} items, expected {len(want)}"
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return f"item {i} is {got[i]!r}, expected {want[i]!r}"


# ---- the pool, as a part must leave it --------------------------------------------------------------
def _link(block: Any, queue: Any) -> Any:
    if block is None:
        return None
    if block is queue.fake_free_list_head:
        return "head"
    return "tail" if block is queue.fake_free_list_tail else block.block_id


def _pool_state(pool: Any) -> dict[str, Any]:
    """Everything about a pool a part could change: the free count, each block's ref count, hash and free-queue
    links, the sentinels' links, and which blocks the prefix cache maps each hash to."""
    q = pool.free_block_queue
    return {
        "free count": q.num_free_blocks,
        "blocks": {
            b.block_id: (b.ref_cnt, b.block_hash, _link(b.prev_free_block, q), _link(b.next_free_block, q))
            for b in pool.blocks
        },
        "ends": (_link(q.fake_free_list_head.next_free_block, q), _link(q.fake_free_list_tail.prev_free_block, q)),
        "cache": {h: sorted(d) for h, d in pool.cached_block_hash_to_block.items()},
    }


def _pool_difference(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """The first way ``got`` differs from ``want``, in words, or None."""
    if got["free count"] != want["free count"]:
        return f"the free count is {got['free count']}, expected {want['free count']}"
    for bid, (ref, h, prev, nxt) in want["blocks"].items():
        g_ref, g_h, g_prev, g_nxt = got["blocks"][bid]
        if g_ref != ref:
            return f"block {bid}'s ref count is {g_ref}, expected {ref}"
        if g_h != h:
            if h is None:
                return f"block {bid} kept its hash; expected none (a block handed out leaves the prefix cache)"
            return f"block {bid}'s hash was {'cleared' if g_h is None else 'rewritten'}"
        if (g_prev, g_nxt) != (prev, nxt):
            return f"block {bid}'s free-queue links are ({g_prev}, {g_nxt}), expected ({prev}, {nxt})"
    if got["ends"] != want["ends"]:
        return f"the free queue's ends link to {got['ends']}, expected {want['ends']}"
    if got["cache"] != want["cache"]:
        return "the prefix cache's map from hash to blocks was changed"
    return None


def _left_alone(pool: Any, before: dict[str, Any]) -> str | None:
    problem = _pool_difference(_pool_state(pool), before)
    return None if problem is None else f"it changed the pool, which this part only reads: {problem}"


# free_queue_remove(queue, block): the block, its two neighbours' links and the free count change; nothing else
def _queue_blocks(queue: Any, block: Any) -> list[Any]:
    """Every block on the free queue, and ``block``."""
    seen = queue.get_all_free_blocks()
    return seen if any(x is block for x in seen) else [*seen, block]


def _block_states(queue: Any, blocks: list[Any]) -> dict[int, tuple[Any, ...]]:
    return {
        b.block_id: (b.ref_cnt, b.block_hash, _link(b.prev_free_block, queue), _link(b.next_free_block, queue))
        for b in blocks
    }


def _remove_before(args: tuple[Any, ...]) -> Any:
    queue, block = args
    blocks = _queue_blocks(queue, block)
    return block.prev_free_block, block.next_free_block, queue.num_free_blocks, blocks, _block_states(queue, blocks)


def _remove_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    queue, block = args
    prev_block, next_block, num_free, blocks, state = before
    if block.prev_free_block is not None or block.next_free_block is not None:
        return f"block {block.block_id} still has free-queue links after its removal"
    if prev_block.next_free_block is not next_block or next_block.prev_free_block is not prev_block:
        return (
            f"the neighbours of block {block.block_id} (blocks {prev_block.block_id} and {next_block.block_id}, "
            f"-1 = a fake end) are not linked to each other afterwards"
        )
    if queue.num_free_blocks != num_free - 1:
        return f"queue.num_free_blocks is {queue.num_free_blocks}, expected {num_free - 1}"
    # Everything else as it was: every queued block's ref count and hash, and the links of all but three blocks.
    want = dict(state)
    ref, h, _, _ = want[block.block_id]
    want[block.block_id] = (ref, h, None, None)
    p, n = _link(prev_block, queue), _link(next_block, queue)
    if p in want:
        want[p] = (*want[p][:3], n)
    if n in want:
        want[n] = (*want[n][:2], p, want[n][3])
    got = _block_states(queue, blocks)
    for bid, w in want.items():
        g = got[bid]
        if g[0] != w[0]:
            return f"block {bid}'s ref count is {g[0]}, expected {w[0]}: remove only unlinks"
        if g[1] != w[1]:
            return f"block {bid}'s hash was {'cleared' if g[1] is None else 'changed'}: remove only unlinks"
        if g[2:] != w[2:]:
            return (
                f"block {bid}'s links are {g[2:]}, expected {w[2:]}: only the removed block and its two "
                f"neighbours change"
            )
    return None


# get_new_blocks(pool, num_blocks) and free_blocks(pool, ordered_blocks): the LRU order of a pool.
# A twin of the pool (same ref counts, hashes, cache map and free-queue order) takes the package's own call;
# the learner's call must leave the real pool exactly like the twin. Built field by field: a deep copy would
# recurse down the free queue's links.
def _twin(pool: Any) -> tuple[BlockPool, list[KVCacheBlock]]:
    twin = BlockPool(pool.num_blocks, pool.enable_caching)
    for mine, theirs in zip(twin.blocks, pool.blocks):
        mine.ref_cnt, mine._block_hash = theirs.ref_cnt, theirs.block_hash
        mine.prev_free_block = mine.next_free_block = None  # relinked below, in the pool's order
    order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    twin.free_block_queue = FreeKVCacheBlockQueue([twin.blocks[i] for i in order])
    twin.cached_block_hash_to_block = {
        h: {i: twin.blocks[i] for i in same} for h, same in pool.cached_block_hash_to_block.items()
    }
    return twin, twin.blocks


def _get_new_before(args: tuple[Any, ...]) -> Any:
    pool, num_blocks = args
    twin, _ = _twin(pool)
    want = [b.block_id for b in package_pool.get_new_blocks(twin, num_blocks)]
    return want, _pool_state(twin)


def _blocks_accept(args: tuple[Any, ...], result: Any) -> list[KVCacheBlock]:
    pool, num_blocks = args
    if not isinstance(result, list) or not all(isinstance(b, KVCacheBlock) for b in result):
        raise ValueError(f"a list of the pool's KVCacheBlock objects, got {type(result).__name__}")
    if len(result) != num_blocks:
        raise ValueError(f"{num_blocks} blocks were asked for, {len(result)} returned")
    if any(pool.blocks[b.block_id] is not b for b in result if 0 <= b.block_id < len(pool.blocks)):
        raise ValueError("blocks that are not this pool's own")
    return result


def _get_new_verify(args: tuple[Any, ...], result: list[KVCacheBlock], before: Any) -> str | None:
    want, state = before
    got = [b.block_id for b in result]
    if got != want:
        return f"it handed out blocks {got}, expected {want}: the front of the free queue, least recently freed first"
    problem = _pool_difference(_pool_state(args[0]), state)
    return None if problem is None else f"the pool afterwards: {problem}"


def _free_before(args: tuple[Any, ...]) -> Any:
    pool, blocks = args
    twin, twin_blocks = _twin(pool)
    package_pool.free_blocks(twin, [twin_blocks[b.block_id] for b in blocks])
    return _pool_state(twin)


def _free_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    problem = _pool_difference(_pool_state(args[0]), before)
    return None if problem is None else f"the pool afterwards: {problem}"


# slot_mapping(block_tables, positions, block_size, pad_to=None)
def _slots_accept(args: tuple[Any, ...], result: Any) -> torch.Tensor:
    slots = _int_list(result, "a list of slot numbers")
    n = sum(len(p) for p in args[1])
    if len(slots) != n:
        raise ValueError(f"returned {len(slots)} slots for {n} new tokens")
    return torch.tensor(slots, dtype=torch.int64)


def _slots_verify(args: tuple[Any, ...], result: torch.Tensor, before: Any) -> str | None:

    want = package_slot_mapping(*args).tolist()
    got = result.tolist()
    if got == want:
        return None
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return f"token {i} of the step got slot {got[i]}, expected {want[i]} (block tables {args[0]!r:.120})"


# would_allocate(manager, request, num_new_tokens)
def _bool_accept(args: tuple[Any, ...], result: Any) -> bool:
    if not (isinstance(result, bool) or str(getattr(result, "dtype", "")) in ("bool", "torch.bool")):
        raise ValueError(f"returned {type(result).__name__} {result!r:.40}; expected True or False")
    return bool(result)


def _would_accept(args: tuple[Any, ...], result: Any) -> bool:
    """A yes the pool cannot honour is refused here, checked or not: the engine would take blocks that are not
    there (the package's own ``allocate_slots`` counts them the same way, ``block_budget.block_need``)."""
    fits = _bool_accept(args, result)
    manager, request, num_new = args
    if fits:
        need = block_need(manager, request, num_new)
        if need.num_new_blocks > manager.block_pool.get_num_free_blocks():
            raise ValueError(
                f"wrong: said yes to {need.num_new_blocks} new blocks for {request.request_id!r}, "
                f"but only {manager.get_num_free_blocks()} are free"
            )
    return fits


def _manager_state(manager: Any) -> dict[str, Any]:
    return {
        "blocks": {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        "cached": dict(manager.num_cached_block),
        "copies": list(manager.pending_copies),
    }


def _would_before(args: tuple[Any, ...]) -> Any:
    return _pool_state(args[0].block_pool), _manager_state(args[0])


def _would_verify(args: tuple[Any, ...], result: bool, before: Any) -> str | None:
    manager, request, num_new = args
    want = manager.can_allocate(request, num_new)
    if result == want:
        pool_before, manager_before = before
        if _manager_state(manager) != manager_before:
            return "it changed the manager's block tables: this part only answers"
        return _left_alone(manager.block_pool, pool_before)
    return (
        f"said {result} for {num_new} new tokens of request {request.request_id!r} (holding "
        f"{manager.get_num_blocks(request.request_id)} blocks, {manager.get_num_free_blocks()} free, "
        f"{manager.reserved_blocks} reserved, watermark {manager.watermark_blocks}); allocate_slots says {want}"
    )


# reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
def _cache_before(args: tuple[Any, ...]) -> Any:
    return args[2].clone(), args[3].clone()


def _cache_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:

    key, value, key_cache, value_cache, slots = args
    want_k, want_v = before
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    for name, got, want in (("key_cache", key_cache, want_k), ("value_cache", value_cache, want_v)):
        wrong = (got != want).flatten(2).any(-1).nonzero()  # (block, offset) pairs that differ
        if len(wrong):
            b, o = (int(x) for x in wrong[0])
            slot = b * key_cache.shape[1] + o
            token = (slots == slot).nonzero().flatten().tolist()
            whose = f"token {token[0]}'s slot" if token else "a slot no token of this step writes"
            return f"{name} block {b}, offset {o} ({whose}) holds the wrong numbers; {len(wrong)} slot(s) differ"
    return None


def _scratch_caches(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Callable[[], None]]:
    """The part writes into copies of the caches; once verified, the copies' contents go into the real ones, so
    a wrong write never reaches a block another request (or the prefix cache) reads."""
    key, value, key_cache, value_cache, slots = args
    k2, v2 = key_cache.clone(), value_cache.clone()

    def commit() -> None:
        key_cache.copy_(k2)
        value_cache.copy_(v2)

    return (key, value, k2, v2, slots), commit


def _read_only_caches(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], Callable[[], None]]:
    """The part reads copies of the caches; ``_attention_verify`` checks it left them as they were."""
    query, key_cache, value_cache, *rest = args
    return (query, key_cache.clone(), value_cache.clone(), *rest), lambda: None


# paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
def _attention_accept(args: tuple[Any, ...], result: Any) -> torch.Tensor:
    query = args[0]
    if not isinstance(result, torch.Tensor) or result.shape != query.shape:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise ValueError(f"returned {shape}; expected a tensor shaped like the query, {tuple(query.shape)}")
    return result.to(query.dtype)


def _attention_before(args: tuple[Any, ...]) -> Any:
    """The real caches, by reference: checked, the part only ever sees copies (``_read_only_caches``)."""
    return args[1], args[2]


def _attention_verify(args: tuple[Any, ...], result: torch.Tensor, before: Any) -> str | None:
    """Decode (6 arguments) or prefill (7: ``cu_seqlens_q`` before ``seq_lens``) against the reference."""
    decode = len(args) == 6
    for name, got, was in (("key_cache", args[1], before[0]), ("value_cache", args[2], before[1])):
        if not bool(((got == was) | (got.isnan() & was.isnan())).all()):
            return f"it wrote into {name}: attention only reads the cache"
    want = (reference.paged_decode_attention if decode else reference.paged_prefill_attention)(*args)
    tol = 1e-4 if result.dtype == torch.float32 else 2e-2
    err = (result.float() - want.float()).abs()
    bad = ~(err <= tol + tol * want.float().abs())  # NaN counts as wrong
    if not bool(bad.any()):
        return None
    row, head = (int(x) for x in bad.any(-1).nonzero()[0])
    if decode:
        where = f"sequence {row} (seq_len {int(args[4][row])})"
    else:  # row is a new token of the packed batch: name its sequence and position
        cu = args[4].tolist()
        seq = max(i for i in range(len(cu) - 1) if cu[i] <= row)
        seq_len, q_len = int(args[5][seq]), cu[seq + 1] - cu[seq]
        where = f"sequence {seq} (seq_len {seq_len}, {q_len} new), position {seq_len - q_len + row - cu[seq]}"
    return f"{where}, query head {head} is off by up to {float(err[row, head].max()):.3g} from the reference"


# ---- the requests a scheduler part must leave alone ------------------------------------------------------------
def _requests_state(kv: Any, requests: Any) -> dict[str, tuple[Any, ...]]:
    """Each request's block table (ids), computed tokens and status."""
    return {r.request_id: (kv.get_block_ids(r.request_id), r.num_computed_tokens, r.status) for r in requests}


def _untouched(kv: Any, requests: Any, before: dict[str, tuple[Any, ...]], why: str) -> str | None:
    """The first request of ``before`` whose blocks, computed tokens or status changed, in words."""
    now = _requests_state(kv, requests)
    for rid, (blocks, computed, status) in before.items():
        g_blocks, g_computed, g_status = now[rid]
        if g_blocks != blocks:
            return f"it changed the blocks of {rid!r} ({blocks} -> {g_blocks}), {why}"
        if g_computed != computed or g_status != status:
            return (
                f"it changed {rid!r} (computed tokens {computed} -> {g_computed}, status {status.name} -> "
                f"{g_status.name}), {why}"
            )
    return None


def _blocks_state(kv: Any) -> dict[int, tuple[int, Any]]:
    """Every block's ref count and hash."""
    return {b.block_id: (b.ref_cnt, b.block_hash) for b in kv.block_pool.blocks}


def _other_blocks_untouched(kv: Any, before: dict[int, tuple[int, Any]], exempt: set[int], whose: str) -> str | None:
    """The blocks outside ``exempt`` (those of the requests the part works on) kept their ref counts and hashes."""
    for b in kv.block_pool.blocks:
        if b.block_id in exempt:
            continue
        ref, h = before[b.block_id]
        if b.ref_cnt != ref:
            return f"block {b.block_id}'s ref count went from {ref} to {b.ref_cnt}, and it is not {whose}"
        if b.block_hash != h:
            return (
                f"block {b.block_id}'s hash was {'cleared' if b.block_hash is None else 'changed'}, and it is "
                f"not {whose}"
            )
    return None


# schedule_running(running, waiting, kv, token_budget, preempt)
def _running_before(args: tuple[Any, ...]) -> Any:
    running, waiting, kv = args[0], args[1], args[2]
    return (
        list(running),
        {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in running},
        list(waiting),
        _requests_state(kv, waiting),
        _blocks_state(kv),
        {b for r in running for b in kv.get_block_ids(r.request_id)},
    )


def _running_accept(args: tuple[Any, ...], result: Any) -> tuple[list[tuple[str, int]], list[str]]:
    try:
        scheduled, preempted = result
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}; expected (scheduled, preempted)") from None
    return _pairs(scheduled, "scheduled as [(request_id, num_new_tokens), ...]"), [str(r) for r in preempted]


def _running_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    running, waiting, kv, budget, _ = args
    scheduled, preempted = result
    before_list, sizes, waiting_before, waiting_state, blocks_before, held_before = before
    ids = [r.request_id for r in before_list]
    held = held_before | {b for r in before_list for b in kv.get_block_ids(r.request_id)}
    problem = _other_blocks_untouched(kv, blocks_before, held, "a block of a running request")
    if problem is not None:
        return problem
    if list(waiting)[len(waiting) - len(waiting_before) :] != waiting_before:
        return "it changed the waiting queue behind the victims it put at the front: it only serves running requests"
    problem = _untouched(kv, waiting_before, waiting_state, "a waiting request: it only serves running requests")
    if problem is not None:
        return problem
    k, p = len(scheduled), len(preempted)
    if [rid for rid, _ in scheduled] != ids[:k]:
        return f"scheduled {[rid for rid, _ in scheduled]}; the running requests, oldest first, are {ids}"
    if preempted != ids[::-1][:p] or [r.request_id for r in running] != ids[: len(ids) - p]:
        return f"preempted {preempted} of running {ids}; victims are taken newest first (the end of the list)"
    left = budget
    for rid, n in scheduled:
        computed, total = sizes[rid]
        if n != min(total - computed, left):
            return f"gave {rid!r} {n} new tokens; it has {total - computed} to compute and the budget left is {left}"
        if kv.get_num_blocks(rid) * kv.block_size < computed + n:
            return f"scheduled {rid!r} without the blocks for its {computed + n} tokens (allocate_slots)"
        left -= n
    if left > 0 and len(running) > k:
        return (
            f"stopped after {k} request(s) with {left} tokens of budget left and {running[k].request_id!r} "
            f"still running and not scheduled"
        )
    return None


# preempt_recompute(victim, kv, waiting)
def _preempt_before(args: tuple[Any, ...]) -> Any:
    victim, kv, waiting = args
    others = {rid: kv.get_block_ids(rid) for rid in kv.num_blocks_per_request if rid != victim.request_id}
    return (
        len(waiting),
        victim.num_preemptions,
        list(waiting),
        others,
        _requests_state(kv, waiting),
        _blocks_state(kv),
        set(kv.get_block_ids(victim.request_id)),
    )


def _preempt_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:

    victim, kv, waiting = args
    num_waiting, num_preemptions, waiting_before, others, state, blocks_before, victims_blocks = before
    problem = _other_blocks_untouched(kv, blocks_before, victims_blocks, f"a block of the victim {victim.request_id!r}")
    if problem is not None:
        return problem
    if list(waiting)[1:] != waiting_before:
        return f"victim {victim.request_id!r}: the waiting queue behind it changed (it only goes to the front)"
    for rid, blocks in others.items():
        if kv.get_block_ids(rid) != blocks:
            return (
                f"it changed the blocks of {rid!r} ({blocks} -> {kv.get_block_ids(rid)}), not the victim "
                f"{victim.request_id!r}"
            )
    problem = _untouched(kv, waiting_before, state, f"a waiting request, not the victim {victim.request_id!r}")
    if problem is not None:
        return problem
    problems = []
    if kv.get_num_blocks(victim.request_id):
        problems.append(f"it still holds {kv.get_num_blocks(victim.request_id)} blocks")
    if victim.num_computed_tokens:
        problems.append(f"num_computed_tokens is {victim.num_computed_tokens} (its KV is gone)")
    if victim.status is not RequestStatus.PREEMPTED:
        problems.append(f"its status is {victim.status.name}")
    if victim.num_preemptions != num_preemptions + 1:
        problems.append(f"num_preemptions is {victim.num_preemptions}, expected {num_preemptions + 1}")
    if len(waiting) != num_waiting + 1 or waiting[0] is not victim:
        problems.append("it is not at the front of the waiting queue")
    return f"victim {victim.request_id!r}: " + "; ".join(problems) if problems else None


# admit_waiting(waiting, kv, token_budget, free_seats)
def _admit_before(args: tuple[Any, ...]) -> Any:
    waiting, kv = args[0], args[1]
    running = {rid: kv.get_block_ids(rid) for rid in kv.num_blocks_per_request}
    return list(waiting), running, _requests_state(kv, waiting), _blocks_state(kv)


def _admit_accept(args: tuple[Any, ...], result: Any) -> list[tuple[str, int]]:
    return _pairs(result, "[(request_id, num_new_tokens), ...]")


def _admit_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:

    waiting, kv, budget, seats = args
    before, running, waiting_state, blocks_before = before
    ids = [r.request_id for r in before]
    k = len(result)
    admitted = {b for rid, _ in result for b in kv.get_block_ids(rid)}
    problem = _other_blocks_untouched(kv, blocks_before, admitted, "a block of a request it admitted")
    if problem is not None:
        return problem
    for rid, blocks in running.items():
        if kv.get_block_ids(rid) != blocks:
            return f"it changed the blocks of {rid!r} ({blocks} -> {kv.get_block_ids(rid)}), a request already running"
    if [rid for rid, _ in result] != ids[:k] or list(waiting) != before[k:]:
        return (
            f"admitted {[rid for rid, _ in result]} and left {[r.request_id for r in waiting]} waiting, from "
            f"the queue {ids}: admission takes the head of the queue, in order, and pops what it admits"
        )
    left = budget
    for req, (rid, n) in zip(before, result):
        seats -= num_seqs_when_running(req)
        computed = req.num_computed_tokens
        if req.status is not RequestStatus.RUNNING:
            return f"admitted {rid!r} but left its status {req.status.name}"
        if seats < 0:
            return f"admitted {rid!r} with no free seat left"
        if computed % kv.block_size or n != min(req.num_tokens - computed, left):
            return (
                f"admitted {rid!r} with {n} new tokens and num_computed_tokens={computed}; its prompt has "
                f"{req.num_tokens} tokens, the budget left was {left}"
            )
        if kv.get_num_blocks(rid) * kv.block_size < computed + n:
            return f"admitted {rid!r} without the blocks for its {computed + n} tokens (allocate_slots)"
        left -= n
    for req in before[k:]:
        if kv.get_num_blocks(req.request_id):
            return f"{req.request_id!r} was not admitted but holds {kv.get_num_blocks(req.request_id)} blocks"
    problem = _untouched(
        kv, before[k:], {r.request_id: waiting_state[r.request_id] for r in before[k:]}, "a request it did not admit"
    )
    if problem is not None:
        return problem
    if waiting and left > 0 and num_seqs_when_running(waiting[0]) <= seats:
        head = waiting[0]
        hits, hit_tokens = kv.get_computed_blocks(head)
        if kv.can_allocate(head, min(head.num_tokens - hit_tokens, left), hit_tokens, hits):
            return (
                f"stopped with {left} tokens of budget left although the head of the queue, {head.request_id!r}, fits"
            )
    return None


# chain_block_hashes(token_ids, block_size, cache_salt=None)
def _hashes_accept(args: tuple[Any, ...], result: Any) -> list[bytes]:

    token_ids, block_size = args[0], args[1]
    if not isinstance(result, (list, tuple)) or not all(isinstance(h, (bytes, bytearray)) for h in result):
        raise ValueError(
            f"returned {type(result).__name__} {result!r:.60}; expected a list of bytes, one per full block"
        )
    if len(result) != len(token_ids) // block_size:
        raise ValueError(
            f"returned {len(result)} hashes for {len(token_ids)} tokens in blocks of {block_size}; "
            f"expected {len(token_ids) // block_size}, one per full block"
        )
    return [BlockHash(bytes(h)) for h in result]


def _hashes_verify(args: tuple[Any, ...], result: list[bytes], before: Any) -> str | None:

    want = chain_block_hashes(*args)
    if result == want:
        return None
    i = next(i for i, (g, w) in enumerate(zip(result, want)) if g != w)
    return f"the hash of block {i} (of {len(want)}) differs from the package's (salt {args[2]!r})"


# find_prefix_hits(pool, block_hashes, num_tokens, block_size)
def _hits_accept(args: tuple[Any, ...], result: Any) -> list[int]:
    pool = args[0]
    ids = _int_list(result, "a list of block ids")
    bad = [i for i in ids if not 0 <= i < len(pool.blocks)]
    if bad:
        raise ValueError(f"returned block id(s) {bad}: the pool has blocks 0 to {len(pool.blocks) - 1}")
    return ids


def _hits_verify(args: tuple[Any, ...], result: list[int], before: Any) -> str | None:
    """Right by meaning: as many blocks as the longest cached prefix, block i cached under hash i. Which block,
    when several hold the same hash (two requests computed one prefix at once), is the part's choice."""

    pool, block_hashes, num_tokens, _ = args
    want = find_prefix_hits(*args)
    if len(result) != len(want):
        return (
            f"returned {len(result)} block(s) {result} for a {num_tokens}-token prompt; its longest cached "
            f"prefix is {len(want)} block(s), e.g. {want}"
        )
    for i, bid in enumerate(result):
        if bid not in pool.cached_block_hash_to_block.get(block_hashes[i], {}):
            return f"block {bid} (hit {i}) is not cached under the hash of block {i} of the prompt; e.g. {want[i]} is"
    return _left_alone(pool, before)


# The open capstone's policy (exercise 10b): three questions the scheduler asks once a step, before it changes
# anything; any answer is allowed that keeps the step sound, and each is checked as it returns, checked mode or
# not (the rest of the step is the package's and relies on it).
def _permutation(given: list[Any], result: Any, what: str) -> list[str]:
    ids = [r.request_id for r in given]
    got = [str(rid) for rid in result] if isinstance(result, (list, tuple)) else None
    if got is None or sorted(got) != sorted(ids):
        raise ValueError(
            f"returned {result!r:.120}; expected every {what} request id exactly once: a permutation of {ids}"
        )
    return got


def _order_accept(args: tuple[Any, ...], result: Any) -> list[str]:
    return _permutation(args[0], result, "waiting")


def _victims_accept(args: tuple[Any, ...], result: Any) -> list[str]:
    return _permutation(args[0], result, "running")


def _cap_accept(args: tuple[Any, ...], result: Any) -> int:
    # Any integer but a bool (numpy's too: a cap computed with np.clip is one), handed on as a plain int.
    if isinstance(result, bool) or not isinstance(result, numbers.Integral) or result < 1:
        raise ValueError(f"returned {result!r:.40}; expected a whole number of prompt tokens, at least 1")
    return int(result)


def _any_answer(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    return None  # accept() has checked everything a policy must respect


# step_inputs(scheduled): pure, so the package's own answer on the same plain data is the expected one
def _plain(scheduled: Any) -> list[tuple[Any, ...]]:
    return [(s.request_id, s.start, s.num_new_tokens, tuple(s.token_ids), s.num_samples) for s in scheduled]


def _inputs_before(args: tuple[Any, ...]) -> Any:
    from ..worker.step_inputs import step_inputs

    return step_inputs(args[0]), _plain(args[0])


_INPUT_NAMES = ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "sample_rows")


def _inputs_accept(args: tuple[Any, ...], result: Any) -> tuple[list[int], ...]:
    if not isinstance(result, (tuple, list)) or len(result) != 5:
        raise ValueError(f"returned {type(result).__name__}; expected five lists: ({', '.join(_INPUT_NAMES)})")
    return tuple(_int_list(r, f"{name} as a list of ints") for r, name in zip(result, _INPUT_NAMES))


def _inputs_verify(args: tuple[Any, ...], result: tuple[list[int], ...], before: Any) -> str | None:
    want, plain = before
    if _plain(args[0]) != plain:
        return "it changed the scheduler's decisions (the ScheduledRequest objects): it only reads them"
    for name, got, expected in zip(_INPUT_NAMES, result, want):
        if list(got) != list(expected):
            return f"{name}: {_first_difference(list(got), list(expected))}"
    return None


# ---- probes: shapes that tell apart mistakes SmolLM2's shapes hide ------------------------------------------
# SmolLM2 has 9 query heads over 3 KV heads (h // 3 and h // num_kv_heads agree), 16-token blocks and tables
# with no spare column: a part can be right on it by accident. Checked mode first calls each part on these.
Probe = tuple[str, tuple[Any, ...]]


def _free_queue_probes() -> list[Probe]:

    pool = BlockPool(8)
    for block, h in zip(pool.blocks[1:4], chain_block_hashes(list(range(48)), 16)):  # cached-but-free blocks
        block.set_block_hash(h)
        pool.cached_block_hash_to_block[h] = {block.block_id: block}
    q, b = pool.free_block_queue, pool.blocks
    return [
        ("a cached block at the front of the queue", (q, b[1])),
        ("a cached block at the back of the queue", (q, b[7])),
        ("a cached block in the middle", (q, b[3])),
    ]


def _lru_pool() -> tuple[BlockPool, list[KVCacheBlock]]:
    """Eight blocks: three cached and free (LRU order 5, 2, 7), two in use (3 shared by two requests, 6)."""
    pool = BlockPool(8)
    hashes = chain_block_hashes(list(range(48)), 16)
    used = pool.get_new_blocks(7)  # 1..7, in use
    for block, h in zip((used[4], used[1], used[6]), hashes):  # blocks 5, 2, 7: full and cached
        block.set_block_hash(h)
        pool.cached_block_hash_to_block[h] = {block.block_id: block}
    pool.touch([used[2]])  # block 3: a second user
    pool.free_blocks([used[4], used[1], used[6], used[0], used[3]])  # 5, 2, 7, 1, 4 free, in that order
    return pool, pool.blocks


def _inputs_probes() -> list[Probe]:
    from ..core.scheduler_output import ScheduledRequest

    def sr(rid: str, start: int, n: int, samples: int) -> ScheduledRequest:
        return ScheduledRequest(
            rid, n, start, samples, token_ids=[100 + start + i for i in range(n)], block_updates=[(0, [3, 9])]
        )

    return [
        (
            "a mixed step: a prompt's last chunk at 16, a decode at 7, a 3-token prompt sampled twice (n = 2), and "
            "a chunk in the middle of a prompt (no sample)",
            ([sr("a", 16, 4, 1), sr("b", 7, 1, 1), sr("c", 0, 3, 2), sr("d", 8, 5, 0)],),
        )
    ]


def _get_new_probes() -> list[Probe]:
    pool, _ = _lru_pool()
    return [("two blocks from a queue whose front holds cached blocks (LRU order 5, 2, 7, 1, 4)", (pool, 2))]


def _free_probes() -> list[Probe]:
    pool, b = _lru_pool()
    return [("a request's blocks tail first: 6, then 3 (shared by another request)", (pool, [b[6], b[3]]))]


def _slot_probes() -> list[Probe]:
    return [
        (
            "block size 16, a prefill chunk starting mid-block, a table with a spare column",
            ([[7, 3, 9, 4]], [list(range(20, 45))], 16, None),
        ),
        (
            "block size 32, ragged decodes in partial blocks that are not the table's last",
            ([[5, 2, 9], [8, 4], [1, 6, 3]], [[40], [31], [50]], 32, None),
        ),
        (
            "block size 16, decodes at a block's first and last slot and mid-block",
            ([[3, 8, 2], [6, 1], [4]], [[16], [31], [9]], 16, None),
        ),
    ]


def _would_probes() -> list[Probe]:

    # 11 usable blocks, 2 reserved, watermark 1 (for new requests only)
    roomy = KVCacheManager(16, 12, watermark_blocks=1, reserved_blocks=2, enable_caching=False)
    roomy.allocate_slots(Request("other", list(range(96))), 96)  # 6 taken: 5 free, 3 available
    tight = KVCacheManager(16, 12, watermark_blocks=1, reserved_blocks=2, enable_caching=False)
    running = Request("running", list(range(100)))
    tight.allocate_slots(running, 90)  # 6 blocks, the last one 10/16 full
    running.num_computed_tokens = 90
    tight.block_pool.get_new_blocks(3)  # held elsewhere: 2 free, 0 available
    return [
        (
            "2 reserved blocks, watermark 1, 5 free: a new 40-token prompt needs 3",
            (roomy, Request("new", list(range(40))), 40),
        ),
        ("the same pool: a new 16-token prompt needs 1", (roomy, Request("small", list(range(16))), 16)),
        ("2 reserved, 2 free: a running request's next 6 tokens fit in its part-full last block", (tight, running, 6)),
        ("the same request's next 10 tokens need one block more", (tight, running, 10)),
    ]


def _cache_probes() -> list[Probe]:
    g = torch.Generator().manual_seed(24)
    cases = []
    for bs, slots in ((32, [65, 66, 67, 31, 160, 0, 100]), (16, [17, 18, 47, 5, 80])):
        n, heads, d = len(slots), 2, 8
        kv = torch.randn(n, 2 * heads, d, generator=g)  # key and value as views of one tensor, as a QKV split gives
        key_cache = torch.randn(6, bs, heads, d, generator=g)
        cases.append(
            (
                f"block size {bs}, {n} tokens to ragged slots, key/value not contiguous",
                (
                    kv[:, :heads],
                    kv[:, heads:],
                    key_cache,
                    torch.randn(6, bs, heads, d, generator=g),
                    torch.tensor(slots, dtype=torch.int64),
                ),
            )
        )
    return cases


def _decode_probes() -> list[Probe]:
    g = torch.Generator().manual_seed(9)
    cases = []
    for bs, seq_lens in ((16, [1, 17, 40]), (32, [33, 5, 64])):
        heads, kv_heads, d = 8, 2, 16
        width = -(-max(seq_lens) // bs) + 1  # one spare column
        num_blocks = 1 + len(seq_lens) * width
        key_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        value_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        order = torch.randperm(num_blocks - 1, generator=g) + 1
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        for i, n in enumerate(seq_lens):
            owned = order[i * width : (i + 1) * width]
            tables[i] = owned
            last, used = int(owned[(n - 1) // bs]), (n - 1) % bs + 1
            key_cache[last, used:] = 1e4  # slots past the sequence's end hold numbers it must not read
            value_cache[last, used:] = 1e4
            for spare in owned[-(-n // bs) :]:
                key_cache[int(spare)] = 1e4
                value_cache[int(spare)] = 1e4
        query = torch.randn(len(seq_lens), heads, d, generator=g)
        cases.append(
            (
                f"8 query heads over 2 KV heads, block size {bs}, seq_lens {seq_lens}, scale 0.3",
                (query, key_cache, value_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), 0.3),
            )
        )
    # fp16 activations of 40 to 80 with head_dim 16: q·k sums to 25,600 or more, often past fp16's 65,504
    query, key_cache, value_cache, tables, lens, _ = cases[0][1]
    big_q, big_k, big_v = (t.abs().clamp(0.5, 1).mul(80).to(torch.float16) for t in (query, key_cache, value_cache))
    cases.append(
        (
            "fp16, activations of 40 to 80: q·k overflows fp16 unless computed in float32",
            (big_q, big_k, big_v, tables, lens, 1 / 16**0.5),
        )
    )
    return cases


def _prefill_probes() -> list[Probe]:
    """New tokens after a cached prefix, a whole prompt and a decode row in one batch; the decode probes'
    pools (slots past each sequence's end hold 1e4), and the same fp16 overflow trap."""
    cases = []
    for label, args in _decode_probes()[:2]:
        query, key_cache, value_cache, tables, seq_lens, scale = args
        lens = seq_lens.tolist()
        q_lens = [n if n <= 17 else n // 3 for n in lens]  # a whole short prompt, or its last third
        g = torch.Generator().manual_seed(11)
        q = torch.randn(sum(q_lens), query.shape[1], query.shape[2], generator=g)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        new = label.replace(", scale 0.3", f", new tokens {q_lens}, scale 0.3")
        cases.append((new, (q, key_cache, value_cache, tables, cu, seq_lens, scale)))
    q, key_cache, value_cache, tables, cu, lens, _ = cases[0][1]
    big_q, big_k, big_v = (t.abs().clamp(0.5, 1).mul(80).to(torch.float16) for t in (q, key_cache, value_cache))
    cases.append(
        (
            "fp16, activations of 40 to 80: q·k overflows fp16 unless computed in float32",
            (big_q, big_k, big_v, tables, cu, lens, 1 / 16**0.5),
        )
    )
    return cases


def _hash_probes() -> list[Probe]:
    tokens = list(range(100, 170))
    return [
        ("70 tokens, block size 16, no salt", (tokens, 16, None)),
        ("70 tokens, block size 32, salt 'tenant-a'", (tokens, 32, "tenant-a")),
        ("31 tokens, block size 32: no full block", (tokens[:31], 32, None)),
    ]


def _hit_probes() -> list[Probe]:

    hashes = chain_block_hashes(list(range(64)), 16)

    def pool(cached: list[list[int]]) -> BlockPool:
        p = BlockPool(8)
        for h, ids in zip(hashes, cached):
            for bid in ids:
                p.blocks[bid].set_block_hash(h)
                p.cached_block_hash_to_block.setdefault(h, {})[bid] = p.blocks[bid]
        return p

    full = pool([[1], [2, 5], [3], [4]])  # every block cached, the second one twice
    gap = pool([[1], [], [3], [4]])  # the second block not cached: the chain breaks there
    return [
        (
            "a fully cached 64-token prompt, its second block cached twice (one token must stay to compute)",
            (full, hashes, 64, 16),
        ),
        ("the same blocks, a 65-token prompt", (full, hashes, 65, 16)),
        ("a prompt whose second block is not cached, its third and fourth are", (gap, hashes, 64, 16)),
        ("a 10-token prompt: no full block", (full, hashes[:0], 10, 16)),
    ]


def _where(part: str) -> str:
    """Where the engine runs ``part``: in its seam's own words (``hooks.Seam``, declared by the component)."""
    return next(seam.parts[part] for seam in hooks.SEAMS.values() if part in seam.parts)


PARTS: dict[str, Part] = {
    p.name: p
    for p in [
        Part(
            "free_queue_remove",
            "ex03",
            "remove(queue, block) -> None",
            _where("free_queue_remove"),
            _remove_before,
            _none,
            _remove_verify,
            _free_queue_probes,
        ),
        Part(
            "slot_mapping",
            "ex04",
            "slot_mapping(block_tables, positions, block_size, pad_to=None) -> list[int]",
            _where("slot_mapping"),
            None,
            _slots_accept,
            _slots_verify,
            _slot_probes,
        ),
        Part(
            "would_allocate",
            "ex04",
            "would_allocate(manager, request, num_new_tokens) -> bool",
            _where("would_allocate"),
            _would_before,
            _would_accept,
            _would_verify,
            _would_probes,
        ),
        Part(
            "reshape_and_cache",
            "ex05b",
            "reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None",
            _where("reshape_and_cache"),
            _cache_before,
            _none,
            _cache_verify,
            _cache_probes,
            _scratch_caches,
        ),
        Part(
            "admit_waiting",
            "ex06",
            "admit_waiting(waiting, kv, token_budget, free_seats) -> [(request_id, n)]",
            _where("admit_waiting"),
            _admit_before,
            _admit_accept,
            _admit_verify,
        ),
        Part(
            "schedule_running",
            "ex07",
            "schedule_running(running, waiting, kv, token_budget, preempt) -> (scheduled, preempted)",
            _where("schedule_running"),
            _running_before,
            _running_accept,
            _running_verify,
        ),
        Part(
            "preempt_recompute",
            "ex07",
            "preempt_recompute(victim, kv, waiting) -> None",
            _where("preempt_recompute"),
            _preempt_before,
            _none,
            _preempt_verify,
        ),
        Part(
            "chain_block_hashes",
            "ex08",
            "chain_block_hashes(token_ids, block_size, cache_salt=None) -> [bytes]",
            _where("chain_block_hashes"),
            None,
            _hashes_accept,
            _hashes_verify,
            _hash_probes,
        ),
        Part(
            "find_prefix_hits",
            "ex08",
            "find_prefix_hits(pool, block_hashes, num_tokens, block_size) -> [block id]",
            _where("find_prefix_hits"),
            lambda args: _pool_state(args[0]),
            _hits_accept,
            _hits_verify,
            _hit_probes,
        ),
        Part(
            "get_new_blocks",
            "ex08",
            "get_new_blocks(pool, num_blocks) -> [KVCacheBlock]",
            _where("get_new_blocks"),
            _get_new_before,
            _blocks_accept,
            _get_new_verify,
            _get_new_probes,
        ),
        Part(
            "free_blocks",
            "ex08",
            "free_blocks(pool, ordered_blocks) -> None",
            _where("free_blocks"),
            _free_before,
            _none,
            _free_verify,
            _free_probes,
        ),
        Part(
            "admission_order",
            "ex10b",
            "admission_order(waiting) -> [request_id]",
            "Scheduler.schedule: the order waiting requests are tried in (first come, first served)",
            None,
            _order_accept,
            _any_answer,
        ),
        Part(
            "preemption_order",
            "ex10b",
            "preemption_order(running) -> [request_id]",
            "Scheduler.schedule: the order running requests give way when the pool is dry (newest first)",
            None,
            _victims_accept,
            _any_answer,
        ),
        Part(
            "prefill_cap",
            "ex10b",
            "prefill_cap(request) -> int",
            "Scheduler.schedule: the most prompt tokens a prefill takes this step (no cap but the budget)",
            None,
            _cap_accept,
            _any_answer,
        ),
        Part(
            "step_inputs",
            "ex09",
            "step_inputs(scheduled) -> (input_ids, positions, cu_seqlens_q, seq_lens, sample_rows)",
            _where("step_inputs"),
            _inputs_before,
            _inputs_accept,
            _inputs_verify,
            _inputs_probes,
        ),
        Part(
            "paged_decode_attention",
            "ex05",
            "paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale) -> Tensor",
            _where("paged_decode_attention"),
            _attention_before,
            _attention_accept,
            _attention_verify,
            _decode_probes,
            _read_only_caches,
        ),
        Part(
            "paged_prefill_attention",
            "ex05d",
            "paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale) -> "
            "Tensor",
            _where("paged_prefill_attention"),
            _attention_before,
            _attention_accept,
            _attention_verify,
            _prefill_probes,
            _read_only_caches,
        ),
    ]
}


class Plugged:
    """A learner's function standing in for one part: it counts calls, accepts and (checked) verifies them."""

    def __init__(self, name: str, fn: Callable[..., Any], check: bool) -> None:
        self.spec, self.fn, self.check, self.calls = PARTS[name], fn, check, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return self._run(args, self.calls, None)

    def fail(self, message: str) -> PartError:
        """The error for a wrong answer the engine itself noticed (e.g. a yes from ``would_allocate`` with too few
        blocks free), naming this part and its last call."""
        return PartError(self.spec.name, f"wrong: {message}", self.calls, None, self.spec.exercise)

    def probe(self) -> None:
        """Call the part on the probe shapes (see ``Part.probes``); the first wrong answer raises ``PartError``."""
        for label, args in self.spec.probes() if self.spec.probes else ():
            self._run(args, 0, label)

    def _run(self, args: tuple[Any, ...], call: int, probe: str | None) -> Any:
        spec = self.spec
        before = spec.before(args) if self.check and spec.before else None
        handed: list[str] = []
        if spec.name == "schedule_running" and self.check:  # record who is handed to preempt
            preempt = args[4]

            def recording_preempt(victim: Any, kv: Any, waiting: Any) -> None:
                handed.append(victim.request_id)
                preempt(victim, kv, waiting)

            args = (*args[:4], recording_preempt)
        args, commit = spec.sandbox(args) if self.check and spec.sandbox else (args, None)
        try:
            result = self.fn(*args)
        except PartError:
            raise
        except Exception as exc:  # the learner's bug, named, not a traceback from inside the engine
            raise PartError(spec.name, f"raised {type(exc).__name__}: {exc}", call, probe, spec.exercise) from exc
        try:
            result = spec.accept(args, result)
        except ValueError as exc:
            raise PartError(spec.name, str(exc), call, probe, spec.exercise) from None
        if self.check:
            problem = spec.verify(args, result, before)
            if problem is None and spec.name == "schedule_running" and handed != result[1]:
                problem = f"returned preempted={result[1]} but handed {handed} to preempt"
            if problem is not None:
                raise PartError(spec.name, f"wrong: {problem}", call, probe, spec.exercise)
            if commit is not None:
                commit()
        return result


_PROBES = True  # the course's tests turn probes off to test the checks of the engine's own calls alone
plugged, active, at_exit = hooks.plugged, hooks.active, hooks.at_exit  # the seam, as the engine sees it
_plugged = hooks._plugged  # what is plugged in now (the same dict)


def _check_signature(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(f"part {name!r} must be a function, got {type(fn).__name__}")
    spec = PARTS[name]
    num_args = spec.signature.split("(", 1)[1].split(")", 1)[0].count(",") + 1
    try:
        inspect.signature(fn).bind(*range(num_args))
    except TypeError:
        raise TypeError(f"part {name!r} must take {num_args} arguments: {spec.signature}") from None
    except ValueError:
        pass  # a builtin or a C function without a signature: let it try


class use:
    """Plug learner's functions in for the named parts (see ``PARTS``) while a ``with`` block lasts.

    ``check=True`` (the default) first calls each part on its probe shapes (8 query heads over 2 KV heads,
    blocks of 16 and 32, ragged lengths...) and raises ``PartError`` at the first wrong answer; then every call
    the engine makes is verified as it returns. Nesting adds to (and may override) the parts plugged outside;
    leaving the block restores them, also when the block raises. Leaving it also makes every engine that ran
    while it was active forget its prefix cache, so no later result depends on what a learner's code computed
    or wrote. Entering yields the ``Plugged`` wrappers (their ``calls`` count calls). One ``use`` object can be
    entered again once it has been left, never twice at once.
    """

    def __init__(self, check: bool = True, **parts: Callable[..., Any]) -> None:
        if not isinstance(check, bool):
            raise TypeError(f"check must be True or False, got {check!r}")
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
        for name, fn in parts.items():
            _check_signature(name, fn)
        self.check, self.parts = check, parts
        self._active = False

    def __enter__(self) -> dict[str, Plugged]:
        if self._active:
            raise RuntimeError("this parts.use(...) block is already active: leave it before entering it again")
        wrappers = {name: Plugged(name, fn, self.check) for name, fn in self.parts.items()}
        if self.check and _PROBES:
            for wrapper in wrappers.values():
                wrapper.probe()
        # A learner's policy functions are asked through the scheduler's one ``policy`` part (``policy.py``),
        # with those an outer block plugged in that this one does not replace.
        plug: dict[str, Callable[..., Any]] = {n: w for n, w in wrappers.items() if n not in POLICY_PARTS}
        if wrappers.keys() & set(POLICY_PARTS):
            outer = hooks.plugged("policy")
            fns = {**(outer.fns if isinstance(outer, PolicyAsker) else {}), **wrappers}
            plug["policy"] = PolicyAsker({n: f for n, f in fns.items() if f is not None and n in POLICY_PARTS})
        hooks.push(plug)
        self._active = True
        return wrappers

    def __exit__(self, *exc: Any) -> None:
        self._active = False
        hooks.pop()


def table() -> str:
    """The parts, one line each: exercise, name, where the engine calls it."""
    return "\n".join(f"{p.exercise}  {p.name:<23} {p.where}" for p in PARTS.values())


__all__ = ["PARTS", "Part", "PartError", "Plugged", "active", "at_exit", "plugged", "table", "use"]
