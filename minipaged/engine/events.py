"""Engine events: after each step, a plain-data picture of the KV pool and the queues, for whoever watches.

vLLM v1 hands its stat loggers a ``SchedulerStats`` after each step (``vllm/v1/metrics/stats.py``,
``vllm/v1/metrics/loggers.py``); a ``StepEvent`` is the same idea, with enough in it to *draw* the pool: which
blocks each request holds, how full its last block is, what is free, what is free but still cached::

    StepEvent(step=41, step_s=0.031, device="cpu", block_size=16, num_blocks=64)
      requests  "0"  running  blocks [1, 2, 3]   37 tokens in the cache  -> 11 slots unused in block 3
                "1"  running  blocks [4, 5]      20 tokens               -> 12 slots unused in block 5
                "2"  waiting  blocks []          (preempted: it will be recomputed)
      free 58 blocks (3 of them, [7, 8, 12], still cached), null block 0
      this step: 2 requests scheduled, 2 tokens, preempted ["2"], prefix hits 0 of 0 tokens looked up

Why a thread of its own: a watcher (a widget redrawing a figure, a metrics exporter) may be slow or may fail,
and the engine must not wait for it or fail with it. ``Observers.publish`` builds the event (a copy: the
engine goes on changing) and drops it in a bounded queue; one daemon thread hands it to each observer in turn.
An observer that raises is detached with a warning; a queue that overflows drops its oldest events and counts
them. With no observer attached nothing is built at all.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler
    from .step import StepResult

Observer = Callable[["StepEvent"], object]
EVENTS_QUEUED = 256  # events waiting for slow observers; older ones are dropped (and counted)


@dataclass(frozen=True)
class RequestKV:
    """One request's share of the pool after a step."""

    request_id: str
    state: str  # "running", "waiting" (new or preempted for recompute: no blocks) or "swapped" (blocks on the CPU)
    block_ids: tuple[int, ...]  # its block table (device blocks); empty while waiting or swapped
    num_computed_tokens: int  # tokens whose K/V are in those blocks
    num_tokens: int  # prompt + output so far
    unused_slots: int  # slots of its blocks holding no token: its internal fragmentation, all in the last block


@dataclass(frozen=True)
class StepEvent:
    """The engine after one step (see the module docstring). Plain data: safe to keep, send or pickle."""

    step: int
    time: float  # the engine's clock (seconds since it started) when the step ended
    step_s: float  # schedule + execute + update
    device: str
    block_size: int
    num_blocks: int  # the whole pool, the null block included
    num_free_blocks: int  # free for new tokens, cached-free ones included (the null block never is)
    cached_free_block_ids: tuple[int, ...]  # free, but still holding a prefix a later request may hit
    requests: tuple[RequestKV, ...]
    num_scheduled_tokens: int
    num_scheduled_requests: int  # the batch this step ran
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    prefix_queries: int  # prompt tokens looked up in the prefix cache this step ...
    prefix_hits: int  # ... and how many it held
    drafts: int = 0  # speculative decoding: draft tokens checked this step ...
    accepted: int = 0  # ... and how many the model accepted
    num_null_blocks: int = 1  # block 0: never handed out (padding in block tables)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.cached_free_block_ids)

    @property
    def blocks_in_use(self) -> int:
        return self.num_blocks - self.num_null_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """The share of usable blocks in use (vLLM's ``kv_cache_usage``)."""
        return self.blocks_in_use / max(1, self.num_blocks - self.num_null_blocks)

    def in_state(self, state: str) -> list[str]:
        return [r.request_id for r in self.requests if r.state == state]

    @property
    def unused_slots(self) -> int:
        return sum(r.unused_slots for r in self.requests)


def step_event(scheduler: Scheduler, result: StepResult, step: int, now: float, device: str) -> StepEvent:
    """The event for a step that just ran (read from the scheduler and its KV cache manager, copied)."""
    kv, bs = scheduler.kv_cache_manager, scheduler.block_size
    pool = kv.block_pool
    requests: list[RequestKV] = []
    for state, queue in (
        ("running", scheduler.running),
        ("waiting", scheduler.waiting),
        ("swapped", scheduler.swapped),
    ):
        for req in queue:
            blocks = tuple(b.block_id for b in kv.req_to_blocks.get(req.request_id, ()))
            computed = req.num_computed_tokens if blocks else 0
            requests.append(
                RequestKV(req.request_id, state, blocks, computed, req.num_tokens, len(blocks) * bs - computed)
            )
    cached = pool.cached_block_hash_to_block.values()
    cached_free = tuple(sorted(b.block_id for same in cached for b in same.values() if b.ref_cnt == 0))
    out = result.output
    return StepEvent(
        step=step,
        time=now,
        step_s=result.schedule_s + result.execute_s + result.update_s,
        device=device,
        block_size=bs,
        num_blocks=kv.num_blocks,
        num_free_blocks=kv.get_num_free_blocks(),
        cached_free_block_ids=cached_free,
        requests=tuple(requests),
        num_scheduled_tokens=out.total_num_scheduled_tokens,
        num_scheduled_requests=len(out.scheduled),
        preempted=tuple(out.preempted),
        finished=tuple(r.request_id for r in result.finished),
        prefix_queries=result.prefix_queries,
        prefix_hits=result.prefix_hits,
        drafts=result.drafts,
        accepted=result.accepted,
    )


class Observers:
    """Callbacks that each get every ``StepEvent``, on a daemon thread of their own (see the module docstring).

    ``attach(fn)`` / ``detach(fn)``; ``flush()`` waits until every event published so far was delivered (tests,
    and a widget's last redraw). ``dropped`` counts events a slow observer never saw; ``detached`` says which
    observers raised, and what.
    """

    def __init__(self, maxlen: int = EVENTS_QUEUED) -> None:
        self._observers: list[Observer] = []
        self._queue: deque[StepEvent] = deque()
        self._maxlen = maxlen
        self._cond = threading.Condition()
        self._busy = False  # the thread holds an event it has not finished delivering
        self._thread: threading.Thread | None = None
        self.dropped = 0
        self.detached: deque[tuple[str, str]] = deque(maxlen=16)  # (observer, its error): the latest few

    def __bool__(self) -> bool:
        return bool(self._observers)

    def __len__(self) -> int:
        return len(self._observers)

    def attach(self, observer: Observer) -> Observer:
        if not callable(observer):
            raise TypeError(f"an observer must be callable (it gets each StepEvent), got {observer!r}")
        with self._cond:
            self._observers.append(observer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._deliver, name="minipaged-observers", daemon=True)
                self._thread.start()
        return observer

    def detach(self, observer: Observer) -> None:
        """Stop calling it (unknown observers are ignored). An event being delivered may still reach it. With
        the last one gone, the delivering thread ends once the queue is empty (``attach`` starts a new one)."""
        with self._cond:
            if observer in self._observers:
                self._observers.remove(observer)
                self._cond.notify_all()

    def publish(self, event: StepEvent) -> None:
        """Queue an event for the observers; never waits for them."""
        with self._cond:
            if len(self._queue) >= self._maxlen:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(event)
            self._cond.notify_all()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event published so far was handed to every observer; False if ``timeout`` ran out."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def _deliver(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or not self._observers)
                if not self._queue:  # nothing to tell and nobody to tell it to: no thread idles on, per engine
                    self._thread = None
                    self._cond.notify_all()
                    return
                event = self._queue.popleft()
                self._busy = True
                observers = list(self._observers)
            try:
                for observer in observers:
                    try:
                        observer(event)
                    except Exception as exc:  # a broken watcher must not stop the others, or the engine
                        self.detach(observer)
                        name = getattr(observer, "__qualname__", None) or type(observer).__name__
                        self.detached.append((name, repr(exc)))
                        warnings.warn(
                            f"engine observer {name} raised {exc!r} on step {event.step} and was detached",
                            RuntimeWarning,
                            stacklevel=1,
                        )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
