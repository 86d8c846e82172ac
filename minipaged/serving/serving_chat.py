"""``POST /v1/chat/completions`` (vLLM's ``vllm/entrypoints/openai/chat_completion/serving.py``).

The messages go through the model's chat template (``InputProcessor.tokenize``); ``max_tokens`` (or OpenAI's
newer ``max_completion_tokens``) defaults to all the room the context has left, as in vLLM. A stream opens each
choice with ``delta {"role": "assistant", "content": ""}``, sends content deltas, closes each choice with an
empty delta and its ``finish_reason``, then the usage chunk (``choices: []``) if asked, then ``[DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineError
from .protocol import ChatCompletionRequest, OpenAIError
from .serving_completion import usage
from .serving_engine import (
    SSE_DONE,
    ClientGone,
    TextDeltas,
    check_common,
    engine_error,
    final_outputs,
    finish_reason,
    max_tokens_for,
    merged,
    now,
    request_id,
    sampling_params,
    sse,
    tokenize,
    unless_disconnected,
)


async def create_chat_completion(
    req: ChatCompletionRequest, raw: Request, engine: AsyncEngine, served_model_name: str
) -> Response:
    check_common(req, served_model_name, engine)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise OpenAIError("give max_completion_tokens or max_tokens, not both", param="max_tokens")
    field = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
    asked = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    (ids,) = await tokenize(engine, lambda: [[m.model_dump() for m in req.messages]], "messages")
    params = sampling_params(req, max_tokens_for(req, asked, field, len(ids), engine, "messages", None), field)
    rid, created = request_id("chatcmpl"), now()
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_model_name}
    if req.stream:
        return StreamingResponse(_stream(req, engine, ids, params, rid, head), media_type="text/event-stream")
    try:
        (out,) = await unless_disconnected(raw, final_outputs(engine, [ids], [params], rid))
    except ClientGone:
        return Response(status_code=499)
    except EngineError as exc:
        raise engine_error(exc) from None
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": None,
            "finish_reason": finish_reason(o.finish_reason),
        }
        for o in out.outputs
    ]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": usage([out])})


def _chunk(head: dict[str, Any], index: int, delta: dict[str, str], reason: str | None, extra: dict) -> str:
    return sse({**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
                **extra})  # fmt: skip


async def _stream(
    req: ChatCompletionRequest, engine: AsyncEngine, ids: list[int], params: SamplingParams, rid: str,
    head: dict[str, Any],
) -> AsyncGenerator[str, None]:  # fmt: skip
    deltas, done = TextDeltas(), set()
    extra = {"usage": None} if req.include_usage else {}
    final = None
    try:
        for j in range(req.n):  # the role first, before the engine has done anything: the client sees life
            yield _chunk(head, j, {"role": "assistant", "content": ""}, None, extra)
        async with aclosing(merged(engine, [ids], [params], rid)) as outputs:
            async for _, out in outputs:
                for o in out.outputs:
                    if o.index in done:
                        continue
                    text = deltas.delta(o.index, o.text, o.finish_reason is not None)
                    if text:
                        yield _chunk(head, o.index, {"content": text}, None, extra)
                    if o.finish_reason is not None:
                        yield _chunk(head, o.index, {}, finish_reason(o.finish_reason), extra)
                        done.add(o.index)
                if out.finished:
                    final = out
        if req.include_usage and final is not None:
            yield sse({**head, "choices": [], "usage": usage([final])})
    except EngineError as exc:
        yield sse(engine_error(exc).body())
    yield SSE_DONE
