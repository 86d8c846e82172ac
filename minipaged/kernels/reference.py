"""Plain PyTorch references: what the paged kernels compute, written to be read.

Each function here has a Triton twin with exactly the same signature
(``cache_write.py``, ``paged_decode.py``, ``paged_prefill.py``) and a tuned
CPU twin (``torch_backend.py``, what the engine runs on a CPU); the tests compare
both against these. Written to be read, not to be fast: one sequence at a time.

The whole trick of PagedAttention is one gather. A sequence's tokens live in
fixed-size blocks scattered over a pool; its block table lists them in order::

    block_tables[i] = [7, 2, 5]        block_size = 4, seq_lens[i] = 10

    logical block   0            1            2
    physical block  7            2            5
    tokens          0 1 2 3  |   4 5 6 7  |   8 9 . .      (. = not yet written)

    token p lives at key_cache[block_tables[i, p // block_size], p % block_size]

Gather the blocks, flatten them, keep the first ``seq_lens[i]`` tokens, and what is
left is ordinary attention over a contiguous K and V. Scores and softmax are
computed in float32 whatever the cache dtype, and the result is cast back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..utils import cdiv
from .validation import check_paged_decode, check_paged_prefill, check_reshape_and_cache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's K and V into its slot of the paged cache, in place.

    ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``; the caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping[t]`` is
    ``block * block_size + offset`` for token ``t``, or ``-1`` for a padding token,
    which writes nothing.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    keep = slot_mapping >= 0
    write_slots(key[keep], value[keep], key_cache, value_cache, slot_mapping[keep].long())


def write_slots(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """The scatter itself, unchecked: row ``t`` of K/V goes to slot ``slots[t]`` (int64, no padding).

    A ``[num_blocks, block_size, ...]`` cache viewed as ``[num_blocks * block_size, ...]``
    is indexed by the slot number directly: that is what ``block * block_size + offset`` means.
    A cache whose blocks are not evenly spaced in memory (sliced block-wise out of a bigger
    buffer) has no such view; it is written through (block, offset) pairs instead.
    """
    for src, cache in ((key, key_cache), (value, value_cache)):
        flat = slot_view(cache)
        if flat is not None:
            flat.index_copy_(0, slots, src.to(cache.dtype))
        else:
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = src.to(cache.dtype)


def slot_view(cache: torch.Tensor) -> torch.Tensor | None:
    """``[num_blocks, block_size, ...]`` as ``[num_slots, ...]`` sharing its memory, or None if the strides forbid it."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, ``[seq_len, num_kv_heads, head_dim]`` each, gathered through its block table."""
    block_size = key_cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    k = key_cache[blocks].flatten(0, 1)[:seq_len]
    v = value_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def attention_mask(
    seq_len: int, q_len: int, device: torch.device | str = "cpu", sliding_window: int | None = None
) -> torch.Tensor:
    """Which of a sequence's ``seq_len`` positions each of its last ``q_len`` tokens attends to, ``[q_len,
    seq_len]``: every position up to its own, and with a sliding window only the last ``sliding_window`` of them
    (its own included: transformers' and vLLM's convention)::

        seq_len 6, q_len 2            causal              sliding_window 3
        token at position 4           1 1 1 1 1 .         . . 1 1 1 .
        token at position 5           1 1 1 1 1 1         . . . 1 1 1
    """
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    kv_pos = torch.arange(seq_len, device=device)[None, :]
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window
    return mask


def _attend_each_sequence(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """One sequence at a time: gather its K/V through its block table, then ordinary causal attention (only over
    the last ``sliding_window`` positions of each token, when given)."""
    out = torch.empty_like(query)
    for i, n in enumerate(seq_lens):
        start, end = cu_seqlens_q[i], cu_seqlens_q[i + 1]
        if start == end:
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[i], n)  # [n, kv_heads, d]
        causal = attention_mask(n, end - start, query.device, sliding_window)  # [q_len, n]
        o = F.scaled_dot_product_attention(
            query[start:end].float().transpose(0, 1),
            k.float().transpose(0, 1),
            v.float().transpose(0, 1),
            attn_mask=causal,
            scale=scale,
            enable_gqa=True,
        )  # [q_heads, q_len, d]
        out[start:end] = o.transpose(0, 1).to(query.dtype)
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
    """Attention of one new token per sequence over all of its cached tokens (the last ``sliding_window`` of
    them, when given).

    ``query`` is ``[num_seqs, num_q_heads, head_dim]``; sequence ``i`` attends to its
    ``seq_lens[i]`` tokens (the new token's own K/V included, already written to the
    cache). Returns ``[num_seqs, num_q_heads, head_dim]`` in the query's dtype.
    """
    check_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _attend_each_sequence(
        query, key_cache, value_cache, block_tables, list(range(query.shape[0] + 1)), seq_lens.tolist(), scale,
        sliding_window,
    )  # fmt: skip


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
    """Causal attention of a packed, variable-length batch of new tokens over their paged context.

    ``query`` is ``[total_new_tokens, num_q_heads, head_dim]``; sequence ``i``'s new
    tokens are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (``q_len`` of them). They are
    the *last* ``q_len`` of its ``seq_lens[i]`` tokens: the first ``seq_len - q_len``
    were cached earlier (a prefix-cache hit or an earlier prefill chunk), and the new
    tokens' own K/V are already in the cache too. New token ``j`` sits at absolute
    position ``seq_len - q_len + j`` and attends to every position up to its own, or, with a
    ``sliding_window``, to the last ``sliding_window`` positions up to its own (``attention_mask``).
    """
    check_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    return _attend_each_sequence(
        query, key_cache, value_cache, block_tables, cu_seqlens_q.tolist(), seq_lens.tolist(), scale, sliding_window
    )
