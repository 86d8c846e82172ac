"""``start_server``: the API on uvicorn in a background thread, for the command line, notebooks and tests
(vLLM's ``vllm/entrypoints/launchers/launcher.py``).

Three threads, each with one job::

    caller (notebook, test, CLI)      uvicorn thread: its asyncio loop     engine thread: AsyncEngine
    start_server() ... handle.stop()  HTTP, JSON, SSE, one task each  ──▶  llm.step(), step after step

The caller keeps its own thread: ``start_server`` returns once ``/health`` answers; ``handle.stop()`` stops
accepting, ends the engine loop (streams still open end with an error), and waits for uvicorn, a bounded wait.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from .api_server import (
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_DEADLINE_S,
    DEFAULT_MAX_BODY_BYTES,
    build_app,
    check_server_options,
)
from .async_engine import AsyncEngine
from .deadlines import DeadlineH11Protocol

if TYPE_CHECKING:
    from ..engine.llm import LLM

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(llm: LLM) -> str:
    """The model folder's name, or SmolLM2's when the engine runs the default model."""
    model = llm.config.model
    return DEFAULT_MODEL_NAME if model is None else Path(os.fspath(model)).name or str(model)


class ServerHandle:
    """A running server: ``url`` (the real port, also when 0 was asked for), ``stop()``; a context manager."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, engine: AsyncEngine, owns_engine: bool,
                 served_model_name: str) -> None:  # fmt: skip
        self.server, self.thread, self.engine = server, thread, engine
        self.owns_engine = owns_engine
        self.served_model_name = served_model_name
        self.host, self.port = server.config.host, 0
        if server.started:
            self.host, self.port = server.servers[0].sockets[0].getsockname()[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, end the engine loop (streams still open end with an error), then wait for uvicorn
        (at most ``timeout`` seconds, then it is told to quit at once). Calling it twice is harmless."""
        self.server.should_exit = True
        if self.owns_engine:
            self.engine.shutdown()
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C in the main thread interrupts it)."""
        while self.thread.is_alive():
            self.thread.join(0.5)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle({self.url}, model={self.served_model_name!r}, alive={self.thread.is_alive()})"


def start_server(
    llm: LLM | AsyncEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
    served_model_name: str | None = None,
    startup_timeout: float = 30.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    header_deadline_s: float = DEFAULT_HEADER_DEADLINE_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
) -> ServerHandle:
    """Serve ``llm`` over HTTP in a daemon thread; returns once ``/health`` answers 200.

    ``port=0`` takes a free port (``handle.url`` has it). Given an ``AsyncEngine`` instead of an ``LLM``, the
    server shares that engine loop (another front end on the same engine, say with an API key) and leaves it
    running when it stops; given an ``LLM``, it starts its own loop and shuts it down in ``stop()``.
    ``max_body_bytes``: larger request bodies are refused (413) before they are read. Slow clients are let go
    with a 408: a body that stops for ``body_timeout_s``, one not all in ``body_deadline_s`` after its headers, a
    header block not all in within ``header_deadline_s`` (``deadlines.DeadlineH11Protocol``). Every option is
    checked before anything starts; an engine that cannot serve (``AsyncEngine.health``) is refused with the reason.
    """
    check_server_options(api_key, max_body_bytes, body_timeout_s, header_deadline_s, body_deadline_s)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535 (0: a free one), got {port!r}")
    if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name.strip()):
        raise ValueError(
            f"served_model_name (--served-model-name) must be a non-empty string, got {served_model_name!r}"
        )
    if not 0 < startup_timeout < float("inf"):
        raise ValueError(f"startup_timeout must be a positive number of seconds, got {startup_timeout!r}")
    owns = not isinstance(llm, AsyncEngine)
    engine = AsyncEngine(llm).start() if not isinstance(llm, AsyncEngine) else llm
    why = engine.health()
    if why is not None:
        if owns:
            engine.shutdown()
        raise RuntimeError(f"cannot serve: {why}")
    name = served_model_name or default_model_name(engine.llm)
    try:
        app = build_app(engine, name, api_key, max_body_bytes, body_timeout_s, body_deadline_s)
    except BaseException:
        if owns:
            engine.shutdown()
        raise
    # uvicorn has no deadline for a request's header block: this protocol adds one (see its docstring for why here).
    protocol = DeadlineH11Protocol.with_deadlines(header_deadline_s, body_deadline_s)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5, http=protocol)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="minipaged-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the server could not start on {host}:{port} (uvicorn's message is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {host}:{port} within {startup_timeout:.0f} s")
            time.sleep(0.02)
        handle = ServerHandle(server, thread, engine, owns, name)
        _wait_healthy(handle, deadline)
    except BaseException:
        server.should_exit = True
        thread.join(5.0)
        if owns:
            engine.shutdown()
        raise
    return handle


def _wait_healthy(handle: ServerHandle, deadline: float) -> None:
    """Ask ``/health`` until it says 200 (a bounded wait, then a clear error). A 503 is the engine's own word
    that it cannot serve (it was checked just before): said at once, with its reason, not after the wait."""
    status: object = None
    while time.monotonic() < deadline:
        conn = http.client.HTTPConnection(handle.host, handle.port, timeout=2.0)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            status = response.status
            if status == 200:
                return
            if status == 503:
                raise RuntimeError(f"cannot serve: {_error_message(response.read())}")
        except OSError as exc:
            status = exc
        finally:
            conn.close()
        time.sleep(0.05)
    raise RuntimeError(f"{handle.url}/health did not answer 200 in time (last answer: {status})")


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:300] or "no reason given"
