"""Checks for exercise 05c, the Triton puzzle ladder's core: a scatter, a gather and paged decode (puzzles 1-3).
Exercise 05d holds the hard rungs (puzzles 4-6 and the engine), graded by ``ex05d`` with the same machinery.

Each check launches the learner's ``@triton.jit`` kernel on one case of ``minipaged.classroom.puzzles`` (fresh inputs in
guarded buffers, Triton's interpreter, an access trace) and expects the verdict "right": every output equal to
the PyTorch reference, no address outside the tensors, no store into an input, no cache cell a right kernel
would not touch and none it must touch left alone, and (puzzles 5 and 6) no K/V element loaded more often than
the layout needs. A wrong kernel's verdict names the first of those that fails; ``puzzles.trace_figure`` draws it.
On a CUDA GPU the kernel is compiled and run on CUDA tensors, without a trace (``puzzles.run`` says what is
checked there); a launch that fails over where a tensor lives is reported as that, without the puzzle's hint.
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
    "split": "axis 1 of the grid is the segment: its blocks are 4a's half-open range, cut short where the sequence "
    "ends; store the three values 4a names, the output normalised; an empty segment stores 4a's values, not 0/0",
    "merge": "the segments' outputs are not averaged: each weighs by its sum, rescaled to the largest max of "
    "them all (4b, chapter 05 §4); an empty segment must weigh exactly 0, never NaN",
    "gqa": "one program per (sequence, KV head) loads each K/V tile once and multiplies it with the G query rows "
    "of that head at once (tl.dot on a [Q_ROWS, HEAD_DIM] tile, rows past G masked)",
    "prefill": "a tile row's position is not its row number: the new tokens come after the cached prefix (the "
    "spec's example: 37 tokens, 13 new), and the causal mask follows from that; rows past q_len are padding; a "
    "query head reads its group's KV head, as in puzzle 5",
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


def puzzle_group(puzzle: str, kernel: Any) -> Outcomes:
    return report(puzzle, [_check(puzzle, kernel, case) for case in puzzles.PUZZLES[puzzle].cases()])


def check_scatter(scatter_kernel: Any) -> Outcomes:
    """Puzzle 1: one new token's K row into its slot, per program; padding slots (-1) write nothing."""
    return puzzle_group("scatter", scatter_kernel)


def check_gather(gather_kernel: Any) -> Outcomes:
    """Puzzle 2: one sequence copied out of the pool through its block table, a logical block per program."""
    return puzzle_group("gather", gather_kernel)


def check_decode(decode_kernel: Any) -> Outcomes:
    """Puzzle 3: one query's attention over its sequence, an online softmax block by block."""
    return puzzle_group("decode", decode_kernel)
