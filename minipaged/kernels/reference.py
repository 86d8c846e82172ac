"""Plain PyTorch references: what the paged kernels compute, written to be read.

Each function here has a Triton twin with exactly the same signature
(``reshape_and_cache.py``, ``paged_decode.py``, ``paged_prefill.py``); the tests
compare them. The engine uses these on a CPU, the Triton kernels on a GPU.

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

from .validation import check_paged_decode, check_paged_prefill, check_reshape_and_cache


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write each new token's K and V into its slot of the paged cache, in place.

    ``key``/``value`` are ``[num_tokens, num_kv_heads, head_dim]``; the caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping[t]`` is
    ``block * block_size + offset`` for token ``t``, or ``-1`` for a padding token,
    which writes nothing.
    """
    check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[keep]
    value_cache[blocks, offsets] = value[keep]


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, ``[seq_len, num_kv_heads, head_dim]`` each, gathered through its block table."""
    block_size = key_cache.shape[1]
    blocks = block_table[: -(-seq_len // block_size)].long()
    k = key_cache[blocks].flatten(0, 1)[:seq_len]
    v = value_cache[blocks].flatten(0, 1)[:seq_len]
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_pos: torch.Tensor) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``q_pos`` over keys at positions ``0..len(k)-1``.

    ``q`` is ``[n_q, num_q_heads, d]``, ``k``/``v`` ``[n_k, num_kv_heads, d]``; query head ``h`` reads
    KV head ``h // (num_q_heads // num_kv_heads)`` (grouped-query attention).
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)                       # [n_k, num_q_heads, d]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale          # [num_q_heads, n_q, n_k]
    k_pos = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over all of its cached tokens.

    ``query`` is ``[num_seqs, num_q_heads, head_dim]``; sequence ``i`` attends to its
    ``seq_lens[i]`` tokens (the new token's own K/V included, already written to the
    cache). Returns ``[num_seqs, num_q_heads, head_dim]`` in the query's dtype.
    """
    check_paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale)
    return _decode_batched(query, key_cache, value_cache, block_tables, seq_lens, scale)


def _decode_batched(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode for the whole batch at once: gather every context padded to the longest, mask the padding.

    The query heads that share a KV head are viewed as one group (``[B, kv_heads, group, d]``),
    so K and V are read once per KV head instead of being repeated per query head::

        K gathered  [B, max_len, kv_heads, d]     (rows past seq_len[b] are masked out)
        scores      [B, kv_heads, group, max_len]
    """
    num_seqs, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    max_len = int(seq_lens.max())
    tables = block_tables[:, : -(-max_len // block_size)].long().clamp(0, num_blocks - 1)  # spare columns: masked
    k = key_cache[tables].flatten(1, 2)[:, :max_len].float()              # [B, max_len, kv_heads, d]
    v = value_cache[tables].flatten(1, 2)[:, :max_len].float()
    q = query.float().view(num_seqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale
    padding = torch.arange(max_len, device=query.device)[None, :] >= seq_lens[:, None].to(query.device)
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    v = v.masked_fill(padding[:, :, None, None], 0.0)  # padded slots may hold anything, even NaN: 0·NaN = NaN
    out = torch.einsum("bkgl,blkd->bkgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_q_heads, head_dim).to(query.dtype)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Causal attention of a packed, variable-length batch of new tokens over their paged context.

    ``query`` is ``[total_new_tokens, num_q_heads, head_dim]``; sequence ``i``'s new
    tokens are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` (``q_len`` of them). They are
    the *last* ``q_len`` of its ``seq_lens[i]`` tokens: the first ``seq_len - q_len``
    were cached earlier (a prefix-cache hit or an earlier prefill chunk), and the new
    tokens' own K/V are already in the cache too. New token ``j`` sits at absolute
    position ``seq_len - q_len + j`` and attends to every position up to its own.
    """
    check_paged_prefill(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
    out = torch.empty_like(query)
    cu = cu_seqlens_q.tolist()
    q_lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    # Sequences bringing one token (decodes mixed into a prefill step) go through the batched decode.
    single = [i for i, q in enumerate(q_lens) if q == 1]
    if single:
        rows = torch.tensor([cu[i] for i in single], device=query.device)
        idx = torch.tensor(single, device=query.device)
        out[rows] = _decode_batched(query[rows], key_cache, value_cache, block_tables[idx], seq_lens[idx], scale)
    for i, n in enumerate(seq_lens.tolist()):
        start, end = cu[i], cu[i + 1]
        if end - start in (0, 1):
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[i], n)
        q_pos = torch.arange(n - (end - start), n, device=query.device)
        out[start:end] = _attend(query[start:end], k, v, scale, q_pos)
    return out
