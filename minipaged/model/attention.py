"""Paged attention as the model sees it: write this step's K/V, then attend through the block table.

One ``AttentionMetadata`` describes a whole step and is shared by every layer::

    sequence        a (prefill chunk)      b (decode)   c (decode)
    new tokens      a5 a6 a7 a8            b17          c3
    cu_seqlens_q    0            4          5            6
    seq_lens        9                       18           4      (cached + new)
    slot_mapping    one slot per new token: physical_block · block_size + offset
    block_tables    one row of physical block ids per sequence (padded)

A step made only of decodes (every sequence brings one token) goes to the
decode kernel; anything else to the prefill kernel, which handles a decode as a
prefill of length one.

Both backends check the metadata on the first layer of a step and plan once; the
other layers reuse the plan: thirty layers read the same block tables, so validating
and planning thirty times would be wasted work. The ``torch`` backend's plan is an
``AttentionPlan`` (gather indices and masks, see ``kernels.reference``); the
``triton`` backend's is a ``TritonPlan``: the decode split count (which asks the GPU
for its SM count) and the longest query run, which the kernels then take as given
(``checked=True``, no host read-back of ``cu_seqlens_q`` per layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding, write nothing
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: every token of the sequence after this step
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: where each sequence's new tokens start
    max_query_len: int
    _plan: object = field(default=None, repr=False)  # the backend's plan of this step, built by the first layer

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class TritonPlan:
    num_splits: int | None   # decode-only steps: KV segments per sequence
    max_query_len: int


class PagedAttention:
    """Picks the kernels of one backend: ``torch`` (reference, the CPU default) or ``triton``."""

    def __init__(self, backend: str = "torch") -> None:
        from .. import kernels

        self.ops = kernels.get_attention_backend(backend)
        self.backend = self.ops.name

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.backend == "torch":
            return self._torch(q, k, v, key_cache, value_cache, meta, scale)
        if meta._plan is None:
            meta._plan = self._plan_triton(q, k, v, key_cache, value_cache, meta, scale)
        plan: TritonPlan = meta._plan
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, checked=True)
        if meta.is_decode_only:
            return self.ops.paged_decode_attention(q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                                   scale, num_splits=plan.num_splits, checked=True)
        return self.ops.paged_prefill_attention(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                                meta.seq_lens, scale, max_query_len=plan.max_query_len, checked=True)

    @staticmethod
    def _plan_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> TritonPlan:
        """First layer of a step: every check the kernels would make, once; then what they need to launch."""
        from ..kernels import paged_decode, validation

        on_cpu = q.device.type == "cpu"   # value checks read the tensors: free on a CPU, a sync on a GPU
        validation.check_reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, check_values=on_cpu)
        validation.check_paged_prefill(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                       meta.seq_lens, scale, check_values=on_cpu)
        validation.check_triton_runtime(q.dtype, q.device)
        validation.check_last_dim_contiguous(query=q, key=k, value=v, key_cache=key_cache, value_cache=value_cache)
        num_splits = None
        if meta.is_decode_only and q.shape[0]:
            capacity = meta.block_tables.shape[1] * key_cache.shape[1]
            num_splits = paged_decode.default_num_splits(q.shape[0], key_cache.shape[2], capacity, q.device)
        return TritonPlan(num_splits, meta.max_query_len)

    def _torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from ..kernels import reference, validation

        if meta._plan is None:  # first layer of the step: check everything once, then plan
            validation.check_reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
            validation.check_paged_prefill(q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q,
                                           meta.seq_lens, scale)
            keep = meta.slot_mapping >= 0
            write = None if bool(keep.all()) else keep
            plan = reference.plan_attention(meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, key_cache.shape[1])
            meta._plan = (write, meta.slot_mapping.long() if write is None else meta.slot_mapping[write].long(), plan)
        write, slots, plan = meta._plan
        if write is None:
            reference.write_slots(k, v, key_cache, value_cache, slots)
        else:
            reference.write_slots(k[write], v[write], key_cache, value_cache, slots)
        return reference.attend(plan, q, key_cache, value_cache, scale)
