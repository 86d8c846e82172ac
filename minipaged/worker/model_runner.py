"""The model runner: the model's side of the engine. At start-up it loads the weights, sizes the KV pool and
allocates the cache tensors (``ModelRunner(config)``); each step it turns one ``SchedulerOutput`` into tensors,
runs the model and samples: token ids out.

The scheduler speaks in requests and block ids; the model wants flat tensors.
For a step with a 5-token prefill chunk of ``a`` and decodes of ``b`` and ``c``::

    input_ids     a5 a6 a7 a8 a9 | b17 | c3        all new tokens, one row each
    positions      5  6  7  8  9 |  17 |  3
    slot_mapping  per new token: block_table[pos // bs] · bs + pos % bs
    block_tables  [[a's blocks...], [b's blocks...], [c's blocks...]]  (padded with block 0)
    seq_lens      [10, 18, 4]
    cu_seqlens_q  [0, 5, 6, 7]
    sample rows   [4, 5, 6]    the last new token of each request that samples this step

Before the forward pass it performs the step's block copies on the cache engine
(swap out, swap in, copy-on-write), in that order: a block swapped out this step
may be handed to another request in the same step, so its data must leave first.

The runner keeps the requests' block tables between steps and builds these arrays with array operations
(``input_batch.py``: the persistent input batch); the step's index tensors live in ``InputBuffers``: device
tensors allocated once, of the largest size a step can need, and filled in place each step (a step uses a
prefix of each), from pinned memory on a GPU. That saves an allocation per tensor per step, and it is what a
CUDA graph needs: the same addresses every step.

Nothing here waits for the GPU: ``launch`` queues the copies, the forward pass and the sampling, and the
tokens come back when the step's result is asked for (one copy, ``SampledOutput.result``). That is what lets
the engine schedule the next step while this one runs (``engine/overlap.py``); ``warm_up`` compiles the
kernels and captures the CUDA graphs before the first request.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import hooks
from ..config import Config, model_config_dtype, resolve_dtype
from ..core.block_pool import BlockHash
from ..core.kv_cache_coordinator import kv_cache_groups, layer_tensors
from ..core.request import PLACEHOLDER_TOKEN_ID
from ..core.scheduler_output import PendingOutput, Ready, RunnerOutput, ScheduledRequest, SchedulerOutput
from ..kv_math import GiB, KVSpec, format_bytes, num_blocks_at_startup
from ..model import AttentionMetadata, LlamaForCausalLM
from ..model.cuda_graphs import CUDAGraphRunner
from ..model.llama import config_from_dict
from ..profiling import span
from ..sampling_params import SamplingParams
from ..utils import cdiv
from .block_table import make_block_table_tensor, slot_mapping
from .cache_engine import CacheEngine
from .input_batch import InputBatch, InputBuffers, StepArrays
from .sampler import DeviceSamples, Sampler, verify

if TYPE_CHECKING:
    from ..distributed import TPGroup


class GPUMemoryError(RuntimeError):
    """An engine does not fit in the GPU memory that this process's other engines (or other processes) leave."""


_LIVE: weakref.WeakSet[ModelRunner] = weakref.WeakSet()  # runners holding device memory: named when one won't fit


def caller_site() -> str:
    """Where the user's code built the engine: the first frame outside this package (a notebook cell, a script)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # minipaged/
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def free_device_memory(device: torch.device) -> None:
    """Hand what PyTorch caches on ``device`` back to the driver: unreachable cycles collected, cuBLAS's
    per-stream workspaces (one per stream that ran a GEMM, a graph capture's side streams included) dropped,
    the caching allocator's free blocks released. A no-op on a CPU."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, so looked up, not assumed
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def gpu_memory_report(device: torch.device, need: int | None = None) -> str:
    """What is free on ``device``, what this engine needs, and which engines of this process hold the rest."""
    free, total = torch.cuda.mem_get_info(device)
    lines = [f"{device} has {format_bytes(free)} free of {format_bytes(total)}"]
    if need is not None:
        lines[0] += f", and this engine needs {format_bytes(need)}"
    held = [r for r in list(_LIVE) if r.device == device and not r.released]
    for r in held:
        lines.append(f"  held by the engine built at {r.created_at}: {r.held()}")
    if held:
        lines.append(
            "Free one with llm.shutdown() (or drop every reference to it: del llm), or ask this one for less: "
            "kv_cache_memory='1GiB', a smaller gpu_memory_utilization, or num_gpu_blocks_override"
        )
    else:
        lines.append(
            "No engine of this process holds it: another process does (nvidia-smi lists them), or tensors of "
            "your own; ask this engine for less with kv_cache_memory='1GiB' or a smaller gpu_memory_utilization"
        )
    return "\n".join(lines)


def step_inputs(scheduled: list[ScheduledRequest]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The flat inputs of one step, from the scheduler's plain-data decisions: every scheduled token in one row,
    request after request, whatever mix of prefill chunks and decodes the step holds::

        scheduled   A: last chunk of a 20-token prompt    B: decode at 7    C: a 3-token prompt, n = 2
        input_ids   [a16 a17 a18 a19 | b7 | c0 c1 c2]      (the tokens at positions 16..19, 7, 0..2)
        positions   [16  17  18  19  | 7  | 0  1  2 ]      (RoPE needs the true positions, not 0..n-1)
        cu_seqlens_q [0, 4, 5, 8]                          (where each request's rows start; the last: total)
        seq_lens    [20, 8, 3]                              (tokens each attends to: cached context + new)
        sample_rows [3, 4, 7, 7]                            (the row of each sampled token: a request's last
                                                             row, once per sample, none mid-prompt)

    A decode with drafts (speculative decoding) is sampled at its last real token's row and at every draft's
    row: B decoding at 7 with drafts d0 d1 feeds ``[b7 d0 d1]`` at positions 7..9 and adds rows ``[4, 5, 6]``.

    Returns ``(input_ids, positions, cu_seqlens_q, seq_lens, sample_rows)`` as lists; ``prepare_inputs``
    copies them into the runner's reused buffers. vLLM's ``GPUModelRunner._prepare_inputs`` builds the same
    arrays (its ``query_start_loc`` is our ``cu_seqlens_q``).
    """
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    for s in scheduled:
        end = s.start + s.num_new_tokens
        ids += s.token_ids
        positions += range(s.start, end)
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.spec_token_ids:  # verification: one row per draft and one for the last real token
            sample_rows += range(cu[-1] - 1 - len(s.spec_token_ids), cu[-1])
        else:
            sample_rows += [cu[-1] - 1] * s.num_samples
    return ids, positions, cu, seq_lens, sample_rows


class SampledOutput:
    """A step's tokens on their way back from the device (``PendingOutput``): ``result()`` waits for the one copy
    of every row, then hands each request its tokens or why it has none."""

    def __init__(self, drawn: DeviceSamples, owners: list[str], timers: dict[str, float]) -> None:
        self.drawn, self.owners, self.timers = drawn, owners, timers
        self.verified: dict[str, list[int]] = {}  # requests with drafts: the tokens they emit (waited for)
        self.errors: dict[str, str] = {}

    def result(self) -> RunnerOutput:
        t0 = time.perf_counter()
        with span("gpu_wait"):  # the CPU waits for the GPU's kernels: neither glue nor a launch
            tokens, errors = self.drawn.to_host()
        self.timers["model"] += time.perf_counter() - t0  # the model's time the launch did not see
        result = RunnerOutput(sampled=dict(self.verified), errors=dict(self.errors))
        for row, (rid, token) in enumerate(zip(self.owners, tokens)):
            if row in errors:
                result.errors.setdefault(rid, errors[row])
            else:
                assert token is not None  # a row without an error has its token
                result.sampled.setdefault(rid, []).append(token)
        for rid in result.errors:  # a request with a failed row samples nothing this step
            result.sampled.pop(rid, None)
        return result


def resolve_max_model_len(config: Config, max_pos: int | None, num_blocks: int) -> int:
    """``max_model_len`` as asked (not past the model's positions unless allowed), or the model's (at most
    8192), lowered with a warning to what the pool can hold."""
    block_size, usable = config.block_size, num_blocks - 1
    asked = config.max_model_len
    if asked is not None and max_pos is not None and asked > max_pos and not config.allow_long_max_model_len:
        raise ValueError(
            f"max_model_len={asked} is longer than the model's max_position_embeddings="
            f"{max_pos}: positions past it were never trained. Lower it, or pass "
            "allow_long_max_model_len=True if you know the model extrapolates"
        )
    max_model_len = asked or min(max_pos or 8192, 8192)
    if asked is None and max_model_len > usable * block_size:
        # Not asked for: fit the longest sequence the pool can hold (a small CPU budget is a fine choice).
        warnings.warn(
            f"max_model_len lowered from {max_model_len} to {usable * block_size} tokens: the KV "
            f"pool holds {usable} blocks of {block_size}. Give the cache more memory for longer "
            "sequences",
            stacklevel=7,
        )
        max_model_len = usable * block_size
    if cdiv(max_model_len, block_size) > usable:
        raise ValueError(
            f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} "
            f"blocks of {block_size} tokens but the KV pool has only {usable}: lower "
            "max_model_len or give the cache more memory"
        )
    return max_model_len


class ModelRunner:
    """The model's side of the engine (nano-vllm's ``ModelRunner``): it loads the weights, sizes the KV pool
    from the memory they leave, holds the cache tensors, and runs steps.

    Pool size, in blocks (the null block included): ``num_gpu_blocks_override`` if given; else, on a CPU or
    with ``kv_cache_memory``, what that byte budget (default 1 GiB) holds; else, on a GPU, what is left of
    ``gpu_memory_utilization`` of the card after the weights and the activation peak of one full-budget
    prefill, measured on a throw-away cache (chapter 01's start-up formula).

    Under tensor parallelism every rank has its own ``ModelRunner`` (``tp``: its group): it loads its shard of the
    weights, sizes its own pool from its own memory, and holds only its KV heads; the ranks then agree on the
    smallest pool, so that one block table fits all. The runner knows nothing of the other ranks' processes: an
    executor (``executor.py``) sends them each step before rank 0's runner runs it, and rank 0 alone samples.
    """

    def __init__(
        self,
        config: Config,
        tp: TPGroup | None = None,
        local_rank: int = 0,
        hf_config: dict[str, Any] | None = None,
    ) -> None:
        from ..model_loader import ensure_converted

        self.tp = tp
        self.created_at, self.released = caller_site(), False
        self.path = ensure_converted(progress=True) if config.model is None else config.model
        self.device = config.torch_device
        if self.device.type == "cuda" and tp is not None:  # one GPU per rank of this machine
            self.device = torch.device("cuda", (self.device.index or 0) + local_rank)
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(config.dtype, model_config_dtype(self.path), self.device)
        self.model = self._load_model(config, hf_config)
        self._plan_kv_cache(config)
        self._allocate(config)
        _LIVE.add(self)
        self.reset()
        if self.device.type == "cuda" and (tp is None or tp.rank == 0):  # how much of the card it took
            print(f"minipaged: {self.describe()}", flush=True)
        self.warm_up_s: float | None = None
        if self.device.type == "cuda" and tp is None:  # ranks would have to warm up in step: they start cold
            note = self.warm_up(config.max_num_seqs, config.max_num_batched_tokens)
            print(f"minipaged: {note}", flush=True)

    def _attention_backend(self, config: Config, hf_config: dict[str, Any] | None) -> str:
        """The kernels' family, ``auto`` resolved: PyTorch for a model with a sliding window (the Triton kernels
        have none); a block size the Triton kernels cannot tile is refused now, not at the first step."""
        from ..kernels import get_attention_backend

        backend = get_attention_backend(config.attention_backend).name
        if config.attention_backend == "auto" and backend != "torch":
            from ..model.llama import read_config, sliding_windows

            shape = config_from_dict(hf_config) if hf_config is not None else read_config(self.path)
            backend = "torch" if any(w is not None for w in sliding_windows(shape)) else backend
        if backend == "triton":
            from ..kernels.launch import kv_tile_n

            kv_tile_n(config.block_size, 16)
        return backend

    def _load_model(self, config: Config, hf_config: dict[str, Any] | None) -> LlamaForCausalLM:
        """The weights (this rank's shard under tensor parallelism) on this runner's device, in its dtype."""
        from ..model_loader import quiet_transformers

        backend, tp = self._attention_backend(config, hf_config), self.tp
        if hf_config is not None:  # a worker, given rank 0's reading of config.json: no transformers here
            return LlamaForCausalLM.from_pretrained(
                self.path, self.dtype, self.device, backend, tp, config_from_dict(hf_config)
            )
        with quiet_transformers():
            return LlamaForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, device=self.device, backend=backend, tp=tp
            )

    def _plan_kv_cache(self, config: Config) -> None:
        """The KV spec this rank holds, its cache groups, and its pools in blocks (device, swap space, offload
        store), agreed with the other ranks; then the longest sequence the pool allows."""
        tp, hf = self.tp, self.model.config
        spec = KVSpec(
            hf.num_hidden_layers,
            hf.num_key_value_heads,
            self.model.head_dim,
            dtype_bytes=self.dtype.itemsize,
            num_attention_heads=hf.num_attention_heads,
            name=getattr(hf, "name_or_path", "") or "model",
        )
        self.spec = spec if tp is None else spec.per_rank(tp.size)  # this rank's KV heads: what its pool holds
        # KV cache groups (kv_cache_coordinator.py): one for SmolLM2; a hybrid model's groups share group_size
        # tensors, so a block holds group_size layers, not all of them.
        self.kv_cache_groups = kv_cache_groups(self.model.model.windows)
        self.layer_tensors = layer_tensors(self.kv_cache_groups, hf.num_hidden_layers)
        self.page_spec = dataclasses.replace(self.spec, num_layers=max(self.layer_tensors) + 1)
        self.block_size = config.block_size
        own_blocks, own_cpu_blocks = self._size_pool(config), self._num_cpu_blocks(config)
        own_offload_blocks = config.kv_offloading_bytes // self.page_spec.bytes_per_block(self.block_size)
        if config.kv_offloading_bytes and not own_offload_blocks:
            raise ValueError(
                f"kv_offloading_size={config.kv_offloading_size!r} holds no block of "
                f"{self.spec.bytes_per_block(self.block_size):,} bytes"
            )
        # Every rank sizes its pool from its own memory; the block tables are shared, so all take the smallest.
        self.num_blocks = own_blocks if tp is None else tp.min_int(own_blocks)
        self.num_cpu_blocks = own_cpu_blocks if tp is None else tp.min_int(own_cpu_blocks)
        self.num_offload_blocks = own_offload_blocks if tp is None else tp.min_int(own_offload_blocks)
        self.max_model_len = resolve_max_model_len(
            config, getattr(hf, "max_position_embeddings", None), self.num_blocks
        )
        self.rank_info = {  # what this rank holds, for ``ranks`` (chapter 01's per-rank KV bytes, read live)
            "rank": 0 if tp is None else tp.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "num_kv_heads": self.spec.num_kv_heads,
            "num_attention_heads": self.model.model.num_heads,
            "bytes_per_block": self.page_spec.bytes_per_block(self.block_size),
            "own_num_blocks": own_blocks,
            "num_blocks": self.num_blocks,
        }

    def _allocate(self, config: Config) -> None:
        """The cache tensors, the step's input buffers and, on one GPU, the CUDA graph runner."""
        self.cache = CacheEngine(
            self.model.config.num_hidden_layers,
            self.num_blocks,
            self.block_size,
            self.model.num_kv_heads,
            self.model.head_dim,
            self.dtype,
            self.device,
            num_cpu_blocks=self.num_cpu_blocks,
            num_offload_blocks=self.num_offload_blocks,
            layer_tensors=self.layer_tensors,
        )
        max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        self.buffers = InputBuffers(config.max_num_batched_tokens, config.max_num_seqs, max_blocks_per_seq, self.device)
        # The requests' block tables, one numpy row each, kept between steps (input_batch.py)
        self.input_batch = InputBatch(
            len(self.kv_cache_groups), config.max_num_seqs, max_blocks_per_seq, self.block_size
        )
        # A KV producer's sender (disaggregated prefill, ``disagg.py``): after the forward, it ships the blocks the
        # step filled (``kv_connector_metadata.sends``) to the engine that decodes.
        self.kv_sender: Callable[[CacheEngine, list[tuple[int, BlockHash]]], None] | None = None
        self.graph_runner: CUDAGraphRunner | None = None  # decode steps replayed from CUDA graphs (a GPU only)
        # CUDA graphs capture one block table per step: models of one KV cache group only.
        one_gpu = self.device.type == "cuda" and self.tp is None
        if one_gpu and not config.enforce_eager and len(self.kv_cache_groups) == 1:
            self.graph_runner = CUDAGraphRunner(
                self.model, self.cache.gpu_cache, config.max_num_seqs, max_blocks_per_seq, self.device
            )

    def reset(self) -> None:
        """Forget every request: a new sampler (no random streams) and zeroed timers. The cache tensors stay:
        a slot is always written before it is read."""
        self.sampler = Sampler()
        self.timers: dict[str, float] = defaultdict(float)  # seconds spent per phase, for profiling
        self.input_batch.clear()  # the block tables the steps sent (input_batch.py): none yet
        # The last step's sampled tokens, on the device, and the row of each request that sampled in it: where a
        # step scheduled ahead of the last one's result finds the tokens it feeds (async scheduling).
        self._last_tokens: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    @property
    def block_tables(self) -> dict[str, list[list[int]]]:
        """Request id -> its block table per KV cache group, as the steps sent them (a copy, for checks)."""
        return self.input_batch.as_dict()

    def held(self) -> str:
        """The device memory this runner holds, in words (its KV pool and its weights)."""
        if self.released:
            return "nothing (released)"
        pool = sum(t.numel() * t.element_size() for k, v in self.cache.gpu_tensors for t in (k, v))
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        graphs = "" if self.graph_runner is None else f", {len(self.graph_runner.graphs)} CUDA graph(s)"
        return f"KV pool {format_bytes(pool)} ({self.num_blocks:,} blocks), weights {format_bytes(weights)}{graphs}"

    def free_memory(self) -> None:
        """Give back the device memory: the CUDA graphs and their pool, the cache tensors, the input buffers and
        the weights, then PyTorch's caches (``free_device_memory``). Run by ``LLM.shutdown()`` and when the
        ``LLM`` is dropped; the runner cannot step afterwards. Safe to call twice."""
        if self.released:
            return
        self.released = True
        _LIVE.discard(self)
        self.graph_runner = None
        self.kv_sender = None
        self.sampler = Sampler()  # seeded streams may hold device generators
        del self.cache, self.buffers, self.model
        free_device_memory(self.device)

    def describe(self) -> str:
        """The pool in one line: blocks, bytes, the longest sequence, the device."""
        b, n = self.page_spec.bytes_per_block(self.block_size), self.num_blocks - 1
        where = f"device {self.device}"
        if self.tp is not None:
            heads = f"{self.spec.num_kv_heads} KV head" + ("s" if self.spec.num_kv_heads > 1 else "")
            where = f"on each of {self.tp.size} tensor-parallel ranks ({heads} each), {where}"
        return (
            f"KV pool: {n:,} blocks × {self.block_size} tokens ({format_bytes(b)} per block, {format_bytes(b * n)} "
            f"in all), {self.spec.bytes_per_token:,} B/token, max_model_len {self.max_model_len}, {where}"
        )

    # ---- start-up ---------------------------------------------------------------------------
    def _size_pool(self, config: Config) -> int:
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_bytes is not None or self.device.type != "cuda":
            budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else GiB
            return self.page_spec.capacity(budget, config.block_size).num_blocks  # raises if < one block
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        activation_peak = self._profile_activation_peak(config.max_num_batched_tokens, config.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        num = num_blocks_at_startup(
            total, config.gpu_memory_utilization, weights, activation_peak, self.page_spec, config.block_size
        )
        # vLLM's check: the fraction is of the whole card, so it must be free now. A second engine in one process
        # (a re-run notebook cell) meets the first one's pool here: name it, rather than run out mid-allocation.
        need = num * self.page_spec.bytes_per_block(config.block_size) + activation_peak
        free_device_memory(self.device)  # an engine dropped in a reference cycle gives its memory back first
        if need > torch.cuda.mem_get_info(self.device)[0]:
            raise GPUMemoryError(
                f"gpu_memory_utilization={config.gpu_memory_utilization} sizes this engine's KV pool to "
                f"{num:,} blocks of the card's {format_bytes(total)}, but that memory is not free.\n"
                + gpu_memory_report(self.device, need)
            )
        return num

    def _num_cpu_blocks(self, config: Config) -> int:
        """The CPU swap pool: as asked, or what ``swap_space`` holds (plus the unused block 0), or none."""
        if config.num_cpu_blocks_override is not None:
            return config.num_cpu_blocks_override
        bytes_per_block = self.page_spec.bytes_per_block(self.block_size)
        num = config.swap_space_bytes // bytes_per_block + 1 if config.swap_space_bytes else 0
        if config.preemption_mode == "swap" and num < 2:
            raise ValueError(
                f"swap_space={config.swap_space!r} holds no block of {bytes_per_block:,} bytes: give it at "
                f"least {bytes_per_block:,} bytes"
            )
        return num

    @torch.inference_mode()
    def _profile_activation_peak(self, num_tokens: int, block_size: int) -> int:
        """Run one dummy prefill of ``num_tokens`` tokens on a throw-away cache; measure the memory peak."""
        nb = cdiv(num_tokens, block_size) + 1
        cfg = self.model.config
        cache = CacheEngine(
            cfg.num_hidden_layers, nb, block_size, self.model.num_kv_heads, self.model.head_dim, self.dtype, self.device
        )
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=pos + block_size,
            block_tables=torch.arange(1, nb, dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
        )
        self.model.compute_logits(self.model(ids, pos, cache.gpu_cache, meta)[-1:])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - base

    # ---- warm start ------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int) -> str:
        """Start warm (vLLM: the profile run and ``capture_model``): run the kinds of step the engine will run
        (a long prefill, a prefill chunk beside decodes, decode batches of a few sizes, greedy and random
        sampling), so that Triton compiles their kernels now, then capture every CUDA graph bucket. Nothing is
        written to the cache (every slot is -1) and nothing read from it counts. Returns what it did, in words."""
        t0 = time.perf_counter()
        bs, dev = self.block_size, self.device
        long = max(1, min(max_num_batched_tokens, self.max_model_len) - 1)
        shapes = [[long], [17, 1, 1], [1] * min(3, max_num_seqs), [1] * max_num_seqs, [1]]  # new tokens per row
        for new_tokens in shapes:
            num_rows, total = len(new_tokens), sum(new_tokens)
            # a decode and a prefill chunk have a cached context before their new tokens; the long prefill has none
            context = [n if n == long else min(n + 16, self.max_model_len) for n in new_tokens]
            width = cdiv(max(context), bs)
            meta = AttentionMetadata(
                slot_mapping=torch.full((total,), -1, dtype=torch.long, device=dev),  # write nowhere
                block_tables=torch.zeros(num_rows, width, dtype=torch.int32, device=dev),  # read the null block
                seq_lens=torch.tensor(context, dtype=torch.int32, device=dev),
                cu_seqlens_q=torch.tensor([0, *np.cumsum(new_tokens).tolist()], dtype=torch.int32, device=dev),
                max_query_len=max(new_tokens),
            )
            ids = torch.zeros(total, dtype=torch.long, device=dev)
            positions = torch.cat([torch.arange(c - n, c, device=dev) for n, c in zip(new_tokens, context)])
            logits = self.model.compute_logits(self.model(ids, positions, self.cache.gpu_cache, meta)[-num_rows:])
            assert logits is not None  # one process: it has the whole vocabulary
            params = [SamplingParams(max_tokens=1, temperature=0.0)] + [SamplingParams(max_tokens=1, seed=0)] * (
                num_rows - 1
            )
            Sampler().sample(logits.float(), [("warm-up", i) for i in range(num_rows)], params)
        captured = 0
        if self.graph_runner is not None:
            captured, _ = self.graph_runner.capture_all()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.warm_up_s = time.perf_counter() - t0
        graphs = (
            f"captured {captured} CUDA graphs"
            if self.graph_runner is not None and self.graph_runner.off_reason is None
            else "no CUDA graphs (enforce_eager, or a capture failed)"
        )
        return f"compiled the kernels of {len(shapes)} kinds of step and {graphs} in {self.warm_up_s:.1f} s"

    # ---- a step -----------------------------------------------------------------------------
    def prepare_inputs(
        self, out: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata], torch.Tensor]:
        """The step's tensors in the reused device buffers: ``input_ids``, ``positions``, the attention metadata
        (one per KV cache group) and the sampled rows. Built with array operations from the persistent input
        batch (``input_batch.py``); a learner's plugged-in ``step_inputs`` or ``slot_mapping`` is called as the
        one-token-at-a-time specification instead."""
        if hooks.plugged("step_inputs") is not None or hooks.plugged("slot_mapping") is not None:
            arrays = self._arrays_by_parts(out)
        else:
            arrays = self.input_batch.step_arrays(out)
        buf = self.buffers
        buf.next_step()
        seq_lens, cu = buf.fill("seq_lens", arrays.seq_lens), buf.fill("cu_seqlens_q", arrays.cu_seqlens_q)
        metas = [
            AttentionMetadata(
                slot_mapping=buf.fill("slot_mapping" + suffix, slots),
                block_tables=buf.fill("block_tables" + suffix, table),
                seq_lens=seq_lens,
                cu_seqlens_q=cu,
                max_query_len=arrays.max_query_len,
            )
            for suffix, slots, table in zip(
                ["", *(f"_{g}" for g in range(1, len(arrays.slot_mappings)))], arrays.slot_mappings, arrays.block_tables
            )
        ]
        input_ids = buf.fill("input_ids", arrays.input_ids)
        if len(arrays.placeholders):
            self._fill_placeholders(input_ids, arrays)
        sample_rows = buf.fill("sample_rows", arrays.sample_rows)
        return input_ids, buf.fill("positions", arrays.positions), metas[0] if len(metas) == 1 else metas, sample_rows

    def _arrays_by_parts(self, out: SchedulerOutput) -> StepArrays:
        """The step's arrays from ``step_inputs`` and ``slot_mapping``, a learner's if plugged in (exercises 04
        and 09b), the package's otherwise: the lists a Python loop builds, token by token."""
        build = hooks.plugged("step_inputs") or step_inputs
        slots = hooks.plugged("slot_mapping") or slot_mapping
        ids, positions, cu, seq_lens, sample_rows = build(out.scheduled)
        groups = [self.input_batch.table(s.request_id) for s in out.scheduled]
        per_group = [[g[i] for g in groups] for i in range(len(self.kv_cache_groups))]
        input_ids = np.array(ids, dtype=np.int64)
        placeholders = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN_ID)
        owner = np.repeat(np.arange(len(out.scheduled)), [s.num_new_tokens for s in out.scheduled])
        return StepArrays(
            input_ids,
            np.array(positions, dtype=np.int64),
            np.array(cu, dtype=np.int32),
            np.array(seq_lens, dtype=np.int32),
            np.array(sample_rows, dtype=np.int64),
            [np.asarray(slots(t, out.positions(), out.block_size), dtype=np.int64) for t in per_group],
            [make_block_table_tensor(t).numpy() for t in per_group],
            max((s.num_new_tokens for s in out.scheduled), default=0),
            placeholders,
            [out.scheduled[i].request_id for i in owner[placeholders].tolist()],
        )

    def _fill_placeholders(self, input_ids: torch.Tensor, arrays: StepArrays) -> None:
        """Async scheduling: the tokens the last step sampled are still on the device, and this step was
        scheduled before they came back. Copy each into the row that waits for it, on the device."""
        try:
            rows = [self._last_rows[rid] for rid in arrays.placeholder_owners]
        except KeyError as e:
            raise RuntimeError(
                f"request {e.args[0]!r} feeds a token of the last step, but it sampled nothing in it: the step was "
                "scheduled ahead of a step this runner did not run"
            ) from None
        assert self._last_tokens is not None  # a step sampled: _last_rows is not empty
        dst = self.buffers.fill("placeholder_dst", arrays.placeholders)
        src = self.buffers.fill("placeholder_src", np.array(rows, dtype=np.int64))
        input_ids.index_copy_(0, dst, self._last_tokens.index_select(0, src))

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        """Drop what the runner keeps for requests that left: their block tables, their random streams."""
        self.rpc_drop_tables(request_ids)
        for key in sample_keys:
            self.sampler.forget(key)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step in this process alone and wait for its tokens (``launch(out).result()``)."""
        return self.launch(out).result()

    def launch(self, out: SchedulerOutput) -> PendingOutput:
        """Start one step in this process alone: block copies, the forward pass, and sampling (n tokens for an
        n > 1 first sample), all queued on the device; the tokens come back when the result is asked for. A
        tensor-parallel executor runs the same calls, sending the step to the other ranks before
        ``forward_step``."""
        if not out.scheduled:  # no forward_step to bring the tables up to the step: drop those that left here
            self.release([*out.finished_req_ids, *out.preempted], out.finished_sample_keys)
            return Ready(RunnerOutput())
        self.release([], out.finished_sample_keys)  # first, before anything can fail: they are sent once
        return self.sample_async(out, self.forward_step(out))

    def sample(self, out: SchedulerOutput, logits: torch.Tensor | None) -> RunnerOutput:
        """The step's tokens, waited for (``sample_async(...).result()``)."""
        return self.sample_async(out, logits).result()

    @torch.inference_mode()
    def sample_async(self, out: SchedulerOutput, logits: torch.Tensor | None) -> PendingOutput:
        """The step's tokens from its sampling rows' logits (rank 0's: it gathers every rank's slice of the
        vocabulary), drafts verified; a request whose row cannot be sampled fails alone. The tokens stay on the
        device (the next step may read them there) and come back in one copy when the result is asked for;
        a step that verifies drafts waits for them here."""
        assert logits is not None, "only rank 0 samples"
        t2 = time.perf_counter()
        keys, params, offsets, owners, rows = [], [], [], [], []
        verifying: list[tuple[ScheduledRequest, int]] = []  # requests with drafts, and their first logit row
        row = 0
        for s in out.scheduled:
            if s.spec_token_ids:
                verifying.append((s, row))
                row += len(s.spec_token_ids) + 1
                continue
            root, first = s.sample_key
            for j in range(s.num_samples):  # the j-th sample of a request draws from seed + j
                keys.append((root, first + j))
                offsets.append(first + j)
                params.append(s.sampling_params)
                owners.append(s.request_id)
                rows.append(row)
                row += 1
        if row != logits.shape[0]:
            raise RuntimeError(
                f"the step has {logits.shape[0]} sampling rows but its requests need {row} (with speculative "
                "decoding, a row per draft: a plugged-in step_inputs must add them)"
            )
        plain = logits if not verifying else logits[rows]
        drawn = self.sampler.sample_on_device(plain, keys, params, offsets)
        # What a step scheduled before these tokens reach the host feeds: each request's row (its first sample's)
        self._last_tokens = drawn.tokens
        self._last_rows = {}
        for i, rid in enumerate(owners):
            self._last_rows.setdefault(rid, i)
        pending = SampledOutput(drawn, owners, self.timers)
        for s, first_row in verifying:  # waits for the device: verification reads the tokens one by one
            verified, why = verify(
                self.sampler, logits[first_row : first_row + len(s.spec_token_ids) + 1], s.spec_token_ids,
                s.sample_key, s.sampling_params, s.sample_key[1],
            )  # fmt: skip
            if why is not None:
                pending.errors[s.request_id] = why
            else:
                pending.verified[s.request_id] = verified
        self.timers["sample"] += time.perf_counter() - t2
        return pending

    @torch.inference_mode()
    def forward_step(self, out: SchedulerOutput) -> torch.Tensor | None:
        """What every rank does with a step: its block copies, then the forward pass on its shard, queued on the
        device without waiting for it. Returns the logits of the sampling rows (None on a worker: rank 0 gathers
        them)."""
        t0 = time.perf_counter()
        self.input_batch.apply(out)
        kv_meta = out.kv_connector_metadata
        if kv_meta:  # first: an evicted block's K/V leaves before anything this step writes over it
            self.cache.offload(kv_meta.saves)
        self.cache.swap_out(out.swap_out)
        self.cache.swap_in(out.swap_in)
        self.cache.copy(out.copy_blocks)
        if kv_meta:  # external hits, into blocks allocated this step
            self.cache.onload(kv_meta.loads)
        input_ids, positions, meta, sample_rows = self.prepare_inputs(out)
        t1 = time.perf_counter()
        with span("model"):  # the span a profile splits into kernels and glue
            graphs = self.graph_runner
            if graphs is not None and isinstance(meta, AttentionMetadata) and graphs.why_not(input_ids, meta) is None:
                hidden = graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, self.cache.gpu_cache, meta)
            logits = self.model.compute_logits(hidden.index_select(0, sample_rows))
        if kv_meta and kv_meta.sends and self.kv_sender is not None:  # the K/V must exist first: wait, then ship
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.kv_sender(self.cache, kv_meta.sends)
        self.timers["prepare inputs"] += t1 - t0
        self.timers["model"] += time.perf_counter() - t1
        return logits

    # ---- what an executor may ask every rank (``ExecutorBase.collective_rpc``) ----------------------------
    def rpc(self, method: str, *args: Any) -> Any:
        """This rank's answer to ``rpc_<method>(*args)``: one of the few questions every rank answers."""
        return getattr(self, f"rpc_{method}")(*args)

    def rpc_drop_tables(self, request_ids: list[str]) -> None:
        """Forget the block tables of requests that left (every rank keeps its own copy)."""
        self.input_batch.drop(request_ids)

    def rpc_kv_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.cache.gpu_cache[layer]
        ids = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return k[ids].cpu(), v[ids].cpu()

    def rpc_rank_info(self) -> dict[str, Any]:
        return self.rank_info

    def rpc_comm(self) -> dict[str, float]:
        """This rank's forward time and time in collectives so far (the benchmark's split of a step)."""
        tp = self.tp
        return {
            "model_s": self.timers["model"],
            "comm_s": 0.0 if tp is None else tp.comm_s,
            "num_all_reduces": 0 if tp is None else tp.num_all_reduces,
            "bytes_all_reduced": 0 if tp is None else tp.bytes_all_reduced,
        }

    def rpc_time_all_reduce(self, shape: tuple[int, ...], repeats: int) -> float:
        """Seconds per all-reduce of a ``shape`` tensor in the model's dtype, every rank taking part at once: the
        collective's own cost, without a slow rank to wait for (0 without tensor parallelism)."""
        if self.tp is None:
            return 0.0
        x = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.tp.all_reduce(x)  # the first one may set up buffers
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.tp.all_reduce(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats
