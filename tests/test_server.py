"""``minipaged serve`` on SmolLM2: the official ``openai`` client gets what ``LLM.generate`` gives, every bad
request is a 400 naming its field, a client that leaves has its request aborted and its blocks freed, a small
load leaves the pool empty, ``/metrics`` is Prometheus text, the command line checks its knobs first. Nothing
hangs and nothing lies: a big prompt leaves ``/health`` answering, a body over the limit or of the wrong type is
refused before it is read, ``/health`` says why an engine cannot serve (its loop died, it was shut down, a
tensor-parallel worker was killed), an empty API key is refused at start.

One server for the module (port 0, 127.0.0.1); outputs are kept short so the module runs in seconds. The tests
of broken engines break a tiny model's engine of their own (no tokenizer: token-id prompts).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from typing import Any

import httpx
import openai
import pytest

from minipaged.engine.llm import LLM
from minipaged.model_loader import save_tiny_llama
from minipaged.sampling_params import SamplingParams
from minipaged.serving import AsyncEngine, ServerHandle, build_app, start_server
from minipaged.serving.serving_engine import TextDeltas

pytestmark = pytest.mark.slow  # HTTP servers, load tests and dropped clients: make test-slow

MAX_TOKENS = 8
MAX_MODEL_LEN = 512
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
BATCH = ["Once upon a time", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks_override=128, max_num_seqs=16, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs from the offline API, computed before the server's engine loop takes the LLM."""
    return {
        "chat": llm.chat([CHAT], GREEDY)[0],
        "completion": llm.generate([PROMPT], GREEDY)[0],
        "batch": [llm.generate([p], SamplingParams(temperature=0, max_tokens=4))[0] for p in BATCH],
    }


@pytest.fixture(scope="module")
def server(llm, reference):
    with start_server(llm) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: ServerHandle):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ---- a small reader of the Prometheus text format ------------------------------------------------------
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(?:,|$)')


def parse_metrics(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """``({family: type}, [(name, labels, value), ...])``; raises on any line that is not HELP, TYPE or a sample,
    and on a sample whose family had no HELP and TYPE before it."""
    types: dict[str, str] = {}
    helped: set[str] = set()
    samples = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            helped.add(line.split()[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        else:
            m = SAMPLE.match(line)
            assert m is not None, f"not a sample line: {line!r}"
            name, raw_labels, value = m.groups()
            labels = dict(LABEL.findall(raw_labels or ""))
            assert len(labels) == (raw_labels or "").count('="'), f"bad labels: {line!r}"
            family = next((f for f in types if name == f or name in (f + "_bucket", f + "_sum", f + "_count")), None)
            assert family is not None and family in helped, f"no HELP/TYPE before {line!r}"
            samples.append((name, labels, float(value)))
    return types, samples


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    r = http.get("/metrics")
    assert r.status_code == 200
    _, samples = parse_metrics(r.text)
    found = [v for n, lab, v in samples if n == "minipaged:" + name and labels.items() <= lab.items()]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


def wait_for(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def idle(http: httpx.Client) -> bool:
    return all(metric(http, m) == 0 for m in ("num_requests_running", "num_requests_waiting", "kv_blocks_in_use"))


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """The JSON events of a server-sent-event stream, and "[DONE]", as they come."""
    for line in lines:
        if line.startswith("data: "):
            yield line[6:] if line == "data: [DONE]" else json.loads(line[6:])


# ---- the official client gets what LLM.generate gives -----------------------------------------------------
def test_chat_matches_greedy_generate(client, server, reference):
    ref = reference["chat"]
    r = client.chat.completions.create(model=server.served_model_name, messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0)  # fmt: skip
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_stream_matches_greedy_generate(client, reference):
    ref = reference["chat"]
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [ref.outputs[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_completions_match_greedy_generate(client, reference):
    ref = reference["completion"].outputs[0]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(ref.token_ids)
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_n_samples_and_batches_number_choices_as_openai(client, reference):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, n=3, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    # A batch of two prompts, two greedy samples each: choice i * n + j is sample j of prompt i.
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=BATCH, max_tokens=4, n=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    refs = reference["batch"]
    assert refs[0].outputs[0].text != refs[1].outputs[0].text  # else the order would not be tested
    assert [c.text for c in r.choices] == [ref.outputs[0].text for ref in refs for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs)  # once per prompt, not per sample
    assert r.usage.completion_tokens == 2 * sum(len(ref.outputs[0].token_ids) for ref in refs)
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=4, n=2, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_models_list(client, http, server, llm):
    (model,) = client.models.list().data
    assert model.id == server.served_model_name
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == llm.max_model_len == MAX_MODEL_LEN and card["object"] == "model"


# ---- bad requests: 400, the field named, nothing queued -------------------------------------------------
LONG = "hello " * 600  # past MAX_MODEL_LEN tokens
BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "Hi", "colour": "blue"}, "colour"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "Hi", "n": 17}, "n"),  # more than max_num_seqs
    ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": [[1]] * 2049}, "prompt"),  # more prompts than one request may hold
    ("/v1/completions", {"prompt": "Hi", "stop": ["\n"]}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "Hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [-3]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True, "x": 1}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": "."}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_object"}}, "response_format"),
]


def post(http: httpx.Client, path: str, body: object, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"}, **kw)


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p[4:]}:{pm}:{i}" for i, (p, _, pm) in enumerate(BAD)])
def test_bad_request_is_400_naming_the_field(http, path, body, param):
    r = post(http, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"] and set(error) == {"message", "type", "param", "code"}
    if body == b"{not json":
        assert "JSON" in error["message"]


def test_context_length_message_and_the_client_error(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=MAX_MODEL_LEN)
    assert exc.value.param == "max_tokens"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in exc.value.message


def test_bad_requests_queue_nothing_and_the_server_goes_on(http, client):
    assert wait_for(lambda: idle(http))
    failed, prompt_tokens = metric(http, "request_failed_total"), metric(http, "prompt_tokens_total")
    for path, body, _ in BAD[::3]:
        assert post(http, path, body).status_code == 400
    assert idle(http)
    assert metric(http, "request_failed_total") == failed and metric(http, "prompt_tokens_total") == prompt_tokens
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert http.get("/health").status_code == 200


def test_api_key(server, client):
    """A second front end on the same engine loop, with a key: 401 without it, /health open."""
    with start_server(server.engine, api_key="sekret") as keyed, httpx.Client(base_url=keyed.url, timeout=30) as c:
        assert keyed.url != server.url
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")):
                r = c.request(method, path, headers=headers, json={"prompt": "Hi"})
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/health").status_code == 200
        good = {"Authorization": "Bearer sekret"}
        assert c.get("/v1/models", headers=good).status_code == 200
        keyed_client = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        r = keyed_client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert server.engine.is_alive  # the keyed front end did not stop the shared engine loop
    assert client.models.list().data


# ---- what is wrong with the request itself: its size, its type, a body that stops ----------------------------
def raw_post(server: ServerHandle, headers: dict[str, str], body: bytes = b"", timeout: float = 10.0):
    """POST /v1/completions with exactly these headers and only ``body`` sent (however long the Content-Length
    says it is): ``(status, error message, seconds to the answer)``. A server that waits for the rest raises
    ``TimeoutError`` after ``timeout``."""
    conn = HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        conn.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        t0 = time.monotonic()
        if body:
            conn.send(body)
        r = conn.getresponse()
        answer = json.loads(r.read())
        return r.status, answer["error"]["message"] if "error" in answer else "", time.monotonic() - t0
    finally:
        conn.close()


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    """Its Content-Length says 5 MiB and not a byte of it is sent: the answer comes anyway, naming the limit."""
    status, message, _ = raw_post(server, {"Content-Type": "application/json", "Content-Length": str(5 * 2**20)})
    assert status == 413 and "4194304 bytes" in message and "--max-body-bytes" in message, message


def test_a_chunked_body_is_counted_as_it_comes_and_a_stalled_one_times_out(server, client):
    with start_server(server.engine, max_body_bytes=1000, body_timeout_s=1.0) as small:
        chunks = [b'{"prompt": "', *[b"x" * 100] * 12, b'", "max_tokens": 1}']  # no Content-Length: chunked
        with httpx.Client(base_url=small.url, timeout=30) as c:
            r = c.post("/v1/completions", content=iter(chunks), headers={"content-type": "application/json"})
            assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"], r.text
            # Under the limit is served (after a refused body, on the same client).
            r = c.post("/v1/completions", content=iter([b'{"prompt": "Hi", ', b'"max_tokens": 1}']),
                       headers={"content-type": "application/json"})  # fmt: skip
            assert r.status_code == 200, r.text
        # A client that sends 10 bytes of the 100 it announced, then nothing (stopped, or gone silent).
        status, message, seconds = raw_post(small, {"Content-Type": "application/json", "Content-Length": "100"},
                                            b'{"prompt":')  # fmt: skip
        assert status == 408 and "stopped arriving" in message and seconds < 5, (status, message, seconds)
    assert client.models.list().data  # the shared engine loop goes on


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain", None])
def test_a_body_that_is_not_json_names_the_content_type_header(server, content_type):
    """``curl -d '{...}'`` without ``-H`` sends a form's Content-Type; the answer says which header to send."""
    headers = {"Content-Length": "15"} | ({} if content_type is None else {"Content-Type": content_type})
    status, message, _ = raw_post(server, headers, b'{"prompt":"Hi"}')
    assert status == 415 and "Content-Type" in message and "application/json" in message, message
    if content_type is not None:
        assert content_type in message
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    for json_type in ("application/json; charset=utf-8", "Application/JSON"):
        assert raw_post(server, {"Content-Type": json_type, "Content-Length": str(len(body))}, body)[0] == 200


def test_a_large_prompt_does_not_stall_health(server):
    """A 1.6 MB prompt (under the 4 MiB limit, far over the context: a 400 once tokenized) takes a second or more
    to tokenize; meanwhile /health answers as fast as ever, because tokenizing runs off the event loop."""
    body = json.dumps({"prompt": "All work and no play makes Jack a dull boy. " * 36_000, "max_tokens": 1}).encode()
    answer: dict[str, Any] = {}

    def send() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            answer["r"] = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})

    waits = []
    sender = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    sender.start()
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        while sender.is_alive() and time.monotonic() - t0 < 60:
            t1 = time.monotonic()
            assert probe.get("/health").status_code == 200
            waits.append(time.monotonic() - t1)
            time.sleep(0.01)
    sender.join(5)
    took = time.monotonic() - t0
    r = answer["r"]
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # it was tokenized
    assert len(waits) >= 3 and max(waits) < 0.5, f"/health waited {max(waits):.2f} s; the prompt took {took:.1f} s"


# ---- clients that leave -----------------------------------------------------------------------------------
LONG_RUN = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def test_stream_disconnect_aborts_and_frees_blocks(server, http):
    aborted, generated = metric(http, "request_aborted_total"), metric(http, "generation_tokens_total")
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/completions",
                                                                       json={**LONG_RUN, "stream": True}) as r:  # fmt: skip
        assert r.status_code == 200
        data = 0
        for line in r.iter_lines():
            data += line.startswith("data: ")
            if data == 2:
                break
        # it holds blocks while it runs: the gauges are read between steps, so a scrape can land just before the
        # snapshot that first shows them (seen under load): poll while the stream is still open
        assert wait_for(lambda: metric(http, "kv_blocks_in_use") > 0, 5.0)
    assert wait_for(lambda: idle(http)), "the request was not aborted"
    assert metric(http, "request_aborted_total") == aborted + 1
    assert metric(http, "generation_tokens_total") - generated < 200  # stopped early, not run to 400


def test_non_streaming_client_that_leaves_is_aborted(server, http):
    aborted = metric(http, "request_aborted_total")
    with httpx.Client(base_url=server.url, timeout=1.0) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json=LONG_RUN)
    assert wait_for(lambda: idle(http)), "the request was not aborted"
    assert metric(http, "request_aborted_total") == aborted + 1


def test_load_with_hang_ups_leaves_the_pool_empty(server, http):
    """40 streams from 8 client threads; every fifth hangs up after its first chunk."""
    aborted = metric(http, "request_aborted_total")

    def one(i: int) -> str:
        hang_up = i % 5 == 0
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 12 if hang_up else 4 + i % 9, "stream": True,
                "temperature": 0.8, "seed": i, "ignore_eos": hang_up}  # fmt: skip
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            reasons, done = [], False
            for event in sse_events(r.iter_lines()):
                if hang_up:
                    return "hung up"
                if event == "[DONE]":
                    done = True
                else:
                    assert "error" not in event, event
                    reasons += [c["finish_reason"] for c in event["choices"] if c["finish_reason"]]
            assert done and len(reasons) == 1, reasons
            return reasons[0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(40), timeout=120))
    assert results.count("hung up") == 8
    assert all(r in ("stop", "length") for r in results if r != "hung up")
    assert wait_for(lambda: idle(http))
    assert metric(http, "request_aborted_total") == aborted + 8


def test_text_deltas_hold_back_half_characters():
    deltas = TextDeltas()
    assert deltas.delta(0, "caf", False) == "caf"
    assert deltas.delta(0, "caf\ufffd", False) == ""  # the first byte of "é": wait for the next token
    assert deltas.delta(1, "x", False) == "x"  # each choice on its own
    assert deltas.delta(0, "café", False) == "é"
    assert deltas.delta(0, "café \ufffd\ufffd", True) == " \ufffd\ufffd"  # finished: nothing more will come


def test_health_is_503_and_requests_get_503_without_an_engine_loop(llm):
    from starlette.testclient import TestClient

    with TestClient(build_app(AsyncEngine(llm), "m")) as c:  # never started
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"


# ---- /health says why an engine cannot serve; the pool's gauges from the start --------------------------------
def tiny_llm(path, **kw) -> LLM:
    return LLM(model=path, block_size=4, num_gpu_blocks_override=16, max_model_len=48, **kw)


def health(url: str) -> tuple[int, str]:
    r = httpx.get(url + "/health", timeout=10)
    return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else ""


def test_metrics_show_the_pool_before_the_first_request(tiny_model):
    llm = tiny_llm(tiny_model)
    with start_server(llm) as s, httpx.Client(base_url=s.url, timeout=10) as c:
        assert metric(c, "kv_blocks_total") == llm.num_blocks - 1 == metric(c, "kv_blocks_free")
        assert metric(c, "kv_blocks_in_use") == 0
    llm.shutdown()


def test_health_says_the_engine_loop_died_and_requests_get_its_reason(tiny_model, monkeypatch):
    llm = tiny_llm(tiny_model)
    with start_server(llm) as s, httpx.Client(base_url=s.url, timeout=10) as c:

        def boom() -> None:
            raise RuntimeError("injected loop fault")

        monkeypatch.setattr(s.engine, "_snapshot", boom)  # called by the loop after every batch of commands
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and "injected loop fault" in r.json()["error"]["message"], r.text
        assert wait_for(lambda: not s.engine.is_alive, 10)
        status, why = health(s.url)
        assert status == 503 and "engine loop has stopped" in why and "injected loop fault" in why, why
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and "injected loop fault" in r.json()["error"]["message"], r.text
        assert llm.kv_cache_manager.get_num_free_blocks() == llm.num_blocks - 1  # nothing left held
    llm.shutdown()


def test_health_says_the_engine_was_shut_down(tiny_model):
    llm = tiny_llm(tiny_model)
    with start_server(llm) as s, httpx.Client(base_url=s.url, timeout=10) as c:
        assert health(s.url) == (200, "")
        llm.shutdown()  # someone frees the engine under a running server
        status, why = health(s.url)
        assert status == 503 and "shut down" in why, why
        r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and "shut down" in r.json()["error"]["message"], r.text
    with pytest.raises(RuntimeError, match="shut down"):  # and no new server starts on it
        start_server(llm)


def test_health_is_503_naming_a_killed_tensor_parallel_worker(tmp_path):
    model = save_tiny_llama(tmp_path, num_attention_heads=8, num_key_value_heads=4, vocab_size=97)
    llm = tiny_llm(model, tensor_parallel_size=2)
    (pid,) = llm.executor.pids
    try:
        with start_server(llm) as s, httpx.Client(base_url=s.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status_code == 200, r.text
            if sys.platform == "linux":  # stopped: a step would wait for it; /health says so, and recovers
                os.kill(pid, signal.SIGSTOP)
                try:
                    assert wait_for(lambda: health(s.url)[0] == 503, 10), "a stopped worker left /health at 200"
                    assert "rank 1" in health(s.url)[1] and "stopped" in health(s.url)[1]
                finally:
                    os.kill(pid, signal.SIGCONT)
                assert wait_for(lambda: health(s.url)[0] == 200, 10)
            os.kill(pid, signal.SIGKILL)
            assert wait_for(lambda: health(s.url)[0] == 503, 10), "a dead worker left /health at 200"
            _, why = health(s.url)
            assert "rank 1" in why and str(pid) in why, why
            r = c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
            assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
    finally:
        llm.shutdown()


def test_an_empty_api_key_is_refused_at_start(server, llm):
    for key in ("", " sekret", "sek\nret"):
        with pytest.raises(ValueError, match=r"api_key \(--api-key\)"):
            start_server(server.engine, api_key=key)
        with pytest.raises(ValueError, match="api_key"):
            build_app(server.engine, "m", api_key=key)
    with pytest.raises(ValueError, match="max_body_bytes"):
        start_server(server.engine, max_body_bytes=0)
    with pytest.raises(ValueError, match="port"):
        start_server(server.engine, port=70000)
    assert server.engine.is_alive


# ---- /metrics ----------------------------------------------------------------------------------------------
def test_metrics_is_prometheus_text(client, http, llm):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0)
    for _ in range(2):  # one chat twice, back to back: the second finds the first's full blocks (its template's
        # system prompt), a hit no other test's load can evict in between
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=4, temperature=0)
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = parse_metrics(r.text)
    names = {n.removeprefix("minipaged:") for n in types}
    assert {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_blocks_in_use",
            "kv_blocks_free", "kv_blocks_total", "prefix_cache_hit_rate", "num_preemptions_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
            "generation_tokens_total", "request_success_total", "request_aborted_total",
            "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
            "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
            "spec_decode_num_accepted_tokens_total"} <= names  # fmt: skip
    assert metric(http, "spec_decode_num_drafts_total") == 0  # this engine does not speculate
    for family, kind in types.items():
        if kind != "histogram":
            continue
        buckets = [(lab["le"], v) for n, lab, v in samples if n == family + "_bucket"]
        les = [float(le) for le, _ in buckets]
        counts = [v for _, v in buckets]
        assert les == sorted(les) and les[-1] == math.inf and buckets[-1][0] == "+Inf"
        assert counts == sorted(counts), f"{family}: buckets not cumulative"
        (count,) = [v for n, _, v in samples if n == family + "_count"]
        assert counts[-1] == count
    assert metric(http, "time_to_first_token_seconds_count") > 0
    assert metric(http, "kv_blocks_total") == llm.num_blocks - 1
    assert metric(http, "kv_blocks_free") + metric(http, "kv_blocks_in_use") == llm.num_blocks - 1
    assert metric(http, "request_success_total", finished_reason="length") > 0
    assert metric(http, "generation_tokens_total") >= 4
    assert 0 <= metric(http, "prefix_cache_hit_rate") <= 1
    assert metric(http, "prefix_cache_hits_total") > 0  # the same chat twice


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(llm, http, client):
    real = type(llm).step

    def boom(self=llm):
        del llm.step  # once: the next step is the real one
        raise RuntimeError("injected fault")

    failed = metric(http, "request_failed_total")
    llm.step = boom
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert "step" not in vars(llm) and type(llm).step is real
    assert wait_for(lambda: idle(http))
    assert metric(http, "request_failed_total") == failed + 1
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


# ---- the command line ---------------------------------------------------------------------------------------
def test_cli_checks_the_knobs_before_loading_the_model():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "minipaged", "serve", "--max-num-seqs", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "max_num_seqs" in proc.stderr
    assert time.monotonic() - t0 < 60


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--api-key", ""], "api_key (--api-key) is empty"),
        (["--max-body-bytes", "0"], "--max-body-bytes: must be a positive integer"),
        (["--port", "70000"], "--port: must be a port number"),
    ],
)
def test_cli_refuses_an_empty_api_key_and_bad_limits_before_loading_the_model(flags, words):
    proc = subprocess.run([sys.executable, "-m", "minipaged", "serve", *flags], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "" and words in proc.stderr, proc.stderr


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C as a terminal gives it. A test run started in the background of a
    non-interactive shell (``make test &``) inherits SIGINT ignored, and a Python started so keeps ignoring it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_cli_serves_until_interrupted():
    proc = subprocess.Popen([sys.executable, "-m", "minipaged", "serve", "--port", "0", "--num-gpu-blocks-override",
                             "32", "--max-num-seqs", "4", "--served-model-name", "tiny-pool"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_default)  # fmt: skip
    watchdog = threading.Timer(120, proc.kill)  # a hung start ends the readline below with EOF
    watchdog.start()
    try:
        line = proc.stdout.readline()  # printed once the model is loaded and /health answers
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line)
        assert url, line + proc.stderr.read() if proc.poll() is not None else line
        models = httpx.get(url.group(1) + "/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "tiny-pool"
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # say where it hung: its own last words
            proc.kill()
            _, err = proc.communicate(timeout=10)
            pytest.fail(f"the server did not exit within 30 s of Ctrl-C; the end of its stderr:\n{err[-4000:]}")
        assert code == 0
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
