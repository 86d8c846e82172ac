"""Scheduling policies (exercise 10b): asked before a step changes anything, every answer checked, the engine's
tokens unchanged, and the report card's leaderboard ranking the example policies."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import PREEMPTING_PROMPTS, small_engine

from minipaged import parts, step
from minipaged.grading import ex10b
from minipaged.parts import PartError
from minipaged.sampling_params import SamplingParams
from minipaged.testing import Driver

EXAMPLES = Path(__file__).resolve().parents[1] / "exercises" / "policies"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def fingerprint(d: Driver) -> tuple:
    s, kv = d.sched, d.kv
    return (
        [r.request_id for r in s.waiting],
        [r.request_id for r in s.running],
        {rid: kv.get_block_ids(rid) for rid in kv.num_blocks_per_request},
        {r.request_id: (r.num_computed_tokens, r.status) for r in d.requests.values()},
        kv.get_num_free_blocks(),
    )


def busy_driver() -> Driver:
    d = Driver(block_size=4, num_blocks=10, caching=False, budget=16, max_num_seqs=4, watermark_blocks=0)
    for i, n in enumerate((7, 9, 5, 11, 6, 8)):
        d.add(f"r{i}", list(range(1, n + 1)), max_tokens=12, ignore_eos=True)
    return d


@pytest.mark.parametrize(
    ("name", "wrong", "message"),
    [
        ("admission_order", lambda waiting: [r.request_id for r in waiting][1:], "a permutation of"),
        ("admission_order", lambda waiting: [r.request_id for r in waiting] * 2, "exactly once"),
        ("preemption_order", lambda running: list(running), "a permutation of"),
        ("prefill_cap", lambda request: 0, "at least 1"),
        ("prefill_cap", lambda request: 2.5, "a whole number"),
    ],
)
def test_a_wrong_answer_is_named_and_the_step_never_happened(name, wrong, message, monkeypatch):
    """Checked or not, a wrong answer is a PartError naming the function; the scheduler is exactly as before the
    step, with no snapshot taken (the policy is asked before anything changes)."""
    d = busy_driver()
    for _ in range(3):
        d.step()  # a pool under pressure, requests waiting and running
    calls = {"n": 0}

    def counted(*args):
        calls["n"] += 1
        return wrong(*args)

    monkeypatch.setattr(step.Snapshot, "take", lambda *a: pytest.fail("a policy alone needs no snapshot"))
    for check in (True, False):
        calls["n"] = 0
        before = fingerprint(d)
        with pytest.raises(PartError, match=message) as caught:
            with parts.use(check=check, **{name: counted}):
                for _ in range(60):
                    d.step()
        assert caught.value.part == name and "exercise 10b" in str(caught.value)
        assert calls["n"] == 1  # the first answer was wrong, in the first step: nothing of that step happened
        assert fingerprint(d) == before
        d.check_invariants()


def test_preemption_order_chooses_among_those_not_served_yet():
    """FCFS preempts the newest; a policy ranking the second-oldest first preempts it instead."""

    def run(order) -> list[str]:
        d = Driver(block_size=4, num_blocks=8, caching=False, budget=64, max_num_seqs=4, watermark_blocks=0)
        for name in ("a", "b", "c"):
            d.add(name, list(range(1, 8)), max_tokens=20, ignore_eos=True)
        with parts.use(**({"preemption_order": order} if order else {})):
            for _ in range(40):
                out = d.step()
                if out.preempted:
                    return out.preempted
        raise AssertionError("no preemption")

    assert run(None) == ["c"]
    assert run(lambda running: ["b", *(r.request_id for r in running if r.request_id != "b")]) == ["b"]


def test_prefill_cap_caps_every_prefill_chunk():
    d = Driver(block_size=4, num_blocks=64, caching=False, budget=64, max_num_seqs=4)
    for i, n in enumerate((30, 3, 17)):
        d.add(f"r{i}", list(range(1, n + 1)), max_tokens=3, ignore_eos=True)
    with parts.use(prefill_cap=lambda request: 5):
        chunks = []
        while len(d.finished) < 3:
            out = d.step()
            chunks += [s.num_new_tokens for s in out.scheduled if s.start < s.num_prompt_tokens]
    assert max(chunks) == 5 and len(d.finished) == 3


@pytest.mark.parametrize("example", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_an_example_policy_leaves_the_engines_tokens_alone(tiny_model, example):
    policy = ex10b.load_policy(EXAMPLES / f"{example}.py")
    llm = small_engine(tiny_model)
    want = [o.outputs[0].token_ids for o in llm.generate(PREEMPTING_PROMPTS, GREEDY)]
    llm.reset()
    with parts.use(**policy):
        got = [o.outputs[0].token_ids for o in llm.generate(PREEMPTING_PROMPTS, GREEDY)]
    assert got == want and llm.scheduler.num_preemptions > 0


def test_the_leaderboard_ranks_the_examples_and_lists_a_broken_file_last(tmp_path):
    for path in EXAMPLES.glob("*.py"):
        shutil.copy(path, tmp_path)
    (tmp_path / "broken.py").write_text("def admission_order(waiting):\n    return [\n")
    (tmp_path / "nothing.py").write_text("x = 1\n")
    board = ex10b.leaderboard(tmp_path, with_engine=False)
    names = [e.name for e in board.entries]
    assert len(names) == 6
    assert set(names[:4]) == {"first come, first served", "capped_chunks", "cheapest_victim", "shortest_prompt_first"}
    assert set(names[4:]) == {"broken", "nothing"} and all(e.sim.error for e in board.entries[4:])
    ranked = board.entries[:4]
    assert [e.score for e in ranked] == sorted((e.score for e in ranked), reverse=True)
    fcfs = next(e for e in ranked if e.name == "first come, first served")
    assert fcfs.score == pytest.approx(1.0) and all(e.sim.finished == ex10b.SIM_REQUESTS for e in ranked)
    assert len({(e.sim.throughput, e.sim.ttft_p99) for e in ranked}) == 4  # each example decides differently
    text = str(board)
    assert text.splitlines()[0].split()[:3] == ["#", "policy", "score"] and "defines none of" in text


def test_policy_parts_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown policy function"):
        ex10b.policy_parts({"admission_orders": lambda w: []})
    assert ex10b.policy_parts({"prefill_cap": None}) == {}
