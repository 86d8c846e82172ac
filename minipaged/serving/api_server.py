"""The OpenAI-compatible HTTP API (vLLM's ``vllm/entrypoints/launchers/app.py``): ``build_app`` wires
the routes to one ``AsyncEngine``::

    POST /v1/completions        serving_completion      GET /v1/models    the one served model
    POST /v1/chat/completions   serving_chat            GET /health       200 while the engine can serve, else
                                                                          503 saying why (AsyncEngine.health)
                                                        GET /metrics      Prometheus text (metrics.py)

Every error is in OpenAI's shape. A bad field is a 400 with ``param`` naming it (``parse_body`` validates the
body in the engine's CPU pool; FastAPI's own 422 is replaced too), so OpenAI's clients raise their usual
``BadRequestError``. Before any
body is read, ``RequestGuard`` answers what is wrong with the request itself: a body over ``max_body_bytes``
(413, from its Content-Length, or counted as it arrives), a Content-Type that is not JSON (415), a body that
stops arriving for ``body_timeout_s`` or is not all in ``body_deadline_s`` after its headers (408, and the
connection closed). ``ApiKeyMiddleware`` (401) runs before both. A header block that is not all in within
``header_deadline_s`` is the server's to refuse, before any app runs (``deadlines.DeadlineH11Protocol``).
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .async_engine import AsyncEngine
from .metrics import CONTENT_TYPE
from .protocol import PROMPT_TYPES, ChatCompletionRequest, CompletionRequest, OpenAIError
from .serving_chat import create_chat_completion
from .serving_completion import create_completion

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (a load balancer's probe has none)
JSON_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # the routes that read a JSON body
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: a long context's prompt many times over; --max-body-bytes
DEFAULT_BODY_TIMEOUT_S = 30.0  # the longest wait for the next piece of a body that has started arriving
# A client sends its headers in one piece; 10 s is ample even over a slow link, and a dozen clients trickling
# theirs a byte at a time are let go in 10 s, not held for as long as they like.
DEFAULT_HEADER_DEADLINE_S = 10.0
# The longest a whole body may take after its headers: 4 MiB (the default limit) at ~70 KB/s. Without it, a body
# sent a byte every body_timeout_s - 1 seconds is held as long as its Content-Length lasts (4 MiB: years).
DEFAULT_BODY_DEADLINE_S = 60.0
M = TypeVar("M", bound=BaseModel)


def build_app(
    engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
) -> FastAPI:  # fmt: skip
    """The FastAPI app over ``engine`` (started by the caller). ``api_key``: every route but ``/health``
    then wants ``Authorization: Bearer <api_key>``. ``max_body_bytes``: a larger request body is refused (413)
    before it is read; ``body_timeout_s``: a body that stops arriving for that long is refused (408);
    ``body_deadline_s``: so is one not all in that long after its headers, however steadily it trickles. The
    header block's deadline is the server's (``start_server``; run uvicorn yourself with
    ``http=DeadlineH11Protocol.with_deadlines(...)`` for it)."""
    check_server_options(api_key, max_body_bytes, body_timeout_s, body_deadline_s=body_deadline_s)
    app = FastAPI(title="minipaged", summary="An OpenAI-compatible server on the minipaged engine")
    app.state.engine = engine
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        req = await parse_body(raw, CompletionRequest, engine)
        return await create_completion(req, raw, engine, served_model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        req = await parse_body(raw, ChatCompletionRequest, engine)
        return await create_chat_completion(req, raw, engine, served_model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "minipaged",
                "root": served_model_name, "max_model_len": engine.llm.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        why = engine.health()
        if why is None:
            return Response(status_code=200)
        return openai_error_response(OpenAIError(why, status=503, type="server_error", code="engine_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(engine.metrics.render(served_model_name), media_type=CONTENT_TYPE)

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return openai_error_response(validation_to_openai(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = openai_error_response(OpenAIError(str(exc.detail), status=exc.status_code, type=kind))
        response.headers.update(exc.headers or {})  # RequestGuard's 408 says Connection: close
        return response

    app.add_middleware(
        RequestGuard, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, body_deadline_s=body_deadline_s
    )
    if api_key is not None:  # added last, so it runs first: a stranger learns nothing about the limits
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def check_server_options(
    api_key: str | None, max_body_bytes: int, body_timeout_s: float,
    header_deadline_s: float = DEFAULT_HEADER_DEADLINE_S, body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
) -> None:  # fmt: skip
    """Refuse, at start-up and naming the option, what would make the server answer every request wrongly."""
    if api_key is not None:
        if not isinstance(api_key, str):
            raise ValueError(f"api_key (--api-key) must be a string, got {type(api_key).__name__}")
        if not api_key:
            raise ValueError(
                f"api_key (--api-key) is empty, got {api_key!r}: every request would be refused with 401. Give a "
                "key, or no --api-key for a server without one (was the variable you passed unset?)"
            )
        if api_key != api_key.strip() or not api_key.isascii() or not api_key.isprintable():
            raise ValueError(
                "api_key (--api-key) must be printable ASCII without leading or trailing spaces (no client can send "
                "another in an 'Authorization: Bearer' header)"
            )
    if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes (--max-body-bytes) must be a positive integer, got {max_body_bytes!r}")
    seconds = {"body_timeout_s": body_timeout_s, "header_deadline_s": header_deadline_s,
               "body_deadline_s": body_deadline_s}  # fmt: skip
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


async def parse_body(raw: Request, model: type[M], engine: AsyncEngine) -> M:
    """The request body as ``model``: read (``RequestGuard`` bounds its size and its pauses), then parsed and checked
    in the engine's CPU pool, not by FastAPI on the event loop: 4 MiB of nested token-id lists take seconds to
    validate, and every stream and ``/health`` must go on meanwhile. Errors as FastAPI's would be (``param``)."""
    try:
        body = await raw.body()
    except ClientDisconnect:
        raise OpenAIError("The client closed the connection before its request body arrived") from None
    if not body.strip():
        raise OpenAIError("The request needs a JSON body", param=None)
    try:
        return await engine.run_cpu(model.model_validate_json, body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise validation_to_openai([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


def openai_error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def validation_to_openai(errors: Any) -> OpenAIError:
    """pydantic's first error as OpenAI's 400: ``param`` is the top-level field it is about (None when the
    body itself is wrong: not JSON, not an object)."""
    first: dict[str, Any] = dict(errors[0]) if errors else {"type": "", "loc": ("body",), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ())]
    field = loc[1] if len(loc) > 1 and loc[0] == "body" and first["type"] != "json_invalid" else None
    where = ".".join(loc[1:]) if field else ""
    if first["type"] == "json_invalid":
        error = first.get("ctx", {}).get("error", "")
        return OpenAIError(f"The request body is not valid JSON: {error}".rstrip(": "), param=None)
    if first["type"] == "extra_forbidden":
        return OpenAIError(f"Unknown field '{where}': this request takes no such field", param=field)
    if first["type"] == "missing" and field is None:
        return OpenAIError("The request needs a JSON body", param=None)
    if field == "prompt":  # a union: pydantic's message is about one of its members, not the whole
        return OpenAIError(PROMPT_TYPES, param=field)
    return OpenAIError(f"{where or 'body'}: {first.get('msg', 'invalid value')}", param=field)


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on every request but the open paths, else a 401 in OpenAI's shape.
    Pure ASGI (not ``BaseHTTPMiddleware``), so streams and disconnect detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if secrets.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
            status=401,
            code="invalid_api_key",
        )
        await openai_error_response(error)(scope, receive, send)


class RequestGuard:
    """What is wrong with a request itself, answered before its body is read (pure ASGI, as ``ApiKeyMiddleware``):

    * a body over ``max_body_bytes``: 413 at once when its Content-Length says so (nothing of it is read), else
      counted as it arrives (a chunked upload) and refused as soon as it passes the limit;
    * on the JSON routes, a Content-Type that is not JSON (``curl -d`` sends a form's): 415 naming the header;
    * a body that stops arriving (a client stopped or gone silent): 408 after ``body_timeout_s`` without a byte;
    * a body that is not all in ``body_deadline_s`` after its headers (a client trickling it, each gap short of
      ``body_timeout_s``): 408 at that deadline.

    Both 408s say ``Connection: close``: a client that is still sending gets its answer and then the connection
    ends, instead of its rest being read and discarded for as long as it keeps sending.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float,
        body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    ) -> None:  # fmt: skip
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.body_deadline_s = body_deadline_s

    def too_large(self) -> str:
        return (
            f"The request body is larger than this server's limit of {self.max_body_bytes} bytes "
            f"({self.max_body_bytes / 2**20:.1f} MiB): send less, or start the server with a larger "
            "--max-body-bytes (max_body_bytes)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        if scope["path"] in JSON_PATHS and not _is_json(headers.get(b"content-type")):
            given = headers.get(b"content-type")
            got = "none was sent" if given is None else f"got {given.decode('latin-1')!r}"
            error = OpenAIError(
                f"The Content-Type header must be application/json ({got}): send the header "
                "'Content-Type: application/json' (curl: -H 'Content-Type: application/json')",
                status=415,
            )
            await openai_error_response(error)(scope, receive, send)
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            # Answered without reading the body: uvicorn discards the rest as it comes, keeping the connection.
            await openai_error_response(OpenAIError(self.too_large(), status=413))(scope, receive, send)
            return
        received, complete = 0, False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_deadline_s  # the headers are in: the whole body is owed by then

        async def guarded() -> Message:
            nonlocal received, complete
            if complete:  # the body is in: what comes now is a disconnect, and may take any time
                return await receive()
            left = deadline - loop.time()
            try:  # each wait is the shorter of the gap allowed and what is left of the whole body's time
                message = await asyncio.wait_for(receive(), max(min(self.body_timeout_s, left), 0.0))
            except asyncio.TimeoutError:
                if left < self.body_timeout_s:
                    why = (f"The request body did not all arrive within {self.body_deadline_s:g} s of its headers "
                           f"(body_deadline_s): {received} bytes came")  # fmt: skip
                else:
                    why = f"The request body stopped arriving: nothing for {self.body_timeout_s:g} s after {received} bytes"
                raise HTTPException(408, why, headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_body_bytes:  # raised in the handler's body read: answered as a 413
                    raise HTTPException(413, self.too_large())
            else:
                complete = True
            return message

        await self.app(scope, guarded, send)


def _is_json(content_type: bytes | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters (charset) allowed, any case."""
    if content_type is None:
        return False
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))
