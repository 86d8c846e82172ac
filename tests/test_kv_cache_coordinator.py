"""KV cache groups, per-type managers and their coordinator: a sliding window's blocks go back as the window moves,
prefix hits follow each type's rule, and a hybrid model stays token-exact against transformers while its
sliding-window group holds a bounded number of blocks."""

from __future__ import annotations

import random

import pytest

from minipaged.core.block_pool import chain_block_hashes, group_block_hash
from minipaged.core.kv_cache_coordinator import KVCacheBlocks, KVCacheGroupSpec, kv_cache_groups, layer_tensors
from minipaged.core.kv_cache_manager import KVCacheManager
from minipaged.core.request import Request
from minipaged.engine.llm import LLM
from minipaged.model_loader import hf_greedy_token_ids, save_tiny_llama
from minipaged.sampling_params import SamplingParams
from minipaged.utils import cdiv

HYBRID = [KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((2, 3), sliding_window=8)]


def test_layers_are_grouped_by_type_in_groups_of_the_smallest_type():
    assert kv_cache_groups([None] * 30) == [KVCacheGroupSpec(tuple(range(30)))]
    assert kv_cache_groups([4096] * 3) == [KVCacheGroupSpec((0, 1, 2), 4096)]
    assert kv_cache_groups([None, None, 8, 8]) == HYBRID
    # Gemma-3-like 3:1 (windowed first): full attention still comes first, the windowed layers in groups of 2
    groups = kv_cache_groups([8, 8, 8, None, 8, 8, 8, None])
    assert groups == [
        KVCacheGroupSpec((3, 7)),
        KVCacheGroupSpec((0, 1), 8),
        KVCacheGroupSpec((2, 4), 8),
        KVCacheGroupSpec((5, 6), 8),
    ]
    assert layer_tensors(groups, 8) == [0, 1, 0, 0, 1, 0, 1, 1]  # two shared tensors, not eight
    # a type whose count is not a multiple of the group size ends with a smaller group
    assert kv_cache_groups([None, None, 8, 8, 8]) == [
        KVCacheGroupSpec((0, 1)),
        KVCacheGroupSpec((2, 3), 8),
        KVCacheGroupSpec((4,), 8),
    ]


def decode(mgr: KVCacheManager, req: Request, steps: int) -> list[tuple[int, int]]:
    """Allocate and 'compute' one token per step; the (group 0, group 1) blocks held after each."""
    held = []
    for _ in range(steps):
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(7)
        mgr.commit_step()
        held.append(tuple(sum(not b.is_null for b in m.req_to_blocks[req.request_id]) for m in mgr.managers))
    return held


def test_a_sliding_window_gives_back_the_blocks_behind_it():
    mgr = KVCacheManager(4, 64, watermark=0.0, kv_cache_groups=HYBRID)
    req = Request("r", list(range(10)))
    assert mgr.allocate_slots(req, 10) is not None  # the prompt: 3 blocks in each group
    req.num_computed_tokens = 10
    assert [len(m.req_to_blocks["r"]) for m in mgr.managers] == [3, 3]
    held = decode(mgr, req, 60)
    full, window = zip(*held)
    assert list(full) == [cdiv(10 + i + 1, 4) for i in range(60)]  # full attention keeps every block
    # The window (8: the token and 7 before it) spans at most 3 blocks of 4 while a token is computed.
    assert max(window) == 3 and min(window[10:]) >= 2
    table = mgr.managers[1].req_to_blocks["r"]
    assert all(b.is_null for b in table[: len(table) - 3])  # behind the window: the null block
    # every block given back is free again: 64 - null - group 0's - group 1's live blocks
    assert mgr.get_num_free_blocks() == 63 - full[-1] - window[-1]
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 63


def test_the_pool_admits_what_the_window_frees():
    """Window 9, block size 4: position 48 opens block 12 in both groups and moves the window past block 9. Two
    new blocks, one free and one given back: it fits only because the window's old block goes back first."""
    groups = [KVCacheGroupSpec((0, 1)), KVCacheGroupSpec((2, 3), sliding_window=9)]
    mgr = KVCacheManager(4, 1 + 16, watermark=0.0, kv_cache_groups=groups)
    req = Request("r", list(range(12)))
    assert mgr.allocate_slots(req, 12) is not None  # 3 + 3 blocks
    req.num_computed_tokens = 12
    assert decode(mgr, req, 36)[-1] == (12, 3)  # positions 12..47 computed
    assert mgr.get_num_free_blocks() == 1
    assert mgr.can_allocate(req, 1)
    assert mgr.allocate_slots(req, 1) is not None
    assert mgr.get_num_free_blocks() == 0 and mgr.managers[1].req_to_blocks["r"][9].is_null
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 16


def cache_prompt(mgr: KVCacheManager, tokens: list[int], rid: str) -> None:
    req = Request(rid, tokens)
    hits, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, len(tokens) - n, n, hits) is not None
    mgr.commit_step()
    mgr.free(req)


def test_sliding_window_hits_are_found_from_the_right():
    mgr = KVCacheManager(4, 64, watermark=0.0, kv_cache_groups=HYBRID)
    prompt = list(range(40))
    cache_prompt(mgr, prompt[:33], "a")  # 8 full blocks cached in both groups
    hits, n = mgr.get_computed_blocks(Request("b", prompt))
    assert n == 32 and isinstance(hits, KVCacheBlocks) and [len(g) for g in hits.blocks] == [8, 8]
    # the window group keeps only what the next token reads: cdiv(8 - 1, 4) = 2 blocks, the rest null
    assert [b.is_null for b in hits.blocks[1]] == [True] * 6 + [False] * 2
    assert not any(b.is_null for b in hits.blocks[0])
    # A group-1 block's key carries its group: the same tokens' group-0 block has another
    h = chain_block_hashes(prompt, 4)[7]
    assert mgr.block_pool.get_cached_block(h) is hits.blocks[0][7]
    assert mgr.block_pool.get_cached_block(group_block_hash(h, 1)) is hits.blocks[1][7]


def test_the_groups_agree_on_one_hit_length():
    """Full attention has the whole prefix; the window group lost its last block: the hit is the longest that ends
    with a whole window in the window group, and full attention's hit is cut to it."""
    mgr = KVCacheManager(4, 64, watermark=0.0, kv_cache_groups=HYBRID)
    prompt = list(range(40))
    cache_prompt(mgr, prompt[:33], "a")
    h7 = group_block_hash(chain_block_hashes(prompt, 4)[7], 1)
    mgr.block_pool.drop_hash(mgr.block_pool.get_cached_block(h7))  # forget the window's block 7 only
    hits, n = mgr.get_computed_blocks(Request("b", prompt))
    # blocks 5, 6 (positions 20..27) hold the window of position 28: a 7-block hit, one short of full attention's
    assert n == 28 and [len(g) for g in hits.blocks] == [7, 7]
    assert [b.is_null for b in hits.blocks[1]] == [True] * 5 + [False] * 2
    assert hits.blocks[0] == [mgr.block_pool.get_cached_block(h) for h in chain_block_hashes(prompt, 4)[:7]]
    req = Request("b", prompt)  # admitted with it: computes from position 28 on
    assert mgr.allocate_slots(req, 12, n, hits) is not None
    assert [len(m.req_to_blocks["b"]) for m in mgr.managers] == [10, 10]


def test_swap_and_connectors_are_refused_for_several_groups():
    with pytest.raises(ValueError, match="one full-attention KV cache group"):
        KVCacheManager(4, 64, num_cpu_blocks=8, kv_cache_groups=HYBRID)
    with pytest.raises(ValueError, match="several KV cache groups take"):
        KVCacheManager(4, 64, kv_cache_groups=HYBRID).allocate_slots(Request("r", [1] * 9), 1, 4, [object()])


def test_random_traffic_keeps_the_books_of_every_group():
    """Random admissions with prefix hits, decodes, forks and frees over two groups: every ref count is the number
    of tables that hold the block, no block is both free and held, and a window group's tables stay short."""
    rng = random.Random(0)
    mgr = KVCacheManager(4, 48, watermark=0.0, kv_cache_groups=HYBRID)
    live: dict[str, Request] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            req = Request(f"r{step}", tokens)
            hits, n = mgr.get_computed_blocks(req)
            if mgr.allocate_slots(req, req.num_tokens - n, n, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live[req.request_id] = req
        elif op < 0.4 and live:
            parent = live[rng.choice(sorted(live))]
            child = Request(f"c{step}", parent.all_token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            mgr.fork(parent, child)
            live[child.request_id] = child
        elif op < 0.85 and live:
            req = live[rng.choice(sorted(live))]
            if mgr.allocate_slots(req, 1) is not None:
                req.append_output_token_ids(rng.randrange(3))
                req.num_computed_tokens += 1
        elif live:
            mgr.free(live.pop(rng.choice(sorted(live))))
        mgr.commit_step()
        mgr.take_pending_copies()
        refs: dict[int, int] = {}
        for manager, rid, blocks in mgr.held_blocks():
            assert len(blocks) == cdiv(live[rid].num_computed_tokens, 4) or len(blocks) == cdiv(live[rid].num_tokens, 4)
            if manager.sliding_window is not None:  # null blocks only in front of the window, none among it
                nulls = [i for i, b in enumerate(blocks) if b.is_null]
                assert nulls == list(range(len(nulls)))
            for b in blocks:
                if not b.is_null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        free = {b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()}
        for b in mgr.block_pool.blocks[1:]:
            assert b.ref_cnt == refs.get(b.block_id, 0) and (b.ref_cnt == 0) == (b.block_id in free)
    for req in live.values():
        mgr.free(req)
    assert mgr.get_num_free_blocks() == 47


# ---- the engine on a hybrid model ----------------------------------------------------------------------------
WINDOW = 6


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2") / "m"
    return save_tiny_llama(
        path, model_type="qwen2", use_sliding_window=True, max_window_layers=2, num_hidden_layers=4,
        initializer_range=0.2, sliding_window=WINDOW,
    )  # fmt: skip


def test_a_long_generation_holds_a_bounded_window(qwen2):
    """The acceptance test: token-exact against transformers over 100 generated tokens, while the window group
    never holds more than the window's blocks (and the full group holds them all)."""
    from transformers import AutoModelForCausalLM

    llm = LLM(model=qwen2, dtype="float32", block_size=4)
    kv = llm.kv_cache_manager
    assert [g.sliding_window for g in kv.kv_cache_groups] == [None, WINDOW] and len(llm.cache.gpu_tensors) == 2
    prompt, params = list(range(3, 20)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    rid = llm.add_request(prompt, params)
    held = []
    while llm.scheduler.has_unfinished():
        llm.step()
        if rid in kv.managers[0].req_to_blocks:
            held.append([sum(not b.is_null for b in m.req_to_blocks[rid]) for m in kv.managers])
    tokens = llm.get_output(rid).outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(qwen2, dtype="float32").eval()
    assert tokens == hf_greedy_token_ids(hf, [prompt], 100)[0]
    assert held[-1][0] == cdiv(len(prompt) + 99, 4)  # every full-attention block kept
    assert max(w for _, w in held[1:]) <= cdiv(WINDOW, 4) + 1  # decode: the window and the new token
    assert held[-1][1] <= 3


def test_hybrid_engine_forks_speculates_and_refuses_swap(qwen2):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 8], list(range(20, 33))]
    plain = LLM(model=qwen2, dtype="float32", block_size=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    spec = LLM(model=qwen2, dtype="float32", block_size=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3})  # fmt: skip
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, greedy)] == want
    assert spec.scheduler.spec_decoding_stats is not None and spec.scheduler.spec_decoding_stats.num_drafts > 0
    # n = 2 seeded samples share the prompt's blocks in both groups, then copy on write
    sampled = SamplingParams(temperature=1.0, n=2, seed=3, max_tokens=12)
    a = [c.token_ids for c in plain.generate([prompts[1]], sampled)[0].outputs]
    b = [c.token_ids for c in spec.generate([prompts[1]], sampled)[0].outputs]
    assert a == b and a[0] != a[1]
    with pytest.raises(ValueError, match="one full-attention KV cache group"):
        LLM(model=qwen2, dtype="float32", block_size=4, preemption_mode="swap", swap_space="1MiB")
