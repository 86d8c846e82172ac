"""The model runner: turn one ``SchedulerOutput`` into tensors, run the model, sample.

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
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch

from .block_table import make_block_table_tensor
from .cache_engine import CacheEngine
from .model import AttentionMetadata, LlamaForCausalLM
from .scheduler import SchedulerOutput


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.timers: dict[str, float] = defaultdict(float)  # seconds spent per phase, for profiling

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        cu = [0]
        sample_rows: list[int] = []
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            ids += s.request.all_token_ids[s.start:end]
            positions += range(s.start, end)
            cu.append(cu[-1] + s.num_new_tokens)
            sample_rows += [cu[-1] - 1] * s.num_samples
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=out.slot_mapping().to(dev),
            block_tables=make_block_table_tensor([s.block_ids for s in out.scheduled]).to(dev),
            seq_lens=torch.tensor([s.start + s.num_new_tokens for s in out.scheduled], dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            max_query_len=max((s.num_new_tokens for s in out.scheduled), default=0))
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, sample_rows)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run one step; return the logits of every sampling row (n rows for an n > 1 first sample)."""
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
        self.timers["prepare inputs"] += t1 - t0
        self.timers["model"] += t2 - t1
        return logits
