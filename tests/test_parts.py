"""Learner's parts in the real engine (minipaged.parts): right ones change nothing, wrong ones are named.

The right parts are the solution notebooks' own functions; the wrong ones are the mutants of
``tests/mutants`` (each a mistake a learner makes), run in a tiny Llama with prefix caching on and a
pool small enough to preempt, so that every part has work. A few mutants are invisible to the
engine by design (``INVISIBLE``, each with the reason); the exercise's checks catch those.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minipaged import LLM, SamplingParams, parts
from minipaged.grading import ex10
from minipaged.parts import PARTS, PartError

sys.path.insert(0, str(Path(__file__).parent))
import mutants  # noqa: E402
from conftest import save_tiny_llama  # noqa: E402

SOLUTIONS = Path(__file__).resolve().parents[1] / "exercises" / "solutions"
SHARED = list(range(1, 13))   # a 12-token prefix every prompt starts with: 3 blocks of 4
LONG = SHARED + [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
# A long head of the queue, a block-aligned fully cached prompt, a prompt one token past the cached blocks,
# a repeat, and two more: with a 16-token budget, 3 seats and 11 blocks, prompts are chunked, the head
# blocks the queue, requests are preempted and readmitted, and every part has its edge cases to meet.
PROMPTS = [LONG, list(SHARED), SHARED + [30], list(range(60, 78)), list(LONG), SHARED + [31, 32, 33, 34, 35],
           SHARED + [36] * 9]
GREEDY = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
FUNCTION_TO_PART = {"remove": "free_queue_remove"}

# Mutants whose mistake never shows in how the engine calls the part; their exercise's checks catch them.
INVISIBLE = {
    "ex03-no_guard": "raises the wrong error for a block that is not free: the engine never asks that",
    "ex03-walks_the_list": "right answer, O(n) time: check_remove_is_O1 catches it",
    "ex04-pads_with_zero": "the engine never pads the slot mapping (pad_to=None)",
    "ex04-ignores_reserved": "the engine reserves no blocks (reserved_blocks=0)",
    "ex05-writes_padding": "the engine's slot mapping has no padding slots (-1)",
    "ex05-shape_addresses": "the engine's new K/V rows and its caches are contiguous: strides are what shapes give",
    "ex05-flat_slot_index": "the engine's caches are contiguous: slot x slot stride is block x block stride + offset",
    "ex08-salts_every_block": "LLM sets no cache salt",
    "ex08-ignores_salt": "LLM sets no cache salt",
    "ex08-skips_misses": "a chain of cached blocks never has a gap in the engine: a block is freed no later "
                         "than its prefix (fewer owners; tail first in one request), so it is evicted first",
    "ex09-ignores_scale": "the engine's scale is head_dim ** -0.5, the very value this mutant assumes",
    "ex09-no_float32": "in a float32 engine there is nothing to upcast",
    "ex09-whole_table_row": "the engine fills the null block with finite numbers, so reading it is harmless here",
}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory):
    """A tiny random Llama with 3 KV heads (like SmolLM2: not a power of two) shared by 6 query heads."""
    return save_tiny_llama(tmp_path_factory.mktemp("gqa"), num_attention_heads=6, num_key_value_heads=3,
                           hidden_size=96, intermediate_size=128)


def engine(model) -> LLM:
    return LLM(model, block_size=4, num_gpu_blocks_override=11, max_model_len=40, max_num_batched_tokens=8,
               max_num_seqs=3, enable_prefix_caching=True, watermark=0.1, dtype="float32")


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm(gqa_model):
    return engine(gqa_model)


@pytest.fixture(scope="module")
def expected(llm):
    llm.reset()
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.scheduler.num_preemptions > 0 and llm.kv_cache_manager.prefix_cache_hits > 0
    return token_ids(outs)


@pytest.fixture(scope="module")
def solution_parts():
    mine = ex10.load_exercises(SOLUTIONS)
    assert not any(ns.errors for ns in mine.values())
    return {name: getattr(mine[spec.exercise], {v: k for k, v in FUNCTION_TO_PART.items()}.get(name, name))
            for name, spec in PARTS.items()}


def run(llm, plugged, check=True):
    llm.reset()
    with parts.use(check=check, **plugged) as wrappers:
        outs = llm.generate(PROMPTS, GREEDY)
    return token_ids(outs), {n: w.calls for n, w in wrappers.items()}


def test_all_solution_parts_together_give_the_package_output_and_all_are_called(llm, expected, solution_parts):
    got, calls = run(llm, solution_parts)
    assert got == expected
    assert all(n > 0 for n in calls.values()), calls
    assert not parts._plugged, "use() must restore the package's pieces"


@pytest.mark.parametrize("exercise", ex10.EXERCISES)
def test_each_exercise_alone_gives_the_package_output(llm, expected, solution_parts, exercise):
    alone = {n: fn for n, fn in solution_parts.items() if PARTS[n].exercise == exercise}
    got, calls = run(llm, alone, check=False)
    assert got == expected
    assert all(n > 0 for n in calls.values()), calls


ENGINE_MUTANTS = [m for m in mutants.all_mutants() if m.exercise in ex10.EXERCISES]


@pytest.mark.parametrize("m", ENGINE_MUTANTS, ids=lambda m: f"{m.exercise}-{m.name}")
def test_a_wrong_part_is_caught_and_named(llm, expected, solution_parts, m):
    name = FUNCTION_TO_PART.get(m.target, m.target)
    helpers = mutants.module(m.exercise).HELPERS
    # the exercise's other part (the solution's, or the mutants' own correct helper) and the mutant
    plugged = {n: helpers.get(n, fn) for n, fn in solution_parts.items() if PARTS[n].exercise == m.exercise}
    plugged[name] = m.fn
    key = f"{m.exercise}-{m.name}"
    if key in INVISIBLE:
        got, _ = run(llm, plugged)
        assert got == expected, f"{key} is listed as invisible to the engine, but it changed the output"
        return
    with pytest.raises(PartError) as caught:
        run(llm, plugged)
    err = caught.value
    assert err.part == name and f"part {name!r} (exercise {m.exercise[2:]})" in str(err), str(err)
    assert err.step is not None and err.call >= 1
    assert llm.scheduler.requests == {} and not llm.scheduler.waiting and not llm.scheduler.running


def test_unchecked_a_wrong_part_changes_the_output(llm, expected, solution_parts):
    wrong = next(m for m in ENGINE_MUTANTS if m.name == "gqa_modulo")
    got, _ = run(llm, {"paged_decode_attention": wrong.fn}, check=False)
    assert got != expected


def test_use_refuses_unknown_parts_and_wrong_signatures():
    with pytest.raises(ValueError, match="unknown part"):
        with parts.use(slot_mapings=lambda *a: None):
            pass
    with pytest.raises(TypeError, match="'slot_mapping' must take 4 arguments"):
        with parts.use(slot_mapping=lambda tables, positions: []):
            pass
    with pytest.raises(TypeError, match="must be a function"):
        with parts.use(slot_mapping=3):
            pass
    assert not parts._plugged


def test_a_part_that_raises_or_returns_the_wrong_kind_is_named(llm):
    def broken(*args):
        raise KeyError("oops")

    for fn, message in ((broken, "raised KeyError"), (lambda *a: "slots", "expected a list of slot numbers"),
                        (lambda t, p, bs, pad=None: [0], "returned 1 slots for")):
        llm.reset()
        with pytest.raises(PartError, match=message) as caught:
            with parts.use(check=False, slot_mapping=fn):
                llm.generate(PROMPTS, GREEDY)
        assert "part 'slot_mapping' (exercise 04)" in str(caught.value)
        assert llm.scheduler.requests == {}


def test_nested_use_restores_the_outer_parts(solution_parts):
    with parts.use(slot_mapping=solution_parts["slot_mapping"]) as outer:
        with parts.use(check=False, slot_mapping=solution_parts["slot_mapping"],
                       find_prefix_hits=solution_parts["find_prefix_hits"]):
            assert parts.plugged("find_prefix_hits") is not None
        assert parts.plugged("slot_mapping") is outer["slot_mapping"]
        assert parts.plugged("find_prefix_hits") is None
    assert parts.plugged("slot_mapping") is None
