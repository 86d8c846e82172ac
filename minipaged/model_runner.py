"""The model runner: turn one ``SchedulerOutput`` into tensors, run the model, sample: token ids out.

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

The step's index tensors live in ``InputBuffers``: device tensors allocated once, of
the largest size a step can need, and filled in place each step (a step uses a prefix
of each). On a GPU that saves an allocation per tensor per step, and it is what a CUDA
graph will need later: the same addresses every step.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import hooks
from .block_table import make_block_table_tensor, slot_mapping
from .cache_engine import CacheEngine
from .model import AttentionMetadata, LlamaForCausalLM
from .sampler import Sampler
from .scheduler import SchedulerOutput


@dataclass
class RunnerOutput:
    """What a step produced: the sampled token ids of each request that samples, or why it could not."""
    sampled: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class InputBuffers:
    """A step's input tensors, allocated once on the device and reused: each step fills a prefix.

    Sized for the scheduler's limits (``max_num_batched_tokens`` tokens, ``max_num_seqs``
    sequences, ``max_blocks_per_seq`` table columns); a step that needs more (it cannot,
    under those limits) gets a bigger buffer rather than an error.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)

    def fill(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """Copy ``values`` (a CPU tensor) into the front of buffer ``name``; return that view."""
        buf = getattr(self, name)
        if any(v > b for v, b in zip(values.shape, buf.shape)):   # larger than planned: grow, keep going
            buf = torch.zeros([max(v, b) for v, b in zip(values.shape, buf.shape)], dtype=buf.dtype,
                              device=self.device)
            setattr(self, name, buf)
        view = buf[tuple(slice(0, n) for n in values.shape)]
        view.copy_(values, non_blocking=True)
        return view


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, max_blocks_per_seq: int = 64) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.buffers = InputBuffers(max_num_batched_tokens, max_num_seqs, max_blocks_per_seq, cache.device)
        self.sampler = Sampler()
        self.timers: dict[str, float] = defaultdict(float)  # seconds spent per phase, for profiling

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            ids += s.token_ids
            positions += range(s.start, end)
            cu.append(cu[-1] + s.num_new_tokens)
            sample_rows += [cu[-1] - 1] * s.num_samples
        buf = self.buffers
        slots = hooks.plugged("slot_mapping") or slot_mapping   # a learner's own (exercise 04), if plugged in
        meta = AttentionMetadata(
            slot_mapping=buf.fill("slot_mapping", slots([s.block_ids for s in out.scheduled], out.positions(),
                                                        out.block_size)),
            block_tables=buf.fill("block_tables", make_block_table_tensor([s.block_ids for s in out.scheduled])),
            seq_lens=buf.fill("seq_lens", torch.tensor([s.start + s.num_new_tokens for s in out.scheduled],
                                                       dtype=torch.int32)),
            cu_seqlens_q=buf.fill("cu_seqlens_q", torch.tensor(cu, dtype=torch.int32)),
            max_query_len=max((s.num_new_tokens for s in out.scheduled), default=0))
        return (buf.fill("input_ids", torch.tensor(ids, dtype=torch.long)),
                buf.fill("positions", torch.tensor(positions, dtype=torch.long)), meta, sample_rows)

    def release(self, sample_keys: list[tuple[str, int]]) -> None:
        """Drop what the runner keeps for requests that left: their random streams."""
        for key in sample_keys:
            self.sampler.forget(key)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one step: block copies, the forward pass, and sampling (n tokens for an n > 1 first sample)."""
        result = RunnerOutput()
        self.release(out.finished_sample_keys)   # first, before anything can fail: they are sent once
        if not out.scheduled:
            return result
        t0 = time.perf_counter()
        self.cache.swap_out(out.swap_out)
        self.cache.swap_in(out.swap_in)
        self.cache.copy(out.copy_blocks)
        input_ids, positions, meta, sample_rows = self.prepare_inputs(out)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, self.cache.gpu_cache, meta)
        logits = self.model.compute_logits(hidden[sample_rows])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        keys, params, offsets, owners = [], [], [], []
        for s in out.scheduled:
            root, first = s.sample_key
            for j in range(s.num_samples):   # the j-th sample of a request draws from seed + j
                keys.append((root, first + j))
                offsets.append(first + j)
                params.append(s.sampling_params)
                owners.append(s.request_id)
        tokens, errors = self.sampler.sample(logits, keys, params, offsets)
        for row, (rid, token) in enumerate(zip(owners, tokens)):
            if row in errors:
                result.errors.setdefault(rid, errors[row])
            else:
                result.sampled.setdefault(rid, []).append(token)
        for rid in result.errors:            # a request with a failed row samples nothing this step
            result.sampled.pop(rid, None)
        self.timers["prepare inputs"] += t1 - t0
        self.timers["model"] += t2 - t1
        self.timers["sample"] += time.perf_counter() - t2
        return result
