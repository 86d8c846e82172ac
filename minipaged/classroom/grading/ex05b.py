"""Checks for exercise 05b, the Triton puzzle ladder: seven small kernels up to paged decode and prefill.

Each check launches the learner's ``@triton.jit`` kernel on one case of ``minipaged.classroom.puzzles`` (fresh inputs in
guarded buffers, Triton's interpreter, an access trace) and expects the verdict "right": every output equal to
the PyTorch reference, no address outside the tensors, no store into an input, no cache cell a right kernel
would not touch and none it must touch left alone, and (puzzles 5 and 6) no K/V element loaded more often than
the layout needs. A wrong kernel's verdict names the first of those that fails; ``puzzles.trace_figure`` draws it.
On a CUDA GPU the kernel is compiled and run on CUDA tensors, without a trace (``puzzles.run`` says what is
checked there); a launch that fails over where a tensor lives is reported as that, without the puzzle's hint.

``check_engine`` plugs puzzles 5 and 6 into the real engine through ``minipaged.classroom.parts`` (checked: the part
probes run first) and serves SmolLM2 with them, token for token against the package's own kernels.
"""

from __future__ import annotations

from typing import Any

from ...kernels import launch
from .. import puzzles
from .core import Check, Outcomes, report

HINTS = {
    "scatter": "one program per token: load its slot; -1 means write nothing, not even an address; the cache is "
    "[num_blocks, BLOCK_SIZE, HEAD_DIM], contiguous (puzzles.trace_figure shows where your stores went)",
    "gather": "program i copies logical block i: its physical block is block_table[i]; the last block may be "
    "part full, so mask positions >= seq_len on the load as well as on the store",
    "decode": "walk the sequence one block at a time with a running max m, sum l and accumulator; when m grows, "
    "rescale l and the accumulator by exp(m_old - m_new) before adding the block",
    "split": "segment s covers logical blocks [s*BLOCKS_PER_SPLIT, (s+1)*BLOCKS_PER_SPLIT) of the sequence; store "
    "its max, its sum of exp(score - max) and its output divided by that sum; an empty segment stores -inf, 0, 0",
    "merge": "rescale every segment to the common maximum m*: weight_s = l_s * exp(m_s - m*); the output is "
    "sum(weight_s * o_s) / sum(weight_s); empty segments weigh 0",
    "gqa": "one program per (sequence, KV head) loads each K/V tile once and multiplies it with the G query rows "
    "of that head at once (tl.dot on a [Q_ROWS, HEAD_DIM] tile, rows past G masked)",
    "prefill": "sequence i's new tokens are rows cu_seqlens_q[i]..cu_seqlens_q[i+1] of query, the last q_len of "
    "its seq_len tokens: new token j sits at position seq_len - q_len + j and sees keys up to it",
}


def _check(puzzle: str, kernel: Any, case: puzzles.Case) -> Check:
    """One case as a check; its hint is dropped when the launch failed over where a tensor lives (the hints are
    about addresses and masks, which that error says nothing about)."""
    check = Check(f"{puzzle}_kernel on {case.label}, grid {case.grid}", lambda: None, "right", hint=HINTS[puzzle])

    def run() -> str:
        got = puzzles.verdict(puzzles.run(puzzle, kernel, case))
        if got.startswith(launch.DEVICE_PROBLEM):
            check.hint = ""
        return got

    check.run = run
    return check


def _group(puzzle: str, kernel: Any) -> Outcomes:
    return report(puzzle, [_check(puzzle, kernel, case) for case in puzzles.PUZZLES[puzzle].cases()])


def check_scatter(scatter_kernel: Any) -> Outcomes:
    """Puzzle 1: one new token's K row into its slot, per program; padding slots (-1) write nothing."""
    return _group("scatter", scatter_kernel)


def check_gather(gather_kernel: Any) -> Outcomes:
    """Puzzle 2: one sequence copied out of the pool through its block table, a logical block per program."""
    return _group("gather", gather_kernel)


def check_decode(decode_kernel: Any) -> Outcomes:
    """Puzzle 3: one query's attention over its sequence, an online softmax block by block."""
    return _group("decode", decode_kernel)


def check_split(split_kernel: Any) -> Outcomes:
    """Puzzle 4a: each (sequence, segment) program's max, sum and normalised output."""
    return _group("split", split_kernel)


def check_merge(merge_kernel: Any) -> Outcomes:
    """Puzzle 4b: the segments' partial results joined into the sequence's output."""
    return _group("merge", merge_kernel)


def check_gqa(gqa_kernel: Any) -> Outcomes:
    """Puzzle 5: G query heads per program over their shared KV head, each K/V element loaded once."""
    return _group("gqa", gqa_kernel)


def check_prefill(prefill_kernel: Any) -> Outcomes:
    """Puzzle 6: a causal tile of new tokens over the sequence's cached prefix."""
    return _group("prefill", prefill_kernel)


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
