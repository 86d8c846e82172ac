"""Deadlines for slow clients where the ASGI app cannot reach them: uvicorn's HTTP/1.1 protocol (h11).

A client that sends its request a byte at a time holds a connection, a socket and a little memory for as long as
it likes, and a dozen such clients ("slowloris") hold a server. Two deadlines end that:

* ``header_deadline_s``: the whole header block (request line and headers) must be in within this long. uvicorn
  reads the headers before the app is called, so no ASGI middleware can time them; and uvicorn 0.54 has no such
  timer: its only one, ``timeout_keep_alive``, runs between requests, is not started before a connection's first
  request, and the next byte that arrives cancels it (h11 only bounds the header block's size,
  ``h11_max_incomplete_event_size``, not its time);
* ``body_deadline_s``: the whole body must be in within this long of its headers. ``RequestGuard`` (api_server)
  enforces it while the app reads the body, answering a 408 in OpenAI's shape; this protocol is the backstop for a
  body nobody reads: one still trickling in after the answer went out (a 415 or 413 answered before reading; uvicorn
  then discards the bytes as they come, for ever, since each one cancels its keep-alive timer), or an app without
  the guard.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar, cast

import h11
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from .api_server import DEFAULT_BODY_DEADLINE_S, DEFAULT_HEADER_DEADLINE_S
from .protocol import OpenAIError

BODY_GRACE_S = 1.0  # how long past body_deadline_s a body the app is still reading waits for RequestGuard's 408


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's header block and one for its body.

    **Why a protocol subclass** (passed as ``uvicorn.Config(http=...)``, as ``start_server`` does): the header
    block is parsed here, before any ASGI app runs, so this is the only place that sees it arrive; a timer started
    when the header block starts and cancelled once h11 has parsed it is a few lines on top of uvicorn's own code
    (its keep-alive timer works the same way), where a patched copy of its event loop would be hundreds. It is
    the h11 protocol, not httptools (uvicorn's "auto" picks httptools when installed): h11 is always installed with
    uvicorn, and its state machine says at every point whether a request's headers or its body are still owed
    (``conn.their_state``), so the same rules hold on every machine.

    **The header deadline** counts from the connection's opening for its first request (a connection that sends
    nothing at all is closed at it too), and from the first byte of the next request on a kept-alive connection
    (before that byte, the idle time is uvicorn's ``timeout_keep_alive``). Once it passes, the client gets a
    **408 response** in OpenAI's JSON shape with ``Connection: close``, then the connection is closed. A response is
    possible here because h11 lets a server answer before a request has arrived (its ``our_state`` is still
    IDLE: nothing has been sent on this request), as uvicorn does for a malformed request (its 400); a client
    that waits for an answer reads why, one that keeps trickling sees the connection end.

    **The body deadline** counts from the moment the headers are in. While the app has not answered yet,
    ``RequestGuard`` answers at the same deadline (a JSON 408 with ``Connection: close``); this protocol waits
    ``BODY_GRACE_S`` more for it, then closes the connection itself (the app's ``receive`` then says the client
    disconnected). After the answer, a body still arriving is cut off at the deadline by closing the connection:
    the client has its answer already.

    ``with_deadlines(header_deadline_s, body_deadline_s)`` gives the class with those values (uvicorn builds one
    protocol per connection from a class, so the values are the class's).
    """

    header_deadline_s: ClassVar[float] = DEFAULT_HEADER_DEADLINE_S
    body_deadline_s: ClassVar[float] = DEFAULT_BODY_DEADLINE_S

    @classmethod
    def with_deadlines(cls, header_deadline_s: float, body_deadline_s: float) -> type[DeadlineH11Protocol]:
        """This class with these deadlines (seconds; checked by ``check_server_options``)."""
        values = {"header_deadline_s": float(header_deadline_s), "body_deadline_s": float(body_deadline_s)}
        return cast("type[DeadlineH11Protocol]", type(cls.__name__, (cls,), values))

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.header_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None
        self.body_grace_used = False
        self.handed_over = False  # upgraded to a WebSocket: no longer this protocol's connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()  # the first request's header block starts with the connection

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(data_arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start on a pipelined request already buffered
        self._watch(data_arrived=False)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        # The connection becomes the WebSocket protocol's: h11 here never hears the rest, so its timers must go.
        self.handed_over = True
        self._cancel_header_timer()
        self._cancel_body_timer()
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        super().connection_lost(exc)

    def _watch(self, data_arrived: bool) -> None:
        """Start or stop each timer from h11's view of the client: IDLE is a request whose headers are not all in
        (or none begun), SEND_BODY a body still owed. A running timer is never restarted: it is a deadline."""
        if self.handed_over or self.transport.is_closing():
            return
        their = self.conn.their_state
        if their is h11.IDLE and (data_arrived or self.conn.trailing_data[0]):
            self._arm_header_timer()
        elif their is not h11.IDLE:
            self._cancel_header_timer()
        if their is h11.SEND_BODY:
            if self.body_timer is None:
                self.body_grace_used = False
                self.body_timer = self.loop.call_later(self.body_deadline_s, self._body_overdue)
        else:
            self._cancel_body_timer()

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_deadline_s, self._headers_overdue)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _cancel_body_timer(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _headers_overdue(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = (
            f"The request's headers did not all arrive within {self.header_deadline_s:g} s (header_deadline_s): "
            "send the request line and headers at once"
        )
        self.logger.info("%s - 408: %s", self.client, message)
        body = json.dumps(OpenAIError(message, status=408).body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        try:  # h11 allows a response before the request: our side has sent nothing on this one
            out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            self.transport.write((out or b"") + (self.conn.send(h11.Data(data=body)) or b""))
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # a state h11 will not answer in: closing alone still frees the connection
            pass
        self.transport.close()

    def _body_overdue(self) -> None:
        self.body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.body_grace_used:
            # The app is reading it: RequestGuard's clock started a moment after ours; let its 408 go out first.
            self.body_grace_used = True
            self.body_timer = self.loop.call_later(BODY_GRACE_S, self._body_overdue)
            return
        self.logger.info("%s - the request body was not all in within %g s: closed", self.client, self.body_deadline_s)
        self.transport.close()
