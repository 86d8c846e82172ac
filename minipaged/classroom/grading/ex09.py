"""Checks for exercise 09: the flat inputs of a mixed prefill + decode step.

``step_inputs(scheduled) -> (input_ids, positions, cu_seqlens_q, seq_lens, sample_rows)`` turns the scheduler's
plain-data decisions (``ScheduledRequest``: a request's id, where its new tokens start, how many, their ids, how
many tokens to sample after the step) into the five lists ``ModelRunner.prepare_inputs`` hands the model. The
expected lists are the package's own ``model_runner.step_inputs`` on the same step; the last check plugs the
learner's function into the engine and serves SmolLM2 with chunked prefill, token for token against
transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.scheduler_output import ScheduledRequest
from .core import Check, CheckOutcome, report


def sr(rid: str, start: int, n: int, samples: int = 1, blocks: tuple[int, ...] = (3, 9)) -> ScheduledRequest:
    """A request's share of a step: ``n`` new tokens from position ``start``, ``samples`` tokens sampled after."""
    return ScheduledRequest(
        rid,
        n,
        start,
        samples,
        token_ids=[1000 + 10 * ord(rid[0]) + start + i for i in range(n)],
        block_updates=[(0, list(blocks))],
    )


# (label, the step's scheduled requests)
STEPS = [
    ("one 5-token prompt, whole: rows 0..4, sampled at its last row", [sr("a", 0, 5)]),
    ("three decodes at positions 7, 30 and 2: one row each", [sr("a", 7, 1), sr("b", 30, 1), sr("c", 2, 1)]),
    ("a prompt's middle chunk (positions 8..12) samples nothing", [sr("a", 8, 5, samples=0)]),
    (
        "the last chunk of a prompt whose first 16 tokens came from the prefix cache: it attends to 20",
        [sr("a", 16, 4)],
    ),
    ("n = 3: a prompt's first token is sampled three times, from its last row", [sr("a", 0, 4, samples=3)]),
    (
        "chapter 09's mixed step: a prompt's last chunk, a decode, a 3-token prompt sampled twice",
        [sr("a", 16, 4), sr("b", 7, 1), sr("c", 0, 3, samples=2)],
    ),
    (
        "five requests: a middle chunk, two decodes, a cached prompt's tail, a new prompt",
        [sr("a", 32, 16, samples=0), sr("b", 40, 1), sr("c", 3, 1), sr("d", 48, 2), sr("e", 0, 6)],
    ),
]


def _describe(step: list[ScheduledRequest]) -> str:
    return (
        "["
        + ", ".join(f"{s.request_id}: start {s.start}, {s.num_new_tokens} new, {s.num_samples} sampled" for s in step)
        + "]"
    )


def _lists(result: Any) -> Any:
    try:
        return tuple(list(map(int, r)) for r in result)
    except (TypeError, ValueError):
        return result


def _engine_tokens(step_inputs: Callable[..., Any]) -> Any:
    """SmolLM2 serves the capstone's four chat prompts with a 24-token budget (prompts of ~40 tokens: chunked,
    mixed with decodes), the learner's ``step_inputs`` inside the runner, checked call by call."""
    from ...sampling_params import SamplingParams
    from .. import parts
    from .capstone import MAX_TOKENS, engine, prompt_ids, reference_outputs

    prompts = prompt_ids()
    llm = engine(dict(max_num_batched_tokens=24, dtype="float32"))
    want = reference_outputs(prompts, device=llm.device, dtype=llm.dtype)  # where and how the engine runs
    with parts.use(step_inputs=step_inputs):
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    got = [list(o.outputs[0].token_ids) for o in outs]
    return "token for token transformers' output" if got == want else f"outputs differ: {got} vs {want}"


def check_step_inputs(step_inputs: Callable[..., Any]) -> list[CheckOutcome]:
    """``step_inputs(scheduled) -> (input_ids, positions, cu_seqlens_q, seq_lens, sample_rows)``."""
    from ...worker.step_inputs import step_inputs as package

    hint = (
        "one row per scheduled token, request after request: positions continue from each request's start "
        "(the cached context), cu_seqlens_q starts at 0 and adds each request's new tokens, seq_lens is what each "
        "request attends to (start + new), and a request's last row is sampled num_samples times (0 mid-prompt, "
        "n for an n > 1 request's first token) (chapter 09, section 6)"
    )
    checks = [
        Check(
            f"step_inputs({_describe(step)})  # {label}",
            lambda step=step: _lists(step_inputs(step)),
            _lists(package(step)),
            hint=hint,
        )
        for label, step in STEPS
    ]
    checks.append(
        Check(
            "SmolLM2 serves four chat prompts, chunked by a 24-token budget, with your step_inputs in the runner",
            lambda: _engine_tokens(step_inputs),
            "token for token transformers' output",
            hint=hint,
        )
    )
    return report("step_inputs", checks)
