"""``POST /v1/completions`` (vLLM's ``vllm/entrypoints/openai/completion/serving.py``).

A batch of prompts is one engine request per prompt, each with its ``n`` samples; the choices are numbered as
OpenAI numbers them, prompt by prompt: choice ``i * n + j`` is sample ``j`` of prompt ``i``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..engine.inputs import Prompt
from ..engine.outputs import RequestOutput
from .async_engine import AsyncEngine, EngineError
from .protocol import CompletionRequest, OpenAIError
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

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
MAX_PROMPTS = 2048  # prompts in one request: each is an engine request and a task (a 4 MiB body holds 800,000)


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt: empty prompt", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise OpenAIError(f"prompt: a batch of {len(prompt)} prompts is more than one request may hold "
                          f"({MAX_PROMPTS}): send it in several requests", param="prompt")  # fmt: skip
    return list(prompt)


async def create_completion(
    req: CompletionRequest, raw: Request, engine: AsyncEngine, served_model_name: str
) -> Response:
    check_common(req, served_model_name, engine)
    prompts = _prompts(req.prompt)
    token_ids = await tokenize(engine, lambda: prompts, "prompt")
    budgets = [max_tokens_for(req, req.max_tokens, "max_tokens", len(ids), engine, "prompt", DEFAULT_MAX_TOKENS)
               for ids in token_ids]  # fmt: skip
    params = [sampling_params(req, budget) for budget in budgets]
    rid, created = request_id("cmpl"), now()
    head = {"id": rid, "object": "text_completion", "created": created, "model": served_model_name}
    if req.stream:
        return StreamingResponse(_stream(req, engine, token_ids, params, rid, head), media_type="text/event-stream")
    try:
        outs = await unless_disconnected(raw, final_outputs(engine, token_ids, params, rid))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    except EngineError as exc:
        raise engine_error(exc) from None
    choices = [
        {
            "index": i * req.n + o.index,
            "text": o.text,
            "logprobs": None,
            "finish_reason": finish_reason(o.finish_reason),
        }
        for i, out in enumerate(outs)
        for o in out.outputs
    ]
    return JSONResponse({**head, "choices": choices, "usage": usage(outs)})


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    """Prompt tokens once per prompt (not per sample), completion tokens over every sample."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(o.token_ids) for out in outs for o in out.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _stream(
    req: CompletionRequest, engine: AsyncEngine, token_ids: list[list[int]], params: list[Any], rid: str,
    head: dict[str, Any],
) -> AsyncGenerator[str, None]:  # fmt: skip
    """Text chunks as they come, a chunk with each choice's finish_reason, the usage chunk if asked, [DONE]."""
    deltas, finals, done = TextDeltas(), {}, set()
    extra = {"usage": None} if req.include_usage else {}
    try:
        async with aclosing(merged(engine, token_ids, params, rid)) as outputs:
            async for i, out in outputs:
                for o in out.outputs:
                    index = i * req.n + o.index
                    if index in done:
                        continue
                    text = deltas.delta(index, o.text, o.finish_reason is not None)
                    reason = finish_reason(o.finish_reason)
                    if text or reason:
                        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
                        yield sse({**head, "choices": [choice], **extra})
                    if reason:
                        done.add(index)
                if out.finished:
                    finals[i] = out
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)])})
    except EngineError as exc:
        yield sse(engine_error(exc).body())
    yield SSE_DONE
