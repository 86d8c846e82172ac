"""``/metrics``: the server's figures in Prometheus' text format 0.0.4 (vLLM's ``vllm/v1/metrics/loggers.py``).

Written by hand, without ``prometheus_client``: a few gauges, counters and histograms are forty lines of text
formatting, and a dependency less. The names are vLLM's with a ``minipaged:`` prefix, so a dashboard built for
one reads the other.

Two threads touch these figures, and neither waits for the other for long::

    engine thread (after every step)                      event loop (GET /metrics)
    set_gauges(snapshot of scheduler + KV pool)  ──┐
    record_tokens / record_finished / ...          ├──▶  ServerMetrics (its own small lock)  ──▶ render()
                                                   ┘
The engine's lock is never taken here: a scrape must not wait for a step to end.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ..engine.outputs import RequestOutput

if TYPE_CHECKING:
    from ..engine.llm import LLM

# vLLM's buckets (vllm/v1/metrics/buckets.py), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
PREFIX = "minipaged:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISHED_REASONS = ("stop", "length")  # the labels of request_success_total, present from the start

# name (without the prefix), help; read from the engine thread's snapshot. Gauges first, then counters.
GAUGES = {
    "num_requests_running": "Sequences in the running batch (an n > 1 request counts each sample).",
    "num_requests_waiting": "Requests waiting to run: new, preempted for recompute, or swapped out to the CPU.",
    "kv_cache_usage_perc": "KV-cache usage as a fraction of the usable blocks (1 means full).",
    "kv_blocks_in_use": "KV blocks held by requests (the null block not counted).",
    "kv_blocks_free": "KV blocks free, cached-but-unreferenced prefix blocks included.",
    "kv_blocks_total": "Usable KV blocks in the pool (the null block not counted).",
    "prefix_cache_hit_rate": "Prompt tokens found in the prefix cache over prompt tokens looked up, so far.",
}
SNAPSHOT_COUNTERS = {
    "num_preemptions_total": "Preemptions so far (recompute or swap).",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens the prefix cache held.",
    "spec_decode_num_drafts_total": "Verification passes of speculative decoding (a request with drafts, a step).",
    "spec_decode_num_draft_tokens_total": "Draft tokens checked by speculative decoding.",
    "spec_decode_num_accepted_tokens_total": "Draft tokens the model accepted.",
}


class Histogram:
    """Observations counted into fixed buckets, plus their sum: what Prometheus calls a histogram."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1  # le is inclusive: bisect_left
        self.sum += value
        self.count += 1

    def samples(self, name: str, labels: str) -> list[str]:
        """The ``_bucket`` lines (cumulative, ``+Inf`` last, equal to ``_count``), then ``_sum`` and ``_count``."""
        lines, total = [], 0
        for le, n in zip([*map(_number, self.buckets), "+Inf"], self.counts):
            total += n
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {total}')
        return [*lines, f"{name}_sum{{{labels}}} {_number(self.sum)}", f"{name}_count{{{labels}}} {self.count}"]


class ServerMetrics:
    """Everything ``/metrics`` shows. The engine thread writes, the event loop reads; a plain lock keeps each
    write and each scrape whole (both take microseconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gauges: dict[str, float] = {name: 0 for name in (*GAUGES, *SNAPSHOT_COUNTERS)}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.aborted = 0
        self.failed = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # ---- the engine thread's side ----------------------------------------------------------------
    def set_gauges(self, snapshot: dict[str, float]) -> None:
        with self._lock:
            self.gauges.update(snapshot)

    def record_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens

    def record_finished(self, out: RequestOutput) -> None:
        """A request that ended well: one success per sample (vLLM v1 counts each sample of n > 1 as a request),
        its latencies into the histograms (the first sample's clock: the samples share their prompt)."""
        m = out.metrics
        with self._lock:
            for o in out.outputs:
                reason = o.finish_reason or "stop"
                self.success[reason] = self.success.get(reason, 0) + 1
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.inter_token_latencies:
                self.itl.observe(gap)
            if m.latency is not None:
                self.e2e.observe(m.latency)

    def record_aborted(self, n: int = 1) -> None:
        with self._lock:
            self.aborted += n

    def record_failed(self, n: int = 1) -> None:
        with self._lock:
            self.failed += n

    # ---- the event loop's side -------------------------------------------------------------------
    def render(self, model_name: str) -> str:
        """The exposition text: ``# HELP`` and ``# TYPE`` before each metric's samples, every sample labelled
        with the model's name (as vLLM labels them)."""
        label = f'model_name="{_escape(model_name)}"'
        out: list[str] = []

        def metric(name: str, kind: str, text: str, samples: Iterable[str]) -> None:
            out.extend([f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}", *samples])

        with self._lock:
            for name, text in GAUGES.items():
                metric(name, "gauge", text, [f"{PREFIX}{name}{{{label}}} {_number(self.gauges[name])}"])
            counters = {
                **{name: (text, self.gauges[name]) for name, text in SNAPSHOT_COUNTERS.items()},
                "prompt_tokens_total": ("Prompt tokens prefilled.", self.prompt_tokens),
                "generation_tokens_total": ("Tokens generated.", self.generation_tokens),
                "request_aborted_total": ("Requests aborted (the client left, or the server stopped).", self.aborted),
                "request_failed_total": (
                    "Requests that ended with an error (rejected, or a step failed).",
                    self.failed,
                ),
            }
            for name, (text, value) in counters.items():
                metric(name, "counter", text, [f"{PREFIX}{name}{{{label}}} {_number(value)}"])
            metric(
                "request_success_total",
                "counter",
                "Sequences that finished, by finish reason (stop: EOS or a stop token; length: max_tokens or max_model_len).",
                [
                    f'{PREFIX}request_success_total{{{label},finished_reason="{_escape(r)}"}} {n}'
                    for r, n in self.success.items()
                ],
            )
            for name, text, hist in (
                ("time_to_first_token_seconds", "Time to first token: arrival to the first output token.", self.ttft),
                ("inter_token_latency_seconds", "Time between consecutive output tokens of a request.", self.itl),
                ("e2e_request_latency_seconds", "Arrival to the last token, for requests that finished.", self.e2e),
            ):
                metric(name, "histogram", text, hist.samples(PREFIX + name, label))
        return "\n".join(out) + "\n"


def engine_snapshot(llm: LLM) -> dict[str, float]:
    """The gauges and the engine's own counters, read by the engine thread between steps (its lock is then
    uncontended: that thread is the only one stepping)."""
    with llm._lock:
        sched, kv = llm.scheduler, llm.kv_cache_manager
        total, free = kv.num_blocks - 1, kv.get_num_free_blocks()
        queries, hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        spec = sched.spec_decoding_stats
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting) + len(sched.swapped),
            "kv_cache_usage_perc": kv.usage,
            "kv_blocks_in_use": total - free,
            "kv_blocks_free": free,
            "kv_blocks_total": total,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_preemptions_total": sched.num_preemptions,
            "prefix_cache_queries_total": queries,
            "prefix_cache_hits_total": hits,
            "spec_decode_num_drafts_total": 0 if spec is None else spec.num_drafts,
            "spec_decode_num_draft_tokens_total": 0 if spec is None else spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": 0 if spec is None else spec.num_accepted_tokens,
        }


def _number(value: float) -> str:
    """Integers as integers, floats as Python writes them (Prometheus reads both), infinities as it spells them."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 2**53):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    """A label value as the text format wants it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
