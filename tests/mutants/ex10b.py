"""Exercise 10b — a scheduling policy of your own: policies a learner writes that the scheduler must refuse, and
one that changes nothing."""

from __future__ import annotations

from minipaged.core.request import Request

from . import mutant

CHECKS = {"my_policy": ["check_policy"]}
HELPERS: dict = {}


@mutant("my_policy", "admission_order drops the request it likes least: a request would be lost")
def drops_one() -> dict:
    def admission_order(waiting: list[Request]) -> list[str]:
        by_length = sorted(waiting, key=lambda r: r.num_tokens)
        return [r.request_id for r in by_length][:-1]  # MISTAKE: every waiting id, exactly once

    return {"admission_order": admission_order}


@mutant("my_policy", "preemption_order returns the requests themselves, not their ids")
def returns_requests() -> dict:
    def preemption_order(running: list[Request]) -> list[str]:
        return sorted(running, key=lambda r: r.num_computed_tokens)  # MISTAKE: [r.request_id for r in ...]

    return {"preemption_order": preemption_order}


@mutant("my_policy", "prefill_cap of 0 for long prompts: they could never start")
def zero_cap() -> dict:
    def prefill_cap(request: Request) -> int:
        return 0 if request.num_prompt_tokens > 512 else 512  # MISTAKE: at least 1 token

    return {"prefill_cap": prefill_cap}


@mutant("my_policy", "a cap as a float (a fraction of the prompt)")
def float_cap() -> dict:
    def prefill_cap(request: Request) -> int:
        return request.num_prompt_tokens / 2  # MISTAKE: a whole number of tokens

    return {"prefill_cap": prefill_cap}


@mutant("my_policy", "first come, first served written out again: no decision of its own")
def plain_fcfs() -> dict:
    def admission_order(waiting: list[Request]) -> list[str]:
        return [r.request_id for r in waiting]  # MISTAKE: the open task asks for a policy of your own

    return {"admission_order": admission_order}


@mutant("my_policy", "longest prompt first: a decision of its own that serves fewer requests within their SLO")
def longest_first() -> dict:
    def admission_order(waiting: list[Request]) -> list[str]:
        by_length = sorted(waiting, key=lambda r: -r.num_prompt_tokens)  # MISTAKE: short ones wait behind long ones
        return [r.request_id for r in by_length]

    return {"admission_order": admission_order}
