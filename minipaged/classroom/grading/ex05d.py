"""Checks for exercise 05d, the Triton puzzle ladder's hard rungs: split-KV and its merge, GQA packing, prefill.

Each puzzle is checked as in exercise 05c (``ex05c.puzzle_group``: the learner's kernel on every case of
``minipaged.classroom.puzzles``, traced under Triton's interpreter, verdict "right" or the first thing wrong).
``check_engine`` plugs puzzles 5 and 6 into the real engine through ``minipaged.classroom.parts`` (checked: the part
probes run first) and serves SmolLM2 with them, token for token against the package's own kernels.
"""

from __future__ import annotations

from typing import Any

from .. import puzzles
from .core import Check, Outcomes, report
from .ex05c import puzzle_group


def check_split(split_kernel: Any) -> Outcomes:
    """Puzzle 4a: each (sequence, segment) program's max, sum and normalised output."""
    return puzzle_group("split", split_kernel)


def check_merge(merge_kernel: Any) -> Outcomes:
    """Puzzle 4b: the segments' partial results joined into the sequence's output."""
    return puzzle_group("merge", merge_kernel)


def check_gqa(gqa_kernel: Any) -> Outcomes:
    """Puzzle 5: G query heads per program over their shared KV head, each K/V element loaded once."""
    return puzzle_group("gqa", gqa_kernel)


def check_prefill(prefill_kernel: Any) -> Outcomes:
    """Puzzle 6: a causal tile of new tokens over the sequence's cached prefix."""
    return puzzle_group("prefill", prefill_kernel)


# ---- puzzles 5 and 6 in the engine ---------------------------------------------------------------------------
SHARED = list(range(100, 120))  # 20 tokens: one full block of 16 that the second prompt finds in the prefix cache
ENGINE_PROMPTS = [SHARED + [7, 8, 9], SHARED + list(range(11, 27))]
ENGINE_SETTINGS = dict(
    dtype="float32", block_size=16, max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=True
)
ENGINE_TOKENS = 3


def serve(gqa_kernel: Any, prefill_kernel: Any) -> dict[str, Any]:
    """SmolLM2 with the package's kernels, then with the learner's two plugged in; what each run gave."""
    from ...engine.llm import LLM
    from ...sampling_params import SamplingParams
    from .. import parts

    llm = LLM(**ENGINE_SETTINGS)  # type: ignore[arg-type]
    greedy = SamplingParams(max_tokens=ENGINE_TOKENS, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, greedy)]
    llm.reset()
    got: dict[str, Any] = dict(want=want, error=None, tokens=None, calls={}, hits=0)
    try:
        with parts.use(
            paged_decode_attention=puzzles.decode_part(gqa_kernel),
            paged_prefill_attention=puzzles.prefill_part(prefill_kernel),
        ) as plugged:
            got["tokens"] = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, greedy)]
        got["calls"] = {n: w.calls for n, w in plugged.items()}
        got["hits"] = llm.kv_cache_manager.prefix_cache_hits
    except Exception as exc:  # a PartError names the part, the probe or call, and the engine step
        got["error"] = f"{type(exc).__name__}: {exc}"
    return got


def check_engine(gqa_kernel: Any, prefill_kernel: Any) -> Outcomes:
    """Puzzles 5 and 6 serve SmolLM2 in the engine: the package's greedy tokens, and each kernel did work."""
    runs: list[dict[str, Any]] = []

    def run() -> dict[str, Any]:
        if not runs:
            runs.append(serve(gqa_kernel, prefill_kernel))
        return runs[0]

    def tokens() -> str:
        r = run()
        if r["error"]:
            return r["error"]
        return (
            "the package's tokens" if r["tokens"] == r["want"] else f"{r['tokens']} where the package has {r['want']}"
        )

    def called(part: str) -> Any:
        r = run()
        return r["error"] or r["calls"].get(part, 0) > 0

    hint = (
        "every call is checked against the reference: the message names the part, the probe or the engine step; "
        "run that puzzle's checks again, then puzzles.trace_figure on its cases"
    )
    checks = [
        Check(
            f"SmolLM2 serves {len(ENGINE_PROMPTS)} prompts ({ENGINE_TOKENS} greedy tokens, a prefix-cache hit, "
            "chunked prefill) with your gqa_kernel and prefill_kernel",
            tokens,
            "the package's tokens",
            hint=hint,
        ),
        Check("the engine's decode steps ran your gqa_kernel", lambda: called("paged_decode_attention"), True, hint),
        Check(
            "the engine's prefill steps ran your prefill_kernel", lambda: called("paged_prefill_attention"), True, hint
        ),
    ]
    return report("engine", checks)
