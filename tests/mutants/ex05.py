"""Exercise 05 — paged decode attention in PyTorch: wrong solutions a learner writes."""

from __future__ import annotations

import torch

from . import mutant

CHECKS = {"paged_decode_attention": ["check_paged_decode", "check_paged_decode_edges"]}
HELPERS: dict = {}


@mutant("paged_decode_attention", "GQA mapping h % num_kv_heads instead of h // group")
def gqa_modulo(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, _head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    kv_head = torch.arange(num_q_heads) % num_kv_heads  # MISTAKE: query head h reads KV head h // group
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float()[:, kv_head]  # [n, num_q_heads, head_dim]
        v = value_cache[blocks].flatten(0, 1)[:n].float()[:, kv_head]
        weights = (torch.einsum("hd,thd->ht", query[i].float(), k) * scale).softmax(dim=-1)
        out[i] = torch.einsum("ht,thd->hd", weights, v).to(query.dtype)
    return out


@mutant(
    "paged_decode_attention",
    "uses head_dim ** -0.5 instead of the scale passed in",
    checks=["check_paged_decode_edges"],
)
def ignores_scale(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float()
        v = value_cache[blocks].flatten(0, 1)[:n].float()
        q = query[i].float().reshape(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", q, k) * head_dim**-0.5  # MISTAKE
        out[i] = torch.einsum("kgt,tkd->kgd", scores.softmax(dim=-1), v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out


@mutant(
    "paged_decode_attention",
    "gathers every column of the table row, then cuts to seq_len (reads padding ids)",
    checks=["check_paged_decode_edges"],
)
def whole_table_row(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i].long()  # MISTAKE: only the first ceil(n / block_size) columns are the sequence's
        k = key_cache[blocks].flatten(0, 1)[:n].float()
        v = value_cache[blocks].flatten(0, 1)[:n].float()
        q = query[i].float().reshape(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", q, k) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", scores.softmax(dim=-1), v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out


@mutant("paged_decode_attention", "reads the whole last block, not just its first seq_len tokens")
def reads_block_tail(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].flatten(0, 1).float()  # MISTAKE: no [:n], the unwritten tail slots are read too
        v = value_cache[blocks].flatten(0, 1).float()
        q = query[i].float().reshape(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", q, k) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", scores.softmax(dim=-1), v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out


@mutant(
    "paged_decode_attention",
    "computes scores and softmax in the cache's dtype (fp16 overflows), not float32",
    checks=["check_paged_decode_edges"],
)
def no_float32(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:n]  # MISTAKE: no .float()
        v = value_cache[blocks].flatten(0, 1)[:n]
        q = query[i].reshape(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", q, k) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", scores.softmax(dim=-1), v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out


@mutant("paged_decode_attention", "leaves out the new token (attends to seq_len - 1 tokens: 'it is not cached yet')")
def excludes_new_token(query, key_cache, value_cache, block_tables, seq_lens, scale):
    num_seqs, num_q_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(query)
    for i in range(num_seqs):
        n = int(seq_lens[i]) - 1  # MISTAKE: seq_lens counts the new token, whose K/V is already in the cache
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:n].float()
        v = value_cache[blocks].flatten(0, 1)[:n].float()
        q = query[i].float().reshape(num_kv_heads, group, head_dim)
        scores = torch.einsum("kgd,tkd->kgt", q, k) * scale
        out[i] = torch.einsum("kgt,tkd->kgd", scores.softmax(dim=-1), v).reshape(num_q_heads, head_dim).to(query.dtype)
    return out
