"""The course's words and formulas in one place: a glossary, and a one-page cheat sheet computed live.

Each ``Term`` names the chapter that teaches it and where it lives in the package (a dotted name, checked to
resolve), so a learner can go from the word to the code. ``cheat_sheet()`` writes every formula of the course
with a worked line for SmolLM2 and for Llama-3-8B, each number computed by the package's own functions
(``kv_math``, ``worker/block_table.py``, ``classroom/viz/kernel_viz.py``) at the moment it is printed, never typed in::

    print(glossary.table())         # term, meaning, chapter, where in the package
    print(glossary.cheat_sheet())   # the formulas, each with its live example

``notebooks/glossary.ipynb`` shows both; ``tests/test_glossary.py`` checks that each term appears in its
chapter, that each package name resolves, and that each cheat-sheet number is what the package computes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Term:
    term: str
    meaning: str
    chapter: str  # "01" ... "13", or "05c" for the puzzle exercise (its core)
    where: str = ""  # a dotted name in the package ("minipaged.core.block_pool.BlockPool"), "" for an idea only


TERMS: tuple[Term, ...] = (
    Term(
        "KV cache",
        "the keys and values of every token seen so far, kept so each new token attends to them "
        "without recomputing them",
        "01",
        "minipaged.kv_math.KVSpec",
    ),
    Term(
        "bytes per token",
        "what one token's K and V cost across all layers: 2 · layers · KV heads · head_dim · bytes per number",
        "01",
        "minipaged.kv_math.KVSpec.bytes_per_token",
    ),
    Term(
        "GQA",
        "grouped-query attention: G query heads share one KV head, so the cache holds G times fewer heads",
        "01",
        "minipaged.kv_math.KVSpec.attention_kind",
    ),
    Term(
        "fragmentation",
        "memory reserved but holding no token: internal (inside a request's reservation) or "
        "external (free, in holes too small to use)",
        "02",
        "minipaged.lab.contiguous",
    ),
    Term(
        "block",
        "a fixed-size run of token slots in the KV pool (16 tokens by default): the unit the pool hands out",
        "03",
        "minipaged.core.block_pool.KVCacheBlock",
    ),
    Term(
        "free queue",
        "the pool's free blocks in a doubly linked list: O(1) to take from the front and to "
        "remove from the middle (a cached block touched again)",
        "03",
        "minipaged.core.block_pool.FreeKVCacheBlockQueue",
    ),
    Term(
        "ref count",
        "how many requests hold a block; it returns to the free queue at 0",
        "03",
        "minipaged.core.block_pool.KVCacheBlock",
    ),
    Term(
        "null block",
        "block 0, never handed out: it pads block tables, so a stray read lands somewhere harmless",
        "03",
        "minipaged.core.block_pool.BlockPool",
    ),
    Term(
        "block table",
        "a request's list of physical blocks in logical order: token p lives in block table[p // block_size]",
        "04",
        "minipaged.worker.block_table.BlockTable",
    ),
    Term(
        "slot",
        "a token's place in the pool, block · block_size + offset; slot mapping lists the slot of every "
        "token a step writes",
        "04",
        "minipaged.worker.block_table.slot_mapping",
    ),
    Term(
        "allocate_slots",
        "the KV manager's one question per request and step: room for n more tokens now, or None (changing nothing)",
        "04",
        "minipaged.core.kv_cache_manager.KVCacheManager.allocate_slots",
    ),
    Term(
        "watermark",
        "blocks kept free when admitting a new request, so the running ones can still grow",
        "04",
        "minipaged.core.kv_cache_manager.KVCacheManager",
    ),
    Term(
        "scatter-write",
        "writing each new token's K and V into its slot (vLLM's reshape_and_cache)",
        "05",
        "minipaged.kernels.reference.reshape_and_cache",
    ),
    Term(
        "paged attention",
        "attention that reads K and V through the block table instead of one contiguous run",
        "05",
        "minipaged.kernels.reference.paged_decode_attention",
    ),
    Term(
        "split-KV",
        "several programs per sequence, each over a segment of its keys, merged with their (max, "
        "sum, output): flash-decoding",
        "05",
        "minipaged.kernels.paged_decode",
    ),
    Term(
        "online softmax",
        "a softmax over blocks seen one at a time: running max and sum, rescaled when the max grows",
        "05c",
        "minipaged.classroom.puzzles",
    ),
    Term(
        "access trace",
        "which elements each program of a Triton kernel loaded or stored, recorded by the interpreter",
        "05c",
        "minipaged.classroom.kernel_trace.AccessTrace",
    ),
    Term(
        "continuous batching",
        "scheduling at every step (iteration-level): a finished request's seat is refilled at once",
        "06",
        "minipaged.core.scheduler.Scheduler",
    ),
    Term(
        "token budget",
        "the most tokens one step computes (max_num_batched_tokens)",
        "06",
        "minipaged.core.scheduler.SchedulerConfig",
    ),
    Term(
        "chunked prefill",
        "a prompt longer than the budget left is computed over several steps",
        "06",
        "minipaged.core.scheduler.Scheduler",
    ),
    Term("TTFT", "time to first token: from arrival to the first output token", "06", "minipaged.lab.simulator"),
    Term(
        "ITL", "inter-token latency: the time between two output tokens of one request", "06", "minipaged.lab.simulator"
    ),
    Term(
        "preemption",
        "taking a running request off the device when the pool runs dry: the newest goes first",
        "07",
        "minipaged.core.scheduler.Scheduler.preempt",
    ),
    Term(
        "recompute",
        "preemption that frees the victim's blocks and prefills its tokens again when it returns (vLLM v1's only kind)",
        "07",
        "minipaged.core.scheduler.preempt_recompute",
    ),
    Term(
        "swap",
        "preemption that copies the victim's blocks to CPU memory and back (the paper's and vLLM v0's; v1 dropped it)",
        "07",
        "minipaged.worker.cache_engine.CacheEngine",
    ),
    Term(
        "prefix caching",
        "reusing the blocks of a prompt prefix another request computed, found by the hash of their tokens",
        "08",
        "minipaged.core.kv_cache_manager.find_prefix_hits",
    ),
    Term(
        "block hash",
        "the hash of a full block's tokens chained with its predecessor's hash: equal hashes mean equal prefixes",
        "08",
        "minipaged.core.block_hash.chain_block_hashes",
    ),
    Term(
        "copy-on-write",
        "a block shared by forked sequences is copied before one of them writes into it (the paper's and vLLM "
        "v0's fork; v1 shares only full blocks, through the prefix cache)",
        "08",
        "minipaged.core.kv_cache_manager.KVCacheManager.fork",
    ),
    Term(
        "parts",
        "a learner's function plugged into the real engine in place of the package's own",
        "10",
        "minipaged.classroom.parts.use",
    ),
    Term(
        "tensor parallelism",
        "the model split by heads over processes; one block table, a pool per rank",
        "12",
        "minipaged.worker.executor.MultiprocExecutor",
    ),
    Term(
        "all-reduce",
        "the collective that sums each rank's partial result so every rank has the total",
        "12",
        "minipaged.distributed.TPGroup.all_reduce",
    ),
    Term(
        "speculative decoding",
        "guessed next tokens checked in one forward pass; the model's own choices decide which are kept",
        "13",
        "minipaged.worker.sampler.verify",
    ),
    Term(
        "prompt lookup",
        "draft tokens taken from what followed the request's last few tokens earlier in its own context",
        "13",
        "minipaged.core.spec_decode.NgramProposer",
    ),
    Term(
        "external hits",
        "prompt tokens whose K/V a KV connector holds outside the pool: blocks allocated, then loaded",
        "13",
        "minipaged.core.kv_connector.KVConnector.get_num_new_matched_tokens",
    ),
    Term(
        "disaggregated prefill",
        "prompts computed by one engine, their K/V shipped to another that only decodes",
        "13",
        "minipaged.engine.disagg.DisaggregatedLLM",
    ),
    Term(
        "sliding window",
        "an attention layer that reads only the last window of positions; the blocks behind it go back to the pool",
        "13",
        "minipaged.core.single_type_kv_cache_manager.SlidingWindowManager",
    ),
    Term(
        "KV cache group",
        "layers of one attention type sharing a block table; a hybrid model has several over one pool",
        "13",
        "minipaged.core.kv_cache_coordinator.KVCacheCoordinator",
    ),
)


def resolve(dotted: str) -> Any:
    """The object a dotted name points at: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def table() -> str:
    """The glossary as a markdown table, in teaching order."""
    rows = ["| term | meaning | chapter | in the package |", "|---|---|---|---|"]
    rows += [f"| **{t.term}** | {t.meaning} | {t.chapter} | `{t.where}` |" if t.where else
             f"| **{t.term}** | {t.meaning} | {t.chapter} | |" for t in TERMS]  # fmt: skip
    return "\n".join(rows)


# ---- the cheat sheet ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Formula:
    name: str
    formula: str
    chapter: str
    example: str  # computed when the sheet is built


def formulas(context: int = 4096, block_size: int = 16, budget_gib: int = 16) -> list[Formula]:
    """Every formula of the course, each with an example computed now by the package's own functions."""
    import torch

    from ..kv_math import PRESETS, GiB, format_bytes
    from ..worker.block_table import slot_mapping
    from .viz.kernel_viz import decode_traffic

    small, llama = PRESETS["smollm2-135m"], PRESETS["llama-3-8b"]
    q_small, q_llama = small.num_attention_heads or 0, llama.num_attention_heads or 0  # both presets name them
    cap = llama.capacity(budget_gib * GiB, block_size, request_tokens=context)
    table_row, p, bs = [7, 2, 5], 9, 4
    (slot,) = slot_mapping([table_row], [[p]], bs).tolist()
    traffic = decode_traffic(q_llama, llama.num_kv_heads, llama.head_dim, 2, 1, context)
    waste = small.blocks_for_tokens(1000, block_size) * block_size - 1000
    m = torch.tensor([1.0, 3.0])
    l_ = torch.tensor([2.0, 0.5])
    m_star = float(m.max())
    weights = (l_ * (m - m_star).exp()).tolist()
    return [
        Formula("KV bytes per token", "2 · layers · KV heads · head_dim · bytes", "01",
                f"SmolLM2 bf16: 2 · {small.num_layers} · {small.num_kv_heads} · {small.head_dim} · 2 = "
                f"{small.bytes_per_token:,} B; Llama-3-8B: {llama.bytes_per_token:,} B"),
        Formula("GQA saving", "query heads ÷ KV heads (the cache shrinks by that factor against MHA)", "01",
                f"SmolLM2 {q_small} ÷ {small.num_kv_heads} = {q_small // small.num_kv_heads}; Llama-3-8B "
                f"{q_llama} ÷ {llama.num_kv_heads} = {q_llama // llama.num_kv_heads}"),
        Formula("per-rank KV bytes under TP", "bytes per token ÷ TP (each rank holds KV heads ÷ TP)", "01, 12",
                f"SmolLM2 at TP = 3: {small.per_rank(3).bytes_per_token:,} B per token on each rank"),
        Formula("blocks for n tokens", "ceil(n ÷ block_size)", "03",
                f"{context} tokens in blocks of {block_size}: {llama.blocks_for_tokens(context, block_size)} blocks"),
        Formula("internal waste", "blocks · block_size − n < block_size per request", "02, 03",
                f"1000 tokens in blocks of {block_size}: {waste} empty slots in the last block"),
        Formula("requests that fit", "⌊budget ÷ (block_size · bytes per token)⌋ blocks ÷ blocks per request", "01",
                f"Llama-3-8B bf16, {budget_gib} GiB: {cap.num_blocks:,} blocks, {cap.full_requests} requests of "
                f"{context} tokens"),
        Formula("slot of position p", "table[p // block_size] · block_size + p % block_size", "04",
                f"table {table_row}, blocks of {bs}, p = {p}: block {table_row[p // bs]}, offset {p % bs} → "
                f"slot {slot}"),
        Formula("merge of split-KV segments", "w_s = l_s · exp(m_s − m*), out = Σ w_s·o_s ÷ Σ w_s", "05",
                f"m = {m.tolist()}, l = {l_.tolist()}: weights {[round(w, 3) for w in weights]}"),
        Formula("decode arithmetic intensity", "2 · G ÷ bytes per number FLOP per byte (G = query ÷ KV heads)", "05",
                f"Llama-3-8B bf16: {traffic['intensity']:.1f} FLOP/B, far below any GPU's ridge point"),
        Formula("decode KV read per step", "2 · layers · batch · context · KV heads · head_dim · bytes", "05",
                f"Llama-3-8B, one sequence of {context}: {format_bytes(llama.bytes_for_tokens(context))}"),
        Formula("prefix caching saves", "the prompt's full cached blocks · block_size tokens of prefill", "08",
                f"a 1000-token shared prefix in blocks of {block_size}: {1000 // block_size * block_size} tokens "
                f"found, {1000 % block_size} computed again"),
    ]  # fmt: skip


def cheat_sheet(**kw: Any) -> str:
    """The formulas as text: name, formula, chapter, and the live example under each."""
    lines = []
    for f in formulas(**kw):
        lines += [f"{f.name}  (chapter {f.chapter})", f"    {f.formula}", f"    e.g. {f.example}"]
    return "\n".join(lines)


__all__ = ["TERMS", "Formula", "Term", "cheat_sheet", "formulas", "resolve", "table"]
