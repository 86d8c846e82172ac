"""What the completion and chat endpoints share (vLLM's ``vllm/entrypoints/generate/base/serving.py``): request
checks that turn bad input into a 400 naming the field, sampling parameters, streaming text deltas, several
engine requests merged into one stream, and a non-streaming wait that notices a client leaving.

Everything is checked here, before anything is queued: a bad request costs the engine nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import Request

from ..engine.inputs import Prompt
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineDeadError, EngineError
from .protocol import WHY_NOT, OpenAIError, SamplingRequest, unsupported_field

T = TypeVar("T")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}  # the engine's → OpenAI's
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "ignore_eos", "stop_token_ids")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def check_common(req: SamplingRequest, served_model_name: str, engine: AsyncEngine) -> None:
    """The model asked for, fields the engine cannot honour, ``n`` against the batch, ``seed`` against torch."""
    if req.model is not None and req.model != served_model_name:
        raise OpenAIError(f"The model `{req.model}` does not exist (this server serves `{served_model_name}`).",
                          param="model", code="model_not_found")  # fmt: skip
    name = unsupported_field(req)
    if name is not None:
        why = WHY_NOT.get(name, "")
        raise OpenAIError(f"{name} is not supported by minipaged{f': {why}' if why else ''}", param=name)
    max_num_seqs = engine.llm.scheduler.config.max_num_seqs
    if req.n > max_num_seqs:
        raise OpenAIError(f"n={req.n} samples exceed the server's max_num_seqs={max_num_seqs}", param="n")
    if req.seed is not None and not -(2**63) <= req.seed <= 2**64 - req.n:  # torch's generators take 64 bits
        raise OpenAIError(f"seed must be in [-2**63, 2**64 - n], got {req.seed}", param="seed")


async def tokenize(engine: AsyncEngine, prompts: Callable[[], Sequence[Prompt]], field: str) -> list[list[int]]:
    """Each prompt's checked token ids (not empty, inside the vocabulary). ``prompts()`` and the tokenizer run in
    the engine's CPU pool, not on the event loop: a 2 MB prompt takes seconds, and every other stream and
    ``/health`` must go on meanwhile. The tokenizer takes no engine lock."""
    processor = engine.llm.processor

    def run() -> list[list[int]]:
        return [processor.token_ids(prompt, field) for prompt in prompts()]

    try:
        return await engine.run_cpu(run)
    except ValueError as exc:
        raise OpenAIError(str(exc).replace(f"request {field!r}: ", f"{field}: "), param=field) from None


def max_request_len(engine: AsyncEngine) -> int:
    """The longest prompt + output one request may ask for: ``max_model_len``, or less when the KV pool cannot
    give one request that many blocks (the scheduler would reject it)."""
    llm, kv = engine.llm, engine.llm.kv_cache_manager
    capacity = kv.num_blocks - 1 - kv.reserved_blocks - kv.watermark_blocks
    return min(llm.max_model_len, capacity * kv.block_size)


def max_tokens_for(
    req: SamplingRequest, asked: int | None, asked_field: str, num_prompt: int, engine: AsyncEngine,
    prompt_field: str, default: int | None,
) -> int:  # fmt: skip
    """The output budget: as asked, or ``default`` (None: all the room left, as vLLM does for chat), checked
    against the context length with vLLM's message."""
    limit = max_request_len(engine)
    if num_prompt >= limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, your {prompt_field} has "
            f"{num_prompt} tokens, which leaves no room for a completion. Please reduce the length of the "
            f"{prompt_field}.",
            param=prompt_field,
        )
    if asked is None:
        return min(default or limit, limit - num_prompt)  # a default never makes a request fail
    if isinstance(asked, int) and asked >= 1 and num_prompt + asked > limit:
        raise OpenAIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt + asked} tokens ({num_prompt} in the {prompt_field}, {asked} in the completion). "
            f"Please reduce the length of the {prompt_field} or completion.",
            param=asked_field,
        )
    return asked


def sampling_params(req: SamplingRequest, max_tokens: int, max_tokens_field: str = "max_tokens") -> SamplingParams:
    """``SamplingParams`` checks every value itself; its ValueError names the field, which becomes ``param``."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_k=-1 if req.top_k is None else req.top_k,
            top_p=req.top_p,
            seed=req.seed,
            n=req.n,
            ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()),
        )
    except ValueError as exc:
        field = next((f for f in SAMPLING_FIELDS if str(exc).startswith(f)), None)
        message = str(exc)
        if field == "max_tokens" and max_tokens_field != "max_tokens":
            field, message = max_tokens_field, message.replace("max_tokens", max_tokens_field, 1)
        raise OpenAIError(message, param=field) from None


def engine_error(exc: EngineError) -> OpenAIError:
    """A rejected request is the client's error (400); a failed step is the server's (500); no engine loop, 503."""
    if exc.rejected:
        return OpenAIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), status=503, type="server_error")
    return OpenAIError(str(exc), status=500, type="server_error")


def finish_reason(reason: str | None) -> str | None:
    return None if reason is None else FINISH_REASONS.get(reason, reason)


def sse(data: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class TextDeltas:
    """The new text of each choice since the last chunk, from the text decoded so far. Trailing U+FFFD are
    held back: they are the first bytes of a character whose last bytes are in a token not sampled yet."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def delta(self, index: int, text: str, finished: bool) -> str:
        stable = text if finished else text.rstrip("\ufffd")
        start = self.sent.get(index, 0)
        if len(stable) <= start:
            return ""
        self.sent[index] = len(stable)
        return stable[start:]


async def merged(
    engine: AsyncEngine, prompts: Sequence[list[int]], params: Sequence[SamplingParams], base_id: str
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """One engine request per prompt, their outputs as ``(prompt index, output)`` in the order they come.
    The first error ends it; ending it early (an error, a client gone) aborts every request still running."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async with aclosing(engine.generate(prompts[i], params[i], f"{base_id}-{i}")) as outputs:
                async for out in outputs:
                    queue.put_nowait((i, out))
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(prompts))]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # each one's generate() aborts its request on the way out
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(
    engine: AsyncEngine, prompts: Sequence[list[int]], params: Sequence[SamplingParams], base_id: str
) -> list[RequestOutput]:
    """Every prompt's finished output, in prompt order."""
    finals: dict[int, RequestOutput] = {}
    async with aclosing(merged(engine, prompts, params, base_id)) as outputs:
        async for i, out in outputs:
            if out.finished:
                finals[i] = out
    return [finals[i] for i in range(len(prompts))]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled (so its requests are aborted) if the client disconnects first: a non-streaming
    client that gave up must not keep the engine busy (vLLM's ``with_cancellation``)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()
