"""Contiguous KV reservation, the allocator PagedAttention replaced, and a trace simulator for both.

Before paging, each request got one contiguous run of token slots in a fixed
arena, sized for the worst case because its output length is unknown when it
is admitted. The PagedAttention paper (Kwon et al., SOSP 2023, section 3.1 and
Fig. 3) names three ways such an arena wastes memory, and the simulator measures
each of them separately::

    arena (token slots):
    |AAAA++++++......|BB......|          |CCCCCC..........|   |
     ^live ^reserved for   ^never  ^free hole         ^free hole (too small for D)
           tokens still    used
           to come
     A reserved max_model_len, holds 4 tokens and will end with 10:
       the 6 slots it will still fill are the *reservation* (future tokens);
       the slots past its final length are *internal fragmentation* (never used);
     the two holes add up to enough for D but neither is big enough: *external fragmentation*.

A snapshot of the arena cannot tell the first two apart: only the request's final
length (known once it finishes) says where its reservation ends and its internal
fragmentation begins. ``internal_waste`` is the two together, "reserved but empty".

``ContiguousAllocator`` is a real first-fit allocator over such an arena: a
sorted list of free extents, holes reused first-fit, neighbours coalesced on
free. (The paper's contiguous baselines use a buddy allocator instead; first fit
is simpler to read and fragments the same way.) ``simulate_trace`` replays a
``workloads.Trace`` step by step on it, or on a paged pool
(``block_pool.BlockPool``) of the same size, and records per step live tokens,
the reservation, internal fragmentation, external fragmentation, utilisation and
refusals.

Scheduling is the same for both, so only the allocator differs: FCFS, a
request is admitted when the allocator has room for it, and admission stops at
the first request that does not fit (no overtaking). Every running request adds
one token per step; a request with ``output_len`` tokens finishes after
``output_len`` steps and frees its memory. The paged side allocates a block when
a request's last block is full and, when the pool runs dry, preempts the most
recently admitted request (its blocks are freed; it resumes later by
recomputing its KV, as vLLM's recompute preemption does).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.block_pool import BlockPool, KVCacheBlock
from ..utils import cdiv, check_int
from .workloads import STATIC_VS_PAGED_BYTES_PER_TOKEN, Trace, TraceRequest, sharegpt_like_trace


class ContiguousAllocator:
    """First-fit allocation of contiguous token-slot extents in an arena of ``num_slots`` slots.

    Free space is a list of ``(start, length)`` extents sorted by start. ``allocate``
    takes the first extent long enough (first fit) and leaves the rest of it as a
    smaller hole; ``free`` puts the extent back and merges it with free
    neighbours, so two adjacent holes never stay split::

        free [(0,4), (10,6)] + free(4..9)  ->  [(0,16)]
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_int("num_slots", num_slots, 1)
        self.free_extents: list[tuple[int, int]] = [(0, num_slots)]
        self.reservations: dict[str, tuple[int, int]] = {}  # request id -> (start, length)

    def allocate(self, request_id: str, size: int) -> int | None:
        """Reserve ``size`` contiguous slots; return the start, or ``None`` if no hole is big enough."""
        check_int("size", size, 1)
        if request_id in self.reservations:
            raise ValueError(f"request {request_id!r} already holds a reservation")
        for i, (start, length) in enumerate(self.free_extents):
            if length >= size:
                if length == size:
                    del self.free_extents[i]
                else:
                    self.free_extents[i] = (start + size, length - size)
                self.reservations[request_id] = (start, size)
                return start
        return None

    def free(self, request_id: str) -> None:
        """Release a reservation and coalesce it with the free extents on either side."""
        if request_id not in self.reservations:
            raise ValueError(f"request {request_id!r} holds no reservation")
        start, length = self.reservations.pop(request_id)
        i = bisect.bisect_left(self.free_extents, (start, 0))
        if i < len(self.free_extents) and self.free_extents[i][0] == start + length:  # merge right
            length += self.free_extents.pop(i)[1]
        if i > 0 and sum(self.free_extents[i - 1]) == start:  # merge left
            start, prev_len = self.free_extents.pop(i - 1)
            length += prev_len
            i -= 1
        self.free_extents.insert(i, (start, length))

    @property
    def num_free_slots(self) -> int:
        return sum(length for _, length in self.free_extents)

    @property
    def num_reserved_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    @property
    def largest_free_extent(self) -> int:
        return max((length for _, length in self.free_extents), default=0)

    def unusable_free_slots(self, size: int) -> int:
        """Free slots in holes shorter than ``size``: external fragmentation for a ``size`` request."""
        return sum(length for _, length in self.free_extents if length < size)


def reservation_size(request: TraceRequest, policy: str, max_model_len: int) -> int:
    """Slots a contiguous system reserves for ``request``: its prompt, plus room for its output.

    * ``"max"``: ``max_model_len``, the only safe choice when the output length is unknown;
    * ``"pow2"``: the prompt plus the output length rounded up to a power of two (25 output
      tokens reserve 32), as if the output length were known to within 2x; at most ``max_model_len``;
    * ``"exact"``: the prompt plus exactly the output length, an oracle no real system has.

    These are the reservation rules of the PagedAttention paper's three contiguous baselines
    (section 6.1: Orca (Max), Orca (Pow2) and Orca (Oracle)).
    """
    if policy == "max":
        return max_model_len
    if policy == "pow2":
        return min(request.prompt_len + (1 << (request.output_len - 1).bit_length()), max_model_len)
    if policy == "exact":
        return request.total_len
    raise ValueError(f"unknown reservation policy {policy!r}: use 'max', 'pow2' or 'exact'")


@dataclass
class TraceResult:
    """Per-step measurements of one allocator replaying one trace (all arrays indexed by step).

    Every allocated slot either holds a token (``live_tokens``) or not (``internal_waste``), and the
    empty ones split the way the PagedAttention paper (section 3.1, Fig. 2) splits them::

        allocated_slots = live_tokens + internal_waste
        internal_waste  = reservation + internal_fragmentation
        num_slots       = allocated_slots + free_slots,   external_waste <= free_slots
    """

    allocator: str
    num_slots: int
    step: np.ndarray
    live_tokens: np.ndarray  # tokens actually held by running requests
    allocated_slots: np.ndarray  # slots reserved (contiguous) or in allocated blocks (paged)
    internal_waste: np.ndarray  # allocated but not (yet) holding a token: reservation + internal fragmentation
    external_waste: np.ndarray  # free, but in holes too small for the request waiting at the head
    num_running: np.ndarray
    num_waiting: np.ndarray
    refused: np.ndarray  # 1 where the head of the queue was refused for lack of room
    refused_fragmented: np.ndarray  # ... although the free slots in total would have been enough
    admit_step: dict[str, int] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    # The two parts of internal_waste, which only the requests' final lengths tell apart:
    reservation: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """allocated slots a running request will still fill before it finishes (its future tokens)"""
    internal_fragmentation: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """allocated slots past the request's final length: they will never hold a token"""

    @property
    def free_slots(self) -> np.ndarray:
        return self.num_slots - self.allocated_slots

    @property
    def utilisation(self) -> np.ndarray:
        """Live tokens / arena slots: the share of the KV memory holding real K/V."""
        return self.live_tokens / self.num_slots

    def summary(self, saturated_only: bool = True) -> dict[str, float]:
        """Time averages; by default over the steps where a request was waiting (memory was the limit),
        or over all steps if none was. Shares of the arena: ``utilisation`` (token states),
        ``reservation``, ``internal_fragmentation`` (the two add up to ``internal_waste``),
        ``external_waste`` and ``free`` (all free slots, external fragmentation included)."""
        mask = self.num_waiting > 0 if saturated_only else np.ones_like(self.step, dtype=bool)
        if not mask.any():
            mask = np.ones_like(self.step, dtype=bool)
        per = lambda a: float(np.mean(a[mask]) / self.num_slots)
        return {
            "steps": int(self.step[-1] + 1) if len(self.step) else 0,
            "utilisation": per(self.live_tokens),
            "reservation": per(self.reservation),
            "internal_fragmentation": per(self.internal_fragmentation),
            "internal_waste": per(self.internal_waste),
            "external_waste": per(self.external_waste),
            "free": per(self.free_slots),
            "mean_running": float(np.mean(self.num_running[mask])),
            "refusals": int(self.refused.sum()),
            "refusals_fragmented": int(self.refused_fragmented.sum()),
            "preemptions": self.num_preemptions,
        }


class _Contiguous:
    def __init__(self, num_slots: int, policy: str, max_model_len: int) -> None:
        self.alloc = ContiguousAllocator(num_slots)
        self.policy, self.max_model_len = policy, max_model_len

    def size(self, r: TraceRequest) -> int:
        return reservation_size(r, self.policy, self.max_model_len)

    def admit(self, r: TraceRequest, context_len: int) -> bool:
        return self.alloc.allocate(r.req_id, self.size(r)) is not None

    def grow(self, r: TraceRequest, context_len: int) -> bool:
        return True  # the reservation already covers the whole request

    def release(self, r: TraceRequest) -> None:
        self.alloc.free(r.req_id)

    def allocated(self) -> int:
        return self.alloc.num_reserved_slots

    def held(self, r: TraceRequest) -> int:
        return self.alloc.reservations[r.req_id][1]

    def external(self, waiting_head: TraceRequest | None) -> int:
        return self.alloc.unusable_free_slots(self.size(waiting_head)) if waiting_head else 0

    def total_free_fits(self, r: TraceRequest) -> bool:
        return self.alloc.num_free_slots >= self.size(r)


class _Paged:
    """The paged side of chapter 02's comparison: the real ``BlockPool``, with admission and growth written
    here rather than through ``KVCacheManager`` and ``Scheduler``, on purpose.

    Chapter 02 compares two *allocators* on one trace, so everything else must be the same on both sides: one
    step rule (every running request grows by one token, FCFS admission, the newest preempted first), applied
    by ``simulate_trace`` to both. The real scheduler brings its own step rule (a token budget, chunked
    prefill, ``max_num_seqs``, prefix caching) that the contiguous arena has no counterpart for, and it needs
    requests with token ids where a trace has only lengths. What is shared is what the comparison is about:
    blocks from the real pool, and the watermark rule of ``KVCacheManager`` (new admissions only).
    """

    def __init__(self, num_slots: int, block_size: int, watermark: float) -> None:
        self.block_size = block_size
        # Same number of token slots as the contiguous arena, plus the null block.
        self.pool = BlockPool(num_slots // block_size + 1, enable_caching=False)
        self.blocks: dict[str, list[KVCacheBlock]] = {}
        self.watermark_blocks = int(watermark * self.pool.num_blocks)  # as KVCacheManager does

    def admit(self, r: TraceRequest, context_len: int) -> bool:
        need = cdiv(context_len, self.block_size)
        if need + self.watermark_blocks > self.pool.get_num_free_blocks():
            return False
        self.blocks[r.req_id] = self.pool.get_new_blocks(need)
        return True

    def grow(self, r: TraceRequest, context_len: int) -> bool:
        held = self.blocks[r.req_id]
        need = cdiv(context_len, self.block_size) - len(held)
        if need > self.pool.get_num_free_blocks():
            return False
        held.extend(self.pool.get_new_blocks(max(need, 0)))
        return True

    def release(self, r: TraceRequest) -> None:
        self.pool.free_blocks(reversed(self.blocks.pop(r.req_id)))

    def allocated(self) -> int:
        return (self.pool.num_blocks - 1 - self.pool.get_num_free_blocks()) * self.block_size

    def held(self, r: TraceRequest) -> int:
        return len(self.blocks[r.req_id]) * self.block_size

    def external(self, waiting_head: TraceRequest | None) -> int:
        return 0  # any free block fits any request

    def total_free_fits(self, r: TraceRequest) -> bool:
        return False  # a paged refusal is never fragmentation


def simulate_trace(
    trace: Trace,
    num_slots: int,
    allocator: str = "contiguous",
    max_model_len: int = 2048,
    policy: str = "max",
    block_size: int = 16,
    watermark: float = 0.01,
    max_steps: int = 1_000_000,
) -> TraceResult:
    """Replay ``trace`` on a ``num_slots``-slot arena with ``allocator`` = ``"contiguous"`` or ``"paged"``.

    Each step: arrivals join the queue; queued requests are admitted FCFS while
    they fit (paged: leaving ``watermark`` of the pool free, as ``KVCacheManager``
    does); every running request generates one token (paged: may take a new
    block, or preempt); the step is measured; finished requests free their memory.
    Steps with nothing running and nothing queued are skipped.
    """
    if trace.max_total_len > max_model_len:
        raise ValueError(f"the trace has a request of {trace.max_total_len} tokens > max_model_len={max_model_len}")
    backend: _Contiguous | _Paged
    if allocator == "contiguous":
        backend = arena = _Contiguous(num_slots, policy, max_model_len)
        biggest = max((arena.size(r) for r in trace), default=0)
        capacity = num_slots
    elif allocator == "paged":
        check_int("block_size", block_size, 1)
        backend = paged = _Paged(num_slots, block_size, watermark)
        biggest = cdiv(trace.max_total_len, block_size) * block_size
        capacity = (paged.pool.num_blocks - 1) * block_size
    else:
        raise ValueError(f"allocator must be 'contiguous' or 'paged', got {allocator!r}")
    if biggest > capacity:
        raise ValueError(f"a request needs {biggest} slots but the arena holds {capacity}: it could never run")

    pending = deque(trace.requests)
    waiting: deque[TraceRequest] = deque()
    running: dict[str, list] = {}  # req_id -> [request, tokens generated so far]; insertion = admission order
    generated: dict[str, int] = {}  # survives preemption: outputs are kept, their KV is recomputed
    rows: list[tuple[int, ...]] = []
    empty = np.zeros(0, dtype=np.int64)
    res = TraceResult(allocator, num_slots, empty, empty, empty, empty, empty, empty, empty, empty, empty)
    t = 0
    while pending or waiting or running:
        if not running and not waiting and pending[0].arrival > t:
            t = pending[0].arrival  # idle: jump to the next arrival
        while pending and pending[0].arrival <= t:
            waiting.append(pending.popleft())
        refused = refused_frag = 0
        while waiting:
            r = waiting[0]
            done = generated.get(r.req_id, 0)
            if not backend.admit(r, r.context_len(done + 1)):
                refused = 1
                refused_frag = int(backend.total_free_fits(r))
                break
            waiting.popleft()
            running[r.req_id] = [r, done]
            res.admit_step.setdefault(r.req_id, t)
        for rid in list(running):
            if rid not in running:
                continue  # preempted earlier in this step
            entry = running[rid]
            r = entry[0]
            while not backend.grow(r, r.context_len(entry[1] + 1)):
                victim_id = next(reversed(running))  # the most recently admitted request
                victim = running.pop(victim_id)[0]
                backend.release(victim)
                waiting.appendleft(victim)
                res.num_preemptions += 1
                if victim_id == rid:
                    break
            if rid in running:
                entry[1] += 1
                generated[rid] = entry[1]
        live = future = never = 0
        for r, done in running.values():
            held, now = backend.held(r), r.context_len(done)
            live += now
            future += min(held, r.total_len) - now  # slots it will still fill: the reservation
            never += max(held - r.total_len, 0)  # slots past its final length: internal fragmentation
        allocated = backend.allocated()
        rows.append(
            (
                t,
                live,
                allocated,
                allocated - live,
                backend.external(waiting[0] if waiting else None),
                len(running),
                len(waiting),
                refused,
                refused_frag,
                future,
                never,
            )
        )
        for rid in [rid for rid, e in running.items() if e[1] >= e[0].output_len]:
            backend.release(running.pop(rid)[0])
            res.finish_step[rid] = t + 1
        t += 1
        if len(rows) > max_steps:
            raise RuntimeError(f"trace did not finish in {max_steps} steps")
    cols = np.array(rows, dtype=np.int64).reshape(-1, 11).T
    (
        res.step,
        res.live_tokens,
        res.allocated_slots,
        res.internal_waste,
        res.external_waste,
        res.num_running,
        res.num_waiting,
        res.refused,
        res.refused_fragmented,
        res.reservation,
        res.internal_fragmentation,
    ) = cols
    return res


def compare_on_trace(
    trace: Trace, num_slots: int, max_model_len: int = 2048, policy: str = "max", block_size: int = 16
) -> tuple[TraceResult, TraceResult]:
    """The same trace on a contiguous arena and on a paged pool of the same size."""
    return (
        simulate_trace(trace, num_slots, "contiguous", max_model_len, policy),
        simulate_trace(trace, num_slots, "paged", max_model_len, block_size=block_size),
    )


# ---- the paper's Fig. 2: where the KV memory of a contiguous system goes ---------------------
# The PagedAttention paper (Kwon et al., SOSP 2023) measures, for OPT-13B on one 40 GB A100 serving
# ShareGPT (its section 6.2), how much of the KV cache holds token states in its three contiguous
# baselines and in vLLM: 20.4-38.2 % against 96.3 % (section 1 and Fig. 2). Its Fig. 2 splits the
# rest three ways (section 3.1). The numbers printed on the bars, in % of the KV cache; the vLLM
# bar prints only its token states (its other 3.7 % is not broken down, ``None`` here):
PAPER_FIG2_CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_and_other")
PAPER_FIG2 = {
    "Orca (Max)": (20.4, 13.3, 57.3, 8.9),
    "Orca (Pow2)": (26.8, 17.9, 13.6, 41.6),
    "Orca (Oracle)": (38.2, 25.2, 0.0, 36.6),
    "vLLM": (96.3, None, None, None),
}
PAPER_BASELINE_OF = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "exact": "Orca (Oracle)", "paged": "vLLM"}

# The same experiment here: 1000 ShareGPT-like requests (seed 0), max_model_len 2048, all queued at
# step 0 so the arena stays full, in the paper's own arena: OPT-13B's 15.7K KV slots on that GPU
# (its Table 1: 12 GB of KV cache at 800 KB per token; 12 GiB / 800 KiB = 15,728 slots).
# Shares are averaged over the steps where a request waits (memory is the limit).
BAND_NUM_REQUESTS = 1000
BAND_SEED = 0
BAND_MAX_MODEL_LEN = 2048
BAND_NUM_SLOTS = 15_728


def contiguous_utilisation_band(
    num_requests: int = BAND_NUM_REQUESTS,
    seed: int = BAND_SEED,
    max_model_len: int = BAND_MAX_MODEL_LEN,
    num_slots: int = BAND_NUM_SLOTS,
    policies: tuple[str, ...] = ("max", "pow2", "exact"),
    block_size: int = 16,
) -> dict[str, dict[str, float]]:
    """Saturated-arena shares of each contiguous reservation policy, and of paging, on one trace.

    Each value is ``TraceResult.summary()``. With the defaults (the paper's Fig. 2 setting, see
    ``BAND_NUM_SLOTS``), in % of the arena, beside the paper's bars::

        policy   token states  reservation  internal frag.  free (external & other)   paper's bar
        max          20.1         13.7          57.4              8.9                  20.4 13.3 57.3  8.9
        pow2         37.7         25.8          19.9             16.6                  26.8 17.9 13.6 41.6
        exact        50.4         34.5           0.0             15.1                  38.2 25.2  0.0 36.6
        paged        97.1          1.6           0.0              1.3                  96.3 (rest not split)

    ``max`` reproduces the paper's Orca (Max) bar within half a point in every category. ``pow2``
    and ``exact`` keep more of the arena busy than the paper's Orca (Pow2) and Orca (Oracle): the
    paper's baselines place reservations with a buddy allocator, ours with first fit, and the paper's
    extra loss sits entirely in the last category. Other random seeds (1-3) move each figure by about one point.
    """
    trace = sharegpt_like_trace(num_requests, seed=seed, max_model_len=max_model_len)
    out = {p: simulate_trace(trace, num_slots, "contiguous", max_model_len, p).summary() for p in policies}
    out["paged"] = simulate_trace(trace, num_slots, "paged", max_model_len, block_size=block_size).summary()
    return out


def waste_breakdown(band: dict[str, dict[str, float]]) -> dict[str, tuple[float, float, float, float]]:
    """``contiguous_utilisation_band``'s result as the paper's four categories, in % of the arena.

    ``(token states, reservation, internal fragmentation, free)``: the four add up to 100. The
    paper's last category is "external fragmentation & others"; here it is every free slot (the
    holes too small for the waiting request are ``external_waste``, a part of them).
    """
    return {
        name: (100 * s["utilisation"], 100 * s["reservation"], 100 * s["internal_fragmentation"], 100 * s["free"])
        for name, s in band.items()
    }


# ---- one request over time, and the block size -----------------------------------------------
def memory_vs_generated_tokens(
    max_model_len: int = 8192,
    block_size: int = 16,
    prompt_len: int = 0,
    bytes_per_token: int = STATIC_VS_PAGED_BYTES_PER_TOKEN,
    num_points: int | None = None,
) -> dict[str, np.ndarray]:
    """KV bytes one request holds as it generates, contiguous vs paged.

    Contiguous is flat at ``max_model_len`` from the first token; paged climbs in
    steps of one block and never wastes more than ``block_size - 1`` slots::

        bytes |______________________________ contiguous (max_model_len)
              |                         _|
              |                 ___|‾‾‾        paged (whole blocks)
              |________|‾‾‾‾‾‾‾
              +--------------------------------- generated tokens
    """
    if prompt_len < 0 or prompt_len >= max_model_len:
        raise ValueError(f"prompt_len must be in [0, max_model_len), got {prompt_len}")
    n = max_model_len - prompt_len
    gen = np.arange(1, n + 1) if num_points is None else np.unique(np.linspace(1, n, num_points).astype(np.int64))
    tokens = prompt_len + gen
    paged_slots = -(-tokens // block_size) * block_size  # cdiv, element by element
    return {
        "generated_tokens": gen,
        "context_tokens": tokens,
        "contiguous_bytes": np.full_like(tokens, max_model_len * bytes_per_token),
        "paged_bytes": paged_slots * bytes_per_token,
        "live_bytes": tokens * bytes_per_token,
    }


def block_size_tradeoff(
    lengths: np.ndarray | list[int],
    block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
    bytes_per_entry: int = 4,
) -> list[dict[str, float]]:
    """For each block size: tail waste (tokens and % of allocated slots) and block-table size.

    Small blocks waste little (under one block per request, ``(block_size - 1) / 2``
    on average) but need long block tables; big blocks the reverse::

        block_size   waste / request   table entries / request
              1            0              len
             16          ~7.5             len / 16
            256         ~127.5            len / 256
    """
    x = np.asarray(lengths, dtype=np.int64)
    if x.size == 0 or np.any(x <= 0):
        raise ValueError("lengths must be a non-empty list of positive token counts")
    rows = []
    for bs in block_sizes:
        check_int("block size", bs, 1)
        blocks = -(-x // bs)  # x is a numpy array here: cdiv vectorised
        allocated = blocks * bs
        waste = allocated - x
        rows.append(
            {
                "block_size": int(bs),
                "mean_waste_tokens": float(waste.mean()),
                "max_waste_tokens": int(waste.max()),
                "waste_pct": 100.0 * float(waste.sum() / allocated.sum()),
                "mean_table_entries": float(blocks.mean()),
                "max_table_entries": int(blocks.max()),
                "mean_table_bytes": float(blocks.mean() * bytes_per_entry),
            }
        )
    return rows


def contiguous_layouts(
    trace: Trace, result: TraceResult, max_model_len: int, policy: str = "max"
) -> list[dict[str, Any]]:
    """The arena after each measured step of ``result`` (a contiguous run of ``simulate_trace``).

    ``simulate_trace`` records totals only; this replays its admissions and
    departures on a fresh ``ContiguousAllocator``: at step ``t`` the requests
    finished earlier are freed, then those admitted at ``t`` allocate in FCFS
    (trace) order. First fit is deterministic, so the replay lands every
    reservation where the simulation put it. One dict per row of ``result``::

        {"step": t, "reservations": [(req_id, start, length, live_tokens), ...],
         "free_extents": [(start, length), ...], "waiting_head": req_id or None}
    """
    if result.allocator != "contiguous":
        raise ValueError("contiguous_layouts replays a contiguous run, not a paged one")
    by_id = {r.req_id: r for r in trace.requests}
    order = {r.req_id: i for i, r in enumerate(trace.requests)}
    admits: dict[int, list[str]] = {}
    for rid, t in result.admit_step.items():
        admits.setdefault(t, []).append(rid)
    alloc = ContiguousAllocator(result.num_slots)
    held: dict[str, int] = {}  # request id -> admission step
    out = []
    for t in (int(x) for x in result.step):
        for rid in [rid for rid in held if result.finish_step.get(rid, t + 1) <= t]:
            alloc.free(rid)
            del held[rid]
        for rid in sorted(admits.get(t, []), key=order.__getitem__):
            if alloc.allocate(rid, reservation_size(by_id[rid], policy, max_model_len)) is None:
                raise RuntimeError(f"replay diverged from the simulation at step {t}: {rid} does not fit")
            held[rid] = t
        reservations = sorted(
            ((rid, *alloc.reservations[rid], by_id[rid].context_len(t - a + 1)) for rid, a in held.items()),
            key=lambda x: x[1],
        )
        head = next(
            (r.req_id for r in trace.requests if r.arrival <= t and result.admit_step.get(r.req_id, t + 1) > t), None
        )
        out.append(dict(step=t, reservations=reservations, free_extents=list(alloc.free_extents), waiting_head=head))
    return out
