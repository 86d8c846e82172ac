"""Sources and checked claims: every figure the course quotes from elsewhere, with what the package computes.

The course takes figures from papers, from vLLM's source and from a few public texts about vLLM. A learner
must be able to find each of them, so every claim here names its source the way a reader would search for it:
the PagedAttention paper's section or figure, a vLLM file, another paper, or a text by its own title. Beside
each claim stands what the course computes live (a function of this package, called when the page is drawn)
and a verdict: ``holds``, ``holds if read as ...``, ``unverifiable as quoted: ...`` (the source gives too little to
check it) or ``wrong: ...``.

The appendix notebook ``notebooks/sources.ipynb`` draws the table from ``claims()``; the tests check that every
claim has a source, a verdict and a live computation that runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

# ---- the sources, as a reader finds them ---------------------------------------------------------------------
PAGED_ATTENTION = (
    'Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023'
)
BOOK_CHAPTER = '"KV cache and PagedAttention: memory as the real bottleneck" (a book chapter on vLLM v1 internals)'
INFERENCE_AT_SCALE = '"Inference at scale", section 23.1 "KV cache + PagedAttention"'
DEEP_DIVE = 'the "vLLM Deep Dive" site (GPU memory architecture, chapters on the KV cache and PagedAttention)'
CAPACITY_ARTICLE = (
    '"Calculate KV cache capacity, trace paged block allocation, and separate memory packing from '
    'prefix reuse and scheduling tradeoffs" (an article on KV-cache capacity)'
)


@dataclass(frozen=True)
class Claim:
    """One quoted figure: where it comes from, what the course computes, and whether it holds."""

    chapter: str  # "01" ... "13": where the course quotes it
    claim: str  # the figure as the source states it
    source: str  # one of the constants above, with section / figure / file
    computed: Callable[[], str]  # what the package computes, as a short line; called live
    verdict: str  # "holds", "holds if read as ...", "unverifiable as quoted: ...", or "wrong: ..., because ..."


# Each chapter's claims, in the order the chapter quotes them. Filled chapter by chapter.
@cache
def _fig2_band() -> dict:
    """Chapter 02's saturated-arena experiment (the paper's Fig. 2 setting), run once per page."""
    from ..lab.contiguous import contiguous_utilisation_band

    return contiguous_utilisation_band()


def _chapter_01() -> list[Claim]:
    from ..gpus import GPUS
    from ..kv_math import GiB, KVSpec, MiB, dtype_bytes, format_bytes, num_blocks_at_startup

    h100_bytes = GPUS["h100"].memory_bytes  # what an "80 GB" H100 reports (nvidia-smi's memory.total)
    a100_bytes = GPUS["a100"].memory_bytes

    def llama70() -> KVSpec:
        return KVSpec.from_preset("llama-3-70b")

    def card_bytes() -> str:
        return "; ".join(
            f"minipaged.gpus' {GPUS[key].name}: {GPUS[key].memory_mib:,} MiB = {total:,} B = {total / GiB:.2f} GiB "
            f"= {total / 1e9:.2f} GB"
            for key, total in (("h100", h100_bytes), ("a100", a100_bytes))
        )

    def per_token() -> str:
        b = llama70().bytes_per_token
        return f"{b:,} B/token = {format_bytes(b)} = {b / 1e3:.1f} kB"

    def three_lengths() -> str:
        s = llama70()
        k1000 = " / ".join(f"{s.bytes_for_tokens(n) / 1e9:.2f}" for n in (4_000, 32_000, 128_000))
        k1024 = " / ".join(f"{s.bytes_for_tokens(n) / 1e9:.2f}" for n in (4_096, 32_768, 131_072))
        gib = " / ".join(f"{s.bytes_for_tokens(n) / GiB:.2f}" for n in (4_096, 32_768, 131_072))
        return f"4,000 / 32,000 / 128,000 tokens: {k1000} GB; 4,096 / 32,768 / 131,072 tokens: {k1024} GB = {gib} GiB"

    def at_128k() -> str:
        s = llama70()
        return (
            f"131,072 tokens: {s.bytes_for_tokens(131_072) / 1e9:.1f} GB; 128,000: "
            f"{s.bytes_for_tokens(128_000) / 1e9:.1f} GB; 32,000 (for comparison): "
            f"{s.bytes_for_tokens(32_000) / 1e9:.1f} GB"
        )

    def mha_gqa_mqa_8b() -> str:
        s = KVSpec.from_preset("llama-3-8b")
        return " / ".join(
            f"{s.with_kv_heads(h).bytes_for_tokens(2048) / MiB:.0f} MiB ({h} KV head{'s' * (h > 1)})"
            for h in (32, 8, 1, 2)
        )

    def mha_gqa_mqa_80() -> str:
        s = llama70()
        return " / ".join(f"{s.with_kv_heads(h).bytes_for_tokens(4096) / GiB:.2f} GiB" for h in (64, 8, 1))

    def three_architectures() -> str:
        rows = []
        for layers, heads in ((32, 8), (80, 8), (96, 96)):
            s = KVSpec(layers, heads, 128, dtype_bytes("fp16"))
            rows.append(
                f"{layers}×{heads}: "
                + " / ".join(
                    format_bytes(x)
                    for x in (s.bytes_per_token, s.bytes_for_tokens(4096), s.bytes_for_tokens(32 * 1024))
                )
            )
        batch = 128 * llama70().bytes_for_tokens(4096)
        fit = llama70().capacity(h100_bytes, 16, 4096).full_requests
        return "; ".join(rows) + (
            f"; 128 × 4K = {format_bytes(batch)}, an 80 GB H100 ({h100_bytes / 1e9:.1f} GB reported) holds {fit} of them"
        )

    def kv_vs_weights() -> str:
        s = llama70()
        assert s.num_params is not None  # every preset has its weights' size
        kv = [32 * s.bytes_for_tokens(n) for n in (2048, 8192)]
        return (
            f"one 2,048-token request {s.bytes_for_tokens(2048) / MiB:.0f} MiB; 32 of them "
            f"{kv[0] / GiB:.0f} GiB = {kv[0] / 1e9:.1f} GB; at 8,192 tokens {kv[1] / GiB:.0f} GiB = "
            f"{kv[1] / 1e9:.1f} GB; weights {s.num_params * 2 / 1e9:.0f} GB"
        )

    def h100_chain() -> str:
        s = llama70()
        assert s.num_params is not None  # every preset has its weights' size
        budget = h100_bytes - s.num_params // 2
        static = s.capacity(budget, 16, 32 * 1024).full_requests
        tokens = int(200e6 // s.bytes_per_token)
        paged = s.capacity(budget, 16, tokens).full_requests
        assert static is not None and paged is not None  # set whenever request_tokens is given
        return (
            f"4-bit weights {s.num_params / 2 / 1e9:.1f} GB; KV budget {budget / 1e9:.1f} GB of the "
            f"{h100_bytes / 1e9:.1f} GB an H100 reports ({(80e9 - s.num_params // 2) / 1e9:.1f} GB of a marketed "
            f"80 GB); static 32K: {static} requests; paged at 200 MB ({tokens} tokens): {paged} requests = "
            f"{paged / static:.1f}×"
        )

    def startup_blocks() -> str:
        s = KVSpec.from_preset("llama-3-8b")
        assert s.num_params is not None  # every preset has its weights' size
        blocks = num_blocks_at_startup(a100_bytes, 0.9, s.num_params * 2, 2 * GiB, s, 16)
        return (
            f"{blocks:,} blocks = {blocks * 16:,} token slots (0.9 of the {a100_bytes / GiB:.0f} GiB an A100 80 GB "
            f"reports, bf16 weights, 2 GiB activation peak); 4,096 blocks are "
            f"{format_bytes(4096 * s.bytes_per_block(16))}"
        )

    def tp_sizes() -> str:
        s, out = llama70(), []
        for t in (2, 3, 16):
            try:
                heads, how = s.check_tp_size(t)
                out.append(f"TP={t}: {heads} KV head{'s' * (heads > 1)} per rank ({how})")
            except ValueError as refused:
                out.append(f"TP={t}: refused ({str(refused).split(': ', 1)[1].split('. Sizes')[0]})")
        return "KVSpec.check_tp_size on Llama-3-70B (64 attention heads, 8 KV heads): " + "; ".join(out)

    def tp2() -> str:
        rank = llama70().per_rank(2)
        per_request = rank.bytes_for_tokens(8192)
        cap = rank.capacity(8 * GiB, 16, 8192)
        return (
            f"{llama70().bytes_for_tokens(8192) / GiB:.2f} GiB per request, {per_request / GiB:.2f} GiB per "
            f"rank, {per_request * 1.04 / GiB:.2f} GiB with 4 %; 8 GiB per rank: {cap.full_requests} full "
            "8K requests"
        )

    return [
        Claim(
            "01",
            'Llama-3-70B (80 layers × 8 KV heads × 128, fp16) needs 327,680 bytes, "~320 KB", of KV cache per token',
            f"{INFERENCE_AT_SCALE}, the KV cache recap",
            per_token,
            "holds if KB is read as KiB: 327,680 B is exactly 320 KiB (327.7 kB)",
        ),
        Claim(
            "01",
            "1.3 / 10.5 / 42 GB per request at 4K / 32K / 128K tokens",
            f"{INFERENCE_AT_SCALE}, the KV cache recap",
            three_lengths,
            "holds if read as K = 1,000 tokens and GB = 10^9 bytes: 4,000 / 32,000 / 128,000 tokens give "
            "1.31 / 10.49 / 41.9 GB. Read as 4,096 / 32,768 / 131,072 tokens, the decimal figures are "
            "1.34 / 10.74 / 42.9 GB, and the binary ones exactly 1.25 / 10 / 40 GiB",
        ),
        Claim(
            "01",
            'a 70B model serving 128K context needs "~10 GB per request" (opening paragraph); its own '
            "worked check gives ~43 GB",
            f'{INFERENCE_AT_SCALE}, opening paragraph and first "think, then check"',
            at_128k,
            "wrong for ~10 GB, which is the 32K figure; the worked check's ~43 GB holds (131,072 tokens: "
            "42.9 GB = 40 GiB)",
        ),
        Claim(
            "01",
            'at 2,048 tokens: MHA "1024 MB Llama-2 7B", GQA "256 MB Llama-3 8B"',
            f"{DEEP_DIVE}, section 1.5 (MHA vs GQA vs MQA)",
            mha_gqa_mqa_8b,
            "holds in binary units: Llama-2-7B's 32 KV heads and Llama-3-8B's 8, on the same 32 layers of 128, give "
            "1,024 and 256 MiB",
        ),
        Claim(
            "01",
            'at 2,048 tokens: MQA "64 MB Example model"',
            f"{DEEP_DIVE}, section 1.5 (MHA vs GQA vs MQA)",
            mha_gqa_mqa_8b,
            'unverifiable as quoted: the card names no model ("Example model") and no shape. On Llama-3-8B\'s other '
            "dimensions one KV head gives 32 MiB and 64 MiB is two; 64 layers of one KV head of 128 would give "
            "exactly 64 MiB",
        ),
        Claim(
            "01",
            "80 layers, head_dim 128, fp16, 4K tokens: MHA-64 10.00 GiB, GQA-8 1.25 GiB, MQA-1 0.16 GiB",
            CAPACITY_ARTICLE,
            mha_gqa_mqa_80,
            "holds",
        ),
        Claim(
            "01",
            'an "80 GB" H100 SXM has 80 GB of HBM3; nvidia-smi reports its total memory as 81559MiB (an "80GB" A100: '
            "81920MiB)",
            "NVIDIA H100 Tensor Core GPU datasheet (SXM column); the nvidia-smi output quoted in the GitHub issue "
            'wilicc/gpu-burn#114 ("NVIDIA H100 80GB HBM3 ... 81559MiB") and the GitHub pull request '
            "modal-labs/modal-client#2797 (H100 81559MiB, A100 80GB 81920MiB)",
            card_bytes,
            'holds: the marketed "80 GB" is neither unit. An H100 reports 79.65 GiB, 85.52 GB, and chapter 01 does '
            "every capacity on an 80 GB card with those bytes (the A100's, exactly 80 GiB, for the start-up "
            "calculation); what PyTorch can allocate is a little less again, which the course does not pin down",
        ),
        Claim(
            "01",
            "32×8 / 80×8 / 96×96 (layers × KV heads, head_dim 128, fp16): 128 KiB / 320 KiB / 4.5 MiB per "
            "token, 512 MiB / 1.25 GiB / 18 GiB at 4K, 4 / 10 / 144 GiB at 32K; 128 requests of 4K "
            "on the 80-layer model need 160 GiB, beyond one 80 GB-class accelerator",
            CAPACITY_ARTICLE,
            three_architectures,
            "holds: every figure is exact in binary units (160 GiB is 171.8 GB); an 80 GB H100 holding nothing "
            "but KV (the 81,559 MiB it reports) takes fewer than half of the 128 requests",
        ),
        Claim(
            "01",
            'Llama-3-70B, 32 requests: 2,048 tokens each take "32 × 0.64 GB = 20.5 GB", 8,192 tokens '
            '"82 GB", against ≈ 140 GB of bf16 weights',
            f"{DEEP_DIVE}, section 1.4 (KV cache vs model weights)",
            kv_vs_weights,
            'holds if read as 640 MiB per request and "GB" as thousands of MiB (32 × 640 = 20,480 MiB); '
            "in GiB the cache is 20 and 80, in GB 21.5 and 85.9. The weights hold: 141 GB",
        ),
        Claim(
            "01",
            "Llama-3-70B on an 80 GB H100 with ~35 GB of quantised weights leaves ~45 GB: static "
            "allocation at MAX_CONTEXT 32K (10 GB/request) serves 4 requests, paging at ~200 MB/request "
            '~200: "50× more throughput per GPU"',
            f'{INFERENCE_AT_SCALE}, third "think, then check"',
            h100_chain,
            'holds if read as requests held at once, each figure rounded down. Its "~45 GB" is 80 − 35 in marketed '
            "gigabytes: the card reports 85.5 GB, which leaves 50.2 GB, 4 static requests and 245 paged ones (61×), "
            'so "~200" and "50×" are conservative. Not as throughput, which grows with the batch but not in '
            "proportion (chapter 09)",
        ),
        Claim(
            "01",
            'A100 80 GB, Llama-3-8B, bf16, block_size 16: "~4 096 blocks → ~65 536 concurrent token slots"',
            f"{DEEP_DIVE}, chapter 06 (start-up memory calculation)",
            startup_blocks,
            "wrong: the start-up formula it states gives 28,181 blocks (450,896 slots) on the 81,920 MiB an "
            "A100 80 GB reports, for a 2 GiB activation peak; 4,096 blocks of 2 MiB are only 8 GiB of the card",
        ),
        Claim(
            "01",
            "vLLM runs tensor_parallel_size t only if t divides the model's attention heads; its KV heads are split "
            "evenly over the t ranks, or each copied whole onto t / n_kv ranks when t is a multiple of them",
            'vLLM, vllm/config/model.py (ModelConfig.verify_with_parallel_config: "Total number of attention heads '
            '(...) must be divisible by tensor parallel size (...)") and vllm/model_executor/layers/linear.py '
            "(QKVParallelLinear)",
            tp_sizes,
            "holds: KVSpec.check_tp_size applies both rules. TP=3 on Llama-3-70B breaks both (64 attention heads, 8 KV "
            "heads), so vLLM refuses it; chapter 01 shows the refusal instead of budgeting a replicated cache",
        ),
        Claim(
            "01",
            "80 layers, 8 KV heads, fp16, 8K context, TP=2: 2.5 GiB per request, 1.25 GiB per rank, "
            "~1.30 GiB with the paper's < 4 % tail waste; an 8 GiB per-rank budget admits 6 full 8K "
            "requests",
            CAPACITY_ARTICLE,
            tp2,
            "holds",
        ),
    ]


def _chapter_02() -> list[Claim]:
    import numpy as np

    from ..kv_math import GiB, KVSpec, MiB, format_bytes
    from ..lab import workloads
    from ..lab.contiguous import PAPER_FIG2, block_size_tradeoff, waste_breakdown

    def four_requests() -> str:
        bpt = KVSpec.from_preset("llama-3-70b").bytes_per_token
        live = [600, 1250, 4000, 128]
        reserved, used = 4 * 8192 * bpt, sum(live) * bpt
        return f"reserved {reserved / GiB:.2f} GiB, live {used / GiB:.2f} GiB, unused {1 - used / reserved:.1%}"

    def fifty_tokens() -> str:
        s = KVSpec.from_preset("llama-3-8b")
        reserved, used = s.bytes_for_tokens(2048), s.bytes_for_tokens(50)
        return (
            f"reserved {reserved / MiB:.0f} MiB, 50 tokens {used / MiB:.2f} MiB, idle "
            f"{(reserved - used) / MiB:.2f} MiB ({1 - used / reserved:.1%}); 12 MiB is "
            f"{12 * MiB / s.bytes_per_token:.0f} tokens"
        )

    def chat_mix() -> str:
        mix = workloads.chat_mix_lengths(10_000, seed=0)
        out = []
        for cap in (100_000, 32_768):
            x = np.minimum(mix, cap)
            out.append(f"reserving {cap:,}: {np.sum(-(-x // 16) * 16) / (len(x) * cap):.1%}")
        return "paged slots / static slots, 10,000 draws: " + "; ".join(out)

    def static_vs_paged() -> str:
        t = workloads.static_vs_paged_table()
        return (
            f"min {t['min']} mean {t['mean']:.0f} max {t['max']}, {t['total_tokens']:,} tokens; static "
            f"{t['static_allocated_gb']:.2f} GB, {t['static_utilisation_pct']:.1f} %; paged "
            f"{t['paged_blocks']:,} blocks, {t['paged_allocated_gb']:.2f} GB, {t['paged_utilisation_pct']:.1f} %; "
            f"{t['ratio']:.1f}×"
        )

    def band() -> str:
        b = _fig2_band()
        return ", ".join(f"{name} {100 * s['utilisation']:.1f} %" for name, s in b.items())

    def fig2() -> str:
        return "; ".join(
            f"{name}: " + " / ".join(f"{x:.1f}" for x in shares)
            for name, shares in waste_breakdown(_fig2_band()).items()
        )

    def three_wastes() -> str:
        from ..lab.contiguous import simulate_trace

        trace = workloads.sharegpt_like_trace(400, seed=0, arrival_rate=2.0, max_model_len=2048)
        got = simulate_trace(trace, 16 * 2048, "contiguous", 2048, policy="max").summary()
        return (
            f"chapter 02's 400-request trace, max reservation: reserved for tokens to come {got['reservation']:.1%}, "
            f"internal fragmentation {got['internal_fragmentation']:.1%}, external {got['external_waste']:.1%}; "
            f"reserved but empty (exercise 02's internal) {got['internal_waste']:.1%}, the first two together"
        )

    def sixty_fifteen() -> str:
        b = _fig2_band()
        return (
            f"15 / 60 = {15 / 60:.0%}; measured: max {b['max']['utilisation']:.1%}, pow2 {b['pow2']['utilisation']:.1%}"
        )

    def one_request() -> str:
        s = KVSpec.from_preset("llama-3-8b")
        return (
            f"Llama-3-8B: {s.bytes_per_token / 1024:.0f} KiB/token ({s.bytes_per_token / 1e3:.0f} kB); 8,192 "
            f"tokens: {format_bytes(s.bytes_for_tokens(8192))}"
        )

    def tails() -> str:
        rows = [block_size_tradeoff([n], block_sizes=(16,))[0] for n in (505, 1000, 4096)]
        return "; ".join(
            f"{n} → {r['max_table_entries'] * 16} slots, {r['max_waste_tokens']} unused"
            for n, r in zip((505, 1000, 4096), rows)
        )

    def half_block() -> str:
        s = KVSpec.from_preset("llama-3-70b")
        at16 = block_size_tradeoff(workloads.static_vs_paged_lengths(), block_sizes=(16,))[0]
        return (
            f"block {format_bytes(s.bytes_per_block(16))}; mean tail {at16['mean_waste_tokens']:.1f} tokens = "
            f"{at16['mean_waste_tokens'] * s.bytes_per_token / MiB:.2f} MiB per request"
        )

    def block_sizes() -> str:
        p, o = workloads.sharegpt_like_pairs(2_000, seed=0)
        short = workloads.lognormal_lengths(2_000, mean=78, sigma=0.8, lo=4, seed=0)  # Alpaca: 19 + 58 tokens
        out = []
        for label, lengths in (("ShareGPT-like", p + o), ("Alpaca-like", short)):
            rows = {r["block_size"]: r["waste_pct"] for r in block_size_tradeoff(lengths, (16, 32, 128))}
            out.append(f"{label} tail waste " + " / ".join(f"{rows[b]:.1f} %" for b in (16, 32, 128)))
        return "at 16 / 32 / 128 tokens: " + "; ".join(out)

    paper_fig2 = ", ".join(
        f"{k}: " + " / ".join("–" if x is None else f"{x}" for x in v) for k, v in PAPER_FIG2.items()
    )
    return [
        Claim(
            "02",
            'three kinds of waste in a contiguous KV cache: "reserved" slots for future tokens, "internal '
            'fragmentation" in slots over-provisioned for the maximum length that will never be used, and '
            '"external fragmentation" from the memory allocator',
            f"{PAGED_ATTENTION}, section 3.1 and Fig. 3",
            three_wastes,
            "holds, and chapter 02 keeps the three apart: only the slots past a request's final length are internal "
            'fragmentation. Exercise 02\'s "internal" key counts every reserved-but-empty slot, the first two '
            "together, because a snapshot of the arena cannot split them; its markdown says so",
        ),
        Claim(
            "02",
            "four chat requests of 600, 1,250, 4,000 and 128 tokens, each reserving 8,192 slots at "
            "320 KiB/token: 10.00 GiB reserved, 1.82 GiB live, 81.8 % unused",
            CAPACITY_ARTICLE,
            four_requests,
            "holds",
        ),
        Claim(
            "02",
            'Llama-3-8B, a 2,048-token reservation, 50 tokens generated: "256 MB reserved but only 12 MB '
            'used. 244 MB sits idle"',
            f"{DEEP_DIVE}, section 1.6 (internal fragmentation)",
            fifty_tokens,
            "holds if read as the request's whole reservation in use, its prompt included: 12 MiB is what 96 tokens "
            "hold, a prompt of about 46 tokens beside the 50 generated (chapter 02's reading; 50 tokens at twice the "
            "bytes per token, 12.5 MiB, is the other). Read as the 50 generated tokens alone it is off: they hold "
            "6.25 MiB and 249.75 MiB (97.6 %) sits idle. The 256 MiB reservation holds",
        ),
        Claim(
            "02",
            "with the chat mix (50 / 30 / 15 / 5 % of requests in 100–1k / 1k–5k / 5k–20k / 20k–100k "
            'tokens) paging needs "~10–15 % of static allocation"',
            f'{INFERENCE_AT_SCALE}, second "think, then check"',
            chat_mix,
            "holds if read as a static system reserving 32K tokens (the text's own MAX_CONTEXT example) and "
            "cutting the longest 3.5 % of requests to it: 12.7 %; against a 100K reservation that serves "
            "every request paging needs only 5.1 %",
        ),
        Claim(
            "02",
            "100 lognormal requests (min 34, mean 193, max 631 tokens): static 107.37 GB allocated, "
            "2.4 % used; paged 1,253 blocks, 2.63 GB, 96.1 %; 40.9× more requests per GPU",
            f"{INFERENCE_AT_SCALE}, the C program kv_cache.c and its output",
            static_vs_paged,
            "holds: 131,072 B/token (32 layers × 8 KV heads × 128 × fp16) and MAX_CONTEXT 8,192, which it does "
            "not print, give back every GB figure; our own draw of 100 lengths differs from its rand() draw "
            "by a few tokens, and every percentage and ratio by at most one in the last digit",
        ),
        Claim(
            "02",
            "existing systems keep only 20.4–38.2 % of the KV cache in token states; vLLM 96.3 %",
            f"{PAGED_ATTENTION}, section 1 and Fig. 2 (OPT-13B, ShareGPT, the experiment of section 6.2)",
            band,
            "holds: on the paper's arena (15,728 slots, 2,048-token max) the max reservation lands 0.3 points "
            "below the band's lower end (the paper's Orca (Max) is that end), pow2 inside it near the top, the "
            "oracle above it, paging above 96.3 %",
        ),
        Claim(
            "02",
            f"Fig. 2, token states / reservation / internal frag. / external frag. & others, in %: {paper_fig2}",
            f"{PAGED_ATTENTION}, section 3.1 and Fig. 2",
            fig2,
            "holds for Orca (Max), reproduced within a point in each of the four bars; for Pow2 and Oracle "
            "our first-fit arena keeps more tokens and loses less to the last bar than the paper's buddy "
            "allocator (the paper does not split that bar, so where exactly it loses is our guess)",
        ),
        Claim(
            "02",
            'an 80 GB card with ~60 GB left for KV, allocated contiguously: "paying for 60 GB and serving '
            'as if you had 15"',
            f'{BOOK_CHAPTER}, "The naive layout and the waste it bakes in"',
            sixty_fifteen,
            "holds: 25 % lies inside the paper's 20.4–38.2 %, between our max and pow2 runs",
        ),
        Claim(
            "02",
            "a typical 7–8B GQA model in bf16 holds ~100–150 KB (~125 KB) per token; at max_model_len 8k "
            "a contiguous reservation is ~1 GB",
            f'{BOOK_CHAPTER}, "Why the KV cache is the budget"',
            one_request,
            "holds: 128 KiB per token, 1 GiB at 8,192 tokens",
        ),
        Claim(
            "02",
            "16-token blocks: 505 live tokens → 512 slots (7 unused), 1,000 → 1,008 (8), 4,096 → 4,096 (0)",
            CAPACITY_ARTICLE,
            tails,
            "holds",
        ),
        Claim(
            "02",
            "16 tokens × 320 KB = 5 MB per block for a 70B model; on average ~2.5 MB (half a block) wasted per request",
            f'{INFERENCE_AT_SCALE}, "Why the block size matters"',
            half_block,
            "holds: 5 MiB per block; the 100 lognormal requests waste 7.8 tokens = 2.44 MiB each",
        ),
        Claim(
            "02",
            "block sizes 16–128 work best on ShareGPT, 16–32 on the shorter Alpaca requests; vLLM's default is 16",
            f"{PAGED_ATTENTION}, section 7.2 (Fig. 18b)",
            block_sizes,
            "holds if read as a memory argument: big blocks waste a far larger share of short requests; the "
            "kernel-speed half of the trade-off is measured in the paper, not here",
        ),
    ]


def _chapter_03() -> list[Claim]:
    from ..config import Config
    from ..core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request
    from ..worker.block_table import BlockTable

    def ab_trace() -> str:
        mgr = KVCacheManager(block_size=4, num_blocks=20, enable_caching=False, watermark=0.0)
        a, b = Request("A", [0]), Request("B", [0])
        writes = []
        for req, n in ((a, 5), (b, 1)):
            for _ in range(n):
                mgr.allocate_slots(req, 1)
                where = BlockTable(4, mgr.get_block_ids(req.request_id)).resolve(req.num_computed_tokens)
                writes.append(f"{req.request_id} {where}")
                req.num_computed_tokens += 1
                req.append_output_token_ids(1)
        mgr.free("A")
        theirs = [
            f"{p}" for p in (*[BlockTable(4, [19, 18]).resolve(i) for i in range(5)], BlockTable(4, [17]).resolve(0))
        ]
        return (
            f"ours: {', '.join(writes)}, free {mgr.get_num_free_blocks()}; its ids through resolve: {', '.join(theirs)}"
        )

    def middle_removal() -> str:
        blocks = [KVCacheBlock(i) for i in range(100_000)]
        q = FreeKVCacheBlockQueue(blocks)
        mid = blocks[50_000]
        q.remove(mid)
        left, right = blocks[49_999], blocks[50_001]
        assert left.next_free_block is not None and right.prev_free_block is not None  # still queued
        return (
            f"remove(block 50,000) of 100,000: its neighbours now link to each other "
            f"({left.next_free_block.block_id} ⇄ {right.prev_free_block.block_id}), {q.num_free_blocks:,} left"
        )

    def null_block() -> str:
        pool = BlockPool(8, enable_caching=False)
        got = pool.get_new_blocks(pool.get_num_free_blocks())
        return (
            f"null block id {pool.null_block.block_id}; all {len(got)} usable blocks handed out: "
            f"{[b.block_id for b in got]}"
        )

    def default_block_size() -> str:
        return f"minipaged Config().block_size = {Config.block_size}"

    def tail_first() -> str:
        pool = BlockPool(6, enable_caching=False)
        got = pool.get_new_blocks(3)
        pool.free_blocks(reversed(got))
        return (
            f"blocks {[b.block_id for b in got]} freed tail first → free queue "
            f"{[b.block_id for b in pool.free_block_queue.get_all_free_blocks()]}"
        )

    return [
        Claim(
            "03",
            "block_size 4, 20 blocks: A writes 5 tokens at (19, 0) (19, 1) (19, 2) (19, 3) (18, 0), B at "
            '(17, 0); after A finishes, "free blocks: 19"',
            CAPACITY_ARTICLE,
            ab_trace,
            "holds for its free list, a stack popped from the end: the same ids through our resolve give its "
            "lines exactly; our pool hands out 1, 2, 3 from the front of a queue and keeps block 0 as the null "
            "block, so it counts 18 free",
        ),
        Claim(
            "03",
            "the free list is a doubly linked list, not a deque, so that a block can be removed from the "
            "middle in O(1)",
            f"vLLM, vllm/v1/core/kv_cache_utils.py (FreeKVCacheBlockQueue); {BOOK_CHAPTER}",
            middle_removal,
            "holds",
        ),
        Claim(
            "03",
            "block 0 is a placeholder, the null block: taken off the free queue at start-up, never handed out or freed",
            "vLLM, vllm/v1/core/block_pool.py (BlockPool.null_block)",
            null_block,
            "holds",
        ),
        Claim(
            "03",
            "a request's blocks are freed in reverse order, so that its tail blocks are evicted first",
            "vLLM, vllm/v1/core/kv_cache_manager.py (KVCacheManager.free)",
            tail_first,
            "holds",
        ),
        Claim(
            "03",
            "the default block size is 16 tokens",
            f"vLLM, vllm/config/cache.py (DEFAULT_BLOCK_SIZE); {PAGED_ATTENTION}, section 7.2",
            default_block_size,
            "holds",
        ),
    ]


def _chapter_04() -> list[Claim]:
    from ..core.kv_cache_manager import KVCacheManager
    from ..core.request import Request
    from ..kv_math import KVSpec, MiB
    from ..worker.block_table import BlockTable

    def picture() -> str:
        mgr = KVCacheManager(block_size=16, num_blocks=12, enable_caching=False, watermark=0.0)
        for i in range(1, 12):
            mgr.allocate_slots(Request(f"w{i}", [0] * 16), 16)
        for i in (7, 1, 6, 2, 4, 9, 3, 5, 8, 10, 11):
            mgr.free(f"w{i}")
        reqs = {rid: Request(rid, [1] * n) for rid, n in (("A", 48), ("B", 32), ("C", 16))}
        while any(r.num_computed_tokens < r.num_tokens for r in reqs.values()):
            for r in reqs.values():
                if r.num_computed_tokens < r.num_tokens:
                    mgr.allocate_slots(r, 16)
                    r.num_computed_tokens += 16
        return "; ".join(f"{rid} → {mgr.get_block_ids(rid)}" for rid in reqs)

    def slot() -> str:
        t = BlockTable(4, [19, 18, 5], num_tokens=11)
        block, offset = t.resolve(10)
        return f"table [19, 18, 5], block_size 4, position 10 → ({block}, {offset}) → slot {t.slot(10)}"

    def fifty() -> str:
        mgr = KVCacheManager(block_size=16, num_blocks=8, enable_caching=False, watermark=0.0)
        req = Request("r", list(range(50)))
        mgr.allocate_slots(req, 50)
        req.num_computed_tokens = 50
        held = len(mgr.get_block_ids("r"))
        new = []
        for _ in range(15):
            new.append(mgr.allocate_slots(req, 1))
            req.num_computed_tokens += 1
            req.append_output_token_ids(0)
        first_new = 51 + next(i for i, b in enumerate(new) if b)
        return (
            f"50 tokens → {held} blocks, the last holding {50 - 16 * (held - 1)}; first new block at token {first_new}"
        )

    def block_bytes() -> str:
        return "; ".join(
            f"{KVSpec.from_preset(m).name}: {KVSpec.from_preset(m).bytes_per_block(16) / MiB:.0f} MiB"
            for m in ("llama-3-70b", "llama-3-8b")
        )

    def admission(watermark: float, reserved: int) -> str:
        """Chapter 04's sequence: four 160-token prompts, r0's next token, r4 (80), r5 (16), r1's next 16."""
        mgr = KVCacheManager(
            block_size=16, num_blocks=41, enable_caching=False, watermark=watermark, reserved_blocks=reserved
        )
        reqs: dict[str, Request] = {}
        out = []
        for rid, n in (
            ("r0", 160),
            ("r1", 160),
            ("r2", 160),
            ("r3", 160),
            ("r0", 1),
            ("r4", 80),
            ("r5", 16),
            ("r1", 16),
        ):
            req = reqs.get(rid) or Request(rid, [0] * n)
            ok = mgr.allocate_slots(req, n) is not None
            if ok:
                req.num_computed_tokens += n
                reqs[rid] = req
            out.append(f"{rid} +{n} {'gets blocks' if ok else 'None'}")
        return ", ".join(out)

    def v0_watermark() -> str:
        return f"KVCacheManager(16, 1000).watermark_blocks = {KVCacheManager(16, 1000).watermark_blocks}"

    return [
        Claim(
            "04",
            "three requests in a 12-block pool of 16-token blocks: A → 7, 2, 9; B → 1, 4; C → 6",
            f"{DEEP_DIVE}, chapter 02 (block table)",
            picture,
            "holds: the real allocator produces it when earlier requests free their blocks in the order "
            "7, 1, 6, 2, 4, 9, …",
        ),
        Claim(
            "04",
            "slot = block × block_size + offset (slot_ids = block_numbers * block_size + local_block_offsets)",
            f"vLLM, vllm/v1/worker/block_table.py; {BOOK_CHAPTER}",
            slot,
            "holds",
        ),
        Claim(
            "04",
            "a request with 50 tokens in 16-token blocks holds 4 blocks, the last with 2 of 16 slots used; "
            "token 51 goes into block 3, token 65 needs a new block",
            f"{INFERENCE_AT_SCALE}, the block-table example",
            fifty,
            "holds",
        ),
        Claim(
            "04",
            "one 16-token block is 5 MB for a 70B-class model (80 layers) and ≈ 2 MB for Llama 8B",
            f"{INFERENCE_AT_SCALE}, the block-table example",
            block_bytes,
            "holds if MB is read as MiB: exactly 5 and 2 MiB",
        ),
        Claim(
            "04",
            "allocate_slots returns None when blocks needed + watermark > free blocks − reserved blocks; "
            "the watermark applies to waiting or preempted requests only",
            f"vLLM, vllm/v1/core/kv_cache_manager.py (KVCacheManager.allocate_slots); {BOOK_CHAPTER}",
            lambda: "40 usable blocks, 5 % watermark, 2 reserved: " + admission(0.05, 2),
            "holds",
        ),
        Claim(
            "04",
            'allocate_slots checks only "blocks needed > free blocks"',
            f"{DEEP_DIVE}, chapter 02 (core allocation code)",
            lambda: "no watermark, no reserve: " + admission(0.0, 0),
            "holds if read as vLLM v1 with its default watermark of 0 and no reserve, which the simple check "
            "leaves out: then r3 takes the pool's last blocks, and the running r0's very next token gets None "
            "(a preemption); with the watermark r3 waits and r0 runs on (chapter 04, section 5)",
        ),
        Claim(
            "04",
            "the watermark is 1 % of the GPU blocks by default, kept free when admitting a waiting request",
            "vLLM v0, vllm/core/block_manager.py (BlockSpaceManager, watermark=0.01)",
            v0_watermark,
            "holds: minipaged keeps v0's 1 %; vLLM v1's KVCacheManager defaults to 0.0",
        ),
    ]


def _chapter_05() -> list[Claim]:
    from ..kv_math import KVSpec

    kernel_overhead = (0.20, 0.26)  # the paper's §7.1: its paged kernel against FasterTransformer's

    def step_overhead() -> str:
        llama = KVSpec.from_preset("llama-3-8b")
        assert llama.num_params is not None  # every preset has its weights' size
        weights = llama.num_params * llama.dtype_bytes
        parts = []
        for batch, ctx in ((8, 1024), (32, 1024), (32, 4096)):
            kv = llama.bytes_for_tokens(batch * ctx)
            share = kv / (kv + weights)
            parts.append(f"{batch} × {ctx}: {share * kernel_overhead[0]:.1%}–{share * kernel_overhead[1]:.1%}")
        return (
            "a 20–26 % slower attention kernel slows a whole Llama-3-8B decode step (bf16) by "
            + "; ".join(parts)
            + ": attention's share of the bytes the step reads"
        )

    def kernel_latency() -> str:
        llama = KVSpec.from_preset("llama-3-8b")
        assert llama.num_attention_heads is not None  # every preset names its query heads
        intensity = 2 * (llama.num_attention_heads // llama.num_kv_heads) / llama.dtype_bytes
        bound = (
            f"decode attention on Llama-3-8B does {intensity:.0f} FLOP per byte it reads: bandwidth-bound, so any "
            "addressing cost shows as latency"
        )
        import json
        from pathlib import Path

        runs = sorted((Path(__file__).resolve().parents[2] / "assets/benchmarks/gpu").glob("paged_attention_*.json"))
        if not runs:  # an installed package carries no benchmark results
            return f"no GPU result here (assets/benchmarks/gpu/); {bound}"
        res = json.loads(runs[-1].read_text())
        s = res["summary"]
        return (
            f"{bound}. The course's kernel on {res['device']} ({res['date'][:10]}, {res['config']['dtype']}, "
            f"{s['summarised_points']} points of >= 64 MB of KV): paged at most "
            f"{s['max_paged_over_contiguous'] - 1:.1%} slower than the same kernel on contiguous blocks, and "
            f"{s['median_paged_over_sdpa']:.2f}x the time of PyTorch SDPA on a contiguous cache (median)"
        )

    def block_sizes() -> str:
        import numpy as np

        from ..lab.workloads import sharegpt_like_trace

        lens = np.array([r.prompt_len + r.output_len for r in sharegpt_like_trace(1000, seed=0)])
        parts = [
            f"block {bs}: {float((np.ceil(lens / bs) * bs - lens).mean()):.1f} empty slots per request, "
            f"{1024 // bs} table lookups per 1,024 tokens"
            for bs in (16, 128)
        ]
        return "the memory side only, 1,000 ShareGPT-like requests: " + "; ".join(parts)

    def h100_ridge() -> str:
        from ..lab.simulator import HARDWARE

        hw = HARDWARE["h100"]
        return (
            f"the cost model's H100 entry: {hw.mem_bandwidth / 1e12:.2f} TB/s, {hw.flops / 1e12:.0f} TFLOP/s "
            f"dense 16-bit: a ridge point of {hw.flops / hw.mem_bandwidth:.0f} FLOP per byte"
        )

    def t4_row() -> str:
        from ..gpus import GPUS
        from ..lab.simulator import HARDWARE

        t4 = GPUS["t4"]
        assert t4.fp16_tflops is not None and t4.ridge_point is not None and t4.memory_gib is not None
        from_clock = 2 * 5001e6 * 256 / 8 / 1e9  # GDDR6 at 5,001 MHz, two transfers a clock, a 256-bit bus
        return (
            f"minipaged.gpus' T4 row: {t4.bandwidth_gbps:.0f} GB/s (the memory's clock and bus give "
            f"{from_clock:.0f}), {t4.fp16_tflops:.0f} TFLOP/s dense fp16, {t4.warps_per_sm} warps per SM, bfloat16 "
            f"tensor cores: {'yes' if t4.bf16_tensor_cores else 'no'}; a ridge point of {t4.ridge_point:.0f} FLOP "
            f"per byte; {t4.memory} reported as {t4.memory_gib:.1f} GiB; the cost model's T4 entry: "
            f"{HARDWARE['t4'].mem_bandwidth / 1e9:.0f} GB/s, {HARDWARE['t4'].flops / 1e12:.0f} TFLOP/s"
        )

    def h200_row() -> str:
        from ..gpus import GPUS

        h100, h200 = GPUS["h100"], GPUS["h200"]
        assert h200.fp16_tflops is not None and h200.ridge_point is not None and h100.ridge_point is not None
        return (
            f"minipaged.gpus' H200 row: {h200.memory} at {h200.bandwidth_gbps / 1e3:.1f} TB/s, "
            f"{h200.fp16_tflops:.0f} TFLOP/s dense fp16 (the H100 SXM's); a ridge point of {h200.ridge_point:.0f} "
            f"FLOP per byte against the H100's {h100.ridge_point:.0f}; bandwidth-bound decode at most "
            f"{h200.bandwidth_gbps / h100.bandwidth_gbps:.2f}x as fast"
        )

    return [
        Claim(
            "05",
            'H100 SXM: 3.35 TB/s of HBM3; 1,979 TFLOPS of BF16/FP16 tensor-core arithmetic "with sparsity"',
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column)",
            h100_ridge,
            "holds if the arithmetic is read as dense, half the sparse figure: 989 TFLOPS (989.4 in NVIDIA's H100 "
            "architecture whitepaper), the peak a dense attention or GEMM can reach",
        ),
        Claim(
            "05",
            'T4: 16 GB of GDDR6 at "320+ GB/s"; 65 TFLOPS of mixed-precision (FP16/FP32) tensor-core arithmetic',
            "NVIDIA T4 Tensor Core GPU datasheet and the T4 product page",
            t4_row,
            "holds: 65 TFLOPS is dense (Turing has no sparsity mode), and 320 GB/s is the peak the memory's clock "
            "and bus give (the T4 board's product brief: \"up to 320 GBytes/s\"; the datasheet's own table rounds "
            "it to 300 GB/sec). A T4 has tensor cores for FP16 only: bfloat16 is emulated",
        ),
        Claim(
            "05",
            'H200: 141 GB of HBM3e at 4.8 TB/s; 1,979 TFLOPS of FP16 tensor-core arithmetic "with sparsity"',
            "NVIDIA H200 Tensor Core GPU datasheet (SXM column)",
            h200_row,
            "holds if the arithmetic is read as dense, half the sparse figure: 989 TFLOPS, the same Hopper die as "
            "the H100 SXM; only the memory grew, so bandwidth-bound decode gains what the bandwidth gains",
        ),
        Claim(
            "05",
            'the block reads of paged attention cost "~5-10% vs contiguous"',
            f'{INFERENCE_AT_SCALE}, the "think, then check" on the 50-token block table',
            step_overhead,
            "holds if read as the cost of a whole decode step for a few dozen requests of 1-4K tokens, not of "
            "the attention kernel: the PagedAttention paper measured its kernel 20-26 % slower than "
            "FasterTransformer's (§7.1, Fig. 18a); the text gives no measurement",
        ),
        Claim(
            "05",
            "20-26 % higher attention-kernel latency than FasterTransformer's kernel, from reading the "
            "block table, extra branches and variable sequence lengths; no end-to-end figure for it",
            f"{PAGED_ATTENTION}, §7.1 and Fig. 18a",
            kernel_latency,
            "holds if read as the paper's 2023 kernel: FlashAttention-2 (from 2.5) and FlashInfer read the "
            "block table inside their own tiled kernels, and vLLM v1 calls FlashAttention with it "
            "(vllm/v1/attention/backends/flash_attn.py); the course's own GPU run (the check) tells the block table's "
            "cost apart from the kernel's quality: the same kernel on contiguous blocks is the peer, not SDPA",
        ),
        Claim(
            "05",
            "block sizes 16-128 perform best on the ShareGPT trace, 16-32 on Alpaca; default 16",
            f"{PAGED_ATTENTION}, §7.2 and Fig. 18b",
            block_sizes,
            "holds if read as the paper's end-to-end measurement; the course computes only the memory side "
            "of the trade-off, not the kernel side",
        ),
    ]


def _chapter_06() -> list[Claim]:
    from ..utils import cdiv

    @cache
    def offline_runs() -> tuple[float, float]:
        """Chapter 06's offline comparison: continuous over padded and over unpadded static batching."""
        from ..lab.simulator import (
            CostModel,
            SimConfig,
            kv_pool_blocks,
            requests_from_trace,
            simulate_continuous,
            simulate_static,
        )
        from ..lab.workloads import sharegpt_like_trace

        h100 = CostModel.for_model("llama-3-8b", "h100")
        cfg = SimConfig(
            block_size=16,
            num_gpu_blocks_override=kv_pool_blocks("llama-3-8b", "h100", 16) + 1,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            max_model_len=2048,
        )
        share = requests_from_trace(sharegpt_like_trace(1000, seed=0))
        cont = simulate_continuous(share, h100, cfg, record_events=False).summary()["throughput_tok_s"]
        padded = simulate_static(share, h100, cfg, padded=True, record_events=False).summary()["throughput_tok_s"]
        bare = simulate_static(share, h100, cfg, padded=False, record_events=False).summary()["throughput_tok_s"]
        return cont / padded, cont / bare

    def defaults() -> str:
        from dataclasses import fields

        from ..core.scheduler import SchedulerConfig

        cfg = SchedulerConfig()
        return "minipaged keeps v0's limits: " + ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg))

    def seven() -> str:
        from ..lab.simulator import SimRequest, simulate_continuous
        from .viz.batching_viz import SEVEN_CONFIG, SEVEN_REQUESTS, STEP_CLOCK

        res = simulate_continuous(
            [SimRequest(r, 0.0, p, o) for r, p, o in SEVEN_REQUESTS], STEP_CLOCK, SEVEN_CONFIG, record_events=False
        ).summary()
        asked = sum(cdiv(p + o, SEVEN_CONFIG.block_size) for _, p, o in SEVEN_REQUESTS)
        return (
            f"the course's 7 requests ask for {asked} blocks of {SEVEN_CONFIG.block_size} from a pool of "
            f"{SEVEN_CONFIG.num_blocks - 1}: {res['preemptions']} preemptions, all done in {res['steps']} steps"
        )

    def two_to_four() -> str:
        padded, bare = offline_runs()
        return (
            f"simulator, 1,000 ShareGPT-like requests at once, Llama-3-8B on H100 numbers: continuous batching "
            f"{padded:.1f}× padded static batching, {bare:.1f}× static batching that skips padded rows"
        )

    def launch_post() -> str:
        padded, _ = offline_runs()
        return f"the course's simulator, same workload: {padded:.1f}× padded static batching"

    return [
        Claim(
            "06",
            "defaults: max_num_seqs 256, block_size 16, swap_space 4 GB, preemption_mode recompute, "
            "enable_prefix_caching False",
            f"{DEEP_DIVE}, chapter 06 (configuration reference)",
            defaults,
            "holds if read as vLLM v0's defaults: v1 picks max_num_seqs and max_num_batched_tokens by device "
            "and usage context (EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py: 1024 sequences on "
            "GPUs of 70 GiB or more other than the A100, 256 elsewhere), never swaps on preemption, and "
            "turns prefix caching and chunked prefill on",
        ),
        Claim(
            "06",
            '"7 requests compete for a 48-block GPU pool"',
            f"{DEEP_DIVE}, chapter 03 (continuous batching simulator)",
            seven,
            "holds if read as a scene, not a measurement: the site gives no lengths; with the course's, the "
            "requests need more blocks than the pool has, so it runs dry and preempts",
        ),
        Claim(
            "06",
            "2-4× the throughput of FasterTransformer and Orca at the same latency",
            f"{PAGED_ATTENTION}, abstract and §6",
            two_to_four,
            "holds if read against those two systems, each with its own kernels and memory reservation; the "
            "course's larger ratio is against naive static batching on a cost model, a weaker baseline",
        ),
        Claim(
            "06",
            "up to 24× higher throughput than Hugging Face Transformers",
            'vLLM\'s launch post, "vLLM: Easy, Fast, and Cheap LLM Serving with PagedAttention" (June 2023)',
            launch_post,
            "holds if read as \"up to\", on the post's own models and workloads; the course's cost model gives "
            "a smaller ratio for its workload, which it does not claim to match",
        ),
    ]


def _chapter_07() -> list[Claim]:
    from ..kv_math import KVSpec

    def a100_llama():
        from ..lab.simulator import CostModel

        return CostModel.for_model("llama-3-8b", "a100")

    def pcie() -> str:
        from ..lab.simulator import HARDWARE

        return (
            f"the cost model: {HARDWARE['a100'].swap_bandwidth / 1e9:.0f} GB/s one way on the A100 entry "
            f"(PCIe 4.0 x16), {HARDWARE['h100'].swap_bandwidth / 1e9:.0f} GB/s on the H100 entry (PCIe 5.0 x16)"
        )

    def per_copy() -> str:
        cost = a100_llama()
        data = 16 * cost.kv_bytes_per_token / cost.swap_bandwidth
        return (
            f"assumed {cost.swap_latency * 1e6:.0f} µs per copy: a 16-token Llama-3-8B block is "
            f"{cost.copies_per_block} copies, {cost.copies_per_block * cost.swap_latency * 1e6:.0f} µs of fixed "
            f"cost against {data * 1e6:.0f} µs of bytes at 32 GB/s"
        )

    def fig19_bound() -> str:
        from ..lab.simulator import CostModel, swap_vs_recompute

        opt13b = KVSpec(40, 40, 128, 2, 40, "OPT-13B", num_params=13_000_000_000)
        cost = CostModel.for_model(opt13b, "a100")
        rows = swap_vs_recompute(cost, 1024, (1, 16, 64, 256))
        ratios = ", ".join(f"{r['block_size']}: {r['recompute_s'] / r['swap_s']:.2f}" for r in rows)
        big = rows[-1]  # the bound binds where swapping is cheapest: the largest blocks
        need = big["recompute_s"] / 1.2 - big["swap_fixed_s"]  # seconds the bytes must take
        bandwidth = 2 * 1024 * cost.kv_bytes_per_token / need
        return (
            f"cost model, OPT-13B, 1,024 tokens, A100: recompute ÷ swap by block size {ratios}; within 1.2 at 256 "
            f"only if the swap moves at most {bandwidth / 1e9:.0f} GB/s each way"
        )

    def fig19() -> str:
        from ..lab.simulator import CostModel, swap_vs_recompute

        opt13b = KVSpec(40, 40, 128, 2, 40, "OPT-13B", num_params=13_000_000_000)
        rows = swap_vs_recompute(CostModel.for_model(opt13b, "a100"), 1024, (1, 16, 64, 256))
        swap = ", ".join(f"{r['block_size']}: {r['swap_s'] * 1e3:.0f} ms" for r in rows)
        return (
            f"cost model (5 µs per copy, assumed), OPT-13B, 1,024 tokens, A100 numbers: swap out + in by block "
            f"size {swap}; recompute {rows[0]['recompute_s'] * 1e3:.0f} ms at every size"
        )

    def rule_of_thumb() -> str:
        cost = a100_llama()
        base = cost.step_time(32 * 500, 32)
        parts = []
        for n in (64, 4096):
            swap = 2 * cost.swap_time(-(-n // 16), 16)
            ride = cost.step_time(32 * 500 + n, 32 + n) - base
            parts.append(f"{n} tokens: swap {swap * 1e3:.1f} ms, recompute beside 32 decodes {ride * 1e3:.1f} ms")
        return "Llama-3-8B, A100 numbers, 16-token blocks: " + "; ".join(parts)

    def swap_space() -> str:
        spec = KVSpec.from_preset("llama-3-8b")
        return f"4 GiB holds {4 * 2**30 // spec.bytes_per_block(16):,} blocks of 16 Llama-3-8B tokens (bf16)"

    def v1_preemption() -> str:
        from ..core.kv_cache_manager import KVCacheManager
        from ..core.request import Request
        from ..core.scheduler import Scheduler, SchedulerConfig
        from ..engine.step import run_step
        from ..lab.fake_device import FakeDeviceExecutor
        from ..sampling_params import SamplingParams

        kv = KVCacheManager(block_size=4, num_blocks=12, enable_caching=False, watermark=0.0)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        reqs = {
            f"r{i}": Request(f"r{i}", list(range(10 * i + 1, 10 * i + 9)), sampling_params=params) for i in range(4)
        }
        for r in reqs.values():
            sched.add_request(r)
        device = FakeDeviceExecutor(4, 4, 64, 12)  # the step driver's executor, a virtual device
        for step in range(1, 10):
            out = run_step(sched, device, partial(float, step)).output
            if out.preempted:
                victim = reqs[out.preempted[0]]
                return (
                    f"minipaged's scheduler ({SchedulerConfig().preemption_mode}, its default), chapter 07's four "
                    f"requests: at step {step} it preempts {victim.request_id}: status {victim.status.name}, "
                    f"num_computed_tokens {victim.num_computed_tokens}, {len(kv.get_block_ids(victim.request_id))} "
                    f"blocks held, position {[r.request_id for r in sched.waiting].index(victim.request_id)} of the "
                    f"waiting queue, nothing swapped out ({out.swap_out})"
                )
        return "no preemption in 9 steps"

    def a100_entry() -> str:
        from ..lab.simulator import HARDWARE

        hw = HARDWARE["a100"]
        return (
            f"the cost model's A100 entry: {hw.mem_bandwidth / 1e9:,.0f} GB/s, {hw.flops / 1e12:.0f} TFLOP/s "
            f"dense 16-bit; a Llama-3-8B decode step of 32 requests at 500 tokens: "
            f"{a100_llama().step_time(32 * 500, 32) * 1e3:.2f} ms"
        )

    return [
        Claim(
            "07",
            "vLLM v1 preempts only by recompute: the victim's blocks are freed, its status set to PREEMPTED, its "
            "num_computed_tokens reset to 0, and it goes back to the front of the waiting queue; swapping to CPU "
            "memory was vLLM v0's other way, and the PagedAttention paper's",
            "vLLM, vllm/v1/core/sched/scheduler.py (Scheduler._preempt_request, called from Scheduler.schedule when "
            f"allocate_slots returns None); {PAGED_ATTENTION}, §4.5 (swapping and recomputation)",
            v1_preemption,
            "holds: v1's _preempt_request has no swap branch; chapter 07 says so up front and builds swap only to "
            "compare the two, as v0 and the paper had them",
        ),
        Claim(
            "07",
            "A100 80 GB SXM: 2,039 GB/s of HBM2e; 312 TFLOPS of BF16 tensor-core arithmetic (624 with sparsity)",
            "NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM column)",
            a100_entry,
            "holds",
        ),
        Claim(
            "07",
            'swapping is limited by PCIe bandwidth, "~32 GB/s"',
            f"{DEEP_DIVE}, chapter 05 (preemption strategies)",
            pcie,
            "holds for PCIe 4.0 x16, one way, on paper; PCIe 5.0 doubles it. Bandwidth is half the price: "
            "each copy also pays a fixed cost (the paper's §7.3)",
        ),
        Claim(
            "07",
            "submitting one cudaMemcpyAsync costs about 5-7 µs of latency, for small chunks",
            'Wu et al., "DualPath: Breaking the Storage Bandwidth Bottleneck in Agentic LLM Inference", '
            "arXiv:2602.21548, §5.2",
            per_copy,
            "holds if read as the DualPath authors' measurement on their machines; the course assumes 5 µs per "
            "copy in its cost model and has not measured it on a GPU",
        ),
        Claim(
            "07",
            "swapping incurs excessive overhead with small block sizes (many small CPU-GPU transfers "
            "underuse PCIe); recomputation's overhead is the same at every block size; the two are "
            "comparable end to end for block sizes 16 to 64",
            f"{PAGED_ATTENTION}, §7.3 and Fig. 19",
            fig19,
            "holds in the cost model once each copy has a fixed cost, with vLLM v0's one copy per block, layer "
            "and K or V (swap_blocks in csrc/cache_kernels.cu); without it the block size would not matter",
        ),
        Claim(
            "07",
            "recomputation's overhead is never more than 20 % of swapping's latency, at any block size measured "
            "(1 to 256)",
            f"{PAGED_ATTENTION}, §7.3 and Fig. 19",
            fig19_bound,
            "holds as the paper's measurement; the course's cost model departs from it at large blocks, where its "
            "recompute costs about 1.5 times the swap (OPT-13B, 256-token blocks), because it moves swapped bytes at "
            "PCIe 4.0's nominal 32 GB/s each way and adds only 5 µs per copy. At an effective 25 GB/s or less, about "
            "what a PCIe 4.0 x16 copy reaches in practice, it meets the bound at every block size; the paper does not "
            "report its swap bandwidth, so the model keeps the nominal figure, and chapter 07 says so",
        ),
        Claim(
            "07",
            "use swap when CPU RAM is plentiful and requests are long, recompute when CPU RAM is limited "
            "or requests are short; the default is recompute",
            f"{DEEP_DIVE}, chapter 05 (rule of thumb)",
            rule_of_thumb,
            "holds if read with the block size in mind: short contexts recompute nearly free inside memory-bound "
            "steps, but at 16 tokens per block a long one costs about as much to swap as to recompute; "
            "vLLM v1 only recomputes",
        ),
        Claim(
            "07",
            "swap_space defaults to 4 GiB",
            "vLLM v0's vllm/engine/arg_utils.py (EngineArgs.swap_space)",
            swap_space,
            "holds for vLLM v0; v1 does not swap on preemption, and its CPU offloading (kv_offloading_size in "
            "vllm/config/cache.py) is off by default",
        ),
    ]


def _chapter_08() -> list[Claim]:
    @cache
    def system_prompt(prefix_len: int) -> tuple[int, int, int]:
        """Chapter 08's section 6 on the real manager: (blocks per copy, blocks holding it, system tokens computed)."""
        import numpy as np

        from ..core.kv_cache_manager import KVCacheManager
        from ..core.request import Request

        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(1, 32000, prefix_len)]
        kv = KVCacheManager(block_size=16, num_blocks=8000, enable_caching=True, watermark=0.0)
        computed = 0
        for i in range(100):
            r = Request(f"q{i}", prompt + [int(t) for t in rng.integers(1, 32000, 20)])
            hits, n_hit = kv.get_computed_blocks(r)
            kv.allocate_slots(r, r.num_tokens - n_hit, n_hit, hits)
            r.num_computed_tokens = r.num_tokens
            computed += max(0, prefix_len - n_hit)
        per_copy = -(-prefix_len // 16)
        holding = {b.block_id for blocks in kv.req_to_blocks.values() for b in blocks[:per_copy]}
        return per_copy, len(holding), computed

    def fork_and_copy() -> str:
        from ..core.kv_cache_manager import KVCacheManager
        from ..core.request import Request
        from ..core.scheduler import Scheduler, SchedulerConfig
        from ..engine.step import run_step
        from ..lab.fake_device import FakeDeviceExecutor
        from ..sampling_params import SamplingParams

        kv = KVCacheManager(block_size=4, num_blocks=32, enable_caching=True, watermark=0.0)
        sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
        params = SamplingParams(n=3, max_tokens=4, ignore_eos=True)
        sched.add_request(Request("p", [1, 2, 3, 4, 5, 6], sampling_params=params))
        copies = []
        device = FakeDeviceExecutor(4, 8, 64, 32)  # the step driver's executor, a virtual device
        for step in (1, 2, 3):
            copies += run_step(sched, device, partial(float, step)).output.copy_blocks
        shared = {b.block_id: b.ref_cnt for b in kv.block_pool.blocks if b.ref_cnt > 1}
        return (
            f"minipaged, chapter 08's fork (n=3, a 6-token prompt, blocks of 4): {len(copies)} block copies "
            f"{copies} at the siblings' first writes into the shared partial block; the full first block stays "
            f"shared (block id: ref count {shared})"
        )

    def blocks_saved() -> str:
        parts = []
        for n in (1000, 1008):
            per_copy, holding, _ = system_prompt(n)
            parts.append(
                f"{n} tokens: {per_copy} blocks per copy, {holding} hold it for 100 requests, "
                f"{1 - holding / (100 * per_copy):.1%} saved"
            )
        return "KVCacheManager, 100 requests each adding 20 tokens: " + "; ".join(parts)

    def prefill_saved() -> str:
        parts = []
        for n in (1000, 1008):
            computed = system_prompt(n)[2]
            parts.append(
                f"{n}-token prompt: {computed:,} of {100 * n:,} system tokens computed ({100 * n / computed:.0f}× less)"
            )
        return "; ".join(parts)

    return [
        Claim(
            "08",
            "parallel sampling and beam search share a sequence's blocks by reference counts, and a shared block is "
            "copied on its first write (copy-on-write at the block level)",
            f"{PAGED_ATTENTION}, §4.4 and Fig. 8; vLLM v0, vllm/core/block_manager.py (SelfAttnBlockSpaceManager.fork) "
            "and vllm/core/block/common.py (CopyOnWriteTracker); vLLM v1, vllm/v1/engine/parallel_sampling.py "
            "(ParentRequest) and vllm/v1/core/block_pool.py (BlockPool.cache_full_blocks)",
            fork_and_copy,
            "holds for the paper and vLLM v0, whose design chapter 08 builds; vLLM v1 has no copy-on-write: it turns "
            "n > 1 into n child requests that share only full, immutable blocks through the prefix cache",
        ),
        Claim(
            "08",
            "a 1000-token system prompt in 16-token blocks: 63 blocks per copy; 100 requests with their own "
            "copies need 6,300 blocks, one shared copy 63: 99 % of the prefix-block storage saved",
            CAPACITY_ARTICLE,
            blocks_saved,
            "holds if read as a prompt that fills whole blocks: 1,000 tokens leave a partial 63rd block that "
            "holds each request's own first tokens too, so every request keeps it private (97.4 % saved); "
            "at 1,008 tokens the 99 % is exact",
        ),
        Claim(
            "08",
            'a 1000-token system prompt shared across 100 concurrent requests "eliminates 100× prefill computation"',
            f"{DEEP_DIVE}, chapter 02 (prefix caching)",
            prefill_saved,
            "holds if read as the prompt's full blocks, computed once instead of 100 times: with 1,000 tokens "
            "each request recomputes the 8 tokens of the partial last block",
        ),
    ]


def _chapter_09() -> list[Claim]:
    def engine_lines() -> str:
        from pathlib import Path

        root = Path(__file__).resolve().parents[1]  # minipaged/
        files = [
            "core/block_pool.py",
            "worker/block_table.py",
            "core/kv_cache_manager.py",
            "core/block_budget.py",
            "core/step_commit.py",
            "core/request.py",
            "sampling_params.py",
            "core/scheduler.py",
            "worker/sampler.py",
            "worker/cache_engine.py",
            "worker/model_runner.py",
            "worker/step_inputs.py",
            "worker/sampled_output.py",
            "worker/kv_pool_plan.py",
            "engine/llm.py",
        ]
        files += [f"model/{p.name}" for p in sorted((root / "model").glob("*.py"))]
        lines = sum(len((root / f).read_text().splitlines()) for f in files)
        return (
            f"not re-counted here; for scale, minipaged's engine modules ({len(files)} files, docstrings "
            f"included) hold {lines:,} lines"
        )

    return [
        Claim(
            "09",
            'nano-vllm: a readable implementation in "~ 1,200 lines of Python code"',
            "the nano-vllm README (GitHub GeeeekExplorer/nano-vllm)",
            engine_lines,
            "holds if read as the project's own count; the course has not counted it",
        ),
    ]


def _chapter_10() -> list[Claim]:
    def attainment() -> str:
        from .grading import ex10b

        run = ex10b.baseline_sim()
        return (
            f"exercise 10b's burst (400 requests, 85 % chat turns, 15 % long documents), first come, first served: "
            f"{run.slo_attainment:.1%} of requests within the SLO ({ex10b.slo_text().split(';')[0]})"
        )

    return [
        Claim(
            "10",
            "goodput: the highest request rate a system serves while a target share of requests (90 %, say) meets "
            "both its time-to-first-token and its time-per-output-token objective",
            'Zhong et al., "DistServe: Disaggregating Prefill and Decoding for Goodput-optimized Large Language '
            'Model Serving", OSDI 2024, §2',
            attainment,
            "holds if read as what exercise 10b scores: the share itself (SLO attainment) at one load, not the "
            "highest rate at a target share, so that one simulated burst ranks policies",
        ),
    ]


def _chapter_11() -> list[Claim]:
    def joins_next_step() -> str:
        from ..lab.simulator import CostModel, SimConfig, SimRequest, simulate_continuous

        cost = CostModel.for_model("llama-3-8b", "a100")
        early = [SimRequest(f"r{i}", 0.0, 64, 400) for i in range(4)]
        late = SimRequest("late", 1.0, 64, 8)
        res = simulate_continuous([*early, late], cost, SimConfig(), record_events=False)
        got = {r.req_id: r for r in res.requests}
        first = got["late"].token_times[0] if got["late"].token_times else float("nan")
        ends = max(r.token_times[-1] for r in got.values() if r.req_id != "late")
        return (
            f"simulated Llama-3-8B on an A100: a request arriving at 1.000 s, while 4 others decode until "
            f"{ends:.3f} s, has its first token at {first:.3f} s"
        )

    return [
        Claim(
            "11",
            "iteration-level scheduling: a new request joins the running batch at the next iteration instead of "
            "waiting for the batch to finish; vLLM keeps it",
            f'Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative Models", OSDI 2022, '
            f"§3.1; {PAGED_ATTENTION}, §2.3 (batching techniques for LLMs)",
            joins_next_step,
            "holds: the package's scheduler (and its simulator) admit a waiting request at the next step",
        ),
    ]


def _chapter_12() -> list[Claim]:
    def all_reduces() -> str:
        from ..kv_math import KVSpec

        layers = KVSpec.from_preset("smollm2-135m").num_layers
        return f"SmolLM2-135M: {layers} layers, so {2 * layers} + 1 (the vocabulary-split embedding) = {2 * layers + 1}"

    def ring() -> str:
        return "; ".join(f"t = {t}: {2 * (t - 1) / t:.2f}× the tensor" for t in (2, 3, 4, 8)) + " sent per rank"

    def nvlink() -> str:
        calls, tensor, t = 61, 12 * 576 * 2, 3
        sent = calls * 2 * (t - 1) / t * tensor
        return (
            f"chapter 12's decode step (12 tokens, SmolLM2 over 3 ranks): {sent / 1e3:.0f} kB sent per rank, "
            f"{1e6 * sent / 450e9:.1f} µs at 450 GB/s beside {calls * 10} µs of latency at 10 µs a call (assumed)"
        )

    return [
        Claim(
            "12",
            "split a transformer layer with column-parallel then row-parallel linears: two all-reduces per layer "
            "in the forward pass, one after attention's output projection, one after the MLP",
            'Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model '
            'Parallelism", arXiv:1909.08053, §3 and Fig. 3',
            all_reduces,
            "holds: the package's tensor-parallel SmolLM2 runs 61 all-reduces a step (chapter 12 counts them)",
        ),
        Claim(
            "12",
            "a ring all-reduce over t ranks sends 2 (t − 1) / t of the tensor from each rank, whatever t is",
            'Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", '
            "J. Parallel Distrib. Comput. 69(2), 2009",
            ring,
            "holds: exercise 12's grader counts it message by message on 2 to 5 ranks",
        ),
        Claim(
            "12",
            "NVLink 4 on an H100 SXM: 900 GB/s of GPU-to-GPU bandwidth, 450 GB/s in each direction",
            "NVIDIA H100 Tensor Core GPU datasheet",
            nvlink,
            "holds as the datasheet's figure; the 10 µs per collective call beside it is the course's assumption, "
            "not measured on a GPU",
        ),
    ]


def _chapter_13() -> list[Claim]:
    def window_blocks() -> str:
        from ..utils import cdiv

        bs = 16
        full = cdiv(32_768, bs)
        return (
            f"a 32,768-token request, blocks of 16: {full:,} blocks per full-attention layer, at most "
            f"{cdiv(4_096, bs) + 1} per windowed one (the window's 256, plus the one it straddles)"
        )

    def gemma_groups() -> str:
        from ..core.kv_cache_coordinator import kv_cache_groups

        windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(30)]
        groups = kv_cache_groups(windows)
        full = sum(g.sliding_window is None for g in groups)
        return (
            f"30 layers, every sixth full: {len(groups)} KV cache groups ({full} full, {len(groups) - full} "
            f"windowed) of {len(groups[0].layer_ids)} layers each"
        )

    def failure_table() -> str:
        from ..gpus import GPUS
        from ..kv_math import KVSpec

        per_req = KVSpec.from_preset("llama-3-8b").bytes_for_tokens(8192)
        room = GPUS["h100"].memory_bytes * 0.9 - 16e9  # what an "80 GB" H100 reports, at 90 %
        return (
            f"first row: 8K-token chats on Llama-3-8B hold {per_req / 2**30:.0f} GiB each; {int(room // per_req)} fit"
        )

    return [
        Claim(
            "13",
            "Mistral 7B's sliding window: each layer attends to the last W = 4,096 tokens",
            'Jiang et al., "Mistral 7B", arXiv:2310.06825, §2 (Sliding Window Attention)',
            window_blocks,
            "holds for Mistral-7B-v0.1 (its config.json: sliding_window 4096); later versions dropped the window",
        ),
        Claim(
            "13",
            "Gemma 3 interleaves five local (sliding-window, 1,024 tokens) layers with each global one",
            'Gemma Team, "Gemma 3 Technical Report", arXiv:2503.19786, §2 (model architecture)',
            gemma_groups,
            "holds; chapter 13's think-then-check works the 5:1 pattern on 30 layers",
        ),
        Claim(
            "13",
            "the failure table, symptom → cause → fix: OOM as concurrency rises; throughput stalls after scheduler "
            "tuning; TTFT swings; swap makes latency explode; the context still does not fit (and benchmarks that "
            "disappoint in production)",
            CAPACITY_ARTICLE,
            failure_table,
            "holds for the five rows chapter 13, section 5, computes with the package; the sixth (benchmarks that "
            "do not match the route mix) is advice, with no figure to compute",
        ),
    ]


def claims() -> list[Claim]:
    """Every claim of the course, chapter by chapter."""
    return [
        c
        for chapter in (
            _chapter_01,
            _chapter_02,
            _chapter_03,
            _chapter_04,
            _chapter_05,
            _chapter_06,
            _chapter_07,
            _chapter_08,
            _chapter_09,
            _chapter_10,
            _chapter_11,
            _chapter_12,
            _chapter_13,
        )
        for c in chapter()
    ]
