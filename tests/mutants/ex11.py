"""Exercise 11 — the server's streaming side: merging, server-sent events and disconnects a learner gets wrong.

The helpers are right answers written differently from the solution notebook's (a task per request feeding one
queue): ``merged_by_wait`` keeps one pending ``__anext__`` per request and races them with ``asyncio.wait``;
``events_by_table`` keeps each choice's state in a small record; ``unless_by_event`` races the work against an
``asyncio.Event`` set by the watcher. Each mutant is one mistake away from one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from minipaged.serving.async_engine import EngineError
from minipaged.serving.serving_engine import SSE_DONE, ClientGone, engine_error, sse

from . import mutant

CHECKS = {
    "merged": ["check_merged"],
    "completion_events": ["check_events"],
    "unless_disconnected": ["check_disconnect"],
}


# ---- right answers, written differently ---------------------------------------------------------------------
async def merged_by_wait(
    engine: Any, prompts: Sequence[list[int]], params: Sequence[Any], base_id: str
) -> AsyncIterator[tuple[int, Any]]:
    gens = {i: engine.generate(prompts[i], params[i], f"{base_id}-{i}") for i in range(len(prompts))}
    pending = {asyncio.ensure_future(anext(g)): i for i, g in gens.items()}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in sorted(done, key=lambda f: pending[f]):
                i = pending.pop(fut)
                try:
                    out = fut.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for fut in pending:
            fut.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens.values():
            await g.aclose()  # a generator never started, or stopped at a yield: closing it aborts its request


@dataclass
class _Choice:
    sent: str = ""
    done: bool = False


async def events_by_table(
    engine: Any, prompts: Sequence[list[int]], params: Sequence[Any], head: dict[str, Any]
) -> AsyncIterator[str]:
    n = params[0].n if params else 1
    choices: dict[int, _Choice] = {}
    try:
        async with aclosing(merged_by_wait(engine, prompts, params, head["id"])) as outs:
            async for i, out in outs:
                for o in out.outputs:
                    c = choices.setdefault(i * n + o.index, _Choice())
                    if c.done:
                        continue
                    text = o.text
                    if o.finish_reason is None:
                        while text.endswith("\ufffd"):
                            text = text[:-1]
                    new = text[len(c.sent) :] if len(text) > len(c.sent) else ""
                    c.sent += new
                    c.done = o.finish_reason is not None
                    if new or c.done:
                        chunk = {
                            "index": i * n + o.index,
                            "text": new,
                            "logprobs": None,
                            "finish_reason": o.finish_reason,
                        }
                        yield sse({**head, "choices": [chunk]})
    except EngineError as exc:
        yield sse(engine_error(exc).body())
    yield SSE_DONE


async def unless_by_event(receive: Any, work: Awaitable[Any]) -> Any:
    gone = asyncio.Event()

    async def watch() -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                gone.set()
                return

    task = asyncio.ensure_future(work)
    watcher, waiter = asyncio.create_task(watch()), asyncio.create_task(gone.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (watcher, waiter, task):
            if not t.done():
                t.cancel()
        await asyncio.gather(watcher, waiter, task, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    raise ClientGone()


HELPERS: dict = {
    "merged": merged_by_wait,
    "completion_events": events_by_table,
    "unless_disconnected": unless_by_event,
}


# ---- merged ----------------------------------------------------------------------------------------------------
async def _pumping(
    engine: Any, prompts: Any, params: Any, base_id: str, ids: Any = None, swallow: bool = False,
    cancel: bool = True, wait: bool = True, until_first: bool = False,
) -> AsyncIterator[Any]:  # fmt: skip
    """The solution's shape with one knob per mistake (each mutant below turns one)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            rid = ids(i) if ids else f"{base_id}-{i}"
            async with aclosing(engine.generate(prompts[i], params[i], rid)) as outs:
                async for out in outs:
                    queue.put_nowait((i, out))
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(None if swallow else exc)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                if until_first:
                    return
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        if cancel:
            for t in tasks:
                t.cancel()
            if wait:
                await asyncio.gather(*tasks, return_exceptions=True)


@mutant("merged", "one prompt after another: the first request's whole output before the second starts")
async def sequential(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    for i in range(len(prompts)):  # MISTAKE: the requests must run at once
        async with aclosing(engine.generate(prompts[i], params[i], f"{base_id}-{i}")) as outs:
            async for out in outs:
                yield i, out


@mutant("merged", "no finally: a consumer that stops leaves the other requests running in the engine")
def no_cancel(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    return _pumping(engine, prompts, params, base_id, cancel=False)  # MISTAKE


@mutant("merged", "the tasks are cancelled but not awaited: the aborts land after merged has returned")
def cancel_not_awaited(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    return _pumping(engine, prompts, params, base_id, wait=False)  # MISTAKE


@mutant("merged", "a request's error is swallowed: the stream ends as if it had finished")
def swallows_errors(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    return _pumping(engine, prompts, params, base_id, swallow=True)  # MISTAKE


@mutant("merged", "every request gets base_id as its id: the engine refuses the second")
def one_id(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    return _pumping(engine, prompts, params, base_id, ids=lambda i: base_id)  # MISTAKE


@mutant("merged", "it ends when the first request finishes, not the last")
def ends_at_first(engine: Any, prompts: Any, params: Any, base_id: str) -> AsyncIterator[Any]:
    return _pumping(engine, prompts, params, base_id, until_first=True)  # MISTAKE


# ---- completion_events ------------------------------------------------------------------------------------------
async def _events(engine: Any, prompts: Any, params: Any, head: dict[str, Any], hold_back: bool = True,
                  delta: bool = True, by_prompt: bool = True, once: bool = True, catch: bool = True,
                  close: bool = True, skip_empty: bool = True) -> AsyncIterator[str]:  # fmt: skip
    """``events_by_table``'s logic with one knob per mistake."""
    n = params[0].n if params else 1
    sent: dict[int, int] = {}
    done: set[int] = set()

    async def body() -> AsyncIterator[str]:
        outs = merged_by_wait(engine, prompts, params, head["id"])
        try:
            async for i, out in outs:
                for o in out.outputs:
                    index = i * n + o.index if by_prompt else o.index
                    if once and index in done:
                        continue
                    finished = o.finish_reason is not None
                    stable = o.text if (finished or not hold_back) else o.text.rstrip("\ufffd")
                    new = stable[sent.get(index, 0) :] if delta else stable
                    sent[index] = max(sent.get(index, 0), len(stable))
                    if new or finished or not skip_empty:
                        chunk = {"index": index, "text": new, "logprobs": None, "finish_reason": o.finish_reason}
                        yield sse({**head, "choices": [chunk]})
                    if finished:
                        done.add(index)
        finally:
            if close:
                await outs.aclose()

    if not catch:
        async for e in body():
            yield e
        yield SSE_DONE
        return
    try:
        async with aclosing(body()) as events:
            async for e in events:
                yield e
    except EngineError as exc:
        yield sse(engine_error(exc).body())
    yield SSE_DONE


@mutant("completion_events", "a half-decoded character's U+FFFD is sent as text (no hold-back)")
def sends_fffd(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, hold_back=False)  # MISTAKE


@mutant("completion_events", "each chunk holds the whole text so far, not what is new")
def whole_text(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, delta=False)  # MISTAKE


@mutant("completion_events", "the choice index is the sample's index alone: prompts overwrite each other")
def sample_index(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, by_prompt=False)  # MISTAKE


@mutant("completion_events", "a finished choice is sent again while its prompt's other sample runs on")
def reason_again(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, once=False)  # MISTAKE


@mutant("completion_events", "an engine error escapes: the client sees a cut stream with no error and no [DONE]")
def error_escapes(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, catch=False)  # MISTAKE


@mutant("completion_events", "merged is not closed when the stream is: a client who leaves keeps its requests")
async def merged_left_open(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    stream = _events(engine, prompts, params, head, close=False)
    async for e in stream:  # MISTAKE: not inside aclosing, and merged is not closed in a finally
        yield e


@mutant("completion_events", "a chunk for every snapshot, empty or not")
def empty_chunks(engine: Any, prompts: Any, params: Any, head: dict[str, Any]) -> AsyncIterator[str]:
    return _events(engine, prompts, params, head, skip_empty=False)  # MISTAKE


# ---- unless_disconnected ---------------------------------------------------------------------------------------
async def _watch(receive: Any, any_message: bool = False) -> None:
    while True:
        message = await receive()
        if any_message or message["type"] == "http.disconnect":
            return


@mutant("unless_disconnected", "it awaits the work first and looks at the client afterwards")
async def work_first(receive: Any, work: Awaitable[Any]) -> Any:
    return await work  # MISTAKE: a client who leaves waits for the whole answer


@mutant("unless_disconnected", "the watcher task is never cancelled: one task left behind per request")
async def watcher_leaks(receive: Any, work: Awaitable[Any]) -> Any:
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_watch(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # MISTAKE: watch is neither cancelled nor awaited
    if task.cancelled():
        raise ClientGone()
    return task.result()


@mutant("unless_disconnected", "a disconnect returns None: the caller sends an answer nobody reads")
async def none_when_gone(receive: Any, work: Awaitable[Any]) -> Any:
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_watch(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return None if task.cancelled() else task.result()  # MISTAKE: raise ClientGone


@mutant("unless_disconnected", "any message from the client counts as a disconnect")
async def any_message(receive: Any, work: Awaitable[Any]) -> Any:
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_watch(receive, any_message=True))  # MISTAKE
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


@mutant("unless_disconnected", "no finally: a caller who is cancelled leaves the work (and its requests) running")
async def no_finally(receive: Any, work: Awaitable[Any]) -> Any:
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_watch(receive))
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)  # MISTAKE: cancellation skips the rest
    watch.cancel()
    if not task.done():
        task.cancel()
    await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


@mutant("unless_disconnected", "it tells a disconnect by a None result, not by which task ended")
async def none_means_gone(receive: Any, work: Awaitable[Any]) -> Any:
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_watch(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    result = None if task.cancelled() else task.result()
    if result is None:  # MISTAKE
        raise ClientGone()
    return result
