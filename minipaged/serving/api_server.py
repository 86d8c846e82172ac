"""The OpenAI-compatible HTTP API (vLLM's ``vllm/entrypoints/launchers/app.py``): ``build_app`` wires
the routes to one ``AsyncEngine``::

    POST /v1/completions        serving_completion      GET /v1/models    the one served model
    POST /v1/chat/completions   serving_chat            GET /health       200 while the engine loop lives
                                                        GET /metrics      Prometheus text (metrics.py)

Every client error is a 400 in OpenAI's shape with ``param`` naming the field: FastAPI's own validation error
(a 422 with its own body) is replaced, so OpenAI's clients raise their usual ``BadRequestError``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from .async_engine import AsyncEngine
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest, OpenAIError
from .serving_chat import create_chat_completion
from .serving_completion import create_completion

PROMPT_TYPES = "prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids"
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (a load balancer's probe has none)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over ``engine`` (started by the caller). ``api_key``: every route but ``/health``
    then wants ``Authorization: Bearer <api_key>``."""
    app = FastAPI(title="minipaged", summary="An OpenAI-compatible server on the minipaged engine")
    app.state.engine = engine
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(req, raw, engine, served_model_name)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(req, raw, engine, served_model_name)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": served_model_name, "object": "model", "created": created, "owned_by": "minipaged",
                "root": served_model_name, "max_model_len": engine.llm.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

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
        return openai_error_response(OpenAIError(str(exc.detail), status=exc.status_code, type=kind))

    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


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
