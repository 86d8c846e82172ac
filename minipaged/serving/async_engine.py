"""``AsyncEngine``: one thread steps the ``LLM``; asyncio request handlers await their outputs
(vLLM's ``vllm/v1/engine/async_llm.py``, in small and in one process).

A step holds the engine's lock for 50-200 ms on a CPU. If the event loop called ``add_request`` or ``abort``
itself, every stream of the server would freeze while a step runs. So the event loop never calls a
lock-taking ``LLM`` method; it talks to the engine thread through a command queue, and requests join (and
leave) at step boundaries::

    event loop (uvicorn)                           engine thread
    generate() ── ("add", id, tokens) ──▶ commands ──▶ llm.add_request  ┐
    abort()    ── ("abort", id) ────────▶          ──▶ llm.abort        │ between steps
                                                       llm.step()       ┘
    asyncio.Queue per request ◀── call_soon_threadsafe ── llm._poll(id): new tokens, or finished

The engine thread sleeps on a condition when there is no work, and is the only caller of the ``LLM``'s
methods while it runs: one engine loop per ``LLM``. The event loop's own CPU-heavy work (tokenizing a long
prompt, a chat template) goes to a small thread pool (``run_cpu``), so a big prompt does not freeze the other
streams and ``/health`` while it is tokenized.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics, engine_snapshot

if TYPE_CHECKING:
    from ..engine.llm import LLM

log = logging.getLogger("minipaged.serving")
T = TypeVar("T")
CPU_THREADS = 2  # tokenizers at once: a small request is not stuck behind a big one, the loop keeps its share
SHUT_DOWN = "the engine was shut down (llm.shutdown()): its weights and KV pool are gone; restart the server"
_DRIVEN: weakref.WeakSet[Any] = weakref.WeakSet()  # the LLMs an engine loop runs now: one loop each


def _stopped(pid: int) -> bool:
    """Whether a process is stopped (SIGSTOP, a debugger), from Linux's /proc; False where there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


class EngineError(RuntimeError):
    """A request that could not be served: ``rejected`` by the scheduler (a client error) or failed (the server's)."""

    def __init__(self, message: str, rejected: bool = False) -> None:
        super().__init__(message)
        self.rejected = rejected


class EngineDeadError(EngineError):
    """The engine loop has stopped (shut down, or died): nothing can be queued."""


@dataclass
class _Stream:
    """Where one request's outputs go: the queue of the coroutine awaiting them, on its event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    num_tokens: int = 0  # output tokens counted into the metrics so far


class AsyncEngine:
    """Serve an ``LLM`` to asyncio code: ``async for out in engine.generate(token_ids, params, request_id)``."""

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None) -> None:
        self.llm = llm
        self.metrics = metrics or ServerMetrics()
        self._wake = threading.Condition()  # guards _commands, _stopping, _closed (never held during a step)
        self._commands: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        # Owned by the engine thread alone: the requests it serves, and the output tokens _poll has seen.
        self._live: dict[str, _Stream] = {}
        self._pending: dict[str, int] = {}
        self._stopped_because: str | None = None  # why the loop ended: shut down, or the error that killed it
        self._cpu = ThreadPoolExecutor(CPU_THREADS, thread_name_prefix="minipaged-cpu")

    @property
    def is_alive(self) -> bool:
        """The engine loop runs (it may still be unable to serve: see ``health``)."""
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def health(self) -> str | None:
        """None while the engine can serve; else why not, in words (``/health``'s 503 says it). Read from any
        thread without the engine's lock: flags, an error string, and a ``waitpid`` and a /proc read per worker."""
        if self._thread is None:
            return "the engine loop was never started (AsyncEngine.start())"
        executor = self.llm.executor
        if executor.released:
            return SHUT_DOWN
        from ..worker.executor import MultiprocExecutor  # the engine loaded it already

        if isinstance(executor, MultiprocExecutor):  # tensor parallelism: rank 0 cannot step without every worker
            if executor.closed_because is not None:
                return f"the engine's tensor-parallel ranks are gone ({executor.closed_because}); restart the server"
            alive = set(executor.alive())
            dead = [f"rank {rank} (pid {pid})" for rank, pid in enumerate(executor.pids, start=1) if pid not in alive]
            stopped = [f"rank {rank} (pid {pid})" for rank, pid in enumerate(executor.pids, start=1) if _stopped(pid)]
            if stopped:  # alive, but a step waits for it until distributed_timeout_s ends every rank
                return f"tensor-parallel {', '.join(stopped)} {'is' if len(stopped) == 1 else 'are'} stopped (SIGSTOP or a debugger): steps wait for it"
            if dead:
                return f"tensor-parallel {', '.join(dead)} {'is' if len(dead) == 1 else 'are'} not running; restart the server"
        if self._closed or self._stopping or not self._thread.is_alive():
            return f"the engine loop has stopped ({self._stopped_because or 'it is shutting down'})"
        return None

    async def run_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the engine's small thread pool, awaited: CPU work that must not hold the event loop."""
        try:
            future = asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)
        except RuntimeError:  # the pool was shut down with the engine loop
            raise EngineDeadError(self.health() or "the engine loop is not running") from None
        return await future

    # ---- life cycle ----------------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is not None:
            raise RuntimeError("this AsyncEngine was started already (make a new one)")
        if self.llm in _DRIVEN:
            raise RuntimeError("another AsyncEngine drives this LLM: shut it down first (one engine loop per LLM)")
        if self.llm.executor.released:
            raise RuntimeError(SHUT_DOWN.replace("restart the server", "build a new LLM"))
        self._snapshot()  # /metrics shows the pool from the first scrape, not zeros until the first step
        _DRIVEN.add(self.llm)
        self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after its current step; every request still in flight ends with an error and is
        aborted, so the ``LLM`` is left empty (another engine loop may take it over)."""
        with self._wake:
            self._stopping = True
            self._stopped_because = self._stopped_because or "it was shut down"
            self._wake.notify_all()
        self._cpu.shutdown(wait=False)  # what it runs now finishes; nothing new is taken
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("minipaged: the engine thread did not stop within %.0f s", timeout)

    # ---- the asyncio side ----------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a checked prompt; yield a ``RequestOutput`` snapshot whenever it gains tokens, the last one
        finished. A rejected or failed request raises ``EngineError``. Leaving early (a client that disconnects,
        a cancelled task, ``aclose()``) aborts the request: its blocks are free after the next step boundary.
        An engine that cannot serve (``health``) raises ``EngineDeadError`` with the reason, before anything is queued."""
        why = self.health()
        if why is not None:
            raise EngineDeadError(why)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._send(("add", request_id, list(prompt_token_ids), params, _Stream(asyncio.get_running_loop(), queue)))
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():  # a slow consumer: each snapshot holds all the text, keep the latest
                    items.append(queue.get_nowait())
                error = next((i for i in items if isinstance(i, BaseException)), None)
                if error is not None:
                    finished = True  # the engine thread has let the request go already
                    raise error
                out = items[-1]
                assert isinstance(out, RequestOutput)
                finished = out.finished
                if out.error:
                    rejected = any(o.finish_reason == "rejected" for o in out.outputs)
                    raise EngineError(out.error, rejected=rejected)
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary (any thread; an unknown or finished id is ignored)."""
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass  # the loop is gone and has aborted everything already

    def _send(self, command: tuple[Any, ...]) -> None:
        with self._wake:
            if self._closed or self._stopping or self._thread is None:
                raise EngineDeadError(self.health() or "the engine loop is not running")
            self._commands.append(command)
            self._wake.notify()

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (commands := self._next_commands()) is not None:
                try:
                    for command in commands:
                        self._apply(command)
                    if self._live:
                        self._step()
                except Exception as exc:  # a bug (a failed step is handled in _step): fail what runs, go on
                    log.exception("minipaged: the engine loop failed: %s", exc)
                    self._fail_all(EngineError(f"internal error in the engine loop: {type(exc).__name__}: {exc}"))
                self._snapshot()
        except BaseException as exc:  # the loop itself died (a bug): logged here, and /health says so from now on
            self._stopped_because = f"it died: {type(exc).__name__}: {exc}"
            log.exception("minipaged: the engine loop died: %s", exc)
        finally:  # shut down, or killed: no stream is left waiting, no block left held
            with self._wake:
                self._closed = True
                left = [c for c in self._commands if c[0] == "add"]
                self._commands.clear()
            dead = EngineDeadError(f"the engine loop has stopped ({self._stopped_because or 'it was shut down'})")
            for command in left:
                self._deliver(command[4], dead)
            self._fail_all(dead, aborted=True)
            try:
                self._snapshot()
            except Exception:  # the figures of a broken engine: not worth a second traceback
                log.debug("minipaged: no last snapshot of the engine", exc_info=True)
            _DRIVEN.discard(self.llm)  # last: another loop may take the LLM over now

    def _next_commands(self) -> list[tuple[Any, ...]] | None:
        """The commands sent since the last step (sleeping while there is nothing to do); None: stop."""
        with self._wake:
            while not (self._commands or self._live or self._stopping):
                self._wake.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: tuple[Any, ...]) -> None:
        if command[0] == "add":
            _, rid, token_ids, params, stream = command
            try:
                self.llm.add_request(token_ids, params, rid)
            except Exception as exc:  # checked before it was queued, so unlikely: an id in use, say
                self._deliver(stream, EngineError(str(exc), rejected=isinstance(exc, ValueError)))
                return
            self._live[rid] = stream
            self._pending[rid] = -1
        elif command[1] in self._live:  # "abort": the client left
            del self._live[command[1]], self._pending[command[1]]
            self.llm.abort(command[1])
            self.metrics.record_aborted()

    def _step(self) -> None:
        """One step if the scheduler has work, then every live request's news to its stream."""
        llm = self.llm
        if llm.scheduler.has_unfinished():
            try:
                llm.step()
            except Exception as exc:  # the step did not happen (step.run_step): fail its requests, keep serving
                log.error("minipaged: a step failed (%s: %s); failing %d request(s)", type(exc).__name__, exc,
                          len(self._live))  # fmt: skip
                why = self.health()  # an engine that can never step again (its ranks gone): 503, with the reason
                failed = f"the engine failed a step: {type(exc).__name__}: {exc}"
                self._fail_all(EngineError(failed) if why is None else EngineDeadError(why))
                return
        for rid, stream in list(self._live.items()):
            try:
                out = llm._poll(rid, self._pending)
            except ValueError as exc:  # gone from the LLM (someone called reset)
                self._drop(rid, EngineError(str(exc)))
                continue
            if out is None:
                continue
            tokens = sum(len(o.token_ids) for o in out.outputs)
            first = stream.num_tokens == 0 and tokens > 0
            self.metrics.record_tokens(len(out.prompt_token_ids) if first else 0, tokens - stream.num_tokens)
            stream.num_tokens = tokens
            if out.finished:
                del self._live[rid]
                if out.error:
                    self.metrics.record_failed()
                else:
                    self.metrics.record_finished(out)
            if not self._deliver(stream, out) and not out.finished:
                self._drop(rid, None)  # nobody listens any more (its event loop closed)
                self.metrics.record_aborted()
        if self._live and not llm.scheduler.has_unfinished():  # cannot happen; never spin on it
            self._fail_all(EngineError("the engine lost track of these requests"))

    def _drop(self, rid: str, error: BaseException | None) -> None:
        stream = self._live.pop(rid)
        self._pending.pop(rid, None)
        self.llm.abort(rid)
        if error is not None:
            self.metrics.record_failed()
            self._deliver(stream, error)

    def _fail_all(self, error: BaseException, aborted: bool = False) -> None:
        """Every live request ends with ``error`` and is aborted, so its blocks go back to the pool."""
        streams, ids = list(self._live.values()), list(self._live)
        if not ids:
            return
        self._live.clear()
        self._pending.clear()
        try:
            self.llm.abort(ids)
        except Exception:
            log.exception("minipaged: aborting the failed requests failed too")
        for stream in streams:
            self._deliver(stream, error)
        (self.metrics.record_aborted if aborted else self.metrics.record_failed)(len(ids))

    @staticmethod
    def _deliver(stream: _Stream, item: RequestOutput | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:  # its event loop is closed
            return False

    def _snapshot(self) -> None:
        """The gauges, read here between steps: ``/metrics`` then never waits for the engine's lock."""
        self.metrics.set_gauges(engine_snapshot(self.llm))
