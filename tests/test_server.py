"""``minipaged serve`` on SmolLM2: the official ``openai`` client gets what ``LLM.generate`` gives, every bad
request is a 400 naming its field, a client that leaves has its request aborted and its blocks freed, a small
load leaves the pool empty, ``/metrics`` is Prometheus text, the command line checks its knobs first.

One server for the module (port 0, 127.0.0.1); outputs are kept short so the module runs in seconds.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from minipaged.engine import LLM
from minipaged.sampling_params import SamplingParams
from minipaged.serving import AsyncEngine, ServerHandle, build_app, start_server
from minipaged.serving.serving_engine import TextDeltas

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
        assert metric(http, "kv_blocks_in_use") > 0  # it holds blocks while it runs
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


# ---- /metrics ----------------------------------------------------------------------------------------------
def test_metrics_is_prometheus_text(client, http, llm):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0)
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
    assert metric(http, "prefix_cache_hits_total") > 0  # the same prompt twice in this module


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
