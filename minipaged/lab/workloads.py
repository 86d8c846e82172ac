"""Seeded request-length distributions and arrival traces for the fragmentation lab (chapter 02).

Why distributions matter: a contiguous allocator reserves for the *longest*
request it might see, while real traffic is dominated by *short* ones. How much
memory that wastes depends entirely on the shape of the length distribution, so
every figure in chapter 02 starts from one of these:

* ``lognormal_lengths``: most requests short, a long right tail (clipped);
* ``chat_mix_lengths``: the chat mix of "Inference at scale" (section 23.1), 50 / 30 / 15 / 5 %
  of requests in 100-1k / 1k-5k / 5k-20k / 20k-100k tokens;
* ``sharegpt_like_pairs``: (prompt, output) pairs shaped like ShareGPT
  conversations, with a total that fits ``max_model_len``.

A ``Trace`` adds time: each request arrives at a step, then generates one token
per step until it has ``output_len`` of them (tokens held after each step)::

    step:            0     1     2     3     4
    r0 (p=3, o=4)   [4]   [5]   [6]   [7]   finished, freed
    r1 (p=2, o=2)         [3]   [4]   finished, freed

All randomness goes through ``numpy.random.Generator(PCG64(seed))``: same seed,
same numbers, on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..utils import check_int

# ---- static vs paged for 100 lognormal requests ---------------------------------------------
# The experiment of "Inference at scale", section 23.1 "KV cache + PagedAttention" (its C program
# kv_cache.c): 100 concurrent requests with lognormal context lengths, each either reserving
# MAX_CONTEXT slots (static) or holding 16-token blocks (paged). The text prints totals but not its
# model constants; they follow from its own output:
#   used   2.53 GB  / 19269 tokens        = 131 072 B/token = 2 x 32 layers x 8 KV heads x 128 x 2 B
#   static 107.37 GB / (100 x 131 072 B)  = 8192 tokens of MAX_CONTEXT
# i.e. a Llama-3-8B-shaped model in fp16, 16-token blocks.
STATIC_VS_PAGED_NUM_LAYERS = 32
STATIC_VS_PAGED_NUM_KV_HEADS = 8
STATIC_VS_PAGED_HEAD_DIM = 128
STATIC_VS_PAGED_DTYPE_BYTES = 2
STATIC_VS_PAGED_BYTES_PER_TOKEN = (
    2
    * STATIC_VS_PAGED_NUM_LAYERS
    * STATIC_VS_PAGED_NUM_KV_HEADS
    * STATIC_VS_PAGED_HEAD_DIM
    * STATIC_VS_PAGED_DTYPE_BYTES
)
STATIC_VS_PAGED_MAX_CONTEXT = 8192
STATIC_VS_PAGED_BLOCK_SIZE = 16
STATIC_VS_PAGED_NUM_REQUESTS = 100
STATIC_VS_PAGED_MIN_CONTEXT = 16  # the C program clamps each draw to [16, MAX_CONTEXT]
# Its C rand() draws cannot be replayed with numpy. We use a lognormal with the printed mean
# (193 tokens) and sigma 0.55, which puts +-2.5 sigma (the typical extremes of 100 draws) at ~40
# and ~650 tokens, like its printed 34 and 631. The generator seed was picked among 0..4999 as the
# draw whose min/mean/max/blocks come closest to the printed ones: those are one draw of a random
# program too.
STATIC_VS_PAGED_LOGNORMAL_MEAN = 193.0
STATIC_VS_PAGED_LOGNORMAL_SIGMA = 0.55
STATIC_VS_PAGED_RNG_SEED = 292
# What the program printed, as "Inference at scale" section 23.1 shows it, for side-by-side tables.
STATIC_VS_PAGED_PRINTED = {
    "min": 34,
    "mean": 193,
    "max": 631,
    "total_tokens": 19269,
    "static_allocated_gb": 107.37,
    "static_used_gb": 2.53,
    "static_utilisation_pct": 2.4,
    "paged_blocks": 1253,
    "paged_allocated_gb": 2.63,
    "paged_utilisation_pct": 96.1,
    "saved_gb": 104.75,
    "ratio": 40.9,
}

# ---- a chat mix: (fraction of requests, shortest, longest) in tokens ------------------------
# The length mix "Inference at scale" (section 23.1) gives for chat workloads.
CHAT_MIX: tuple[tuple[float, int, int], ...] = (
    (0.50, 100, 1_000),
    (0.30, 1_000, 5_000),
    (0.15, 5_000, 20_000),
    (0.05, 20_000, 100_000),
)

# ShareGPT-like shape: long-tailed lognormals whose means *after* dropping pairs longer than
# 2048 tokens come out near what the vLLM paper reports for ShareGPT (about 161 prompt and
# 338 output tokens; these parameters give about 161 and 330).
SHAREGPT_PROMPT_MEAN, SHAREGPT_PROMPT_SIGMA = 170.0, 1.0
SHAREGPT_OUTPUT_MEAN, SHAREGPT_OUTPUT_SIGMA = 360.0, 0.9
SHAREGPT_MIN_LEN = 4  # vLLM's benchmark drops prompts and outputs shorter than 4 tokens


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check_n(n: int) -> int:
    return check_int("n", n, 0)


def lognormal_lengths(
    n: int,
    *,
    mean: float | None = None,
    median: float | None = None,
    sigma: float = 0.55,
    lo: int = 1,
    hi: int | None = None,
    seed: int | np.random.Generator = 0,
) -> np.ndarray:
    """``n`` integer lengths, lognormal, rounded and clipped to ``[lo, hi]``.

    Give exactly one of ``mean`` or ``median`` (of the unclipped distribution):
    ``median = exp(mu)`` and ``mean = exp(mu + sigma**2 / 2)``. Clipping moves the
    sample mean a little when the bounds bite.
    """
    n = _check_n(n)
    if (mean is None) == (median is None):
        raise ValueError("give exactly one of mean= or median=")
    centre = mean if mean is not None else median
    if centre is None or centre <= 0 or sigma < 0:
        raise ValueError(f"need a positive mean/median and sigma >= 0, got {centre!r}, {sigma!r}")
    if hi is not None and hi < lo:
        raise ValueError(f"hi ({hi}) must be >= lo ({lo})")
    mu = math.log(centre) - (sigma**2 / 2 if mean is not None else 0.0)
    x = np.rint(_rng(seed).lognormal(mu, sigma, n))
    return np.clip(x, lo, hi if hi is not None else np.inf).astype(np.int64)


def chat_mix_lengths(
    n: int, seed: int | np.random.Generator = 0, mix: tuple[tuple[float, int, int], ...] = CHAT_MIX
) -> np.ndarray:
    """``n`` lengths from the chat mix: pick a bucket by its share, then a length log-uniformly inside it.

    Log-uniform inside a bucket keeps the skew the mix describes (a 1k-5k request
    is more often near 1k than near 5k).
    """
    n = _check_n(n)
    shares = np.array([m[0] for m in mix], dtype=float)
    if np.any(shares < 0) or not math.isclose(shares.sum(), 1.0, abs_tol=1e-9):
        raise ValueError(f"bucket shares must be non-negative and sum to 1, got {shares.tolist()}")
    rng = _rng(seed)
    bucket = rng.choice(len(mix), size=n, p=shares)
    lo = np.array([m[1] for m in mix], dtype=float)[bucket]
    hi = np.array([m[2] for m in mix], dtype=float)[bucket]
    x = np.exp(rng.uniform(np.log(lo), np.log(hi)))
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def sharegpt_like_pairs(
    n: int, seed: int | np.random.Generator = 0, max_model_len: int = 2048
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt_len, output_len) pairs shaped like ShareGPT, each with ``prompt + output <= max_model_len``.

    Both lengths are lognormal (prompt: mean 170, sigma 1.0; output: mean 360,
    sigma 0.9; means before filtering), at least 4 tokens. Pairs that do not fit ``max_model_len`` are
    redrawn, as vLLM's ShareGPT benchmark filters them out.
    """
    n = _check_n(n)
    if max_model_len < 2 * SHAREGPT_MIN_LEN:
        raise ValueError(f"max_model_len must be at least {2 * SHAREGPT_MIN_LEN}, got {max_model_len}")
    rng = _rng(seed)
    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    have = 0
    while have < n:
        k = max(2 * (n - have), 16)  # draw in batches; most pairs fit
        p = lognormal_lengths(k, mean=SHAREGPT_PROMPT_MEAN, sigma=SHAREGPT_PROMPT_SIGMA, lo=SHAREGPT_MIN_LEN, seed=rng)
        o = lognormal_lengths(k, mean=SHAREGPT_OUTPUT_MEAN, sigma=SHAREGPT_OUTPUT_SIGMA, lo=SHAREGPT_MIN_LEN, seed=rng)
        ok = p + o <= max_model_len
        prompts.append(p[ok])
        outputs.append(o[ok])
        have += int(ok.sum())
    return np.concatenate(prompts)[:n], np.concatenate(outputs)[:n]


def bimodal_lengths(
    n: int,
    rng: int | np.random.Generator = 0,
    long_share: float = 0.15,
    short_prompt: tuple[int, int] = (64, 400),
    long_prompt: tuple[int, int] = (1500, 3500),
    short_output: tuple[int, int] = (16, 256),
    long_output: tuple[int, int] = (16, 128),
) -> tuple[np.ndarray, np.ndarray]:
    """``(prompt_lens, output_lens)`` of ``n`` requests of two kinds: chat turns (short prompts, answers of any
    length) and, with probability ``long_share``, documents (long prompts, short answers). Each length is uniform
    in its ``[low, high)`` range. Under load the long prompts hold up the short ones behind them under first come,
    first served, which is what a scheduling policy can change (exercise 10b)."""
    n = _check_n(n)
    if not 0.0 <= long_share <= 1.0:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    for name, (lo, hi) in dict(
        short_prompt=short_prompt, long_prompt=long_prompt, short_output=short_output, long_output=long_output
    ).items():
        if not 1 <= lo < hi:
            raise ValueError(f"{name} must be a range (low, high) with 1 <= low < high, got {(lo, hi)}")
    g = _rng(rng)
    is_long = g.random(n) < long_share
    prompts = np.where(is_long, g.integers(*long_prompt, n), g.integers(*short_prompt, n))
    outputs = np.where(is_long, g.integers(*long_output, n), g.integers(*short_output, n))
    return prompts.astype(np.int64), outputs.astype(np.int64)


def generation_workload(
    n: int,
    vocab_size: int,
    seed: int = 0,
    *,
    prompt_median: float = 64,
    output_median: float = 48,
    prompt_max: int = 512,
    output_max: int = 256,
    head: Sequence[int] = (),
    tail: Sequence[int] = (),
) -> tuple[list[list[int]], list[int]]:
    """A mixed-length batch for a real engine: ``n`` prompts of random token ids and an output length each.

    Prompt lengths are lognormal (sigma 0.6, 8..``prompt_max``), output lengths lognormal
    (sigma 0.7, 4..``output_max``); token ids are uniform in ``[100, vocab_size)``. Served with
    ``ignore_eos`` every request produces exactly its output length, whatever the text says, so
    two engines given the same workload do exactly the same amount of work.

    ``head``/``tail`` wrap every prompt the way a chat template wraps a user's message (the
    system prompt before it, the assistant's turn after it), inside the same total length: what
    a chat service really receives, and what a prefix cache is for::

        [ head: <|im_start|>system ... <|im_start|>user\n | random ids | tail: <|im_end|>\n<|im_start|>assistant\n ]
    """
    rng = _rng(seed)
    prompt_lens = lognormal_lengths(n, median=prompt_median, sigma=0.6, lo=8, hi=prompt_max, seed=rng)
    output_lens = lognormal_lengths(n, median=output_median, sigma=0.7, lo=4, hi=output_max, seed=rng)
    wrap = len(head) + len(tail)
    prompts = [
        list(head) + rng.integers(100, vocab_size, max(1, int(k) - wrap)).tolist() + list(tail) for k in prompt_lens
    ]
    return prompts, [int(k) for k in output_lens]


# ---- traces --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: it arrives at ``arrival`` and wants ``output_len`` tokens after its prompt."""

    req_id: str
    arrival: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        """Tokens in its KV cache when it finishes: prompt plus all outputs."""
        return self.prompt_len + self.output_len

    def context_len(self, steps_run: int) -> int:
        """Tokens held after ``steps_run`` steps of generation (one new token per step)."""
        return self.prompt_len + min(steps_run, self.output_len)


@dataclass(frozen=True)
class TraceEvent:
    time: int
    kind: str  # "arrive" or "finish"
    req_id: str
    prompt_len: int
    output_len: int


class Trace:
    """Requests with arrival steps, sorted by arrival (ties keep their order).

    ``events()`` lists arrivals and departures for an engine with unlimited
    memory: a request arriving at step ``t`` runs steps ``t .. t + output_len - 1``
    and finishes at ``t + output_len``. A real allocator delays some requests;
    ``contiguous.simulate_trace`` reports the finish steps it actually achieves.
    """

    def __init__(self, requests: list[TraceRequest]) -> None:
        for r in requests:
            if r.arrival < 0 or r.prompt_len < 1 or r.output_len < 1:
                raise ValueError(f"bad trace request {r}: need arrival >= 0, prompt_len >= 1, output_len >= 1")
        if len({r.req_id for r in requests}) != len(requests):
            raise ValueError("request ids in a trace must be unique")
        self.requests: list[TraceRequest] = sorted(requests, key=lambda r: r.arrival)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    def finish_step(self, req_id: str) -> int:
        """Step at which ``req_id`` finishes with unlimited memory."""
        r = next(r for r in self.requests if r.req_id == req_id)
        return r.arrival + r.output_len

    def events(self) -> list[TraceEvent]:
        ev = [TraceEvent(r.arrival, "arrive", r.req_id, r.prompt_len, r.output_len) for r in self.requests]
        ev += [
            TraceEvent(r.arrival + r.output_len, "finish", r.req_id, r.prompt_len, r.output_len) for r in self.requests
        ]
        return sorted(ev, key=lambda e: (e.time, e.kind != "finish"))  # departures free memory first

    @property
    def max_total_len(self) -> int:
        return max((r.total_len for r in self.requests), default=0)


def make_trace(
    prompt_lens: np.ndarray | list[int],
    output_lens: np.ndarray | list[int],
    arrival_rate: float | None = None,
    seed: int | np.random.Generator = 0,
) -> Trace:
    """A trace from lengths. ``arrival_rate`` requests per step arrive as a Poisson process
    (exponential gaps, rounded down to whole steps); ``None`` puts every arrival at step 0."""
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"{len(prompt_lens)} prompt lengths but {len(output_lens)} output lengths")
    n = len(prompt_lens)
    if arrival_rate is None:
        arrivals = np.zeros(n, dtype=np.int64)
    else:
        if arrival_rate <= 0:
            raise ValueError(f"arrival_rate must be positive, got {arrival_rate}")
        arrivals = np.floor(np.cumsum(_rng(seed).exponential(1.0 / arrival_rate, n))).astype(np.int64)
    return Trace(
        [
            TraceRequest(f"r{i}", int(a), int(p), int(o))
            for i, (a, p, o) in enumerate(zip(arrivals, prompt_lens, output_lens))
        ]
    )


def sharegpt_like_trace(n: int, seed: int = 0, arrival_rate: float | None = None, max_model_len: int = 2048) -> Trace:
    """``n`` ShareGPT-like requests arriving at ``arrival_rate`` per step (all at once if ``None``)."""
    rng = np.random.default_rng(seed)
    p, o = sharegpt_like_pairs(n, rng, max_model_len)
    return make_trace(p, o, arrival_rate, rng)


# ---- static vs paged for 100 lognormal requests: the table ------------------------------------
def static_vs_paged_lengths(seed: int = STATIC_VS_PAGED_RNG_SEED) -> np.ndarray:
    """The 100 context lengths behind ``static_vs_paged_table``."""
    return lognormal_lengths(
        STATIC_VS_PAGED_NUM_REQUESTS,
        mean=STATIC_VS_PAGED_LOGNORMAL_MEAN,
        sigma=STATIC_VS_PAGED_LOGNORMAL_SIGMA,
        lo=STATIC_VS_PAGED_MIN_CONTEXT,
        hi=STATIC_VS_PAGED_MAX_CONTEXT,
        seed=seed,
    )


def static_vs_paged_table(
    seed: int = STATIC_VS_PAGED_RNG_SEED,
    max_context: int = STATIC_VS_PAGED_MAX_CONTEXT,
    block_size: int = STATIC_VS_PAGED_BLOCK_SIZE,
    bytes_per_token: int = STATIC_VS_PAGED_BYTES_PER_TOKEN,
) -> dict[str, float]:
    """Static (reserve ``max_context`` per request) vs paged (``block_size`` blocks) for 100 lognormal requests.

    Same keys as ``STATIC_VS_PAGED_PRINTED``, so a notebook can print ours beside the
    printed table of "Inference at scale" (section 23.1). GB are 10**9 bytes, as it prints them::

        static: 100 x max_context slots           utilisation = tokens / (100 x max_context)
        paged:  sum(ceil(len / block_size)) blocks  utilisation = tokens / (blocks x block_size)
        ratio = static slots / paged slots (how many more requests fit)
    """
    lengths = static_vs_paged_lengths(seed)
    lengths = np.minimum(lengths, max_context)
    total = int(lengths.sum())
    static_slots = len(lengths) * max_context
    blocks = int(np.sum(-(-lengths // block_size)))  # numpy array: cdiv vectorised
    paged_slots = blocks * block_size
    gb = bytes_per_token / 1e9
    return {
        "min": int(lengths.min()),
        "mean": float(lengths.mean()),
        "max": int(lengths.max()),
        "total_tokens": total,
        "static_allocated_gb": static_slots * gb,
        "static_used_gb": total * gb,
        "static_utilisation_pct": 100.0 * total / static_slots,
        "paged_blocks": blocks,
        "paged_allocated_gb": paged_slots * gb,
        "paged_utilisation_pct": 100.0 * total / paged_slots,
        "saved_gb": (static_slots - paged_slots) * gb,
        "ratio": static_slots / paged_slots,
    }
