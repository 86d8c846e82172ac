"""``LLM``: the finished engine — SmolLM2 served from a paged KV cache with continuous batching.

Everything the course built meets here, in a loop that vLLM users will recognise::

    prompts ─▶ Request ─▶ Scheduler.schedule() ─▶ ModelRunner.execute() ─▶ Scheduler.update_from_output()
                              │                     (forward, then Sampler)             │
                              │ KVCacheManager / BlockPool     CacheEngine (K/V tensors) │
                              └────────────────── blocks in, blocks out ─────────────────┘

At start-up the engine sizes its block pool: on a GPU from what the weights and
an activation peak leave of ``gpu_memory_utilization`` of the card (chapter 01's
start-up formula), on a CPU from a byte budget, ``kv_cache_memory``.
"""
from __future__ import annotations

import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import hooks
from .cache_engine import CacheEngine
from .config import Config, model_config_dtype, resolve_dtype
from .kv_cache_manager import KVCacheManager
from .utils import cdiv
from .kv_math import GiB, KVSpec, format_bytes, num_blocks_at_startup
from .model import LlamaForCausalLM
from .model_runner import ModelRunner
from .request import Request
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .snapshot import Snapshot

STEP_STATS_KEPT = 100_000
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


def _has_tokenizer(path: str | os.PathLike) -> bool:
    return any((Path(path) / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


class LLM:
    """A small offline engine with vLLM's shape: ``LLM(...).generate(prompts, SamplingParams(...))``.

    ``LLM(model=None, **kwargs)``: the keyword arguments are the fields of :class:`minipaged.config.Config`
    (``dtype``, ``device``, ``block_size``, ``kv_cache_memory``, ``gpu_memory_utilization``,
    ``num_gpu_blocks_override``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``allow_long_max_model_len``, ``enable_prefix_caching``, ``preemption_mode``, ``swap_space``,
    ``attention_backend``, ``watermark``), all checked before the model loads.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        from .kernels import get_attention_backend
        from .model_loader import ensure_converted, load_tokenizer, quiet_transformers

        self.config = cfg = Config.from_kwargs(model, kwargs)
        self.device = cfg.torch_device
        path = ensure_converted(progress=True) if model is None else model
        self.dtype = resolve_dtype(cfg.dtype, model_config_dtype(path), self.device)
        backend = get_attention_backend(cfg.attention_backend).name
        if backend == "triton":   # refuse a block size the kernels cannot tile now, not at the first step
            from .kernels.launch import kv_tile_n
            kv_tile_n(cfg.block_size, 16)
        with quiet_transformers():
            self.model = LlamaForCausalLM.from_pretrained(path, dtype=self.dtype, device=self.device, backend=backend)
        self.tokenizer = load_tokenizer(path) if _has_tokenizer(path) else None  # a bare test model has none
        hf = self.model.config
        self.spec = KVSpec(hf.num_hidden_layers, hf.num_key_value_heads, self.model.head_dim,
                           dtype_bytes=self.dtype.itemsize, num_attention_heads=hf.num_attention_heads,
                           name=getattr(hf, "name_or_path", "") or "model")
        self.block_size = block_size = cfg.block_size
        self.num_blocks = self._size_pool()
        self.max_model_len = self._max_model_len(getattr(hf, "max_position_embeddings", None))
        bytes_per_block = self.spec.bytes_per_block(block_size)
        num_cpu_blocks = cfg.swap_space_bytes // bytes_per_block + 1 if cfg.swap_space_bytes else 0
        if cfg.preemption_mode == "swap" and num_cpu_blocks < 2:
            raise ValueError(f"swap_space={cfg.swap_space!r} holds no block of {bytes_per_block:,} bytes: give it at "
                             f"least {bytes_per_block:,} bytes")
        self.cache = CacheEngine(hf.num_hidden_layers, self.num_blocks, block_size, hf.num_key_value_heads,
                                 self.model.head_dim, self.dtype, self.device, num_cpu_blocks=num_cpu_blocks)
        self._num_cpu_blocks = num_cpu_blocks
        self._build_core()
        eos = getattr(hf, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self._t0 = time.perf_counter()

    def _build_core(self) -> None:
        """Everything that holds requests and blocks, around the loaded weights and the cache tensors."""
        cfg = self.config
        self.kv_cache_manager = KVCacheManager(self.block_size, self.num_blocks,
                                               enable_caching=cfg.enable_prefix_caching, watermark=cfg.watermark,
                                               num_cpu_blocks=self._num_cpu_blocks)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=cfg.max_num_seqs,
                                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                                   max_model_len=self.max_model_len,
                                                   preemption_mode=cfg.preemption_mode), self.kv_cache_manager)
        self.runner = ModelRunner(self.model, self.cache, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                  max_num_seqs=cfg.max_num_seqs,
                                  max_blocks_per_seq=cdiv(self.max_model_len, self.block_size))
        self.sampler = self.runner.sampler
        # One row per step, what the widgets and benchmarks plot: the latest STEP_STATS_KEPT steps only.
        self.step_stats: deque[dict[str, Any]] = deque(maxlen=STEP_STATS_KEPT)
        self.num_steps = 0   # steps run so far (a plugged-in part's error names the step it failed in)
        # The requests added and not yet handed back (the scheduler forgets a request when it finishes).
        self._requests: dict[str, Request] = {}
        self._counter = 0

    def reset(self) -> None:
        """A fresh engine around the same weights: every request dropped, an empty pool and prefix cache,
        new scheduler and runner (a second ``LLM`` would load the model again). The cache tensors are
        kept: a slot is always written before it is read."""
        self._build_core()

    # ---- start-up -------------------------------------------------------------------------------
    def _size_pool(self) -> int:
        """Blocks in the pool: as asked, or from the CPU byte budget, or from what the GPU has left."""
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if cfg.kv_cache_bytes is not None or self.device.type != "cuda":
            budget = cfg.kv_cache_bytes if cfg.kv_cache_bytes is not None else GiB
            return self.spec.capacity(budget, cfg.block_size).num_blocks  # raises if < one block
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        activation_peak = self._profile_activation_peak(cfg.max_num_batched_tokens, cfg.block_size)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return num_blocks_at_startup(total, cfg.gpu_memory_utilization, weights, activation_peak, self.spec,
                                     cfg.block_size)

    def _max_model_len(self, max_pos: int | None) -> int:
        """``max_model_len`` as asked (not past the model's positions unless allowed), or the model's,
        lowered with a warning to what the pool can hold."""
        cfg, block_size, usable = self.config, self.config.block_size, self.num_blocks - 1
        asked = cfg.max_model_len
        if asked is not None and max_pos is not None and asked > max_pos and not cfg.allow_long_max_model_len:
            raise ValueError(f"max_model_len={asked} is longer than the model's max_position_embeddings="
                             f"{max_pos}: positions past it were never trained. Lower it, or pass "
                             "allow_long_max_model_len=True if you know the model extrapolates")
        max_model_len = asked or min(max_pos or 8192, 8192)
        if asked is None and max_model_len > usable * block_size:
            # Not asked for: fit the longest sequence the pool can hold (a small CPU budget is a fine choice).
            warnings.warn(f"max_model_len lowered from {max_model_len} to {usable * block_size} tokens: the KV "
                          f"pool holds {usable} blocks of {block_size}. Give the cache more memory for longer "
                          "sequences", stacklevel=3)
            max_model_len = usable * block_size
        if cdiv(max_model_len, block_size) > usable:
            raise ValueError(f"max_model_len={max_model_len} needs {cdiv(max_model_len, block_size)} "
                             f"blocks of {block_size} tokens but the KV pool has only {usable}: lower "
                             "max_model_len or give the cache more memory")
        return max_model_len

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
        """A string is tokenized as it is; token ids (a list, or a 1-D integer tensor or numpy array, as
        vLLM's ``TokensPrompt``) are used as they are; chat messages get the template."""
        import numpy as np

        from .model_loader import chat_prompt_ids

        if prompt is None:
            raise ValueError("a prompt is None: pass a string, a list of token ids, or a list of chat messages")
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            if prompt.ndim != 1 or not (prompt.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)
                                        or (isinstance(prompt, np.ndarray) and prompt.dtype.kind in "iu")):
                raise ValueError(f"a {type(prompt).__name__} prompt must be 1-D integer token ids, got shape "
                                 f"{tuple(prompt.shape)} and dtype {prompt.dtype}")
            prompt = [int(t) for t in prompt.tolist()]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, dict):
            raise ValueError("a chat prompt is a *list* of messages: [{'role': 'user', 'content': ...}]")
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string, a list of token ids, or a list of chat messages; got "
                             f"{type(prompt).__name__}")
        if prompt and all(isinstance(m, dict) for m in prompt):
            for i, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise ValueError(f"chat message {i} must have a 'role' and a 'content', both strings; got "
                                     f"{sorted(m)}")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass prompts as lists of token ids")
            return chat_prompt_ids(self.tokenizer, list(prompt))
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            raise ValueError("a prompt is a string, a list of token ids, or a list of chat messages "
                             "({'role': ..., 'content': ...}); this one mixes other things: "
                             f"{sorted({type(t).__name__ for t in prompt})}")
        return [int(t) for t in prompt]

    def _checked_ids(self, prompt: Prompt, request_id: str) -> list[int]:
        ids = self.tokenize(prompt)
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if not ids or bad:
            raise ValueError(f"request {request_id!r}: " + ("empty prompt" if not ids else f"token ids {bad[:5]} are "
                             f"outside the vocabulary (0..{vocab - 1})"))
        return ids

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one request (checked first: a bad one raises and queues nothing); returns its id."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        elif not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#', got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self._checked_ids(prompt, request_id)
        req = Request(request_id, ids, sampling_params=params, eos_token_id=self.eos_token_id,
                      arrival_time=self._now())
        self.scheduler.add_request(req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Stop requests wherever they are (waiting, running, swapped) and give back their blocks.

        Unknown or already finished ids are ignored, as in vLLM. Their outputs so far are dropped.
        """
        for rid in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if rid not in self._requests:
                continue
            for req in reversed(self._samples(rid)):   # forked samples first, then the request itself
                self.scheduler.abort(req.request_id)   # the runner drops its state with the next step
            del self._requests[rid]
        self._release_if_idle()

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[str]:
        """One scheduling step; returns the ids of the requests that finished in it.

        A request whose logits or sampling fail (NaN logits, say) finishes with an ``error``;
        the rest of the step goes on. Any other exception leaves the step undone: the scheduler
        applies a step's results only once they are all in (see ``update_from_output``).
        """
        self.num_steps += 1
        # A learner's part may fail half-way through a section the package's own pieces never fail in: with
        # parts plugged in, the whole bookkeeping is saved first and put back if the step fails (see snapshot).
        saved = Snapshot.take(self.scheduler.bookkeeping()) if hooks.active() else None
        if saved is not None:
            hooks.at_exit(id(self), self._forget_prefix_cache_of_parts())
        try:
            finished = self._step()
        except BaseException as exc:   # the step did not happen
            if saved is not None:
                saved.restore()
            else:   # no block hashed for it stays findable
                self.kv_cache_manager.rollback_step()
            if isinstance(exc, hooks.PartError) and exc.step is None:
                exc.step = self.num_steps
                exc.add_note(f"(engine step {self.num_steps})")
            raise
        return finished   # a step that ran is committed by the next schedule()

    def _release_if_idle(self) -> None:
        """With nothing left to schedule no next step will tell the runner who left: tell it now."""
        if not self.scheduler.has_unfinished():
            self.runner.release(self.scheduler.take_finished()[1])

    def _forget_prefix_cache_of_parts(self) -> Callable[[], None]:
        """What a ``parts.use`` block does to this engine when it ends: forget every prefix-cache entry, since a
        learner's code may have computed, hashed or (unchecked) written any of them. Holds the engine weakly."""
        me = weakref.ref(self)

        def forget() -> None:
            llm = me()
            if llm is not None:
                llm.kv_cache_manager.forget_prefix_cache()
        return forget

    def _step(self) -> list[str]:
        """nano-vllm's three calls: schedule, run (forward + sample), postprocess."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(out)
        t2 = time.perf_counter()
        for rid, why in result.errors.items():   # this request alone cannot go on
            self.scheduler.finish_with_error(rid, f"request {rid!r}: {why}")
        finished = self.scheduler.update_from_output(out, result.sampled, now=self._now())
        self._release_if_idle()
        timers = self.runner.timers
        timers["schedule"] += t1 - t0
        timers["update"] += time.perf_counter() - t2
        self.step_stats.append(dict(
            time=self._now(), running=len(self.scheduler.running), waiting=len(self.scheduler.waiting) + len(self.scheduler.swapped),
            blocks_used=self.num_blocks - 1 - self.kv_cache_manager.get_num_free_blocks(),
            tokens=out.total_num_scheduled_tokens, preempted=len(out.preempted)))
        return list(result.errors) + [r.request_id for r in finished]

    def _samples(self, request_id: str) -> list[Request]:
        """The request and the extra samples forked from it so far (an ``n > 1`` request forks at its first token)."""
        main = self._requests[request_id]
        return [main, *main.children]

    def _finished(self, request_id: str) -> bool:
        reqs = self._samples(request_id)
        main = reqs[0]
        # Every sample done; an n > 1 request that ended before its first token (rejected, aborted,
        # failed) never forks.
        return all(r.is_finished for r in reqs) and (len(reqs) == main.sampling_params.n
                                                     or main.num_output_tokens == 0)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (for ``add_request`` + ``step`` users). A finished request is
        handed back once and then forgotten, so a long-running engine keeps no finished state."""
        if request_id not in self._requests:
            raise ValueError(f"unknown request id {request_id!r} (never added, aborted, or already handed back)")
        out = self._output(request_id)
        if out.finished:
            del self._requests[request_id]
        return out

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
        try:
            lengths = {rid: -1 for rid in ids}
            pending = set(ids)
            for rid in ids:  # rejected at once: report them first
                if self._finished(rid):
                    pending.discard(rid)
                    yield self.get_output(rid)
            while pending:
                self.step()
                for rid in sorted(pending, key=ids.index):
                    n = sum(r.num_output_tokens for r in self._samples(rid))
                    done = self._finished(rid)
                    if n != lengths[rid] or done:
                        lengths[rid] = n
                        if done:
                            pending.discard(rid)
                        yield self.get_output(rid) if done else self._output(rid)
        finally:   # closed early, interrupted or failed: this call's requests leave nothing behind
            self.abort([rid for rid in ids if rid in self._requests])

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Serve a batch of prompts to the end; outputs come back in the order of the prompts."""
        from tqdm.auto import tqdm

        ids = self._add_all(prompts, sampling_params)
        try:
            show = len(ids) >= 16 if use_tqdm is None else use_tqdm
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not show) as bar:
                done = sum(self._finished(r) for r in ids)
                bar.update(done)
                while done < len(ids):
                    self.step()
                    now_done = sum(self._finished(r) for r in ids)
                    bar.update(now_done - done)
                    done = now_done
            return [self.get_output(r) for r in ids]
        finally:   # Ctrl-C or a failed step: abort this call's requests, free their blocks
            self.abort([rid for rid in ids if rid in self._requests])

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}`` messages) or a batch of them, through the chat template."""
        batch = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate(batch, sampling_params, use_tqdm=use_tqdm)

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        """Check the whole batch, then queue it: a bad prompt anywhere queues nothing."""
        import numpy as np

        if prompts is None:
            raise ValueError("prompts is None: pass a prompt or a list of prompts")
        single = (isinstance(prompts, (str, dict)) or (isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 1)
                  or (isinstance(prompts, (list, tuple)) and bool(prompts)
                      and isinstance(prompts[0], (int, np.integer, dict))))
        batch = [prompts] if single else list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(batch):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(batch)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(batch)
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(p).__name__}")
        ids = [str(self._counter + i) for i in range(len(batch))]
        checked = [self._checked_ids(p, rid) for p, rid in zip(batch, ids)]   # all of them, before queueing any
        self._counter += len(batch)
        queued: list[str] = []
        try:
            for rid, ids_, p in zip(ids, checked, params):
                self.add_request(ids_, p, request_id=rid)
                queued.append(rid)
        except BaseException:
            self.abort(queued)
            raise
        return ids

    def profile(self) -> dict[str, float]:
        """Seconds spent so far in each phase of the step loop."""
        return dict(self.runner.timers)
