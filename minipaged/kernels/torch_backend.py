"""The engine's CPU attention: the reference's computation, batched and planned once per step.

``reference.py`` says what paged attention computes, one sequence at a time. On a CPU
the engine needs the same numbers faster. Decodes and prefill chunks go to the compiled
kernel (``cpu_kernel``), which reads K/V in place through the block tables; prefills longer
than ``KERNEL_MAX_Q_LEN`` rows (2048 by default, so none under the default token budget) go
to SDPA on their gathered context. Where the kernel cannot run (no compiler), one-token
sequences of similar length are attended together instead, their K/V gathered with
``index_select`` (whole rows, memcpy speed). Either way the plan (``plan_attention``) is
built once per step and reused by every layer. ``tests/test_kernels.py`` and
``tests/test_cpu_kernel.py`` check both against the reference.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import cpu_kernel
from .reference import attention_mask, reshape_and_cache, write_slots
from .validation import check_paged_decode, check_paged_prefill


def context_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot of every context token of every sequence, padded to the longest: ``[num_seqs, max_len]``.

    Position ``p`` of sequence ``i`` is in slot ``block_tables[i, p // block_size] * block_size
    + p % block_size``. Padding positions (``p >= seq_lens[i]``) point at the sequence's own
    position 0, a real value, and come back marked invalid: garbage in slots that belong to
    nobody (even NaN) is never read, so masking the scores is enough::

        block_size 4, seq_lens [6, 3], tables [[7, 2], [5, .]]
        slots  [[28 29 30 31  8  9],      valid [[1 1 1 1 1 1],
                [20 21 22 20 20 20]]             [1 1 1 0 0 0]]
    """
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pos = torch.arange(max_len, device=block_tables.device)
    valid = pos[None, :] < seq_lens[:, None].to(pos.device)
    pos = torch.where(valid, pos[None, :], 0)
    blocks = torch.gather(block_tables.long(), 1, pos // block_size)
    return blocks * block_size + pos % block_size, valid


@dataclass
class DecodeGroup:
    """One-token sequences of similar length, attended together (padded to the group's longest)."""

    rows: torch.Tensor | None  # their query rows; None = every row of the step, in order
    slots: torch.Tensor  # [n, max_len] context slots (see context_slots)
    valid: torch.Tensor  # [n, max_len] which of them are real


@dataclass
class AttentionPlan:
    """What one step's attention needs apart from the layer's own tensors, computed once per step.

    Every layer of the model reads the same sequences through the same block tables, so
    the gather indices and masks are built here once and reused by all of them::

        decode    one-token sequences, in groups of similar length: slots and valid [n, max_len]
        prefills  one entry per multi-token sequence: its rows, its context slots, a causal mask

    Padding every decode to the longest context of the step would gather (and attend over)
    mostly padding when lengths are mixed, so sequences are sorted by length and cut into
    up to sixteen groups of at least four, each padded only to its own longest. Small groups
    also keep each gathered K/V in the CPU's cache while attention reads it back (measured on
    SmolLM2, 128 decodes of mixed length: 4 groups 310 ms a step, 16 groups 220 ms).
    """

    num_rows: int
    decode: list[DecodeGroup] = field(default_factory=list)
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # With the compiled kernel: (block_tables, cu_seqlens_q, seq_lens) as contiguous int32. The kernel
    # then attends every sequence of up to KERNEL_MAX_Q_LEN rows, and `decode` stays empty.
    in_place: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


MAX_DECODE_GROUPS = 16
MIN_DECODE_GROUP = 4
# Longer prefills are GEMM-shaped (every query row meets every context row): SDPA on the gathered
# context beats a row-at-a-time kernel there, and the gather is small beside the arithmetic. At 2048 (the
# engine's default token budget) every chunk goes to the kernel, and the step program binds the whole step
# once; MINIPAGED_KERNEL_MAX_Q_LEN=96 is the earlier choice, the benchmark's lever "long_prefills_on_sdpa".
KERNEL_MAX_Q_LEN = int(os.environ.get("MINIPAGED_KERNEL_MAX_Q_LEN", "2048"))


def plan_attention(
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    in_place: bool = False,
    sliding_window: int | None = None,
) -> AttentionPlan:
    """Sort a step's sequences into decode groups and per-sequence prefills, and build their indices.

    ``in_place`` (the caller has checked ``cpu_kernel.usable``): the kernel takes every sequence
    of up to ``KERNEL_MAX_Q_LEN`` rows as they are, and only longer prefills are planned here.
    ``sliding_window``: each token sees only the last ``sliding_window`` positions up to its own; the
    masks say so (the compiled kernel has no window: a windowed plan is never ``in_place``).
    """
    if in_place and sliding_window is not None:
        raise ValueError("the compiled CPU kernel has no sliding window: plan a windowed layer with in_place=False")
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    device = block_tables.device
    plan = AttentionPlan(cu[-1] if cu else 0)
    if in_place:
        plan.in_place = (
            block_tables.to(torch.int32).contiguous(),
            cu_seqlens_q.to(torch.int32).contiguous(),
            seq_lens.to(torch.int32).contiguous(),
        )
        _plan_prefills(plan, block_tables, lens, q_lens, cu, block_size, min_q_len=KERNEL_MAX_Q_LEN + 1)
        return plan
    single = sorted((i for i, q in enumerate(q_lens) if q == 1), key=lambda i: lens[i])
    num_groups = max(1, min(MAX_DECODE_GROUPS, len(single) // MIN_DECODE_GROUP))
    if single and len(single) == len(q_lens) and (num_groups == 1 or lens[single[0]] == lens[single[-1]]):
        plan.decode.append(_decode_group(None, block_tables, seq_lens, block_size, sliding_window))
    elif single:
        for g in range(num_groups):
            members = single[g * len(single) // num_groups : (g + 1) * len(single) // num_groups]
            idx = torch.tensor(members, dtype=torch.long, device=device)
            rows = torch.tensor([cu[i] for i in members], dtype=torch.long, device=device)
            plan.decode.append(_decode_group(rows, block_tables[idx], seq_lens[idx], block_size, sliding_window))
    _plan_prefills(plan, block_tables, lens, q_lens, cu, block_size, min_q_len=2, sliding_window=sliding_window)
    return plan


def _decode_group(
    rows: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> DecodeGroup:
    """One decode group: its context slots, and which of them its token sees (a window hides the older ones)."""
    slots, valid = context_slots(block_tables, seq_lens, block_size)
    if sliding_window is not None:
        pos = torch.arange(slots.shape[1], device=slots.device)[None, :]
        valid &= pos > seq_lens[:, None].to(pos.device) - 1 - sliding_window
    return DecodeGroup(rows, slots, valid)


def _plan_prefills(
    plan: AttentionPlan,
    block_tables: torch.Tensor,
    lens: list[int],
    q_lens: list[int],
    cu: list[int],
    block_size: int,
    min_q_len: int,
    sliding_window: int | None = None,
) -> None:
    """One SDPA entry per sequence of at least ``min_q_len`` new tokens: its rows, context slots and causal mask."""
    device = block_tables.device
    for i, n in enumerate(lens):
        if q_lens[i] < min_q_len:
            continue
        seq_slots, _ = context_slots(block_tables[i : i + 1], torch.tensor([n], device=device), block_size)
        causal = attention_mask(n, q_lens[i], device, sliding_window)  # [q_len, n]
        plan.prefills.append((cu[i], cu[i + 1], seq_slots[0], causal))


def attend(
    plan: AttentionPlan, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of every query row over its sequence's paged context, following ``plan``.

    The one-token sequences go together: the G query heads sharing a KV head are viewed
    as G query rows of that head (``[n, kv_heads, G, d]``), so K and V are gathered once
    per KV head, not once per query head::

        K gathered  [n, kv_heads, max_len, d]     (a view of the [n, max_len, kv_heads, d] gather)
        scores      [n, kv_heads, G, max_len]     padding masked out

    Scores and softmax are float32 whatever the cache dtype; the result has the query's dtype.
    """
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    # A cache with no slot view is copied flat: attention only reads it.
    flat_k = key_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = value_cache.reshape(-1, num_kv_heads, head_dim)
    group = query.shape[1] // num_kv_heads
    if plan.in_place is not None:  # rows of the long prefills are left for the loop below
        out = cpu_kernel.paged_attention(
            query, key_cache, value_cache, *plan.in_place, scale, max_q_len=KERNEL_MAX_Q_LEN, num_rows=plan.num_rows
        )
    else:
        out = torch.empty_like(query)
    for dec in plan.decode:
        n = dec.slots.shape[0]
        q = query if dec.rows is None else query[dec.rows]
        q = q.float().view(n, num_kv_heads, group, head_dim)
        # index_select copies whole rows (memcpy), several times faster on a CPU than flat_k[dec.slots]
        idx = dec.slots.view(-1)
        k = flat_k.index_select(0, idx).view(n, -1, num_kv_heads, head_dim).float().transpose(1, 2)
        v = flat_v.index_select(0, idx).view(n, -1, num_kv_heads, head_dim).float().transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=dec.valid[:, None, None, :], scale=scale)
        o = o.reshape(n, -1, head_dim).to(query.dtype)
        if dec.rows is None:
            out = o
        else:
            out[dec.rows] = o
    for start, end, slots, causal in plan.prefills:
        q = query[start:end].float().transpose(0, 1)[None]  # [1, q_heads, q_len, d]
        k = flat_k.index_select(0, slots).float().transpose(0, 1)[None]  # [1, kv_heads, n, d]
        v = flat_v.index_select(0, slots).float().transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(query.dtype)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``reference.paged_decode_attention``, planned and batched."""
    check_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    cu_seqlens_q = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    in_place = sliding_window is None and cpu_kernel.usable(key_cache, value_cache)
    plan = plan_attention(block_tables, cu_seqlens_q, seq_lens, key_cache.shape[1], in_place, sliding_window)
    return attend(plan, query, key_cache, value_cache, scale)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """``reference.paged_prefill_attention``, planned and batched."""
    check_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    in_place = sliding_window is None and cpu_kernel.usable(key_cache, value_cache)
    plan = plan_attention(block_tables, cu_seqlens_q, seq_lens, key_cache.shape[1], in_place, sliding_window)
    return attend(plan, query, key_cache, value_cache, scale)


# The scatter-write is the reference's own (it is already one index_copy_).
__all__ = [
    "AttentionPlan",
    "DecodeGroup",
    "attend",
    "context_slots",
    "paged_decode_attention",
    "paged_prefill_attention",
    "plan_attention",
    "reshape_and_cache",
    "write_slots",
]
