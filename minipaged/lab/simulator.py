"""The model-free simulator: the real scheduler, a fake model, and a cost model that tells the time.

Chapters 06-08 compare scheduling policies on thousands of requests. Running a
real model for that would take hours on a laptop, and it is not needed: what a
policy decides depends only on token *counts*, not on token *values*. So the
simulator runs the package's real ``Scheduler`` and ``KVCacheManager`` with a
fake model whose output lengths are known in advance (every request has
``SamplingParams(max_tokens=L, ignore_eos=True)``) and charges each step a time
from a simple cost model::

    step time = max( (weights + KV bytes/token · tokens in context) / memory bandwidth ,   memory-bound
                     2 · params · new tokens / FLOP/s )                                    compute-bound
              + copies · latency per copy + swapped bytes / PCIe bandwidth                 swap copies

    weights read once per step, whatever the batch   →  big batches amortise them
    KV read once per token in context, per step      →  long contexts cost every step
    compute per new token                            →  prefill chunks are compute-bound
    a fixed cost per copy, then the bytes            →  many small copies waste the bus

(a roofline: a GPU overlaps memory traffic and arithmetic, so a step takes as
long as the slower of the two). Decode steps of a few requests are dominated by
reading the weights; long prefills by arithmetic. ``HARDWARE`` holds T4-, A100-,
H100-, H200- and laptop-CPU-like numbers (the GPUs' peak figures from the package's
table of GPUs, ``minipaged.gpus``, each from its datasheet).

**Pricing a swap.** A swapped block is not one transfer. vLLM v0, whose swap
mode the PagedAttention paper measured, kept one key and one value tensor per
layer and issued one ``cudaMemcpyAsync`` per block for each of them
(``swap_blocks`` in ``csrc/cache_kernels.cu``, called per layer by
``vllm/worker/cache_engine.py`` and for K and for V by the attention backend):
``2 · num_layers`` copies per block, each only ``block_size · bytes/token /
(2 · num_layers)`` bytes. Every copy pays a fixed cost before its bytes move
(the call, the DMA set-up, the bus round trip). We assume **5 µs per copy**:
the DualPath paper (Wu et al., arXiv:2602.21548, §5.2) measured 5–7 µs per
``cudaMemcpyAsync`` call on small chunks; it is an assumption here, not a
measurement of ours. With it, the cost model reproduces the shape of the paper's
§7.3 (Fig. 19): small blocks make swapping slow, because the fixed costs
outweigh the bytes; at 16–64 tokens per block the two are of the same order.
A copy engine that batches its copies (``CacheEngine`` does: one gather per
layer for K and for V) sets ``copies_per_block`` lower.

Beside it, the **static batching** baseline that continuous batching replaced:
take up to ``B`` requests in arrival order, run them as one padded batch until
its *longest* member finishes, then take the next ``B``. Its KV memory is
reserved contiguously for ``max_model_len`` tokens per request, so the same
memory caps ``B`` at ``pool tokens // max_model_len``. It runs under the same
cost model (vectorised: a batch is a rectangle, no scheduler needed)::

    static, B = 3        step:  1 2 3 4 5 6 7 8 9       continuous       1 2 3 4 5 6 7 8 9
    r0 (4 tokens)              P d d d · · · · ·        r0                P d d d
    r1 (9 tokens)              P d d d d d d d d        r1                P d d d d d d d d
    r2 (2 tokens)              P d · · · · · · ·        r2                P d
    r3 waits for the whole batch ──────────────▶        r3                    P d d   (takes r2's place)
                               · = a padded row still computed, producing nothing

Both return a ``SimResult``: per step (running, waiting, blocks in use, tokens
scheduled, preemptions) and per request (TTFT, inter-token latency, finish
time), with ``summary()`` for the headline numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import Config
from ..core.request import Request, RequestMetrics
from ..core.scheduler import Scheduler, check_invariants
from ..core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from ..engine.step import run_step
from ..gpus import GPUS
from ..kv_math import KVSpec
from ..sampling_params import SamplingParams
from ..utils import cdiv
from .workloads import Trace

if TYPE_CHECKING:
    import torch

FAKE_TOKEN = 1  # what the fake model "samples": any id will do, nobody reads it


# ---- hardware and the cost model -------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """The three rates the cost model needs (peak numbers), and the memory size."""

    name: str
    mem_bandwidth: float  # bytes/s between memory and the compute units (HBM, or DRAM on a CPU)
    flops: float  # dense 16-bit matmul FLOP/s
    swap_bandwidth: float  # bytes/s between device and host memory (PCIe), used by swap copies
    memory_bytes: float
    copy_latency: float = 5e-6  # fixed seconds per device↔host copy, before its bytes move (assumed: see above)


def gpu_hardware(key: str, copy_latency: float = 5e-6) -> Hardware:
    """A GPU of the package's table (``minipaged.gpus``) as the cost model sees it: its datasheet's peak
    bandwidth, dense 16-bit tensor-core FLOP/s, PCIe one way and the memory the device reports (``memory_mib``,
    81,559 MiB = 85.5e9 B for an "80 GB" H100; the marketed decimal GB where the table has no reported figure);
    ``copy_latency`` seconds per device↔host copy (assumed, see the module docstring)."""
    gpu = GPUS[key]
    if gpu.fp16_tflops is None or gpu.pcie_gbps is None or gpu.memory_gb is None:
        raise ValueError(f"the table of GPUs has no FLOP/s, PCIe or memory size for {gpu.name}")
    return Hardware(
        gpu.name,
        gpu.bandwidth_gbps * 1e9,
        gpu.fp16_tflops * 1e12,
        gpu.pcie_gbps * 1e9,
        gpu.memory_gb * 1e9 if gpu.memory_mib is None else gpu.memory_bytes,
        copy_latency,
    )


HARDWARE: dict[str, Hardware] = {
    # Data-sheet peaks, from minipaged.gpus: memory bandwidth, dense 16-bit tensor-core FLOP/s, PCIe x16 one
    # direction (3.0 on the T4, 4.0 on the A100, 5.0 on the H100 and H200); 5 µs per cudaMemcpyAsync call
    # (assumed, see the module docstring).
    **{key: gpu_hardware(key) for key in ("t4", "a100", "h100", "h200")},
    # A laptop: dual-channel DDR4, two cores of AVX2 FMA in fp32; "swap" is a copy inside the same DRAM,
    # about a microsecond of fixed cost per copy call (assumed).
    "cpu": Hardware("laptop CPU, 2 cores", 25e9, 100e9, 10e9, 16e9, 1e-6),
}


@dataclass(frozen=True)
class CostModel:
    """Seconds per step from what the step reads and computes (see the module docstring).

    ``step_time(kv_tokens, new_tokens, swap_bytes)``:

    * ``kv_tokens``: tokens whose K/V the step reads: for each scheduled request,
      everything up to its last new token (context + new);
    * ``new_tokens``: tokens computed this step (prefill chunks + one per decode);
    * ``swap_bytes``: bytes copied between device and host (swap out + swap in);
    * ``swap_copies``: how many separate copies move them; each costs ``swap_latency`` seconds
      on top of its bytes (``copies_per_block`` copies per swapped block).

    A cost model built by hand (keywords) has no fixed cost per copy unless given one;
    ``for_model`` takes the hardware's ``copy_latency`` and ``2 · num_layers`` copies per block.
    """

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    mem_bandwidth: float
    flops: float
    swap_bandwidth: float
    step_overhead: float = 0.0  # fixed seconds per step (kernel launches, sampling, scheduling)
    name: str = ""
    swap_latency: float = 0.0  # fixed seconds per device↔host copy, on top of its bytes
    copies_per_block: int = 1  # separate copies one swapped block takes (vLLM v0: 2 · num_layers)

    @classmethod
    def for_model(
        cls,
        model: str | KVSpec = "llama-3-8b",
        hardware: str | Hardware = "h100",
        num_params: float | None = None,
        weight_bytes_per_param: float = 2.0,
        kv_dtype: str | int | None = None,
        step_overhead: float = 0.0,
        copy_latency: float | None = None,
        copies_per_block: int | None = None,
    ) -> CostModel:
        """A cost model for a preset (``kv_math.PRESETS``) or any ``KVSpec`` on a ``HARDWARE`` entry.

        ``copy_latency`` (default: the hardware's) and ``copies_per_block`` (default ``2 · num_layers``,
        one copy per layer for K and one for V, as vLLM v0 swapped) price a swap's copies.
        """
        spec = KVSpec.from_preset(model, dtype=kv_dtype) if isinstance(model, str) else model
        hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
        params = num_params if num_params is not None else spec.num_params
        if not params:
            raise ValueError(f"{spec.name or 'this spec'} has no num_params: pass num_params=")
        copies = 2 * spec.num_layers if copies_per_block is None else copies_per_block
        if not isinstance(copies, int) or copies < 1:
            raise ValueError(f"copies_per_block must be a positive integer, got {copies!r}")
        latency = hw.copy_latency if copy_latency is None else copy_latency
        if latency < 0:
            raise ValueError(f"copy_latency must be >= 0 seconds, got {latency!r}")
        return cls(
            weight_bytes=params * weight_bytes_per_param,
            kv_bytes_per_token=spec.bytes_per_token,
            flops_per_token=2.0 * params,
            mem_bandwidth=hw.mem_bandwidth,
            flops=hw.flops,
            swap_bandwidth=hw.swap_bandwidth,
            step_overhead=step_overhead,
            name=f"{spec.name} on {hw.name}",
            swap_latency=latency,
            copies_per_block=copies,
        )

    def step_time(
        self, kv_tokens: float, new_tokens: float, swap_bytes: float = 0.0, swap_copies: float = 0.0
    ) -> float:
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / self.mem_bandwidth
        compute = self.flops_per_token * new_tokens / self.flops
        return (
            self.step_overhead
            + (memory if memory > compute else compute)
            + swap_copies * self.swap_latency
            + swap_bytes / self.swap_bandwidth
        )

    def step_times(self, kv_tokens: np.ndarray, new_tokens: np.ndarray) -> np.ndarray:
        """``step_time`` over arrays of steps (no swapping)."""
        memory = (self.weight_bytes + self.kv_bytes_per_token * np.asarray(kv_tokens, float)) / self.mem_bandwidth
        compute = self.flops_per_token * np.asarray(new_tokens, float) / self.flops
        return self.step_overhead + np.maximum(memory, compute)

    def swap_time(self, num_blocks: int, block_size: int, copies_per_block: int | None = None) -> float:
        """Seconds to move ``num_blocks`` blocks of ``block_size`` tokens one way over PCIe.

        Each block is ``copies_per_block`` copies (default: this model's), each paying
        ``swap_latency`` before its share of the block's bytes moves at ``swap_bandwidth``.
        """
        copies = self.copies_per_block if copies_per_block is None else copies_per_block
        return num_blocks * (copies * self.swap_latency + block_size * self.kv_bytes_per_token / self.swap_bandwidth)


def swap_vs_recompute(
    cost: CostModel, num_tokens: int, block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
) -> list[dict[str, float]]:
    """What bringing back a preempted request of ``num_tokens`` tokens costs, block size by block size.

    One row per block size: ``blocks``, ``copies`` (both ways), ``swap_s`` (out and back in),
    split into ``swap_fixed_s`` (the copies' fixed costs) and ``swap_data_s`` (the bytes), and
    ``recompute_s``, a stand-alone prefill of the ``num_tokens`` tokens, which reads and writes
    no swapped block and so is the same at every block size (the PagedAttention paper's §7.3).
    """
    rows = []
    for bs in block_sizes:
        blocks = cdiv(num_tokens, bs)
        fixed = 2 * blocks * cost.copies_per_block * cost.swap_latency
        data = 2 * blocks * bs * cost.kv_bytes_per_token / cost.swap_bandwidth
        rows.append(
            dict(
                block_size=bs,
                blocks=blocks,
                copies=2 * blocks * cost.copies_per_block,
                swap_s=fixed + data,
                swap_fixed_s=fixed,
                swap_data_s=data,
                recompute_s=cost.step_time(num_tokens, num_tokens),
            )
        )
    return rows


def kv_pool_blocks(
    model: str | KVSpec = "llama-3-8b",
    hardware: str | Hardware = "h100",
    block_size: int = 16,
    gpu_memory_utilization: float = 0.9,
    weight_bytes_per_param: float = 2.0,
) -> int:
    """Usable KV blocks left after the weights (vLLM's start-up sizing, activations ignored)."""
    from ..kv_math import num_blocks_at_startup

    spec = KVSpec.from_preset(model) if isinstance(model, str) else model
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    return num_blocks_at_startup(
        hw.memory_bytes, gpu_memory_utilization, (spec.num_params or 0) * weight_bytes_per_param, 0, spec, block_size
    )


# ---- the workload ----------------------------------------------------------------------------
@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated workload: it arrives at ``arrival`` seconds and will generate ``output_len``."""

    req_id: str
    arrival: float
    prompt_len: int
    output_len: int
    prompt_token_ids: tuple[int, ...] | None = None  # None: a prompt no other request shares
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival < 0:
            raise ValueError(f"bad request {self.req_id}: need prompt_len >= 1, output_len >= 1, arrival >= 0")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"request {self.req_id}: {len(self.prompt_token_ids)} prompt ids, prompt_len={self.prompt_len}"
            )

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


def requests_from_trace(trace: Trace, time_unit: float = 0.0) -> list[SimRequest]:
    """A ``workloads.Trace`` as simulator requests; its arrival steps become ``arrival · time_unit`` seconds.

    ``time_unit=0`` puts every request at time 0 (an offline batch).
    """
    return [SimRequest(r.req_id, r.arrival * time_unit, r.prompt_len, r.output_len) for r in trace]


def shared_prefix_requests(
    requests: Sequence[SimRequest],
    prefix_len: int,
    share: float = 1.0,
    num_prefixes: int = 1,
    vocab: int = 32_000,
    seed: int = 0,
) -> list[SimRequest]:
    """Give a fraction ``share`` of the requests one of ``num_prefixes`` system prompts of ``prefix_len`` tokens.

    Each request keeps its own ``prompt_len`` tokens *after* the prefix (random ids),
    so a shared request's prompt grows by ``prefix_len``.
    """
    rng = np.random.default_rng(seed)
    prefixes = [tuple(int(t) for t in rng.integers(1, vocab, prefix_len)) for _ in range(num_prefixes)]
    out = []
    for r in requests:
        own = tuple(int(t) for t in rng.integers(1, vocab, r.prompt_len))
        if rng.random() < share:
            ids = prefixes[int(rng.integers(num_prefixes))] + own
        else:
            ids = own
        out.append(replace(r, prompt_len=len(ids), prompt_token_ids=ids))
    return out


# ---- configuration and results ---------------------------------------------------------------
@dataclass
class SimConfig(Config):
    """The engine's ``Config`` as the simulator reads it: no model, and the pool given in blocks.

    The knobs and their checks are the engine's (``num_gpu_blocks_override`` is the pool, null block
    included; ``num_cpu_blocks_override`` the swap space); the defaults suit a simulated GPU: 4096 blocks,
    ``max_model_len`` 2048, prefix caching off (the chapters turn it on to compare).
    """

    device: str | torch.device | None = "cpu"  # the simulator's bookkeeping runs on the CPU, whatever it models
    num_gpu_blocks_override: int | None = 4097
    max_model_len: int | None = 2048
    enable_prefix_caching: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_gpu_blocks_override", "max_model_len"):
            if getattr(self, name) is None:
                raise ValueError(f"the simulator needs {name}: it has no model to derive it from")
        if self.speculative_config is not None:
            raise ValueError("the simulator cannot speculate: it has no model to check drafts with")
        if self.kv_offloading_bytes:
            raise ValueError("the simulator has no KV offloading store: leave kv_offloading_size at 0")

    @property
    def num_blocks(self) -> int:
        assert self.num_gpu_blocks_override is not None  # __post_init__ checked it
        return self.num_gpu_blocks_override

    @property
    def model_len(self) -> int:
        assert self.max_model_len is not None  # __post_init__ checked it
        return self.max_model_len

    @property
    def pool_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def make_scheduler(self) -> Scheduler:
        return Scheduler.from_config(self, self.num_blocks, self.model_len, self.num_cpu_blocks_override or 0)

    def static_batch_cap(self) -> int:
        """Requests a contiguous allocator can hold at once: each reserves ``max_model_len`` slots."""
        return self.pool_tokens // self.model_len


STEP_FIELDS = (
    "time",
    "duration",
    "num_running",
    "num_waiting",
    "blocks_in_use",
    "tokens_scheduled",
    "prefill_tokens",
    "kv_tokens",
    "num_preempted",
    "swap_out_blocks",
    "swap_in_blocks",
)


@dataclass
class SimResult:
    """What one simulated run did: ``steps`` (one array per ``STEP_FIELDS`` entry) and ``requests``.

    ``events`` lists ``(time, kind, request id)`` with kind in admit / preempt / resume / finish
    (continuous) or batch / finish (static). For static batching ``blocks_in_use`` counts the
    *reserved* contiguous memory, in blocks of ``block_size`` tokens.
    """

    policy: str
    config: SimConfig
    cost: CostModel
    requests: list[RequestMetrics]
    steps: dict[str, np.ndarray]
    events: list[tuple[float, str, str]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> list[RequestMetrics]:
        return [r for r in self.requests if not r.rejected]

    def slo_attainment(self, ttft_s: float, tpot_s: float, ttft_per_prompt_token_s: float = 0.0) -> float:
        """The share of all requests served within their service-level objective (DistServe's goodput):
        a first token within ``ttft_s + ttft_per_prompt_token_s · prompt_len`` seconds of arriving (a long prompt
        may take longer to read) and a mean time per output token within ``tpot_s``. A rejected request misses."""
        if not self.requests:
            raise ValueError("no request to score")
        met = 0
        for r in self.finished:
            ttft, tpot = r.ttft, r.mean_itl
            if ttft is not None and ttft <= ttft_s + ttft_per_prompt_token_s * r.prompt_len:
                met += tpot is None or tpot <= tpot_s
        return met / len(self.requests)

    def summary(self) -> dict[str, float]:
        done = self.finished
        if not done:
            raise ValueError("no request finished")
        t0 = min(r.arrival for r in done)
        makespan = max(r.finish for r in done if r.finish is not None) - t0
        out_tokens = sum(len(r.token_times) for r in done)
        ttft = np.array([r.ttft for r in done])
        lat = np.array([r.latency for r in done])
        itl = np.concatenate([r.itls for r in done]) if done else np.zeros(0)
        itl = itl if itl.size else np.zeros(1)
        s = self.steps
        usable = self.config.num_blocks - 1
        return dict(
            requests=len(done),
            rejected=len(self.requests) - len(done),
            makespan_s=makespan,
            throughput_tok_s=out_tokens / makespan,
            requests_per_s=len(done) / makespan,
            ttft_mean_s=float(ttft.mean()),
            ttft_p50_s=float(np.percentile(ttft, 50)),
            ttft_p99_s=float(np.percentile(ttft, 99)),
            itl_mean_s=float(itl.mean()),
            itl_p50_s=float(np.percentile(itl, 50)),
            itl_p99_s=float(np.percentile(itl, 99)),
            latency_mean_s=float(lat.mean()),
            latency_p99_s=float(np.percentile(lat, 99)),
            steps=len(s["time"]),
            mean_batch=float(s["num_running"].mean()) if len(s["time"]) else 0.0,
            peak_blocks=int(s["blocks_in_use"].max()) if len(s["time"]) else 0,
            mean_block_usage=float(s["blocks_in_use"].mean() / usable) if len(s["time"]) else 0.0,
            preemptions=int(s["num_preempted"].sum()),
            computed_tokens=int(s["tokens_scheduled"].sum()),
            swapped_blocks=int(s["swap_out_blocks"].sum() + s["swap_in_blocks"].sum()),
            **{k: v for k, v in self.info.items() if isinstance(v, (int, float))},
        )


def _finish_steps(cols: dict[str, list]) -> dict[str, np.ndarray]:
    return {k: np.asarray(cols[k], dtype=float if k in ("time", "duration") else np.int64) for k in STEP_FIELDS}


def fake_samples(
    out: SchedulerOutput, token: Callable[[ScheduledRequest], int] | int = FAKE_TOKEN
) -> dict[str, list[int]]:
    """The fake model: a token for every scheduled request that samples (``n`` on an n > 1 request's first);
    ``token`` is a fixed id or a function of the request's share of the step."""
    if isinstance(token, int):
        return {s.request_id: [token] * s.num_samples for s in out.scheduled if s.num_samples}
    return {s.request_id: [token(s)] * s.num_samples for s in out.scheduled if s.num_samples}


# ---- continuous batching: the real scheduler ------------------------------------------------
def _make_request(i: int, r: SimRequest) -> Request:
    ids = list(r.prompt_token_ids) if r.prompt_token_ids is not None else [i + 2] + [FAKE_TOKEN] * (r.prompt_len - 1)
    return Request(
        r.req_id,
        ids,
        cache_salt=r.cache_salt,
        arrival_time=r.arrival,
        sampling_params=SamplingParams(max_tokens=r.output_len, ignore_eos=True),
    )


class _SimExecutor:
    """The simulator's executor: a step takes ``cost.step_time`` of its tokens on the clock, every sampling
    request gets ``FAKE_TOKEN``; it records what the step did, one row per step (``STEP_FIELDS``)."""

    def __init__(self, sched: Scheduler, cost: CostModel, config: SimConfig, record_events: bool) -> None:
        self.sched, self.cost, self.record_events = sched, cost, record_events
        self.bytes_per_block = cost.kv_bytes_per_token * config.block_size
        self.now = 0.0
        self.cols: dict[str, list] = {k: [] for k in STEP_FIELDS}
        self.events: list[tuple[float, str, str]] = []
        self.starts: dict[str, float] = {}  # when each request first ran
        self.hit_tokens = self.query_tokens = 0
        # Set before each step: who was running, and whose blocks were on the CPU, when it began.
        self.running_before: set[str] = set()
        self.swapped_before: set[str] = set()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sched, now = self.sched, self.now
        if not out.scheduled:
            raise RuntimeError(
                f"the scheduler made no progress at t={now:.3f}s "
                f"({len(sched.waiting) + len(sched.swapped)} waiting, {len(sched.running)} running)"
            )
        kv_tokens = new_tokens = prefill = 0
        for s in out.scheduled:
            new_tokens += s.num_new_tokens
            kv_tokens += s.start + s.num_new_tokens
            req = sched.requests[s.request_id]
            if s.start < req.num_prompt_tokens:
                prefill += s.num_new_tokens
            rid = s.request_id
            if rid not in self.running_before:
                self.starts.setdefault(rid, now)
                if rid not in self.swapped_before:  # a (re)admission that looked in the prefix cache
                    self.hit_tokens += s.start
                    self.query_tokens += req.num_tokens
                if self.record_events:
                    self.events.append((now, "resume" if req.num_preemptions else "admit", rid))
        if self.record_events:
            self.events.extend((now, "preempt", rid) for rid in out.preempted)
        swaps = len(out.swap_out) + len(out.swap_in)
        dt = self.cost.step_time(
            kv_tokens, new_tokens, swaps * self.bytes_per_block, swaps * self.cost.copies_per_block
        )
        row = dict(
            time=now,
            duration=dt,
            num_running=len(out.scheduled),
            num_waiting=len(sched.waiting) + len(sched.swapped),
            blocks_in_use=sched.kv_cache_manager.num_blocks - 1 - sched.kv_cache_manager.get_num_free_blocks(),
            tokens_scheduled=new_tokens,
            prefill_tokens=prefill,
            kv_tokens=kv_tokens,
            num_preempted=len(out.preempted),
            swap_out_blocks=len(out.swap_out),
            swap_in_blocks=len(out.swap_in),
        )
        for k in STEP_FIELDS:
            self.cols[k].append(row[k])
        self.now = now + dt
        return RunnerOutput(fake_samples(out))

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        pass  # no per-request state


def simulate_continuous(
    requests: Sequence[SimRequest],
    cost: CostModel,
    config: SimConfig | None = None,
    record_events: bool = True,
    check: bool = False,
    max_steps: int = 10_000_000,
    on_step: Callable[[Scheduler, SchedulerOutput, float, list[Request]], None] | None = None,
) -> SimResult:
    """Serve ``requests`` with the real ``Scheduler``, stepped by ``step.run_step`` like the engine; the
    executor is a clock that advances by ``cost.step_time`` per step (default config: ``SimConfig()``).

    A request is added to the scheduler once the clock reaches its arrival. With
    ``check=True`` the block-pool invariants (``scheduler.check_invariants``)
    are asserted after every step (slower: for tests). ``on_step(scheduler, output,
    now, finished)`` is called after each step, e.g. to take snapshots for a widget;
    ``finished`` lists the requests that finished in that step, and those rejected on
    arrival since the step before (the scheduler itself forgets finished requests).
    """
    config = config or SimConfig()
    sched = config.make_scheduler()
    ex = _SimExecutor(sched, cost, config, record_events)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    if len({r.req_id for r in requests}) != len(requests):
        raise ValueError("request ids must be unique")
    nxt, n, steps = 0, len(order), 0
    added: dict[str, Request] = {}  # the scheduler forgets finished requests; the driver keeps its own
    rejected: list[Request] = []
    while nxt < n or sched.has_unfinished():
        while nxt < n and requests[order[nxt]].arrival <= ex.now:
            req = _make_request(order[nxt], requests[order[nxt]])
            added[req.request_id] = req
            sched.add_request(req)
            if req.is_finished:
                rejected.append(req)
            nxt += 1
        if not sched.has_unfinished():
            ex.now = max(ex.now, requests[order[nxt]].arrival)
            continue
        ex.running_before = {r.request_id for r in sched.running}
        ex.swapped_before = set(sched.kv_cache_manager.swap.swapped_blocks)
        res = run_step(sched, ex, lambda: ex.now)
        steps += 1
        if record_events:
            ex.events.extend((ex.now, "finish", r.request_id) for r in res.finished)
        if check:
            check_invariants(sched)
        if on_step is not None:
            on_step(sched, res.output, ex.now, rejected + res.finished)
        rejected = []
        if steps >= max_steps:
            raise RuntimeError(f"more than {max_steps} steps")
    metrics: list[RequestMetrics] = []
    for r in requests:
        m = added[r.req_id].metrics()
        m.start = ex.starts.get(r.req_id)
        metrics.append(m)
    info = dict(
        prefix_hit_tokens=ex.hit_tokens,
        prefix_query_tokens=ex.query_tokens,
        prefix_hit_rate=ex.hit_tokens / ex.query_tokens if ex.query_tokens else 0.0,
    )
    return SimResult("continuous", config, cost, metrics, _finish_steps(ex.cols), ex.events, info)


# ---- static batching: the baseline -----------------------------------------------------------
def simulate_static(
    requests: Sequence[SimRequest],
    cost: CostModel,
    config: SimConfig | None = None,
    batch_size: int | None = None,
    padded: bool = True,
    record_events: bool = True,
) -> SimResult:
    """Serve ``requests`` in fixed batches, each running until its longest member finishes.

    * The engine, when idle, takes the requests that have arrived, in arrival
      order, up to ``B = min(batch_size, config.static_batch_cap())`` (it does not
      wait to fill a batch); if none has arrived it waits for the next.
    * Memory: each member reserves ``max_model_len`` contiguous slots, so the
      pool of ``config.num_blocks`` blocks caps ``B``. As in the scheduler, a
      prompt longer than ``max_model_len`` is rejected, and a request stops
      generating when it reaches ``max_model_len`` tokens.
    * A batch is one padded tensor (``padded=True``): the prefill computes
      ``B × longest prompt`` tokens, and every decode step runs all ``B`` rows,
      reading ``B × (longest prompt + step)`` tokens of KV, until the longest
      output is done. ``padded=False`` charges only live requests (a kinder baseline).
    * A request's tokens stream out as they are produced (``finish`` = its own last
      token); its memory is released only when the batch ends (``release``).
    """
    config = config or SimConfig()
    cap = config.static_batch_cap()
    if cap < 1:
        raise ValueError(
            f"a pool of {config.pool_tokens} tokens cannot reserve even one request of max_model_len={config.model_len}"
        )
    B = cap if batch_size is None else min(batch_size, cap)
    if B < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    metrics = [RequestMetrics(r.req_id, r.arrival, r.prompt_len, r.output_len) for r in requests]
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    ok = [i for i in order if requests[i].prompt_len <= config.model_len]
    for i in order:
        if requests[i].prompt_len > config.model_len:
            metrics[i].rejected = True
    # As in the scheduler, a request stops when it reaches max_model_len (always after at least one token).
    out_len = {i: max(1, min(requests[i].output_len, config.model_len - requests[i].prompt_len)) for i in ok}
    parts: dict[str, list[np.ndarray]] = {k: [] for k in STEP_FIELDS}
    events: list[tuple[float, str, str]] = []
    reserved_blocks = cdiv(config.model_len, config.block_size)
    now, k, batches = 0.0, 0, 0
    arrivals = np.array([requests[i].arrival for i in ok], dtype=float)
    while k < len(ok):
        now = max(now, arrivals[k])
        end = k + 1
        while end < len(ok) and end - k < B and arrivals[end] <= now:
            end += 1
        batch = ok[k:end]
        p = np.array([requests[i].prompt_len for i in batch])
        o = np.array([out_len[i] for i in batch])
        rows, P, steps_out = len(batch), int(p.max()), int(o.max())
        # step 0: the prefill (first token); steps 1..steps_out-1: decodes (token j+1 of every live row)
        steps = np.arange(steps_out)
        live = o[None, :] > steps[:, None]  # [steps_out, rows]: row still producing tokens at step j
        if padded:
            new = np.full(steps_out, rows, dtype=np.int64)
            new[0] = rows * P
            kv = rows * (P + steps)
        else:
            new = live.sum(axis=1)
            new[0] = int(p.sum())
            kv = (live * (p[None, :] + steps[:, None])).sum(axis=1)
        dt = cost.step_times(kv, new)
        ends = now + np.cumsum(dt)
        starts = ends - dt
        for j, i in enumerate(batch):
            m = metrics[i]
            m.start = now
            m.token_times = ends[: o[j]].tolist()
            m.first_token, m.finish, m.release = m.token_times[0], m.token_times[-1], float(ends[-1])
        if record_events:
            events.append((now, "batch", ",".join(requests[i].req_id for i in batch)))
            events.extend(sorted((float(ends[o[j] - 1]), "finish", requests[i].req_id) for j, i in enumerate(batch)))
        waiting_after = np.searchsorted(arrivals, starts, side="right") - end
        parts["time"].append(starts)
        parts["duration"].append(dt)
        parts["num_running"].append(live.sum(axis=1))
        parts["num_waiting"].append(np.maximum(waiting_after, 0))
        parts["blocks_in_use"].append(np.full(steps_out, rows * reserved_blocks))
        parts["tokens_scheduled"].append(new)
        prefill = np.zeros(steps_out, dtype=np.int64)
        prefill[0] = new[0]
        parts["prefill_tokens"].append(prefill)
        parts["kv_tokens"].append(np.asarray(kv))
        for name in ("num_preempted", "swap_out_blocks", "swap_in_blocks"):
            parts[name].append(np.zeros(steps_out, dtype=np.int64))
        now = float(ends[-1])
        k = end
        batches += 1
    step_cols = {
        name: (np.concatenate(v) if v else np.zeros(0)).astype(float if name in ("time", "duration") else np.int64)
        for name, v in parts.items()
    }
    used = sum(out_len.values())
    computed_useful = sum(requests[i].prompt_len + out_len[i] for i in ok)
    info = dict(
        batch_size=B,
        batch_cap=cap,
        batches=batches,
        padding_fraction=1.0 - computed_useful / max(1, int(step_cols["tokens_scheduled"].sum())),
        output_tokens=used,
    )
    return SimResult("static", config, cost, metrics, step_cols, events, info)


def compare(
    requests: Sequence[SimRequest],
    cost: CostModel,
    config: SimConfig | None = None,
    batch_size: int | None = None,
    padded: bool = True,
) -> dict[str, dict[str, float]]:
    """``summary()`` of static and continuous batching on the same requests, cost model and memory."""
    static = simulate_static(requests, cost, config, batch_size, padded=padded, record_events=False)
    cont = simulate_continuous(requests, cost, config, record_events=False)
    return {"static": static.summary(), "continuous": cont.summary()}


def format_table(rows: dict[str, dict[str, float]], keys: Iterable[tuple[str, str, float, str]]) -> str:
    """A small fixed-width table: ``keys`` = (summary key, label, scale, format) per line; one column per run."""
    names = list(rows)
    width = max(12, *(len(n) + 2 for n in names))
    lines = [f"{'':<26}" + "".join(f"{n:>{width}}" for n in names)]
    for key, label, scale, fmt in keys:
        vals = "".join(f"{format(rows[n][key] * scale, fmt):>{width}}" for n in names)
        lines.append(f"{label:<26}{vals}")
    return "\n".join(lines)


__all__ = [
    "HARDWARE",
    "STEP_FIELDS",
    "CostModel",
    "Hardware",
    "RequestMetrics",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "compare",
    "fake_samples",
    "format_table",
    "gpu_hardware",
    "kv_pool_blocks",
    "requests_from_trace",
    "shared_prefix_requests",
    "simulate_continuous",
    "simulate_static",
    "swap_vs_recompute",
]
