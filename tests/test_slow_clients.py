"""Slow clients (issue 55, part 5): a request's header block and its body each have a deadline for the whole of
it, answered with a 408, so a client that trickles its request a byte at a time is let go at the deadline instead
of holding a connection for as long as it likes; requests sent at once are served, and so is everyone else
meanwhile. Real clients over 127.0.0.1 sockets; deadlines of 1 s, so each test takes a few seconds. Each test
failed before its fix: the trickling clients got no answer at all within the time they gave the server.
"""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from minipaged.engine.llm import LLM
from minipaged.serving import ServerHandle, start_server

pytestmark = pytest.mark.slow  # starts servers (make test-slow), as tests/test_server.py

DEADLINE_S = 1.0  # both deadlines, in the module's server
GAP_S = 5.0  # body_timeout_s: far longer than any gap below, so only the whole-body deadline can fire
EVERY_S = 0.2  # the trickling clients send a byte this often
SLACK_S = 2.5  # 2 cores shared with other work: the answer may come this late past its deadline
GIVE_UP_S = DEADLINE_S + SLACK_S + 1.0  # a client waits this long for an answer (bounds the test before the fix)
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerHandle]:
    llm = LLM(model=tiny_model, block_size=4, num_gpu_blocks_override=16, max_model_len=48)
    with start_server(llm, header_deadline_s=DEADLINE_S, body_deadline_s=DEADLINE_S, body_timeout_s=GAP_S) as s:
        yield s
    llm.shutdown()


@dataclass
class Answer:
    data: bytes  # everything the server sent
    answered_s: float | None  # seconds from the start of the trickle to its first byte (None: nothing came)
    closed_s: float | None  # ... to the server closing the connection (None: still open when the client gave up)
    sent: int  # bytes of the trickle sent

    @property
    def status(self) -> int | None:
        line = self.data.split(b"\r\n", 1)[0].split()
        return int(line[1]) if len(line) > 1 else None

    @property
    def message(self) -> str:
        body = self.data.split(b"\r\n\r\n", 1)[-1]
        return str(json.loads(body)["error"]["message"])


def trickle(port: int, data: bytes, head: bytes = b"", keep_sending: bool = False) -> Answer:
    """Connect, send ``head`` at once, then ``data`` a byte every ``EVERY_S`` until the server answers (or, with
    ``keep_sending``, on past its answer), the server closes, or ``GIVE_UP_S`` pass."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=GIVE_UP_S)
    got, answered, closed, sent = b"", None, None, 0
    try:
        sock.sendall(head)
        t0 = time.monotonic()
        while time.monotonic() - t0 < GIVE_UP_S:
            if sent < len(data) and (answered is None or keep_sending):
                try:
                    sock.send(data[sent : sent + 1])
                    sent += 1
                except OSError:  # closed by the server: what it said before is still to be read
                    pass
            if select.select([sock], [], [], EVERY_S)[0]:
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    closed = time.monotonic() - t0
                    break
                answered = time.monotonic() - t0 if answered is None else answered
                got += chunk
    finally:
        sock.close()
    return Answer(got, answered, closed, sent)


def within_deadline(seconds: float | None) -> bool:
    return seconds is not None and DEADLINE_S - 0.1 <= seconds <= DEADLINE_S + SLACK_S


def completion(s: ServerHandle) -> httpx.Response:
    return httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)


def test_a_header_block_trickled_a_byte_at_a_time_gets_408_at_its_deadline(server):
    a = trickle(server.port, HEAD)
    assert a.status == 408 and within_deadline(a.answered_s), a
    assert "header_deadline_s" in a.message and a.closed_s is not None, a
    assert a.sent < len(HEAD)  # cut off mid-headers, not served once they were all in


def test_a_connection_that_sends_nothing_is_let_go_at_the_header_deadline(server):
    a = trickle(server.port, b"")
    assert a.status == 408 and within_deadline(a.answered_s) and a.closed_s is not None, a


def test_a_body_trickled_with_short_gaps_gets_408_at_the_whole_body_deadline(server):
    """No gap comes near body_timeout_s (5 s), so only the whole body's 1 s deadline can end it: RequestGuard's
    408 in OpenAI's shape, then the connection closes (Connection: close)."""
    a = trickle(
        server.port, b'{"prompt": [1, 2, 3], "max_tokens": 2}' + b" " * 60, HEAD + b"Content-Length: 100\r\n\r\n"
    )
    assert a.status == 408 and within_deadline(a.answered_s), a
    assert "body_deadline_s" in a.message and b"connection: close" in a.data.lower(), a
    assert a.closed_s is not None and a.closed_s - (a.answered_s or 0) < 1.0, a


def test_a_body_still_trickling_after_an_early_answer_is_cut_off_at_the_deadline(server):
    """A 415 is answered before the body is read; the client goes on sending it. uvicorn would read and discard
    it for ever (each byte cancels its keep-alive timer); the protocol closes the connection at the deadline."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\n"
    )
    a = trickle(server.port, b"x" * 100, head, keep_sending=True)
    assert a.status == 415 and a.answered_s is not None and a.answered_s < 1.0, a
    assert within_deadline(a.closed_s), a


def test_requests_sent_at_once_are_served_and_others_meanwhile(server):
    """Twelve clients trickling their headers (the issue's slowloris) are all let go at the deadline; meanwhile a
    plain client is served as fast as ever, with a body sent in pieces too, and /health answers."""
    with ThreadPoolExecutor(12) as pool:
        slow = [pool.submit(trickle, server.port, HEAD) for _ in range(12)]
        time.sleep(0.3)  # all twelve connected and trickling
        t0 = time.monotonic()
        r = completion(server)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        chunked = httpx.post(server.url + "/v1/completions", content=iter([b'{"prompt": [1, 2], ', b'"max_tokens": 1}']),
                             headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
        assert chunked.status_code == 200, chunked.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert time.monotonic() - t0 < DEADLINE_S + SLACK_S
        answers = [f.result() for f in slow]
    assert all(a.status == 408 and within_deadline(a.answered_s) for a in answers), answers
    assert completion(server).status_code == 200  # and after them
