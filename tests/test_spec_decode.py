"""Speculative decoding by prompt lookup: the proposer, the verification, and the scheduler around them.

The engine on SmolLM2 is in ``tests/test_engine.py`` (greedy tokens equal to transformers with speculation on);
here the fake-model ``Driver`` (``minipaged.testing``) runs the scheduler with drafts, writes and reads back
every draft's K/V, and must give every request the very tokens of a run without speculation.
"""

from __future__ import annotations

import random

import pytest
import torch

from minipaged.config import Config, SchedulerConfig, SpeculativeConfig
from minipaged.core.spec_decode import NgramProposer, SpecDecodingStats
from minipaged.lab.checking_driver import EOS, Driver, random_config
from minipaged.lab.simulator import SimConfig
from minipaged.sampling_params import SamplingParams
from minipaged.utils import cdiv
from minipaged.worker.sampler import Sampler, verify


def proposer(k: int = 4, lo: int = 2, hi: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, prompt_lookup_min=lo, prompt_lookup_max=hi))


# ---- the configuration ---------------------------------------------------------------------------------
def test_config_defaults_follow_vllm():
    assert (SpeculativeConfig(3).prompt_lookup_min, SpeculativeConfig(3).prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(3, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig(3, prompt_lookup_min=2).prompt_lookup_max == 2
    from_json = Config(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert from_json.speculative_config == SpeculativeConfig(2, prompt_lookup_min=3, prompt_lookup_max=3)
    assert Config().scheduler_config().speculative_config is None
    assert (
        Config(speculative_config={"num_speculative_tokens": 2})
        .scheduler_config()
        .speculative_config.num_speculative_tokens
        == 2
    )


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "method": "eagle"}, "method must be 'ngram'"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "draft_model": "x"}, "unknown key"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "larger than"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ("{not json", "not valid JSON"),
        (4, "must be a dict"),
    ],
)
def test_bad_configs_are_refused_by_name(bad, message):
    with pytest.raises(ValueError, match=message):
        Config(speculative_config=bad)


def test_the_simulator_refuses_to_speculate():
    with pytest.raises(ValueError, match="simulator cannot speculate"):
        SimConfig(speculative_config={"num_speculative_tokens": 2})


# ---- the proposer --------------------------------------------------------------------------------------
def test_proposer_vllm_docstring_example():
    assert proposer(k=4, lo=2, hi=3).propose([1, 2, 3, 4, 2, 3]) == [4, 2, 3]


def test_proposer_prefers_the_longest_ngram_then_its_earliest_occurrence():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9]  # suffix [7, 8, 9] occurs at 0; [8, 9] also at 5
    assert proposer(k=2, lo=2, hi=3).propose(tokens) == [1, 5]  # n = 3 wins over n = 2
    assert proposer(k=2, lo=2, hi=2).propose(tokens) == [1, 5]  # n = 2: earliest of 1 and 5, i.e. 1
    assert proposer(k=2, lo=1, hi=1).propose([4, 1, 4, 2, 4]) == [1, 4]  # [4] first at 0


def test_proposer_keeps_each_running_requests_tokens_as_they_grow():
    """``propose_for`` converts only new tokens, yet answers as ``propose`` on the whole list: across growth past
    its buffer, a request id taken by another request, and requests that stop running (forgotten)."""
    p, rng = proposer(k=3, lo=1, hi=3), random.Random(5)
    owners = {"a": object(), "b": object()}
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for step in range(300):
        for rid in tokens:
            tokens[rid] += [rng.randrange(4) for _ in range(rng.randint(1, 3))]
            assert p.propose_for(rid, owners[rid], tokens[rid], 2) == p.propose(tokens[rid], 2), (rid, step)
        if step == 150:  # "b" finished; a new request takes its id
            owners["b"], tokens["b"] = object(), [3]
    assert len(p._tokens["a"][1]) >= len(tokens["a"])
    p.keep_only({"a"})
    assert set(p._tokens) == {"a"}


def test_proposer_caps_and_misses():
    p = proposer(k=4, lo=2, hi=3)
    assert p.propose([1, 2, 3, 4, 5]) == []  # no suffix recurs
    assert p.propose([1, 2]) == []  # too short for any earlier match
    assert p.propose([1, 2, 9, 9, 9, 1, 2], max_drafts=2) == [9, 9]
    assert p.propose([1, 2, 9, 9, 9, 1, 2], max_drafts=0) == []
    assert p.propose([1, 2, 1, 2]) == [1, 2]  # overlapping match, only two tokens follow it


def test_proposer_matches_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 4)
        k = rng.randint(1, 5)
        want: list[int] = []
        for n in range(hi, lo - 1, -1):
            if n >= len(tokens):
                continue
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[-n:]]
            if starts:
                want = tokens[starts[0] + n : starts[0] + n + k]
                break
        assert proposer(k, lo, hi).propose(tokens) == want, (tokens, lo, hi, k)


# ---- verification --------------------------------------------------------------------------------------
def one_hot_rows(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(
    "targets, drafts, emitted",
    [
        ([3, 4, 5, 6], [3, 4, 5], [3, 4, 5, 6]),  # all accepted, and the bonus token
        ([3, 4, 5, 6], [3, 9, 5], [3, 4]),  # the second draft rejected: the model's 4 instead
        ([3, 4, 5, 6], [9, 4, 5], [3]),  # nothing accepted: one token, as without drafts
    ],
)
def test_greedy_verification_keeps_the_longest_agreeing_prefix(targets, drafts, emitted):
    assert verify(Sampler(), one_hot_rows(targets), drafts, ("r", 0), GREEDY) == (emitted, None)


def test_verification_reports_only_the_rows_it_needs():
    logits = one_hot_rows([3, 4, 5])
    logits[2] = float("nan")  # the row after a rejected draft: never read without speculation either
    assert verify(Sampler(), logits, [3, 9], ("r", 0), GREEDY) == ([3, 4], None)
    tokens, why = verify(Sampler(), logits, [3, 4], ("r", 0), GREEDY)
    assert tokens == [] and "NaN" in why
    with pytest.raises(ValueError, match="one more row"):
        verify(Sampler(), logits, [3, 4, 5], ("r", 0), GREEDY)


def test_seeded_sampling_draws_as_without_speculation():
    """Each emitted token costs one draw from the request's stream: the drafts the non-speculative run would
    have produced are all accepted, and the stream ends where that run's ends."""
    torch.manual_seed(0)
    logits = torch.randn(5, 12)
    p = SamplingParams(temperature=1.0, seed=11)
    one_at_a_time = Sampler()
    plain = [one_at_a_time.sample(logits[i : i + 1], [("r", 0)], [p])[0][0] for i in range(5)]
    spec = Sampler()
    tokens, why = verify(spec, logits, plain[:4], ("r", 0), p)
    assert why is None and tokens == plain
    nxt = torch.randn(1, 12)
    assert spec.sample(nxt, [("r", 0)], [p]) == one_at_a_time.sample(nxt, [("r", 0)], [p])
    # A wrong draft: the model's token at that row is the one a plain run draws there, then nothing more.
    wrong = [plain[0], (plain[1] + 1) % 12, plain[2]]
    again = Sampler()
    assert verify(again, logits[:4], wrong, ("r", 0), p) == (plain[:2], None)


def test_sampling_distribution_is_the_models():
    """Unseeded: over many draws, the first token after a one-hot draft follows the model's probabilities."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(2, 1)
    p = SamplingParams(temperature=1.0)
    torch.manual_seed(1)
    firsts = [verify(Sampler(), logits, [0], ("r", 0), p)[0][0] for _ in range(4000)]
    freq = torch.bincount(torch.tensor(firsts), minlength=3).float() / len(firsts)
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_stats():
    s = SpecDecodingStats(3)
    assert (s.acceptance_rate, s.mean_acceptance_length) == (0.0, 1.0)
    s.observe(3, 2)
    s.observe(2, 0)
    assert s.num_accepted_tokens_per_pos == [1, 1, 0]
    assert s.acceptance_rate == pytest.approx(2 / 5) and s.mean_acceptance_length == pytest.approx(2.0)


# ---- the scheduler, with the data-checking fake model -----------------------------------------------------
def run(d: Driver, prompts: dict[str, list[int]], **params) -> dict[str, list[int]]:
    for rid, prompt in prompts.items():
        d.add(rid, prompt, **params)
    d.run()
    return {rid: r.output_token_ids for rid, r in d.requests.items()}  # forked samples too


def test_drafts_are_verified_and_their_blocks_given_back():
    d = Driver(block_size=4, num_blocks=40, spec_k=5, period=3, budget=64)
    # The fake model repeats f0 f1 f2. The prompt holds them too, followed by a filler it never says: once the
    # output ends in f0 f1 f2, lookup proposes the filler from the prompt and every draft is rejected.
    f = [d.sample_at("a", p) for p in range(3)]
    filler = next(t for t in range(1, 40) if t not in f)
    d.add("a", f + [filler] * 8, max_tokens=30, ignore_eos=True)
    drafts_seen, trimmed = [], 0
    while d.sched.has_unfinished():
        out = d.step()
        (s,) = out.scheduled
        drafts_seen.append(len(s.spec_token_ids))
        req = d.requests["a"]
        if not req.is_finished:  # no block past the one its next token goes to
            held = d.kv_cache_manager.get_num_blocks("a")
            assert cdiv(req.num_computed_tokens, 4) <= held <= cdiv(req.num_tokens, 4)
            assert req.num_computed_tokens == req.num_tokens - 1
            (start, new_ids), *_ = s.block_updates  # the table after the step's allocation: start + new ids
            trimmed += start + len(new_ids) - held  # the step allocated for every draft; rejected ones gave back
    assert max(drafts_seen) == 5 and trimmed > 0
    stats = d.sched.spec_decoding_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert d.requests["a"].num_output_tokens == 30
    # fewer steps than tokens: speculation paid
    assert d.steps < 30


def test_a_stop_token_among_accepted_drafts_ends_the_request_there():
    d = Driver(block_size=4, num_blocks=40, spec_k=5, period=4)
    # find a request id whose fake tokens hold EOS (token 0) in their period, so it stops mid-verification
    rid = next(f"r{i}" for i in range(500) if EOS in [d.sample_at(f"r{i}", p) for p in range(4)][1:])
    out = run(d, {rid: [1, 2, 3]}, max_tokens=50)[rid]
    assert out[-1] == EOS and EOS not in out[:-1]
    no_spec = run(Driver(block_size=4, num_blocks=40, period=4), {rid: [1, 2, 3]}, max_tokens=50)[rid]
    assert out == no_spec


def test_drafts_respect_the_budget_max_tokens_and_max_model_len():
    d = Driver(block_size=4, num_blocks=60, spec_k=5, period=2, budget=3, max_model_len=24)
    d.add("a", [1, 2], max_tokens=40, ignore_eos=True)
    d.add("b", [3, 4], max_tokens=7, ignore_eos=True)
    while d.sched.has_unfinished():
        out = d.step()
        assert out.total_num_scheduled_tokens <= 3
    assert d.requests["b"].num_output_tokens == 7
    assert d.requests["a"].num_tokens == 24  # stopped by max_model_len, not past it


def test_preemption_drops_drafts():
    d = Driver(block_size=2, num_blocks=9, spec_k=4, period=2, watermark_blocks=0, caching=False)
    d.add("a", [1, 2, 3], max_tokens=8, ignore_eos=True)
    d.add("b", [4, 5, 6], max_tokens=8, ignore_eos=True)
    while d.sched.has_unfinished():
        num_tokens = {rid: r.num_tokens for rid, r in d.sched.requests.items()}
        out = d.step()
        assert not any(r.spec_token_ids for r in d.sched.waiting)  # a victim's drafts went with its K/V
        for s in out.scheduled:  # drafts only ever follow the last real token, never a recomputed prefix
            assert not s.spec_token_ids or s.start == num_tokens[s.request_id] - 1
    assert d.sched.num_preemptions > 0 and d.sched.spec_decoding_stats.num_drafts > 0
    assert all(not r.spec_token_ids for r in d.requests.values())


def test_speculation_never_changes_a_token():
    """Random configurations (preemption by recompute or swap, prefix caching, chunked prefill, tiny pools and
    budgets, n = 1 and 2), the same workload with and without speculation: the same tokens for every request."""
    drafts = accepted = preempted = 0
    for seed in range(40):
        rng = random.Random(seed)
        cfg = random_config(rng)
        cfg.update(spec_k=0, period=rng.choice([2, 3, 5]))
        shared = [rng.randrange(1, 40) for _ in range(rng.randint(0, 10))]
        prompts = {f"q{i}": shared + [rng.randrange(1, 40) for _ in range(rng.randint(1, 12))] for i in range(6)}
        params = dict(max_tokens=rng.randint(5, 25), ignore_eos=rng.random() < 0.5, n=rng.choice([1, 2]))
        plain = run(Driver(**cfg), prompts, **params)
        cfg["spec_k"] = rng.choice([1, 3, 5])
        d = Driver(**cfg)
        assert run(d, prompts, **params) == plain, (seed, cfg)
        drafts += d.sched.spec_decoding_stats.num_draft_tokens
        accepted += d.sched.spec_decoding_stats.num_accepted_tokens
        preempted += d.sched.num_preemptions
    assert accepted > 0 and accepted < drafts and preempted > 0


def test_scheduler_config_builds_the_proposer():
    from minipaged.core.kv_cache_manager import KVCacheManager
    from minipaged.core.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(speculative_config={"num_speculative_tokens": 2}), KVCacheManager(4, 10))
    assert sched.proposer is not None and sched.proposer.k == 2 and sched.spec_decoding_stats.num_drafts == 0
    assert Scheduler(SchedulerConfig(), KVCacheManager(4, 10)).proposer is None
