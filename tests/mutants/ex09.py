"""Exercise 09 — the flat inputs of a mixed step: wrong versions a learner writes."""

from __future__ import annotations

from minipaged.core.scheduler_output import ScheduledRequest

from . import mutant

CHECKS = {"step_inputs": ["check_step_inputs"]}
HELPERS: dict = {}
Inputs = tuple[list[int], list[int], list[int], list[int], list[int]]


@mutant("step_inputs", "positions restart at 0 for every request: a chunk forgets the context before it")
def positions_from_zero(scheduled: list[ScheduledRequest]) -> Inputs:
    ids, positions, cu, seq_lens, rows = [], [], [0], [], []
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.num_new_tokens)  # MISTAKE: range(s.start, s.start + s.num_new_tokens)
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(s.start + s.num_new_tokens)
        rows += [cu[-1] - 1] * s.num_samples
    return ids, positions, cu, seq_lens, rows


@mutant("step_inputs", "seq_lens counts the new tokens only, not the cached context they attend to")
def new_tokens_only(scheduled: list[ScheduledRequest]) -> Inputs:
    ids, positions, cu, seq_lens, rows = [], [], [0], [], []
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.start, s.start + s.num_new_tokens)
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(s.num_new_tokens)  # MISTAKE: s.start + s.num_new_tokens
        rows += [cu[-1] - 1] * s.num_samples
    return ids, positions, cu, seq_lens, rows


@mutant("step_inputs", "cu_seqlens_q without its leading 0")
def no_leading_zero(scheduled: list[ScheduledRequest]) -> Inputs:
    ids, positions, cu, seq_lens, rows = [], [], [], [], []
    total = 0
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.start, s.start + s.num_new_tokens)
        total += s.num_new_tokens
        cu.append(total)  # MISTAKE: cu starts as [0]
        seq_lens.append(s.start + s.num_new_tokens)
        rows += [total - 1] * s.num_samples
    return ids, positions, cu, seq_lens, rows


@mutant("step_inputs", "samples each request's first row, not its last")
def first_row(scheduled: list[ScheduledRequest]) -> Inputs:
    ids, positions, cu, seq_lens, rows = [], [], [0], [], []
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.start, s.start + s.num_new_tokens)
        rows += [cu[-1]] * s.num_samples  # MISTAKE: the row of its last token
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(s.start + s.num_new_tokens)
    return ids, positions, cu, seq_lens, rows


@mutant("step_inputs", "one sampled row per request, whatever num_samples says")
def one_row_each(scheduled: list[ScheduledRequest]) -> Inputs:
    ids, positions, cu, seq_lens, rows = [], [], [0], [], []
    for s in scheduled:
        ids += s.token_ids
        positions += range(s.start, s.start + s.num_new_tokens)
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(s.start + s.num_new_tokens)
        rows.append(cu[-1] - 1)  # MISTAKE: none mid-prompt, n for an n > 1 request's first sample
    return ids, positions, cu, seq_lens, rows
