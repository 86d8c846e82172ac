"""``LLM``: the finished engine — SmolLM2 served from a paged KV cache with continuous batching.

Everything the course built meets here, in a loop that vLLM users will recognise::

    prompts ─▶ InputProcessor ─▶ Request ─▶ run_step: Scheduler.schedule() ─▶ executor.execute() ─▶
                                                      Scheduler.update_from_output() ─▶ RequestOutput
                              KVCacheManager / BlockPool       CacheEngine (K/V tensors)
                              └──────────────── blocks in, blocks out ─────────────────┘

The pieces live in their own modules: prompts in ``inputs``, the step in ``step``, the weights, the pool's
size and the cache tensors behind the executor (``worker/executor.py``: one model runner in this process, or one
per tensor-parallel rank), what comes back in ``outputs``. ``LLM`` holds them together, asks the executor (never
a runner) what it needs, and keeps the requests a caller added until it has handed their outputs back.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from .. import hooks
from ..config import Config
from ..core.kv_connector import KVConnector
from ..core.request import Request
from ..core.scheduler import Scheduler
from ..model import LlamaForCausalLM
from ..sampling_params import SamplingParams
from ..worker.cache_engine import CacheEngine
from ..worker.executor import make_executor
from .events import Observers, step_event
from .inputs import ParamsLike, Prompt, Prompts, check_params, model_inputs
from .outputs import RequestOutput, is_done, num_output_tokens, request_output, samples
from .overlap import StepPipeline

STEP_STATS_KEPT = 10_000  # about 5 MB of rows: enough for any widget or benchmark run
P = ParamSpec("P")
R = TypeVar("R")


SHUT_DOWN = "this LLM was shut down (llm.shutdown()): its weights and KV pool are gone; build a new LLM"


def _serialised(method: Callable[Concatenate[LLM, P], R]) -> Callable[Concatenate[LLM, P], R]:
    """Hold the engine's lock for the call: one step, add, abort or hand-back at a time, whichever thread asks."""

    @functools.wraps(method)
    def locked(self: LLM, *args: P.args, **kwargs: P.kwargs) -> R:
        with self._lock:
            if self.executor.released:
                raise RuntimeError(SHUT_DOWN)
            return method(self, *args, **kwargs)

    return locked


def _held(name: str) -> Any:
    """An ``LLM`` attribute that is rank 0's (its weights, its cache): refused once ``shutdown()`` gave it back."""

    def get(llm: LLM) -> Any:
        if llm.executor.released:
            raise RuntimeError(SHUT_DOWN)
        return getattr(llm.executor, name)

    return property(get, doc=f"Rank 0's {name}, from the executor (gone after ``shutdown()``).")


class LLM:
    """A small offline engine with vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``.

    ``LLM(model=None, **kwargs)``: the keyword arguments are the fields of :class:`minipaged.config.Config`, all
    checked before the model loads. Threads may share one ``LLM``: steps, adds, aborts and hand-backs take turns
    under a lock, so the calls of several threads run as one batch and each gets its own outputs back.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        self.config = Config.from_kwargs(model, kwargs)
        self.executor = ex = make_executor(self.config)  # this process's runner, or rank 0 of a tensor-parallel group
        pool = ex.pool  # the KV pool every rank agreed on (a runner is the executor's: it may live elsewhere)
        self.spec, self.dtype, self.device = pool.spec, pool.dtype, pool.device
        weakref.finalize(self, ex.free_memory).atexit = False  # dropped without shutdown(): the memory goes back too
        self.block_size, self.num_blocks, self.max_model_len = pool.block_size, pool.num_blocks, pool.max_model_len
        self.tokenizer, self.processor, self.eos_token_id = model_inputs(ex.model_path, ex.model.config)
        self._t0, self._lock = time.perf_counter(), threading.RLock()
        self.observers = Observers()  # watchers of every step (events.py); they outlive reset()
        self.kv_connector_factory: Callable[[], KVConnector] | None = None  # makes one per reset() (disagg.py)
        self.pipeline = StepPipeline.for_engine(self.config, self.device.type)  # the step driver (overlap.py)
        self.reset()

    model: LlamaForCausalLM = _held("model")
    cache: CacheEngine = _held("cache")

    @_serialised
    def reset(self) -> None:
        """A fresh engine around the same weights and cache tensors: every request dropped, an empty pool and
        prefix cache, a new scheduler (a second ``LLM`` would load the model again)."""
        connector, pool = None if self.kv_connector_factory is None else self.kv_connector_factory(), self.executor.pool
        self.pipeline.forget()  # a step in flight serves requests that are dropped now
        self.scheduler = Scheduler.from_config(self.config, self.num_blocks, self.max_model_len, pool.num_cpu_blocks,
                                               pool.num_offload_blocks, connector, pool.kv_cache_groups)  # fmt: skip
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.executor.reset()
        self.sampler = self.executor.sampler
        self.step_stats: deque[dict[str, Any]] = deque(maxlen=STEP_STATS_KEPT)  # a row a step, for the widgets
        self._requests: dict[str, Request] = {}  # added and not yet handed back (the scheduler forgets finished)
        self.num_steps = self._counter = 0  # steps run (a part's error names its step), automatic ids handed out

    def describe(self) -> str:
        return self.executor.describe()

    def shutdown(self) -> None:
        """Give back the workers and the device memory now (``executor.shutdown``), even while something (a
        notebook's history) still refers to the engine; dropping it does the same. Later calls raise."""
        with self._lock:
            self._requests.clear()
            self.pipeline.forget()
            self.executor.shutdown()

    # ---- requests -------------------------------------------------------------------------------
    @_serialised
    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    arrival_time: float | None = None) -> str:  # fmt: skip
        """Queue one request (checked first: a bad one raises and queues nothing); returns its id. Its TTFT counts
        from ``arrival_time`` on the engine's clock (``now()``; a disaggregated decode side passes an earlier one)."""
        params = check_params(params or SamplingParams())
        if request_id is None:
            (request_id,) = self._take_ids(1)
        elif not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#', got {request_id!r}")
        return self._queue(request_id, self.processor.token_ids(prompt, request_id), params, arrival_time)

    def _take_ids(self, n: int) -> list[str]:
        """The next ``n`` automatic request ids ("0", "1", ...)."""
        self._counter += n
        return [str(i) for i in range(self._counter - n, self._counter)]

    def _queue(self, request_id: str, token_ids: list[int], params: SamplingParams,
               arrival: float | None = None) -> str:  # fmt: skip
        """Hand a checked prompt to the scheduler (which rejects, on that request alone, one that can never run)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, token_ids, sampling_params=params, eos_token_id=self.eos_token_id,
                      arrival_time=self.now() if arrival is None else min(float(arrival), self.now()))  # fmt: skip
        self.scheduler.add_request(req)
        self._requests[request_id] = req
        return request_id

    @_serialised
    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests wherever they are and give back their blocks; unknown ids are ignored, as in vLLM.
        Cleanup must succeed, also after a learner's part failed a step: it runs the package's own pieces."""
        with hooks.suspended():
            for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
                if rid in self._requests:
                    for req in reversed(samples(self._requests[rid])):  # forked samples first
                        self.scheduler.abort(req.request_id)  # the runner drops its state with the next step
                    del self._requests[rid]
        self.pipeline.release_if_idle(self.scheduler, self.executor)

    def now(self) -> float:
        """The engine's clock: seconds since it was built (what ``RequestMetrics`` times are measured on)."""
        return time.perf_counter() - self._t0

    # ---- the loop -------------------------------------------------------------------------------
    @_serialised
    def step(self) -> list[str]:
        """One step (``run_step`` through ``self.pipeline``: whole or not at all); returns the ids of the requests
        that finished in it. A request whose logits or sampling fail (NaN logits, say) finishes with an ``error``."""
        self.num_steps += 1
        res = self.pipeline.step(self.scheduler, self.executor, self.now, step_index=self.num_steps)
        self.executor.timers["schedule"] += res.schedule_s
        self.executor.timers["update"] += res.update_s
        self.step_stats.append(res.stats(self.scheduler, now := self.now()))
        if self.observers:  # nothing is built while nobody watches
            self.observers.publish(step_event(self.scheduler, res, self.num_steps, now, self.device.type))
        return [r.request_id for r in res.finished]  # a step that ran is committed by the next schedule()

    @_serialised
    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (for ``add_request`` + ``step`` users). A finished request is
        handed back once and then forgotten, so a long-running engine keeps no finished state."""
        if request_id not in self._requests:
            raise ValueError(f"unknown request id {request_id!r} (never added, aborted, or already handed back)")
        out = request_output(self._requests[request_id], self.processor.decode)
        if out.finished:
            del self._requests[request_id]
        return out

    @_serialised
    def _done(self, request_id: str) -> bool:
        """Finished, or gone (``reset`` by another thread: ``get_output`` then says it is unknown)."""
        return request_id not in self._requests or is_done(self._requests[request_id])

    @_serialised
    def _poll(self, rid: str, pending: dict[str, int]) -> RequestOutput | None:
        """A snapshot if it gained tokens since ``pending[rid]``; its final output once it finished; else None."""
        if self._done(rid):
            del pending[rid]
            return self.get_output(rid)
        n = num_output_tokens(self._requests[rid])
        if n == pending[rid]:
            return None
        pending[rid] = n
        return request_output(self._requests[rid], self.processor.decode)

    def stream(self, prompts: Prompts, sampling_params: ParamsLike = None) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` snapshot every time a request gains tokens or finishes. Closing the generator
        early aborts its requests (one dropped in a reference cycle: at ``gc.collect()``); ``close()`` it, or end it."""
        ids = self._add_prompts(prompts, sampling_params)
        try:
            pending = {rid: -1 for rid in ids}  # output tokens seen so far
            for rid in ids:  # rejected at once: report them first
                if self._done(rid):
                    del pending[rid]
                    yield self.get_output(rid)
            while pending:
                self.step()
                for rid in list(pending):
                    if (out := self._poll(rid, pending)) is not None:
                        yield out
        finally:  # closed early, interrupted or failed: this call's requests leave nothing behind
            self.abort([rid for rid in ids if rid in self._requests])

    def generate(self, prompts: Prompts, sampling_params: ParamsLike = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:  # fmt: skip
        """Serve a batch of prompts to the end; outputs come back in the order of the prompts."""
        from tqdm.auto import tqdm

        ids = self._add_prompts(prompts, sampling_params)
        try:
            show = len(ids) >= 16 if use_tqdm is None else use_tqdm
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not show) as bar:
                done = sum(self._done(r) for r in ids)
                bar.update(done)
                while done < len(ids):
                    self.step()
                    now_done = sum(self._done(r) for r in ids)
                    bar.update(now_done - done)
                    done = now_done
            return [self.get_output(r) for r in ids]
        finally:  # Ctrl-C or a failed step: abort this call's requests, free their blocks
            self.abort([rid for rid in ids if rid in self._requests])

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: ParamsLike = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:  # fmt: skip
        """One conversation (a list of ``{"role", "content"}`` messages) or a batch of them, through the chat template."""
        return self.generate(messages, sampling_params, use_tqdm=use_tqdm)

    @_serialised
    def _add_prompts(self, prompts: Prompts, sampling_params: ParamsLike) -> list[str]:
        """Check the whole batch, then queue it: a bad prompt anywhere queues nothing."""
        batch = self.processor.batch(prompts, sampling_params)
        first = self._counter  # the ids are taken once every prompt passed
        checked = [self.processor.token_ids(p, str(first + i)) for i, (p, _) in enumerate(batch)]
        ids = self._take_ids(len(batch))
        queued: list[str] = []
        try:
            for rid, token_ids, (_, params) in zip(ids, checked, batch):
                queued.append(self._queue(rid, token_ids, params))
        except BaseException:
            self.abort(queued)
            raise
        return ids

    def profile(self) -> dict[str, float]:
        """Seconds spent so far in each phase of the step loop."""
        return dict(self.executor.timers)
