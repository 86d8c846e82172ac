"""Parts: run the real engine with a learner's own piece in place of the package's.

Exercises 03–09 each build one piece of the engine, with the same signature as the
package's own. ``use`` plugs them in, without editing the package, for as long as a
``with`` block lasts::

    from minipaged import LLM, parts

    with parts.use(slot_mapping=my_slot_mapping, free_queue_remove=my_remove):
        outputs = llm.generate(prompts)          # the engine calls *your* functions

Each place in the package where a part runs asks ``parts.plugged(name)`` first
and calls the learner's function if one is plugged in::

    ex03  free_queue_remove       BlockPool.touch: a cached block leaves the middle of the free queue
    ex04  slot_mapping            ModelRunner.prepare_inputs: the slot of every new token
    ex04  would_allocate          KVCacheManager.allocate_slots: "are there blocks now?" (no prefix hit)
    ex05  reshape_and_cache       PagedAttention: write this step's K/V into the paged cache
    ex06  admit_waiting           Scheduler.schedule, step 2: admit waiting requests
    ex07  schedule_running        Scheduler.schedule, step 1: serve running requests, preempt
    ex07  preempt_recompute       Scheduler.preempt: undo a victim's allocation
    ex08  chain_block_hashes      Request.block_hashes: the chained hash of every full block
    ex08  find_prefix_hits        KVCacheManager.get_computed_blocks: the longest cached prefix
    ex09  paged_decode_attention  PagedAttention: a decode-only step's attention

**Checked by default.** With ``check=True`` every call of a plugged part is checked
as it returns: the pure parts against the package's own function on the same
arguments, the parts that change state (the free queue, the scheduler's queues)
against the conditions their result must meet. The first wrong call raises
``PartError``, naming the part, its exercise, the call and what was wrong; an
``LLM`` adds the engine step. ``check=False`` runs the parts as they are, to see
what a bug does to the output (the capstone's report card does both). Whatever
the mode, a part that raises, or returns something of the wrong kind, is a
``PartError`` naming it, never a traceback from deep inside the engine.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


class PartError(RuntimeError):
    """A plugged-in part raised, returned the wrong kind of thing, or (checked) returned a wrong result."""

    def __init__(self, part: str, message: str, call: int = 0) -> None:
        spec = PARTS[part]
        where = f" on call {call}" if call else ""
        super().__init__(f"part {part!r} (exercise {spec.exercise[2:]}){where}: {message}")
        self.part, self.call = part, call
        self.step: int | None = None   # the engine step, filled in by LLM.step


@dataclass(frozen=True)
class Part:
    name: str
    exercise: str   # "ex04"
    signature: str
    where: str      # where the engine calls it
    # before(args) -> what the check needs to know from before the call (None when unchecked)
    before: Callable[[tuple[Any, ...]], Any] | None
    # accept(args, result) -> the result as the engine uses it; raises ValueError naming what is wrong
    accept: Callable[[tuple[Any, ...], Any], Any]
    # verify(args, result, before) -> None if right, else what was wrong
    verify: Callable[[tuple[Any, ...], Any, Any], str | None]


# ---- what each part must return, and how a call is checked --------------------------------------------
def _none(args: tuple[Any, ...], result: Any) -> None:
    if result is not None:
        raise ValueError(f"returned {type(result).__name__}; it changes its arguments in place and returns None")


def _int_list(result: Any, what: str) -> list[int]:
    values = result.tolist() if hasattr(result, "tolist") else result
    if not isinstance(values, (list, tuple)) or not all(hasattr(v, "__index__") and not isinstance(v, bool)
                                                         for v in values):
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


# free_queue_remove(queue, block)
def _remove_before(args: tuple[Any, ...]) -> Any:
    queue, block = args
    return block.prev_free_block, block.next_free_block, queue.num_free_blocks


def _remove_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    queue, block = args
    prev_block, next_block, num_free = before
    if block.prev_free_block is not None or block.next_free_block is not None:
        return f"block {block.block_id} still has free-queue links after its removal"
    if prev_block.next_free_block is not next_block or next_block.prev_free_block is not prev_block:
        return (f"the neighbours of block {block.block_id} (blocks {prev_block.block_id} and {next_block.block_id}, "
                f"-1 = a fake end) are not linked to each other afterwards")
    if queue.num_free_blocks != num_free - 1:
        return f"queue.num_free_blocks is {queue.num_free_blocks}, expected {num_free - 1}"
    return None


# slot_mapping(block_tables, positions, block_size, pad_to=None)
def _slots_accept(args: tuple[Any, ...], result: Any) -> torch.Tensor:
    slots = _int_list(result, "a list of slot numbers")
    n = sum(len(p) for p in args[1])
    if len(slots) != n:
        raise ValueError(f"returned {len(slots)} slots for {n} new tokens")
    return torch.tensor(slots, dtype=torch.int64)


def _slots_verify(args: tuple[Any, ...], result: torch.Tensor, before: Any) -> str | None:
    from .block_table import slot_mapping

    want = slot_mapping(*args).tolist()
    got = result.tolist()
    if got == want:
        return None
    i = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
    return f"token {i} of the step got slot {got[i]}, expected {want[i]} (block tables {args[0]!r:.120})"


def _pool_state(pool: Any) -> tuple[int, tuple[int, ...]]:
    """Free blocks and every ref count: a part that only looks must leave both as they were."""
    return pool.get_num_free_blocks(), tuple(b.ref_cnt for b in pool.blocks)


def _changed_pool(pool: Any, before: tuple[int, tuple[int, ...]]) -> str | None:
    if _pool_state(pool) == before:
        return None
    return "it changed the pool (free blocks or reference counts): this part only looks"


# would_allocate(manager, request, num_new_tokens)
def _bool_accept(args: tuple[Any, ...], result: Any) -> bool:
    if not (isinstance(result, bool) or str(getattr(result, "dtype", "")) in ("bool", "torch.bool")):
        raise ValueError(f"returned {type(result).__name__} {result!r:.40}; expected True or False")
    return bool(result)


def _would_verify(args: tuple[Any, ...], result: bool, before: Any) -> str | None:
    manager, request, num_new = args
    want = manager.can_allocate(request, num_new)
    if result == want:
        return _changed_pool(manager.block_pool, before)
    return (f"said {result} for {num_new} new tokens of request {request.request_id!r} (holding "
            f"{manager.get_num_blocks(request.request_id)} blocks, {manager.get_num_free_blocks()} free, "
            f"{manager.reserved_blocks} reserved, watermark {manager.watermark_blocks}); allocate_slots says {want}")


# reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
def _cache_before(args: tuple[Any, ...]) -> Any:
    return args[2].clone(), args[3].clone()


def _cache_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    from .kernels import reference

    key, value, key_cache, value_cache, slots = args
    want_k, want_v = before
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    for name, got, want in (("key_cache", key_cache, want_k), ("value_cache", value_cache, want_v)):
        wrong = (got != want).flatten(2).any(-1).nonzero()   # (block, offset) pairs that differ
        if len(wrong):
            b, o = (int(x) for x in wrong[0])
            slot = b * key_cache.shape[1] + o
            token = (slots == slot).nonzero().flatten().tolist()
            whose = f"token {token[0]}'s slot" if token else "a slot no token of this step writes"
            return f"{name} block {b}, offset {o} ({whose}) holds the wrong numbers; {len(wrong)} slot(s) differ"
    return None


# paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)
def _attention_accept(args: tuple[Any, ...], result: Any) -> torch.Tensor:
    query = args[0]
    if not isinstance(result, torch.Tensor) or result.shape != query.shape:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise ValueError(f"returned {shape}; expected a tensor shaped like the query, {tuple(query.shape)}")
    return result.to(query.dtype)


def _attention_verify(args: tuple[Any, ...], result: torch.Tensor, before: Any) -> str | None:
    from .kernels import reference

    want = reference.paged_decode_attention(*args)
    tol = 1e-4 if result.dtype == torch.float32 else 2e-2
    err = (result.float() - want.float()).abs()
    bad = ~(err <= tol + tol * want.float().abs())   # NaN counts as wrong
    if not bool(bad.any()):
        return None
    seq, head = (int(x) for x in bad.any(-1).nonzero()[0])
    return (f"sequence {seq} (seq_len {int(args[4][seq])}), query head {head} is off by up to "
            f"{float(err[seq, head].max()):.3g} from the reference")


# schedule_running(running, waiting, kv, token_budget, preempt)
def _running_before(args: tuple[Any, ...]) -> Any:
    running = args[0]
    return list(running), {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in running}


def _running_accept(args: tuple[Any, ...], result: Any) -> tuple[list[tuple[str, int]], list[str]]:
    try:
        scheduled, preempted = result
    except (TypeError, ValueError):
        raise ValueError(f"returned {result!r:.80}; expected (scheduled, preempted)") from None
    return _pairs(scheduled, "scheduled as [(request_id, num_new_tokens), ...]"), [str(r) for r in preempted]


def _running_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    running, waiting, kv, budget, _ = args
    scheduled, preempted = result
    before_list, sizes = before
    ids = [r.request_id for r in before_list]
    k, p = len(scheduled), len(preempted)
    if [rid for rid, _ in scheduled] != ids[:k]:
        return f"scheduled {[rid for rid, _ in scheduled]}; the running requests, oldest first, are {ids}"
    if preempted != ids[::-1][:p] or [r.request_id for r in running] != ids[:len(ids) - p]:
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
        return (f"stopped after {k} request(s) with {left} tokens of budget left and {running[k].request_id!r} "
                f"still running and not scheduled")
    return None


# preempt_recompute(victim, kv, waiting)
def _preempt_before(args: tuple[Any, ...]) -> Any:
    victim, _, waiting = args
    return len(waiting), victim.num_preemptions


def _preempt_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    from .request import RequestStatus

    victim, kv, waiting = args
    num_waiting, num_preemptions = before
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
    return list(args[0])


def _admit_accept(args: tuple[Any, ...], result: Any) -> list[tuple[str, int]]:
    return _pairs(result, "[(request_id, num_new_tokens), ...]")


def _admit_verify(args: tuple[Any, ...], result: Any, before: Any) -> str | None:
    from .request import RequestStatus
    from .scheduler import num_seqs_when_running

    waiting, kv, budget, seats = args
    ids = [r.request_id for r in before]
    k = len(result)
    if [rid for rid, _ in result] != ids[:k] or list(waiting) != before[k:]:
        return (f"admitted {[rid for rid, _ in result]} and left {[r.request_id for r in waiting]} waiting, from "
                f"the queue {ids}: admission takes the head of the queue, in order, and pops what it admits")
    left = budget
    for req, (rid, n) in zip(before, result):
        seats -= num_seqs_when_running(req)
        computed = req.num_computed_tokens
        if req.status is not RequestStatus.RUNNING:
            return f"admitted {rid!r} but left its status {req.status.name}"
        if seats < 0:
            return f"admitted {rid!r} with no free seat left"
        if computed % kv.block_size or n != min(req.num_tokens - computed, left):
            return (f"admitted {rid!r} with {n} new tokens and num_computed_tokens={computed}; its prompt has "
                    f"{req.num_tokens} tokens, the budget left was {left}")
        if kv.get_num_blocks(rid) * kv.block_size < computed + n:
            return f"admitted {rid!r} without the blocks for its {computed + n} tokens (allocate_slots)"
        left -= n
    for req in before[k:]:
        if kv.get_num_blocks(req.request_id):
            return f"{req.request_id!r} was not admitted but holds {kv.get_num_blocks(req.request_id)} blocks"
    if waiting and left > 0 and num_seqs_when_running(waiting[0]) <= seats:
        head = waiting[0]
        hits, hit_tokens = kv.get_computed_blocks(head)
        if kv.can_allocate(head, min(head.num_tokens - hit_tokens, left), hit_tokens, hits):
            return (f"stopped with {left} tokens of budget left although the head of the queue, "
                    f"{head.request_id!r}, fits")
    return None


# chain_block_hashes(token_ids, block_size, cache_salt=None)
def _hashes_accept(args: tuple[Any, ...], result: Any) -> list[bytes]:
    from .block_pool import BlockHash

    token_ids, block_size = args[0], args[1]
    if not isinstance(result, (list, tuple)) or not all(isinstance(h, (bytes, bytearray)) for h in result):
        raise ValueError(f"returned {type(result).__name__} {result!r:.60}; expected a list of bytes, one per full block")
    if len(result) != len(token_ids) // block_size:
        raise ValueError(f"returned {len(result)} hashes for {len(token_ids)} tokens in blocks of {block_size}; "
                         f"expected {len(token_ids) // block_size}, one per full block")
    return [BlockHash(bytes(h)) for h in result]


def _hashes_verify(args: tuple[Any, ...], result: list[bytes], before: Any) -> str | None:
    from .block_pool import chain_block_hashes

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
    from .kv_cache_manager import find_prefix_hits

    want = find_prefix_hits(*args)
    if result == want:
        return _changed_pool(args[0], before)
    return f"returned blocks {result} for a {args[2]}-token prompt; the cached prefix is {want}"


PARTS: dict[str, Part] = {p.name: p for p in [
    Part("free_queue_remove", "ex03", "remove(queue, block) -> None",
         "BlockPool.touch: a cached block leaves the middle of the free queue",
         _remove_before, _none, _remove_verify),
    Part("slot_mapping", "ex04", "slot_mapping(block_tables, positions, block_size, pad_to=None) -> list[int]",
         "ModelRunner.prepare_inputs: the slot of every new token", None, _slots_accept, _slots_verify),
    Part("would_allocate", "ex04", "would_allocate(manager, request, num_new_tokens) -> bool",
         "KVCacheManager.allocate_slots: are there blocks now? (requests without prefix hits or a shared block)",
         lambda args: _pool_state(args[0].block_pool), _bool_accept, _would_verify),
    Part("reshape_and_cache", "ex05", "reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None",
         "PagedAttention: write this step's K/V into the paged cache", _cache_before, _none, _cache_verify),
    Part("admit_waiting", "ex06", "admit_waiting(waiting, kv, token_budget, free_seats) -> [(request_id, n)]",
         "Scheduler.schedule, step 2: admit waiting requests", _admit_before, _admit_accept, _admit_verify),
    Part("schedule_running", "ex07",
         "schedule_running(running, waiting, kv, token_budget, preempt) -> (scheduled, preempted)",
         "Scheduler.schedule, step 1: serve running requests, preempt the newest", _running_before, _running_accept,
         _running_verify),
    Part("preempt_recompute", "ex07", "preempt_recompute(victim, kv, waiting) -> None",
         "Scheduler.preempt: undo a victim's allocation (recompute)", _preempt_before, _none, _preempt_verify),
    Part("chain_block_hashes", "ex08", "chain_block_hashes(token_ids, block_size, cache_salt=None) -> [bytes]",
         "Request.block_hashes: the chained hash of every full block", None, _hashes_accept, _hashes_verify),
    Part("find_prefix_hits", "ex08", "find_prefix_hits(pool, block_hashes, num_tokens, block_size) -> [block id]",
         "KVCacheManager.get_computed_blocks: the longest cached prefix", lambda args: _pool_state(args[0]),
         _hits_accept, _hits_verify),
    Part("paged_decode_attention", "ex09",
         "paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale) -> Tensor",
         "PagedAttention: the attention of a decode-only step", None, _attention_accept, _attention_verify),
]}


class Plugged:
    """A learner's function standing in for one part: it counts calls, accepts and (checked) verifies them."""

    def __init__(self, name: str, fn: Callable[..., Any], check: bool) -> None:
        self.spec, self.fn, self.check, self.calls = PARTS[name], fn, check, 0

    def __call__(self, *args: Any) -> Any:
        spec = self.spec
        self.calls += 1
        before = spec.before(args) if self.check and spec.before else None
        handed: list[str] = []
        if spec.name == "schedule_running" and self.check:   # record who is handed to preempt
            preempt = args[4]

            def recording_preempt(victim: Any, kv: Any, waiting: Any) -> None:
                handed.append(victim.request_id)
                preempt(victim, kv, waiting)

            args = (*args[:4], recording_preempt)
        try:
            result = self.fn(*args)
        except PartError:
            raise
        except Exception as exc:   # the learner's bug, named, not a traceback from inside the engine
            raise PartError(spec.name, f"raised {type(exc).__name__}: {exc}", self.calls) from exc
        try:
            result = spec.accept(args, result)
        except ValueError as exc:
            raise PartError(spec.name, str(exc), self.calls) from None
        if self.check:
            problem = spec.verify(args, result, before)
            if problem is None and spec.name == "schedule_running" and handed != result[1]:
                problem = f"returned preempted={result[1]} but handed {handed} to preempt"
            if problem is not None:
                raise PartError(spec.name, f"wrong: {problem}", self.calls)
        return result


_plugged: dict[str, Plugged] = {}


def plugged(name: str) -> Plugged | None:
    """The learner's function for part ``name`` if one is plugged in now, else None (the package's own runs)."""
    return _plugged.get(name) if _plugged else None


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
        pass   # a builtin or a C function without a signature: let it try


@contextmanager
def use(check: bool = True, **parts: Callable[..., Any]) -> Iterator[dict[str, Plugged]]:
    """Plug learner's functions in for the named parts (see ``PARTS``) while the block lasts.

    Nesting adds to (and may override) the parts plugged outside; leaving the block restores them,
    also when the block raises. Yields the ``Plugged`` wrappers (their ``calls`` count calls).
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
    for name, fn in parts.items():
        _check_signature(name, fn)
    saved = dict(_plugged)
    wrappers = {name: Plugged(name, fn, check) for name, fn in parts.items()}
    _plugged.update(wrappers)
    try:
        yield wrappers
    finally:
        _plugged.clear()
        _plugged.update(saved)


def table() -> str:
    """The parts, one line each: exercise, name, where the engine calls it."""
    return "\n".join(f"{p.exercise}  {p.name:<23} {p.where}" for p in PARTS.values())


__all__ = ["PARTS", "Part", "PartError", "Plugged", "plugged", "table", "use"]
