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

**Built once per step, per backend** (vLLM's attention-metadata builders). Thirty
layers read the same block tables, so checking and planning them thirty times would
be wasted work. ``PagedAttention.build_metadata`` runs once per forward pass (the
model calls it before its first layer): it checks the step's index tensors against
the cache and returns the backend's own metadata, which every layer then uses as is:

    TorchAttentionMetadata    the rows to write and their slots, and an ``AttentionPlan``
                              (gather indices and masks, ``kernels.torch_backend``); ``fused`` when
                              the compiled CPU kernels take the whole layer's attention: RoPE, the
                              K/V write and attention straight from the QKV projection's output
                              (``rope_write_attend``), no PyTorch op in between
    TritonAttentionMetadata   the decode split count (it asks the GPU for its SM count);
                              the kernels are then called with ``checked=True`` and read
                              ``max_query_len`` from here, not back from the device
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .. import hooks
from ..profiling import span

# The kernels a learner may write in the backend's place (exercises 05, 05b, 05c and 05d;
# ``minipaged.classroom.parts``);
# their signatures are the reference kernels' (``kernels.reference``), which stand in for any not plugged in.
SEAM = hooks.Seam(
    "paged_attention",
    reshape_and_cache="PagedAttention: write this step's K/V into the paged cache",
    paged_decode_attention="PagedAttention: the attention of a decode-only step",
    paged_prefill_attention="PagedAttention: the attention of a step with new prompt tokens (puzzle 6's kernel)",
)


@dataclass
class AttentionMetadata:
    """What every backend needs of a step (the model runner fills it)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = padding, write nothing
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: every token of the sequence after this step
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]: where each sequence's new tokens start
    max_query_len: int

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    def common(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(AttentionMetadata)}


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    write_rows: torch.Tensor | None = None  # the new K/V rows to write (None: all of them)
    write_slots: torch.Tensor | None = None  # int64, their slots
    plan: Any = None  # kernels.torch_backend.AttentionPlan
    fused: bool = False  # rope_write_attend may run (the compiled kernels, no learner's part plugged in)
    sliding_window: int | None = None  # the layers using this metadata see only that many positions back


@dataclass
class TritonAttentionMetadata(AttentionMetadata):
    num_splits: int | None = None  # decode-only steps: KV segments per sequence


class PagedAttention:
    """Picks the kernels of one backend: ``torch`` (``kernels.torch_backend``, the CPU default) or ``triton``;
    a learner's kernels (``SEAM``) in their place when plugged in."""

    def __init__(self, backend: str = "torch") -> None:
        from .. import kernels

        self.ops = kernels.get_attention_backend(backend)
        self.backend = self.ops.name

    def build_metadata(
        self,
        meta: AttentionMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_q_heads: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ) -> TorchAttentionMetadata | TritonAttentionMetadata:
        """Check a step's metadata once against the cache, and plan it for this backend; with a
        ``sliding_window``, for layers that see only that many positions back (the PyTorch backend's masks: the
        compiled CPU kernel and the Triton kernels have no window)."""
        if isinstance(meta, (TorchAttentionMetadata, TritonAttentionMetadata)):
            return meta
        if sliding_window is not None and (self.backend != "torch" or SEAM.replaced()):
            raise ValueError(
                f"sliding-window attention runs on the PyTorch backend's kernels only, not on {self.backend!r} "
                "or a learner's plugged-in kernel: use attention_backend='torch'"
            )
        q = self._check_against_cache(meta, key_cache, value_cache, num_q_heads, dtype)
        if self.backend == "torch":
            return self._plan_torch(meta, q, key_cache, value_cache, sliding_window)
        return self._plan_triton(meta, key_cache, value_cache, dtype)

    @staticmethod
    def _check_against_cache(
        meta: AttentionMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        num_q_heads: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The kernels' own input checks, run once for the step instead of once per layer, on stand-ins with the
        shapes, dtype and device of this step's q and k/v (one element, expanded). Returns the q stand-in."""
        from ..kernels import validation

        num_tokens, num_kv_heads, head_dim = meta.slot_mapping.shape[0], key_cache.shape[2], key_cache.shape[3]
        dev = key_cache.device
        q = torch.empty((1, num_q_heads, head_dim), dtype=dtype, device=dev).expand(num_tokens, -1, -1)
        kv = torch.empty((1, num_kv_heads, head_dim), dtype=dtype, device=dev).expand(num_tokens, -1, -1)
        on_cpu = dev.type == "cpu"  # value checks read the tensors: free on a CPU, a sync on a GPU
        validation.check_reshape_and_cache(kv, kv, key_cache, value_cache, meta.slot_mapping, check_values=on_cpu)
        validation.check_paged_prefill(
            q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, 1.0, check_values=on_cpu
        )
        return q

    @staticmethod
    def _plan_torch(
        meta: AttentionMetadata,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        sliding_window: int | None,
    ) -> TorchAttentionMetadata:
        """The PyTorch backend's plan: the rows to write and their slots (padding left out), the gather indices
        and masks, and whether the compiled CPU kernels may take the whole layer (``fused``)."""
        from ..kernels import cpu_kernel, torch_backend

        keep = meta.slot_mapping >= 0
        rows = None if bool(keep.all()) else keep
        slots = meta.slot_mapping.long() if rows is None else meta.slot_mapping[rows].long()
        plan = torch_backend.plan_attention(
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            key_cache.shape[1],
            in_place=sliding_window is None and cpu_kernel.usable(key_cache, value_cache),
            sliding_window=sliding_window,
        )
        fused = plan.in_place is not None and cpu_kernel.fits_layer_ops(q, key_cache) and not SEAM.replaced()
        return TorchAttentionMetadata(
            **meta.common(), write_rows=rows, write_slots=slots, plan=plan, fused=fused, sliding_window=sliding_window
        )

    @staticmethod
    def _plan_triton(
        meta: AttentionMetadata, key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype
    ) -> TritonAttentionMetadata:
        """The Triton backend's: its runtime checked once, and a decode-only step's split count (the GPU's SM
        count decides it)."""
        from ..kernels import paged_decode, validation

        validation.check_triton_runtime(dtype, key_cache.device)
        validation.check_last_dim_contiguous(key_cache=key_cache, value_cache=value_cache)
        num_splits = None
        if meta.is_decode_only and meta.seq_lens.shape[0]:
            capacity = meta.block_tables.shape[1] * key_cache.shape[1]
            num_splits = paged_decode.default_num_splits(
                meta.seq_lens.shape[0], key_cache.shape[2], capacity, key_cache.device
            )
        return TritonAttentionMetadata(**meta.common(), num_splits=num_splits)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        with span("paged_attention"):  # a named span in a profile, nothing else
            return self._call(q, k, v, key_cache, value_cache, meta, scale)

    def _call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if not isinstance(meta, (TorchAttentionMetadata, TritonAttentionMetadata)):
            # Called on its own (chapter 09 runs one layer by hand): plan for this call. Inside the model the
            # metadata arrives built, once per step, from LlamaModel.forward.
            meta = self.build_metadata(meta, key_cache, value_cache, q.shape[1], q.dtype)
        if SEAM.replaced():  # a learner's own (exercises 05, 05b, 05c, 05d)
            return self._with_parts(q, k, v, key_cache, value_cache, meta, scale)
        if isinstance(meta, TorchAttentionMetadata):
            from ..kernels import torch_backend

            assert meta.write_slots is not None  # build_metadata always sets it
            if meta.write_rows is None:
                torch_backend.write_slots(k, v, key_cache, value_cache, meta.write_slots)
            else:
                torch_backend.write_slots(
                    k[meta.write_rows], v[meta.write_rows], key_cache, value_cache, meta.write_slots
                )
            return torch_backend.attend(meta.plan, q, key_cache, value_cache, scale)
        self.ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, checked=True)
        if meta.is_decode_only:
            return self.ops.paged_decode_attention(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                num_splits=meta.num_splits,
                checked=True,
            )
        return self.ops.paged_prefill_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.seq_lens,
            scale,
            max_query_len=meta.max_query_len,
            checked=True,
        )

    def rope_write_attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        num_q_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """A layer's attention from its QKV projection's output, where ``meta.fused``: one compiled pass rotates q
        and k and writes k and v to their slots (``cpu_kernel.rope_and_cache``), then the kernel attends. The
        same numbers as RoPE in PyTorch, then ``__call__``, in two calls instead of about twenty."""
        from ..kernels import cpu_kernel, torch_backend

        with span("paged_attention"):
            slots = meta.slot_mapping.to(torch.int64).contiguous()
            q = cpu_kernel.rope_and_cache(qkv, cos, sin, key_cache, value_cache, slots, num_q_heads)
            return torch_backend.attend(meta.plan, q, key_cache, value_cache, scale)

    def _with_parts(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """The same step with a learner's scatter-write, decode and/or prefill attention in place of the backend's.

        Their signatures are the reference kernels' (``kernels.reference``), which stand in for whichever
        piece is not plugged in.
        """
        from ..kernels import reference

        SEAM.pick("reshape_and_cache", reference.reshape_and_cache)(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.is_decode_only:
            return SEAM.pick("paged_decode_attention", reference.paged_decode_attention)(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale
            )
        return SEAM.pick("paged_prefill_attention", reference.paged_prefill_attention)(
            q, key_cache, value_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, scale
        )
