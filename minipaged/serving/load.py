"""A load generator for an OpenAI-compatible server: Poisson arrivals, streaming clients, latency per request.

What chapter 11 and ``benchmarks/bench_serving.py`` send to ``minipaged serve``, and to ``vllm serve`` in the
benchmark: the same requests, measured the way ``vllm bench serve`` measures them (``vllm/benchmarks/serve.py``)::

    arrivals   ──●────●─●──────●──●●─────▶  exponential gaps (a Poisson process at `rate` requests/s)
    clients    [c1][c2]...[c_max]            a bounded pool: a request that finds every client busy waits
    one stream POST /v1/completions, stream: true
               ├── TTFT ──┤ chunk ├ITL┤ chunk ├ITL┤ ... [DONE]   (ITL: the gap between two chunks)
    hang-ups   a chosen share of clients closes the connection after its first token

A request *fails* if the server answers with an error, the stream breaks, or it ends without a finish reason or
with fewer tokens than asked (``ignore_eos`` makes the count exact). A client that hangs up on purpose is not
a failure: the server must abort its request and free its blocks, which ``/metrics`` shows afterwards.

Everything is bounded: the number of requests, each request's time, the whole run's time. Runs in a thread of
its own, so it can be called from a notebook (whose event loop is already running) as well as a script.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request, as its client saw it (seconds)."""

    index: int
    hang_up: bool  # planned: this client closes the connection after its first token
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: str | None = None
    sent: float = 0.0  # when the request was sent, from the start of the run
    end: float = 0.0

    @property
    def hung_up(self) -> bool:
        """Left on purpose after its first token (the server should have aborted it)."""
        return self.hang_up and self.error is None and self.ttft is not None and not self.ok


@dataclass
class LoadResult:
    """A run at one request rate: every request's record and the server's KV use over time."""

    rate: float
    records: list[RequestRecord]
    seconds: float  # from the first request sent to the last answer
    kv_usage: list[tuple[float, float]]  # (seconds into the run, share of the KV cache in use)

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def failed(self) -> list[RequestRecord]:
        return [r for r in self.records if not r.ok and not r.hung_up]

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.records if r.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [x for r in self.completed for x in r.itls]

    def summary(self) -> dict[str, Any]:
        """The figures a table shows (latencies in ms)."""

        def ms(v: float | None) -> float | None:
            return None if v is None else round(1000 * v, 1)

        done = self.completed
        return dict(
            rate=self.rate,
            requests=len(self.records),
            completed=len(done),
            hung_up=sum(r.hung_up for r in self.records),
            failed=len(self.failed),
            seconds=round(self.seconds, 2),
            output_tok_per_s=round(sum(r.output_tokens for r in done) / max(self.seconds, 1e-9), 1),
            ttft_ms_p50=ms(percentile(self.ttfts, 50)),
            ttft_ms_p99=ms(percentile(self.ttfts, 99)),
            itl_ms_p50=ms(percentile(self.itls, 50)),
            itl_ms_p99=ms(percentile(self.itls, 99)),
        )


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A server's ``/metrics`` page as {metric name: its first sample's value} (labels dropped)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                values.setdefault(name.split("{")[0], float(value))
            except ValueError:
                continue
    return values


def kv_usage(values: dict[str, float]) -> float | None:
    """The share of the KV cache in use, under minipaged's or vLLM's name (v1, or its older one)."""
    for name in ("minipaged:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        if name in values:
            return values[name]
    return None


def poisson_gaps(n: int, rate: float, seed: int = 0) -> list[float]:
    """Seconds between arrivals: exponential with mean 1/rate (all 0 for rate = inf: one burst)."""
    rng = random.Random(seed)
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(n)]


async def _one(client: Any, url: str, body: dict, index: int, hang_up: bool, t0: float, timeout: float):
    rec = RequestRecord(index, hang_up, sent=time.perf_counter() - t0)
    start = last = time.perf_counter()
    want = body.get("max_tokens")
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = f"error in the stream: {chunk['error']}"
                    return rec
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    now = time.perf_counter()
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itls.append(now - last)
                    last = now
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                if hang_up and rec.ttft is not None:
                    return rec  # leaving `async with` closes the connection mid-stream
    except Exception as exc:  # a refused or broken connection, a timeout, bad JSON: a failed request
        rec.error = f"{type(exc).__name__}: {exc}"
        return rec
    finally:
        rec.end = time.perf_counter() - t0
    if rec.finish_reason is None:
        rec.error = "the stream ended without a finish reason"
    elif want is not None and body.get("ignore_eos") and rec.output_tokens != want:
        rec.error = f"{rec.output_tokens} output tokens, {want} asked for"
    else:
        rec.ok = True
    return rec


async def _run(url: str, bodies: Sequence[dict], gaps: Sequence[float], hang_ups: Sequence[bool], rate: float,
               max_concurrency: int, request_timeout: float, run_timeout: float, scrape_s: float) -> LoadResult:  # fmt: skip
    import httpx

    slots = asyncio.Semaphore(max_concurrency)
    usage: list[tuple[float, float]] = []
    t0 = time.perf_counter()

    async def scraper() -> None:
        while True:
            try:
                u = kv_usage(await asyncio.to_thread(scrape_metrics, url))
                if u is not None:
                    usage.append((round(time.perf_counter() - t0, 3), u))
            except OSError:
                pass
            await asyncio.sleep(scrape_s)

    async def client(i: int, c: Any) -> RequestRecord:
        async with slots:
            return await _one(c, url, {**bodies[i], "stream": True}, i, hang_ups[i], t0, request_timeout)

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as c:
        watching = asyncio.create_task(scraper()) if scrape_s > 0 else None
        tasks = []
        try:
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(client(i, c)))
            records = await asyncio.wait_for(asyncio.gather(*tasks), run_timeout)
        finally:
            for t in tasks:
                t.cancel()
            if watching is not None:
                watching.cancel()
    return LoadResult(rate, list(records), max((r.end for r in records), default=0.0), usage)


def run_load(
    url: str,
    bodies: Sequence[dict],
    rate: float,
    max_concurrency: int = 32,
    hang_up: float = 0.0,
    seed: int = 0,
    request_timeout: float = 300.0,
    run_timeout: float = 900.0,
    scrape_s: float = 0.5,
) -> LoadResult:
    """Send ``bodies`` (``/v1/completions`` request bodies; ``stream`` is set) to the server at ``url`` at
    ``rate`` requests/s (Poisson; ``math.inf``: all at once) from at most ``max_concurrency`` clients; a share
    ``hang_up`` of them (chosen with ``seed``) closes its stream after the first token. Bounded in time."""
    if not bodies:
        raise ValueError("run_load needs at least one request body")
    if not (rate > 0) or max_concurrency < 1 or not 0 <= hang_up < 1:
        raise ValueError(
            f"need rate > 0, max_concurrency >= 1 and 0 <= hang_up < 1; got {rate}, {max_concurrency}, {hang_up}"
        )
    rng = random.Random(seed + 1)
    hang_ups = [rng.random() < hang_up for _ in bodies]
    coro = _run(url.rstrip("/"), bodies, poisson_gaps(len(bodies), rate, seed), hang_ups, rate,
                max_concurrency, request_timeout, run_timeout, scrape_s)  # fmt: skip
    with ThreadPoolExecutor(1, thread_name_prefix="minipaged-load") as pool:  # a loop of its own (notebooks)
        return pool.submit(asyncio.run, coro).result()
