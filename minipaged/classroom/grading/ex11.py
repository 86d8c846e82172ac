"""Checks for exercise 11: the server's streaming side — merging requests, server-sent events, clients who leave.

The learner writes three coroutines (the shapes of ``minipaged/serving/serving_engine.py`` and
``serving_completion.py``, vLLM's ``vllm/entrypoints/openai/``):

* ``merged(engine, prompts, params, base_id)``: an async generator of ``(prompt index, RequestOutput)``, one
  engine request per prompt (id ``f"{base_id}-{i}"``), outputs in the order they come. The first error ends it;
  however it ends (an error, a consumer that stops or is cancelled), every request still running is aborted
  before it returns, and no task of its own is left running.
* ``completion_events(engine, prompts, params, head)``: the ``/v1/completions`` stream as server-sent events, built
  on ``merged``: each choice's new text (never a dangling U+FFFD), its finish reason once, an engine error as one
  error event, ``data: [DONE]`` last; a client that leaves aborts every request.
* ``unless_disconnected(receive, work)``: ``await work``, unless the ASGI ``receive`` says ``http.disconnect``
  first: then ``work`` is cancelled and ``ClientGone`` raised.

The first three groups run them against ``ScriptedEngine``, a stand-in for ``AsyncEngine`` whose requests emit
scripted outputs at set times and record whether they finished or were aborted (a generator closed before its
last output is an abort, as in ``AsyncEngine.generate``). ``check_served`` runs them on the package's real
``AsyncEngine`` with SmolLM2: the texts must be ``LLM.generate``'s, and clients who leave must leave the engine
empty and its pool free. Every check runs its coroutine in a thread of its own with a deadline, so a hang is a
failed check, not a hung grader.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

from ...engine.outputs import CompletionOutput, RequestOutput
from ...sampling_params import SamplingParams
from ...serving.async_engine import EngineError
from ...serving.serving_engine import ClientGone
from .core import Check, CheckOutcome, report

Merged = Callable[..., AsyncGenerator[tuple[int, RequestOutput], None]]
Events = Callable[..., AsyncGenerator[str, None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Unless = Callable[[Receive, Awaitable[Any]], Coroutine[Any, Any, Any]]

DEADLINE_S = 20.0  # one check's coroutine, however wrong, ends within this
GREEDY = SamplingParams(temperature=0, max_tokens=16)


# ---- a stand-in engine ------------------------------------------------------------------------------------------
# One request's script: (seconds to wait, what the output holds then). The output is one (text, finish_reason)
# per sample, or an exception the request raises at that point.
Step = tuple[float, tuple[tuple[str, str | None], ...] | BaseException]


def texts(delay: float, *pieces: str, reason: str | None = None) -> list[Step]:
    """A one-sample script: the text grows by each piece, ``delay`` seconds apart; the last ends with ``reason``
    (None: the request never finishes in this script, as when it is cut short)."""
    steps: list[Step] = []
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        steps.append((delay, ((text, reason if k == len(pieces) - 1 else None),)))
    return steps


class ScriptedEngine:
    """``AsyncEngine.generate``'s contract, scripted: prompt ``[p]`` plays ``scripts[p]``. It records every request
    it was asked for (``started``), those that reached their last output (``finished``), raised (``failed``) or
    were closed before the end (``aborted``: what ``AsyncEngine.generate`` turns into ``abort(request_id)``)."""

    def __init__(self, scripts: dict[int, list[Step]]) -> None:
        self.scripts = scripts
        self.started: list[str] = []
        self.finished: list[str] = []
        self.failed: list[str] = []
        self.aborted: list[str] = []

    async def generate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if len(prompt_token_ids) != 1 or prompt_token_ids[0] not in self.scripts:
            raise EngineError(f"no such prompt {list(prompt_token_ids)!r} in this script", rejected=True)
        if request_id in self.started:
            raise EngineError(f"request id {request_id!r} is already in use", rejected=True)
        self.started.append(request_id)
        ended = False
        try:
            for delay, what in self.scripts[prompt_token_ids[0]]:
                await asyncio.sleep(delay)
                if isinstance(what, BaseException):
                    ended = True
                    self.failed.append(request_id)
                    raise what
                outputs = [CompletionOutput(j, t, [0] * len(t), r) for j, (t, r) in enumerate(what)]
                done = all(r for _, r in what)
                out = RequestOutput(request_id, list(prompt_token_ids), outputs, done, None)  # type: ignore[arg-type]
                if out.finished:
                    ended = True
                    self.finished.append(request_id)
                yield out
        finally:
            if not ended:
                self.aborted.append(request_id)


def _others() -> list[asyncio.Task[Any]]:
    """Tasks of this loop still running, other than the current one."""
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()]


def _in_thread(make: Callable[[], Awaitable[Any]], deadline: float | None) -> dict[str, Any]:
    """``await make()`` on a fresh event loop in a thread of its own: ``{"r": result}``, ``{"e": error}``, or ``{}``
    if the thread is still blocked ``deadline + 5`` seconds on (its loop held by a synchronous wait; the daemon
    thread is left behind). A thread, because a notebook's kernel already runs a loop in this one."""
    box: dict[str, Any] = {}

    async def main() -> Any:
        if deadline is None:
            return await make()
        # The deadline cancels this task itself (asyncio.timeout's way, which Python 3.10 lacks): wait_for would
        # run make() in a task of its own, and _others() must see only the learner's tasks.
        me, late = asyncio.current_task(), []
        assert me is not None

        def ring() -> None:
            late.append(True)
            me.cancel()

        alarm = asyncio.get_running_loop().call_later(deadline, ring)
        try:
            return await make()
        except asyncio.CancelledError:
            if late:
                return f"did not finish within {deadline:.0f} s"
            raise
        finally:
            alarm.cancel()

    def target() -> None:
        try:
            box["r"] = asyncio.run(main())
        except BaseException as exc:  # a learner's error is an answer
            box["e"] = exc

    thread = threading.Thread(target=target, daemon=True, name="ex11")
    thread.start()
    thread.join(None if deadline is None else deadline + 5)
    return box


def _run(make: Callable[[], Awaitable[Any]], deadline: float = DEADLINE_S) -> Any:
    """``await make()`` with a deadline, for a check: its result, or what went wrong in words (a wrong answer may
    raise, or wait forever)."""
    box = _in_thread(make, deadline)
    if "e" in box:
        return _words(box["e"])
    return box.get("r", f"did not finish within {deadline:.0f} s (the event loop was blocked)")


def run_async(make: Callable[[], Awaitable[Any]]) -> Any:
    """``await make()`` on an event loop of its own (a notebook's kernel already runs one here): its result, or its
    error raised here. For trying cases by hand; the checks use ``_run``."""
    box = _in_thread(make, None)
    if "e" in box:
        raise box["e"]
    return box["r"]


def _discard(job: Coroutine[Any, Any, Any]) -> None:
    """Close a coroutine the learner's code never started (a stub's), so Python prints no "never awaited" warning;
    one that started is left to whoever runs it."""
    if inspect.getcoroutinestate(job) == inspect.CORO_CREATED:
        job.close()


def _words(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _params(n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, seed=0, n=n, max_tokens=8)] if n > 1 else [GREEDY]


# ---- merged -----------------------------------------------------------------------------------------------------
SLOW = texts(0.15, "a", "b", "c", reason="length")  # prompt 0: its first output at 150 ms
FAST = texts(0.005, "x", "y", "z", reason="stop")  # prompt 1: all three within 15 ms
LONG = texts(0.2, *"abcdefghij", reason="length")  # two seconds


def _merge_all(merged: Merged, scripts: dict[int, list[Step]]) -> Callable[[], Awaitable[Any]]:
    async def go() -> Any:
        engine = ScriptedEngine(scripts)
        seen: list[tuple[int, str]] = []
        async with aclosing(merged(engine, [[p] for p in scripts], [GREEDY] * len(scripts), "cmpl")) as outs:
            async for i, out in outs:
                seen.append((int(i), out.outputs[0].text))
        return engine, seen

    return go


def check_merged(merged: Merged) -> list[CheckOutcome]:
    """``merged`` against the scripted engine: what it yields, in what order, and what it leaves behind."""
    cache: dict[str, Any] = {}

    def whole() -> Any:
        if "whole" not in cache:
            cache["whole"] = _run(_merge_all(merged, {0: SLOW, 1: FAST, 2: texts(0.03, "p", "q", reason="stop")}))
        return cache["whole"]

    def per_prompt() -> Any:
        r = whole()
        if isinstance(r, str):
            return r
        return {i: [t for j, t in r[1] if j == i] for i in (0, 1, 2)}

    def ids() -> Any:
        r = whole()
        return r if isinstance(r, str) else sorted(r[0].started)

    def order() -> Any:
        r = whole()
        if isinstance(r, str):
            return r
        seen = r[1]
        fast_last = max((k for k, (i, _) in enumerate(seen) if i == 1), default=None)
        slow_first = min((k for k, (i, _) in enumerate(seen) if i == 0), default=None)
        if fast_last is None or slow_first is None:
            return f"saw {seen}"
        return (
            "as they come" if fast_last < slow_first else f"prompt 0's first output came before prompt 1's last: {seen}"
        )

    def nothing() -> Any:
        r = _run(_merge_all(merged, {}), deadline=5)
        return r if isinstance(r, str) else r[1]

    async def error_run() -> Any:
        boom = EngineError("the step failed: injected")
        engine = ScriptedEngine({0: LONG, 1: [*texts(0.02, "x"), (0.02, boom)], 2: LONG})
        outs = merged(engine, [[0], [1], [2]], [GREEDY] * 3, "cmpl")
        try:
            async with aclosing(outs):
                async for _ in outs:
                    pass
        except EngineError as exc:
            return _words(exc), sorted(engine.aborted), len(_others())
        return "it ended without an error", sorted(engine.aborted), len(_others())

    def error() -> Any:
        if "error" not in cache:
            cache["error"] = _run(error_run)
        return cache["error"]

    async def close_early() -> Any:
        engine = ScriptedEngine({0: LONG, 1: texts(0.01, "x", reason="stop"), 2: LONG})
        outs = merged(engine, [[0], [1], [2]], [GREEDY] * 3, "cmpl")
        async for _ in outs:
            if engine.finished:  # prompt 1 is done; 0 and 2 run on
                break
        await outs.aclose()  # what `async with aclosing(...)` does when the consumer leaves
        return sorted(engine.aborted), len(_others())

    def closed() -> Any:
        if "closed" not in cache:
            cache["closed"] = _run(close_early)
        return cache["closed"]

    async def cancel_run() -> Any:
        engine = ScriptedEngine({0: LONG, 1: LONG})

        async def consume() -> None:
            async with aclosing(merged(engine, [[0], [1]], [GREEDY] * 2, "cmpl")) as outs:
                async for _ in outs:
                    pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.25)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ("cancelled" if task.cancelled() else f"not cancelled: {task}"), sorted(engine.aborted)

    def pick(fn: Callable[[], Any], k: int) -> Callable[[], Any]:
        return lambda: (lambda r: r if isinstance(r, str) else r[k])(fn())

    return report(
        "merged",
        [
            Check("three prompts: every output of each, tagged with its prompt's index, in its own order",
                  per_prompt, {0: ["a", "ab", "abc"], 1: ["x", "xy", "xyz"], 2: ["p", "pq"]},
                  hint="one engine request per prompt; yield (i, out) for each of its outputs"),
            Check("one engine request per prompt, with ids base_id-0, base_id-1, base_id-2", ids,
                  ["cmpl-0", "cmpl-1", "cmpl-2"], hint='request_id is f"{base_id}-{i}"'),
            Check("outputs come as they arrive: prompt 1's three (5 ms apart) before prompt 0's first (at 150 ms)",
                  order, "as they come",
                  hint="run the prompts' generators at once (a task each, one queue), not one after another"),
            Check("no prompts: it yields nothing and ends", nothing, [],
                  hint="with nothing to wait for, end at once"),
            Check("an engine error in prompt 1 ends the stream with that error", pick(error, 0),
                  "EngineError: the step failed: injected",
                  hint="a task that catches its request's error must hand it to the consumer, which raises it"),
            Check("... and prompts 0 and 2, still running, are aborted by the time it raises", pick(error, 1),
                  ["cmpl-0", "cmpl-2"], hint="however the generator ends, cancel every task in a finally"),
            Check("a consumer that stops after prompt 1 finished: prompts 0 and 2 aborted when aclose() returns "
                  "(prompt 1, finished, is not)", pick(closed, 0), ["cmpl-0", "cmpl-2"],
                  hint="cancel the tasks in the generator's finally, and await them there"),
            Check("... and no task of merged's is left running", pick(closed, 1), 0,
                  hint="a cancelled task runs on until awaited: await them all, keeping their errors, not raising"),
            Check("a consumer cancelled while it waits: it ends cancelled, with both requests aborted",
                  lambda: _run(cancel_run), ("cancelled", ["cmpl-0", "cmpl-1"]),
                  hint="the CancelledError arrives at your await: let it through the finally that cancels"),
        ],
    )  # fmt: skip


# ---- completion_events -----------------------------------------------------------------------------------------
HEAD = {"id": "cmpl-7", "object": "text_completion", "created": 1_700_000_000, "model": "SmolLM2-135M-Instruct"}


def parse(events: list[str]) -> list[dict[str, Any] | str]:
    """Each event's JSON, or "[DONE]"; a malformed event as a string saying so."""
    parsed: list[dict[str, Any] | str] = []
    for e in events:
        if not (isinstance(e, str) and e.startswith("data: ") and e.endswith("\n\n")):
            parsed.append(f"not an event: {e!r}")
        elif e == "data: [DONE]\n\n":
            parsed.append("[DONE]")
        else:
            try:
                parsed.append(json.loads(e[6:]))
            except json.JSONDecodeError:
                parsed.append(f"not JSON: {e!r}")
    return parsed


def _stream(events: Events, scripts: dict[int, list[Step]], n: int = 1) -> Callable[[], Awaitable[Any]]:
    async def go() -> Any:
        engine = ScriptedEngine(scripts)
        got: list[str] = []
        params = _params(n) * len(scripts)
        async with aclosing(events(engine, [[p] for p in scripts], params, dict(HEAD))) as stream:
            async for e in stream:
                got.append(e)
        return engine, parse(got)

    return go


def joined(parsed: list[Any]) -> dict[int, str]:
    """Each choice's text, its deltas joined."""
    out: dict[int, str] = {}
    for p in parsed:
        if isinstance(p, dict) and "choices" in p:
            for c in p["choices"]:
                out[c["index"]] = out.get(c["index"], "") + c["text"]
    return dict(sorted(out.items()))


def check_events(completion_events: Events) -> list[CheckOutcome]:
    """The SSE stream of ``/v1/completions`` over the scripted engine."""
    cache: dict[str, Any] = {}

    def plain() -> Any:  # two prompts, one sample each: text split over snapshots, one snapshot unchanged
        if "plain" not in cache:
            scripts: dict[int, list[Step]] = {
                0: [
                    *texts(0.01, "Hel", "lo", " wor"),
                    (0.01, (("Hello wor", None),)),  # a snapshot whose text did not grow
                    (0.01, (("Hello world", "length"),)),
                ],
                1: texts(0.015, "One", ", two", reason="stop"),
            }  # fmt: skip
            cache["plain"] = _run(_stream(completion_events, scripts))
        return cache["plain"]

    def split() -> Any:  # "café": the é's two bytes in two tokens; and a text that ends in U+FFFD for good
        if "split" not in cache:
            scripts: dict[int, list[Step]] = {
                0: [(0.01, (("caf\ufffd", None),)), (0.01, (("café", None),)), (0.01, (("café au lait", "stop"),))],
                1: [(0.012, (("ab\ufffd", None),)), (0.01, (("ab\ufffd", "length"),))],
            }
            cache["split"] = _run(_stream(completion_events, scripts))
        return cache["split"]

    def two() -> Any:  # n = 2 samples per prompt
        if "two" not in cache:
            scripts: dict[int, list[Step]] = {
                0: [
                    (0.01, (("a", None), ("b", None))),
                    (0.01, (("a1", "stop"), ("b1", None))),  # sample 0 finished; sample 1 runs on
                    (0.01, (("a1", "stop"), ("b12", "length"))),
                ],
                1: [(0.015, (("c", None), ("d", "stop"))), (0.01, (("cc", "length"), ("d", "stop")))],
            }  # fmt: skip
            cache["two"] = _run(_stream(completion_events, scripts, n=2))
        return cache["two"]

    def field(fn: Callable[[], Any], view: Callable[[list[Any]], Any]) -> Callable[[], Any]:
        def get() -> Any:
            r = fn()
            return r if isinstance(r, str) else view(r[1])

        return get

    def fffd(parsed: list[Any]) -> Any:
        bad = [
            c["text"]
            for p in parsed
            if isinstance(p, dict)
            for c in p.get("choices", [])
            if c["index"] == 0 and "\ufffd" in c["text"]
        ]
        return bad or "none"  # fmt: skip

    def empty(parsed: list[Any]) -> Any:
        chunks = [p for p in parsed if isinstance(p, dict)]
        return [
            p for p in chunks if any(not c["text"] and not c["finish_reason"] for c in p.get("choices", []))
        ] or "none"

    def shape(parsed: list[Any]) -> Any:
        for p in parsed[:-1]:
            if not isinstance(p, dict):
                return f"an event before the last is {p!r}"
            if {k: p.get(k) for k in HEAD} != HEAD or len(p.get("choices", [])) != 1:
                return f"an event without the head's fields or with other than one choice: {p}"
            if set(p["choices"][0]) != {"index", "text", "logprobs", "finish_reason"}:
                return f"a choice with fields {sorted(p['choices'][0])}"
        return "well formed" if parsed and parsed[-1] == "[DONE]" else f"the last event is {parsed[-1:]}"

    async def error_run() -> Any:
        boom = EngineError("the engine loop has stopped (injected)")
        engine = ScriptedEngine({0: LONG, 1: [*texts(0.02, "x"), (0.02, boom)]})
        got: list[str] = []
        try:
            async with aclosing(completion_events(engine, [[0], [1]], [GREEDY] * 2, dict(HEAD))) as stream:
                async for e in stream:
                    got.append(e)
        except Exception as exc:
            return f"the stream raised {_words(exc)} (a client would see a cut connection)"
        parsed = parse(got)
        tail = parsed[-2:]
        err = tail[0].get("error", {}) if tail and isinstance(tail[0], dict) else {}
        return (err.get("message"), tail[-1:], sorted(engine.aborted))

    async def leave_run() -> Any:
        engine = ScriptedEngine({0: LONG, 1: LONG, 2: texts(0.01, "x")[:1] + LONG})
        stream = completion_events(engine, [[0], [1], [2]], [GREEDY] * 3, dict(HEAD))
        await anext(stream)  # the first chunk; then the client hangs up: Starlette closes the generator
        await stream.aclose()
        return sorted(engine.aborted), len(_others())

    return report(
        "events",
        [
            Check("two prompts: each choice's chunks join to its final text", field(plain, joined),
                  {0: "Hello world", 1: "One, two"}, hint="send only the text after what this choice was sent already"),
            Check("a character split over two tokens (caf\\ufffd, then café): no chunk carries the U+FFFD",
                  field(split, fffd), "none",
                  hint="while a choice runs, hold back its trailing U+FFFD: they are a character's first bytes"),
            Check("... and the texts still join right, a finished text's U+FFFD included", field(split, joined),
                  {0: "café au lait", 1: "ab\ufffd"}, hint="a finished choice sends all its text"),
            Check("each choice's finish_reason once, in its last chunk", field(plain, finish_reasons),
                  {0: (["length"], "length"), 1: (["stop"], "stop")},
                  hint="send the reason with the chunk that finishes the choice; after it, nothing for that choice"),
            Check("no empty chunks: each carries new text or a finish_reason", field(plain, empty), "none",
                  hint="an output whose text did not grow (or grew only by held-back U+FFFD) sends nothing"),
            Check("every event is 'data: <json>\\n\\n' with the head's fields and one choice; the last 'data: [DONE]'",
                  field(plain, shape), "well formed", hint="sse() and SSE_DONE, given above, write them"),
            Check("n = 2: choice i * n + j is sample j of prompt i, each joined right", field(two, joined),
                  {0: "a1", 1: "b12", 2: "cc", 3: "d"}, hint="OpenAI numbers the choices prompt by prompt"),
            Check("... and each of the four gets its finish_reason once, even when its prompt's other sample runs on",
                  field(two, finish_reasons),
                  {0: (["stop"], "stop"), 1: (["length"], "length"), 2: (["length"], "length"), 3: (["stop"], "stop")},
                  hint="a later snapshot still carries a finished sample's reason: remember which choices are done"),
            Check("an engine error mid-stream: one error event with its message, then [DONE], the other request "
                  "aborted; the stream itself does not raise", lambda: _run(error_run),
                  ("the engine loop has stopped (injected)", ["[DONE]"], ["cmpl-7-0"]),
                  hint="catch EngineError around the loop: one error event, shaped by the given pieces, then [DONE]"),
            Check("a client that leaves after the first chunk: every request aborted when aclose() returns, "
                  "no task left", lambda: _run(leave_run), (["cmpl-7-0", "cmpl-7-1", "cmpl-7-2"], 0),
                  hint="iterate merged inside `async with aclosing(...)`: closing your generator must close it"),
        ],
    )  # fmt: skip


# ---- unless_disconnected ---------------------------------------------------------------------------------------
class Client:
    """An ASGI ``receive``: the body, then (after ``leaves_after`` seconds, or never) ``http.disconnect``.

    ``chatter`` extra ``http.request`` messages come first, 10 ms apart (a body in several parts)."""

    def __init__(self, leaves_after: float | None, chatter: int = 0) -> None:
        self.leaves_after, self.chatter, self.calls = leaves_after, chatter, 0

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls <= self.chatter:
            await asyncio.sleep(0.01)
            return {"type": "http.request", "body": b"{}", "more_body": self.calls < self.chatter}
        if self.leaves_after is None:
            await asyncio.Event().wait()  # Starlette's receive() after the body: it waits for the disconnect
        await asyncio.sleep(self.leaves_after or 0)
        return {"type": "http.disconnect"}


class Work:
    """A request's work: ``seconds`` long, then ``result`` (or ``error`` raised); records a cancellation."""

    def __init__(self, seconds: float, result: Any = "answer", error: BaseException | None = None) -> None:
        self.seconds, self.result, self.error = seconds, result, error
        self.cancelled = False

    async def run(self) -> Any:
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error is not None:
            raise self.error
        return self.result


def check_disconnect(unless_disconnected: Unless) -> list[CheckOutcome]:
    """``unless_disconnected`` with scripted clients and work."""

    async def case(client: Client, work: Work) -> Any:
        t0, job = time.perf_counter(), work.run()
        try:
            got: Any = await unless_disconnected(client.receive, job)
        except ClientGone:
            got = "ClientGone"
        except EngineError as exc:
            got = _words(exc)
        finally:
            _discard(job)
        waited = time.perf_counter() - t0
        await asyncio.sleep(0)  # a cancelled task's last step: let it run before counting what is left
        return got, work.cancelled, len(_others()), waited

    def outcome(client: Client, work: Work) -> Callable[[], Any]:
        def get() -> Any:
            r = _run(lambda: case(client, work))
            return r if isinstance(r, str) else r[:3]

        return get

    def prompt() -> Any:
        r = _run(lambda: case(Client(0.05), Work(5.0)))
        return r if isinstance(r, str) else ("within a second" if r[3] < 1.0 else f"after {r[3]:.1f} s")

    async def outer() -> Any:
        work = Work(5.0)
        job = work.run()
        task = asyncio.create_task(unless_disconnected(Client(None).receive, job))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        _discard(job)
        await asyncio.sleep(0)
        return ("cancelled" if task.cancelled() else f"ended otherwise: {task}"), work.cancelled, len(_others())

    return report(
        "disconnect",
        [
            Check("the work finishes first (the client stays): its result, nothing cancelled, no task left",
                  outcome(Client(None), Work(0.05)), ("answer", False, 0),
                  hint="cancel the task that watches receive() once the work is done"),
            Check("the client leaves at 50 ms, the work would take 5 s: ClientGone, the work cancelled, no task "
                  "left", outcome(Client(0.05), Work(5.0)), ("ClientGone", True, 0),
                  hint="wait for whichever ends first; a disconnect cancels the work (and awaits it), then raises"),
            Check("... and it raises at once, not when the work would have ended", prompt, "within a second",
                  hint="a disconnect must not wait for the work: wait on both tasks at once, until the first ends"),
            Check("two more parts of the body (http.request) are not a disconnect", outcome(Client(None, chatter=2),
                  Work(0.08)), ("answer", False, 0), hint='only {"type": "http.disconnect"} means the client left'),
            Check("the work fails: its own error comes out, no task left",
                  outcome(Client(None), Work(0.03, error=EngineError("the request was rejected"))),
                  ("EngineError: the request was rejected", False, 0),
                  hint="the work's own error comes out as it is: ask the finished work task for its outcome"),
            Check("a result of None is a result, not a disconnect", outcome(Client(None), Work(0.02, result=None)),
                  (None, False, 0), hint="tell a disconnect from a result by which task ended, not by the value"),
            Check("the caller is cancelled: the work is cancelled with it and nothing is left",
                  lambda: _run(outer), ("cancelled", True, 0),
                  hint="cancel the work (and the watcher) in a finally"),
        ],
    )  # fmt: skip


# ---- served: the package's real engine -------------------------------------------------------------------------
PROMPTS = [
    "The capital of France is",
    "Three facts about the Moon:",
    "def add(a, b):",
    "A haiku about autumn leaves:",
]
SERVED_TOKENS = 12
WAITING_TOKENS = 96  # the waiting client's answers: 96 steps, far longer than the 0.3 s it waits
_SERVED: dict[str, Any] = {}


def _llm() -> Any:
    """SmolLM2 on a small pool, with each prompt's token ids and greedy text, computed before any engine loop."""
    if "llm" not in _SERVED:
        from ...engine.llm import LLM

        llm = LLM(num_gpu_blocks_override=48, block_size=16, max_num_seqs=8, max_model_len=256)
        params = SamplingParams(temperature=0, max_tokens=SERVED_TOKENS, ignore_eos=True)
        ids = [llm.processor.token_ids(p, "prompt") for p in PROMPTS]
        _SERVED.update(llm=llm, ids=ids, params=params, texts=[o.outputs[0].text for o in llm.generate(ids, params)])
    return _SERVED["llm"]


def _empty(llm: Any) -> bool:
    return not llm.scheduler.has_unfinished() and llm.kv_cache_manager.get_num_free_blocks() == llm.num_blocks - 1


async def _settled(llm: Any, seconds: float = 10.0) -> str:
    """Whether the engine is empty with its pool free within ``seconds`` (aborts land at a step boundary)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if _empty(llm):
            return "empty, every block free"
        await asyncio.sleep(0.02)
    kv = llm.kv_cache_manager
    return f"after {seconds:.0f} s: {kv.num_blocks - 1 - kv.get_num_free_blocks()} blocks held"


def _forbidden() -> dict[int, str]:
    """The package's own answers, by identity: none may be what the learner's functions are or call."""
    from ...serving import serving_completion, serving_engine

    names = ("merged", "final_outputs", "unless_disconnected", "TextDeltas")
    found = {id(getattr(serving_engine, n)): f"minipaged.serving.serving_engine.{n}" for n in names}
    found[id(serving_completion._stream)] = "minipaged.serving.serving_completion._stream"
    return found


def provenance(*fns: Callable[..., Any]) -> str:
    """Each function is written in the notebook, and none of the names it uses is the package's answer."""
    package = str(Path(__file__).resolve().parents[2])
    forbidden = _forbidden()
    for fn in fns:
        code = getattr(fn, "__code__", None)
        if code is None:
            return f"{fn!r} is not a function written in your notebook"
        if str(Path(code.co_filename).resolve()).startswith(package):
            return f"{fn.__name__} is the package's own ({code.co_filename})"
        for name in code.co_names:
            value = fn.__globals__.get(name)
            if value is not None and id(value) in forbidden:
                return f"{fn.__name__} uses {name}, which is {forbidden[id(value)]}"
    return "your own"


def check_served(completion_events: Events, unless_disconnected: Unless) -> list[CheckOutcome]:
    """Your coroutines on the package's ``AsyncEngine`` serving SmolLM2 (4 prompts, greedy, 12 tokens each)."""
    from ...serving.async_engine import AsyncEngine

    cache: dict[str, Any] = {}

    async def serve() -> Any:
        llm = _llm()
        ids, params = _SERVED["ids"], _SERVED["params"]
        engine = AsyncEngine(llm).start()
        try:
            got: list[str] = []
            async with aclosing(completion_events(engine, ids, [params] * len(ids), dict(HEAD))) as stream:
                async for e in stream:
                    got.append(e)
            whole = parse(got)

            async def client(i: int, leave: bool) -> Any:
                events: list[str] = []
                head = {**HEAD, "id": f"cmpl-{i}"}
                async with aclosing(completion_events(engine, [ids[i]], [params], head)) as stream:
                    async for e in stream:
                        events.append(e)
                        if leave:
                            break
                return joined(parse(events)).get(0, "") if not leave else "left"

            mixed = await asyncio.gather(*(client(i, leave=i % 2 == 1) for i in range(len(ids))))
            after_leaving = await _settled(llm)

            long = SamplingParams(temperature=0, max_tokens=WAITING_TOKENS, ignore_eos=True)  # seconds of work
            t0, job = time.perf_counter(), _collect(completion_events(engine, ids, [long] * len(ids), dict(HEAD)))
            try:
                await unless_disconnected(Client(0.3).receive, job)
                waited = "it returned: the client that left got an answer nobody reads"
            except ClientGone:
                waited = "ClientGone" if time.perf_counter() - t0 < 5 else "ClientGone, but late"
            finally:
                _discard(job)
            after_waiting = await _settled(llm)
            return whole, mixed, after_leaving, waited, after_waiting
        finally:
            engine.shutdown()

    def run() -> Any:
        if "r" not in cache:
            cache["r"] = _run(serve, deadline=120)
        return cache["r"]

    def part(k: int, view: Callable[[Any], Any] = lambda x: x) -> Callable[[], Any]:
        return lambda: (lambda r: r if isinstance(r, str) else view(r[k]))(run())

    def own() -> str:
        r = run()  # a stub is nobody's code: it must serve before it can be called the learner's own
        return r if isinstance(r, str) else provenance(completion_events, unless_disconnected)

    def same_text(got: Any) -> str:
        want = dict(enumerate(_SERVED["texts"]))
        return "LLM.generate's texts" if got == want else f"{got}, where LLM.generate gives {want}"

    def stayed(got: Any) -> str:
        want = [t if i % 2 == 0 else "left" for i, t in enumerate(_SERVED["texts"])]
        return "whole texts for those who stayed" if got == want else f"{got}, where it should be {want}"

    return report(
        "served",
        [
            Check("your functions are your own (not the package's merged, TextDeltas, _stream or "
                  "unless_disconnected), and they serve", own, "your own",
                  hint="write them here; the package's sse, SSE_DONE and engine_error are the given pieces"),
            Check(f"4 prompts streamed by your completion_events on the package's AsyncEngine (SmolLM2, greedy, "
                  f"{SERVED_TOKENS} tokens): each choice's text is LLM.generate's",
                  part(0, lambda parsed: same_text(joined(parsed))), "LLM.generate's texts",
                  hint="the scripted checks above pass first; then compare what you send with the outputs' text"),
            Check("... each with finish_reason 'length' once, and the stream ends with [DONE]",
                  part(0, lambda parsed: ({i: rs for i, (rs, _) in finish_reasons(parsed).items()}, parsed[-1:])),
                  ({i: ["length"] for i in range(len(PROMPTS))}, ["[DONE]"]),
                  hint="max_tokens ends each request: its last snapshot carries 'length'"),
            Check("four clients at once, two leave after their first chunk: the two who stay get their whole text",
                  part(1, stayed), "whole texts for those who stayed",
                  hint="a client who leaves aborts its own requests only"),
            Check("... and within 10 s the engine holds no request and every KV block is free", part(2),
                  "empty, every block free", hint="the aborts must reach the engine: close merged when you close"),
            Check(f"a waiting client (4 prompts, {WAITING_TOKENS} tokens each) leaves after 0.3 s: "
                  "unless_disconnected raises ClientGone at once", part(3),
                  "ClientGone", hint="the disconnect must not wait for the work"),
            Check("... and its four requests leave the engine: no request held, every block free", part(4),
                  "empty, every block free", hint="cancelling the work must abort the requests it started"),
        ],
    )  # fmt: skip


def finish_reasons(parsed: list[Any]) -> dict[int, tuple[list[Any], Any]]:
    """Each choice's finish reasons in the order sent (the Nones dropped), and the reason in its last chunk."""
    seen: dict[int, list[Any]] = {}
    for p in parsed:
        if isinstance(p, dict):
            for c in p.get("choices", []):
                seen.setdefault(c["index"], []).append(c["finish_reason"])
    return {i: ([r for r in rs if r is not None], rs[-1]) for i, rs in sorted(seen.items())}


async def _collect(stream: AsyncIterator[str]) -> list[str]:
    """A non-streaming answer: every event, gathered (closed however the wait ends)."""
    async with aclosing(stream) as events:  # type: ignore[type-var]
        return [e async for e in events]
