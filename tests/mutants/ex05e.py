"""Exercise 05e — the performance rung: batched paged decode attention that is right but slow, or fast but wrong.

``decode_by_einsum`` is a right answer written differently from the solution notebook's (which hands the gathered K
and V to ``F.scaled_dot_product_attention``): two einsums around a masked softmax, its scores written out, within
the traffic target all the same. Each mutant is one mistake away from one of the two; the slow ones (``SPEED``)
compute the right numbers, and only the rung's own checks catch them.
"""

from __future__ import annotations

import torch

from minipaged.kernels import reference

from . import mutant

CHECKS = {"batched_decode": ["check_paged_decode", "check_paged_decode_edges", "check_launches", "check_traffic"]}
SPEED = ["check_launches", "check_traffic"]  # the slow-but-right mutants pass 05a's checks: go straight to these


def _slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, longest: int):
    """[S, L] the slot of every position (padding: the sequence's first slot), and which are real."""
    pos = torch.arange(longest)
    valid = pos[None, :] < seq_lens[:, None].long()
    blocks = block_tables[:, : -(-longest // block_size)].long()[:, pos // block_size]
    slots = blocks * block_size + pos % block_size
    return torch.where(valid, slots, slots[:, :1]), valid


def _attend(query, k, v, valid, scale):
    """The solution's arithmetic on gathered ``k``/``v`` ([S, L, kv_heads, d], any float dtype)."""
    n, q_heads, d = query.shape
    kv_heads = k.shape[2]
    q = query.to(k.dtype).view(n, kv_heads, q_heads // kv_heads, d)
    scores = torch.einsum("skgd,slkd->skgl", q, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", scores.softmax(dim=-1), v)
    return out.reshape(n, q_heads, d).to(query.dtype)


def decode_by_einsum(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    return _attend(query, k.float(), v.float(), valid, scale)


HELPERS: dict = {"batched_decode": decode_by_einsum}


@mutant("batched_decode", "one sequence at a time (exercise 05's loop): right, and one pass per sequence",
        checks=SPEED)  # fmt: skip
def per_sequence(query, key_cache, value_cache, block_tables, seq_lens, scale):
    return reference.paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)  # MISTAKE


@mutant("batched_decode", "K and V gathered one block column at a time: a pass per block of the longest sequence",
        checks=SPEED)  # fmt: skip
def per_block_column(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    flat_k, flat_v = key_cache.view(-1, kv_heads, d), value_cache.view(-1, kv_heads, d)
    ks, vs = [], []
    for c in range(0, longest, block_size):  # MISTAKE: one gather per column
        ks.append(flat_k[slots[:, c : c + block_size]])
        vs.append(flat_v[slots[:, c : c + block_size]])
    return _attend(query, torch.cat(ks, 1).float(), torch.cat(vs, 1).float(), valid, scale)


@mutant("batched_decode", "attends over every slot of the pool, masked: right, and as costly as the whole pool",
        checks=SPEED)  # fmt: skip
def whole_pool(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    num_slots = key_cache.shape[0] * block_size
    owned = torch.zeros(n, num_slots, dtype=torch.bool)
    owned[torch.arange(n)[:, None].expand_as(slots)[valid], slots[valid]] = True
    k = key_cache.view(1, num_slots, kv_heads, d).float().expand(n, -1, -1, -1)  # MISTAKE: every slot
    v = value_cache.view(1, num_slots, kv_heads, d).float().expand(n, -1, -1, -1)
    k = torch.where(owned[:, :, None, None], k, 0.0)  # NaN in slots nobody owns must not reach the sums
    v = torch.where(owned[:, :, None, None], v, 0.0)
    return _attend(query, k, v, owned, scale)


@mutant("batched_decode", "pads every sequence to the block table's width, not to the longest sequence",
        checks=SPEED)  # fmt: skip
def table_width(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    width = block_tables.shape[1] * block_size  # MISTAKE: int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, width)
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, width, kv_heads, d)
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, width, kv_heads, d)
    return _attend(query, k.float(), v.float(), valid, scale)


@mutant("batched_decode", "K and V copied for every query head (repeat_interleave) instead of shared by the G heads",
        checks=SPEED)  # fmt: skip
def repeated_heads(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, q_heads, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d).float()
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d).float()
    group = q_heads // kv_heads
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)  # MISTAKE: G copies
    scores = torch.einsum("shd,slhd->shl", query.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("shl,slhd->shd", scores.softmax(dim=-1), v).to(query.dtype)


@mutant("batched_decode", "the whole cache converted to float32 before the gather", checks=SPEED)
def float_cache_first(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    flat_k = key_cache.float().view(-1, kv_heads, d)  # MISTAKE: gather first, then .float()
    flat_v = value_cache.float().view(-1, kv_heads, d)
    k = flat_k.index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    v = flat_v.index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    return _attend(query, k, v, valid, scale)


@mutant("batched_decode", "everything in float64 'to be safe': twice the bytes of float32", checks=SPEED)
def in_float64(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    return _attend(query, k.double(), v.double(), valid, scale)  # MISTAKE: .float()


@mutant("batched_decode", "padding positions read whatever their table column names, trusting the mask")
def padding_reads_garbage(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, _, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    pos = torch.arange(longest)
    valid = pos[None, :] < seq_lens[:, None].long()
    blocks = block_tables[:, : -(-longest // block_size)].long()[:, pos // block_size]
    slots = (blocks * block_size + pos % block_size).clamp(0, key_cache.shape[0] * block_size - 1)  # MISTAKE
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d)
    return _attend(query, k.float(), v.float(), valid, scale)


@mutant("batched_decode", "query heads grouped the wrong way round: head h reads KV head h % kv_heads")
def heads_interleaved(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, q_heads, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    longest = int(seq_lens.max())
    slots, valid = _slots(block_tables, seq_lens, block_size, longest)
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d).float()
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots.flatten()).view(n, longest, kv_heads, d).float()
    q = query.float().view(n, q_heads // kv_heads, kv_heads, d).transpose(1, 2)  # MISTAKE: view(n, kv, G, d)
    scores = torch.einsum("skgd,slkd->skgl", q, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgl,slkd->skgd", scores.softmax(dim=-1), v).transpose(1, 2)
    return out.reshape(n, q_heads, d).to(query.dtype)


@mutant("batched_decode", "split-K over chunks of 512 tokens, merged without rescaling each chunk by exp(m_chunk − m_max): "
        "exact up to 512 tokens, wrong beyond", checks=SPEED)  # fmt: skip
def split_k_without_rescale(query, key_cache, value_cache, block_tables, seq_lens, scale):
    n, q_heads, d = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if n == 0:
        return query.clone()
    chunk = 512
    c = -(-int(seq_lens.max()) // chunk)
    padded = c * chunk  # gather whole chunks: positions past a sequence's end are masked below
    pos = torch.arange(padded)
    valid = pos[None, :] < seq_lens[:, None].long()
    cols = (pos // block_size).clamp_max(block_tables.shape[1] - 1)
    slots = block_tables.long()[:, cols] * block_size + pos % block_size
    slots = torch.where(valid, slots, slots[:, :1]).flatten()
    k = key_cache.view(-1, kv_heads, d).index_select(0, slots).view(n, padded, kv_heads, d).float()
    v = value_cache.view(-1, kv_heads, d).index_select(0, slots).view(n, padded, kv_heads, d).float()
    q = query.float().view(n, kv_heads, q_heads // kv_heads, d)
    scores = (q @ k.permute(0, 2, 3, 1)) * scale  # [S, kv, G, padded]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf")).view(n, kv_heads, -1, c, chunk)
    m = scores.amax(-1, keepdim=True).clamp_min(-1e30)  # each chunk's own maximum
    # MISTAKE: each chunk is exponentiated against its own maximum and the chunks are added as they are, never
    # rescaled by exp(m_chunk − m_max) to a common one
    p = (scores - m).exp().view(n, kv_heads, -1, padded)
    out = (p @ v.permute(0, 2, 1, 3)) / p.sum(-1, keepdim=True)
    return out.reshape(n, q_heads, d).to(query.dtype)
