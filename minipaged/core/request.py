"""``Request``: one prompt and the tokens generated for it, as the KV cache manager sees it.

The manager needs four things from a request: its id (the key of its block
list), its tokens (to know how many slots it needs), how many of them already
have K/V in the cache (``num_computed_tokens``), and the chained hashes of its
full blocks (to find and record prefix-cache hits)::

    all_token_ids:  [ p0 p1 ... p(n-1) | o0 o1 ... ]     prompt | output so far
                      <---- num_computed_tokens ---->      K/V already written
    block_hashes:   [ h0 ][ h1 ] ...                       one per *full* block

The hashes are kept up to date incrementally: every time tokens are appended,
only the blocks that just became full are hashed (vLLM computes them in the same
place, through a ``block_hasher`` the engine hands to each request).

Fields a scheduler needs later (sampling parameters, status, timestamps) are
added below the current ones, with defaults, so existing call sites keep working.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..sampling_params import SamplingParams
from .block_hash import BlockHash

PLACEHOLDER_TOKEN_ID = -1  # an output token still on the device (async scheduling; the runner fills it in)


class RequestStatus(enum.Enum):
    """Where a request is in its life::

    WAITING ──admit──▶ RUNNING ──EOS / max_tokens / stop id──▶ FINISHED
       ▲                 │
       │ recompute       │ pool dry: preempt the newest
       └── PREEMPTED ◀───┤
                         └──▶ SWAPPED (its blocks copied to CPU) ──swap in──▶ RUNNING
    """

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A request: prompt, outputs so far, and how much of it the KV cache already holds.

    ``block_hasher`` (see ``block_pool.get_request_block_hasher``) is optional: a
    manager with prefix caching attaches its own if the request has none.
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    block_hasher: Callable[[Request], list[BlockHash]] | None = field(default=None, repr=False)
    block_hashes: list[BlockHash] = field(default_factory=list, init=False, repr=False)
    # ---- what the scheduler needs (chapter 06) ----
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop", "length", "rejected", "abort" or "error"
    error: str | None = None  # why a request was rejected or failed
    num_preemptions: int = 0
    parent_id: str | None = None  # set on the extra samples of an n > 1 request
    sample_index: int = 0  # 0, or j for the j-th extra sample of an n > 1 request (its seed offset)
    children: list[Request] = field(default_factory=list, repr=False)  # those extra samples, on the parent
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list, repr=False)  # one per output token
    finish_time: float | None = None
    # ---- speculative decoding (spec_decode.py) ----
    spec_token_ids: list[int] = field(default_factory=list, repr=False)  # drafts for the next step, not yet checked
    # ---- async scheduling (core/async_scheduler.py) ----
    # Output tokens sampled by a step still on the device: PLACEHOLDER_TOKEN_ID until the step's result comes
    # back. Only while a step is scheduled ahead of the one before it; never seen between two engine steps.
    num_output_placeholders: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = self._check_tokens("prompt_token_ids", self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must hold at least one token")
        self.output_token_ids = self._check_tokens("output_token_ids", self.output_token_ids)
        # One list for prompt + output, extended in place: block hashing slices it every step.
        self._all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        if not isinstance(self.num_computed_tokens, int) or not 0 <= self.num_computed_tokens <= self.num_tokens:
            raise ValueError(f"num_computed_tokens must be in [0, {self.num_tokens}], got {self.num_computed_tokens!r}")
        self.update_block_hashes()

    @staticmethod
    def _check_tokens(name: str, token_ids: Iterable[int]) -> list[int]:
        out = [int(t) for t in token_ids]
        if any(t < 0 for t in out):
            raise ValueError(f"{name} must be non-negative token ids")
        return out

    # ---- token views -------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read it, do not modify it: use ``append_output_token_ids``."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Its tokens and the drafts proposed for them (vLLM's name): what the next step may compute."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    # ---- growth ------------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Add sampled tokens and hash any block they complete."""
        if type(token_ids) is int and token_ids >= 0:  # one sampled token: the usual step, checked in place
            self.output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
            self.update_block_hashes()
            return
        new = self._check_tokens("output_token_ids", [token_ids] if isinstance(token_ids, int) else token_ids)
        self.output_token_ids.extend(new)
        self._all_token_ids.extend(new)
        self.update_block_hashes()

    def add_placeholder(self) -> None:
        """A token the step on the device will sample: counted, not known (and not hashed) yet."""
        self.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self._all_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.num_output_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """The sampled token came back: it replaces the placeholder (the last output), and its block is hashed."""
        if type(token_id) is not int or token_id < 0:
            (token_id,) = self._check_tokens("output_token_ids", [token_id])  # says what is wrong with it
        if self.num_output_placeholders < 1 or self.output_token_ids[-1] != PLACEHOLDER_TOKEN_ID:
            raise RuntimeError(f"request {self.request_id!r} has no placeholder token to replace")
        self.output_token_ids[-1] = self._all_token_ids[-1] = token_id
        self.num_output_placeholders -= 1
        self.update_block_hashes()

    def drop_placeholder(self) -> None:
        """The step that was to sample it failed (or the request failed in it): the placeholder goes."""
        if self.num_output_placeholders < 1 or self.output_token_ids[-1] != PLACEHOLDER_TOKEN_ID:
            raise RuntimeError(f"request {self.request_id!r} has no placeholder token to replace")
        self.output_token_ids.pop()
        self._all_token_ids.pop()
        self.num_output_placeholders -= 1

    def set_block_hasher(self, block_hasher: Callable[[Request], list[BlockHash]]) -> None:
        """Attach a hasher (and hash the blocks already full). Refuses to mix block sizes."""
        old = getattr(self.block_hasher, "block_size", None)
        new = getattr(block_hasher, "block_size", None)
        if self.block_hasher is not None and old != new:
            raise ValueError(f"request {self.request_id!r} is hashed with block_size={old}, not {new}")
        if self.block_hasher is None:
            self.block_hasher = block_hasher
            self.update_block_hashes()

    def update_block_hashes(self) -> None:
        hasher = self.block_hasher
        if hasher is None:
            return
        block_size = getattr(hasher, "block_size", None)
        if block_size is not None and len(self._all_token_ids) < (len(self.block_hashes) + 1) * block_size:
            return  # no block completed since the last hash (most steps): nothing to hash
        self.block_hashes.extend(hasher(self))

    # ---- life cycle (chapter 06) -------------------------------------------------------
    @property
    def sample_key(self) -> tuple[str, int]:
        """The name of its random stream: (the request it samples for, which sample)."""
        return (self.parent_id or self.request_id, self.sample_index)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def metrics(self) -> RequestMetrics:
        """Its times so far as a ``RequestMetrics`` (a copy: the request goes on)."""
        return RequestMetrics(
            self.request_id,
            self.arrival_time,
            self.num_prompt_tokens,
            self.sampling_params.max_tokens,
            first_token=self.first_token_time,
            finish=self.finish_time,
            token_times=list(self.token_times),
            num_preemptions=self.num_preemptions,
            rejected=self.finish_reason == "rejected",
        )


@dataclass
class RequestMetrics:
    """When things happened to one request, in seconds on the clock of whoever served it: the engine's wall
    clock (``RequestOutput.metrics``) or the simulator's (``SimResult.requests``), so one set of latency
    definitions serves both::

        arrival ── queueing ──▶ start ──▶ first_token ─ itl ─▶ token ─ itl ─▶ ... ─▶ finish (its last token)
        └────────────── ttft ──────────────┘
        └──────────────────────────────── latency ─────────────────────────────────────┘
    """

    req_id: str
    arrival: float
    prompt_len: int
    output_len: int  # the most output tokens it asked for (max_tokens)
    start: float | None = None  # when it first ran (the simulator records it)
    first_token: float | None = None
    finish: float | None = None  # its last token
    token_times: list[float] = field(default_factory=list, repr=False)  # one per output token
    num_preemptions: int = 0
    rejected: bool = False
    release: float | None = None  # static batching: when its batch ended and its memory was released

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival

    @property
    def queueing(self) -> float | None:
        return None if self.start is None else self.start - self.arrival

    @property
    def itls(self) -> np.ndarray:
        """Inter-token latencies: the gaps between consecutive output tokens."""
        return np.diff(np.asarray(self.token_times, dtype=float))

    @property
    def inter_token_latencies(self) -> list[float]:
        return self.itls.tolist()

    @property
    def mean_itl(self) -> float | None:
        return float(self.itls.mean()) if len(self.token_times) > 1 else None
