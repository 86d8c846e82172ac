"""The model runner: the model's side of the engine. At start-up it loads the weights, has the KV pool sized
(``kv_pool_plan.py``) and allocates the cache tensors (``ModelRunner(config)``); each step it turns one
``SchedulerOutput`` into tensors (``step_inputs.py``), runs the model and samples (``sampled_output.py``):
token ids out.

Before the forward pass it performs the step's block copies on the cache engine
(swap out, swap in, copy-on-write), in that order: a block swapped out this step
may be handed to another request in the same step, so its data must leave first.

The runner keeps the requests' block tables between steps and builds a step's arrays with array operations
(``input_batch.py``: the persistent input batch), into device buffers allocated once.

Nothing here waits for the GPU: ``launch`` queues the copies, the forward pass and the sampling, and the
tokens come back when the step's result is asked for (one copy, ``SampledOutput.result``). That is what lets
the engine schedule the next step while this one runs (``engine/overlap.py``); ``warm_up`` compiles the
kernels and captures the CUDA graphs before the first request. What an executor asks every rank by name is
``worker_rpc.py``'s; what the device has free and who holds it, ``gpu_memory.py``'s.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import Config, model_config_dtype, resolve_dtype
from ..core.block_pool import BlockHash
from ..core.scheduler_output import PendingOutput, Ready, RunnerOutput, SchedulerOutput
from ..kv_math import format_bytes
from ..model import AttentionMetadata, LlamaForCausalLM
from ..model.cuda_graphs import CUDAGraphRunner
from ..model.llama import config_from_dict
from ..profiling import span
from ..sampling_params import SamplingParams
from ..utils import cdiv
from .cache_engine import CacheEngine
from .cpu_threads import CpuThreads
from .gpu_memory import caller_site, free_device_memory, track, untrack
from .input_batch import InputBatch, InputBuffers
from .kv_pool_plan import KVPoolPlan
from .sampled_output import SampledOutput
from .sampler import Sampler
from .step_inputs import InputPreparer, StepTensors

if TYPE_CHECKING:
    from ..distributed import TPGroup

__all__ = ["KVSendFn", "ModelRunner"]

# A KV producer's sender (disaggregated prefill, ``engine/disagg.py``): after the forward, it ships the blocks the
# step filled (``kv_connector_metadata.sends``: block id and hash) to the engine that decodes.
KVSendFn = Callable[[CacheEngine, list[tuple[int, BlockHash]]], None]


class ModelRunner:
    """The model's side of the engine (nano-vllm's ``ModelRunner``): it loads the weights, has the KV pool sized
    from the memory they leave (``KVPoolPlan``), holds the cache tensors, and runs steps.

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
        self.plan = plan = KVPoolPlan(config, self.model, self.dtype, self.device, tp)
        # The plan's figures, kept as the runner's own: the cache, the buffers, the graphs and the notebooks read them
        self.spec, self.page_spec, self.kv_cache_groups = plan.spec, plan.page_spec, plan.kv_cache_groups
        self.layer_tensors, self.block_size, self.max_model_len = (
            plan.layer_tensors,
            plan.block_size,
            plan.max_model_len,
        )
        self.num_blocks, self.num_cpu_blocks = plan.num_blocks, plan.num_cpu_blocks
        self.num_offload_blocks, self.rank_info = plan.num_offload_blocks, plan.rank_info
        self._allocate(config)
        track(self)
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
        self.inputs = InputPreparer(self.input_batch, self.buffers, len(self.kv_cache_groups))
        self.kv_sender: KVSendFn | None = None  # a KV producer's (``attach_kv_sender``)
        self.graph_runner: CUDAGraphRunner | None = None  # decode steps replayed from CUDA graphs (a GPU only)
        # A one-process CPU engine: the threads its steps run on, fewer while another program holds a core
        self.cpu_threads = CpuThreads(config.cpu_threads) if self.device.type == "cpu" and self.tp is None else None
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
        # The last step's sampled tokens, on the device: where a step scheduled ahead of the last one's result
        # finds the tokens it feeds (async scheduling).
        self.inputs.last = None

    def attach_kv_sender(self, sender: KVSendFn | None) -> None:
        """Make this runner a KV producer (disaggregated prefill): after each forward that filled blocks to send
        (``kv_connector_metadata.sends``), ``sender(cache, sends)`` ships them. None detaches it."""
        self.kv_sender = sender

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
        untrack(self)
        self.graph_runner = None
        self.kv_sender = None
        if self.cpu_threads is not None:  # the process's thread count as the engine found it
            self.cpu_threads.release()
        self.sampler = Sampler()  # seeded streams may hold device generators
        del self.cache, self.buffers, self.model, self.inputs
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
    def prepare_inputs(self, out: SchedulerOutput) -> StepTensors:
        """The step's tensors in the reused device buffers: ``input_ids``, ``positions``, the attention metadata
        (one per KV cache group) and the sampled rows (``InputPreparer.prepare``)."""
        return self.inputs.prepare(out)

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        """Drop what the runner keeps for requests that left: their block tables, their random streams."""
        self.input_batch.drop(request_ids)
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
        t0 = time.perf_counter()
        pending = SampledOutput.draw(self.sampler, out, logits, self.timers)
        self.inputs.last = pending  # what a step scheduled before these tokens reach the host feeds
        pending.verify_drafts(self.sampler, logits)
        self.timers["sample"] += time.perf_counter() - t0
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
        if self.cpu_threads is not None:
            self.cpu_threads.after_step()
        return logits
