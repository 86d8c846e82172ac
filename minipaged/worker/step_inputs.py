"""A step's inputs: from the scheduler's requests and block ids to the flat tensors the model reads.

The scheduler speaks in requests and block ids; the model wants flat tensors.
For a step with a 5-token prefill chunk of ``a`` and decodes of ``b`` and ``c``::

    input_ids     a5 a6 a7 a8 a9 | b17 | c3        all new tokens, one row each
    positions      5  6  7  8  9 |  17 |  3
    slot_mapping  per new token: block_table[pos // bs] · bs + pos % bs
    block_tables  [[a's blocks...], [b's blocks...], [c's blocks...]]  (padded with block 0)
    seq_lens      [10, 18, 4]
    cu_seqlens_q  [0, 5, 6, 7]
    sample rows   [4, 5, 6]    the last new token of each request that samples this step

- ``step_inputs``: those lists one token at a time, the readable specification (exercise 09 writes it).
- ``SEAM``: the model runner's replaceable parts, ``step_inputs`` and ``slot_mapping`` (a learner's, plugged in
  through ``hooks``).
- ``InputPreparer``: the same numbers from the persistent input batch with array operations
  (``input_batch.py``), copied into the runner's reused device buffers; with a part plugged in, from the
  specification's lists instead.

Why reused buffers: device tensors allocated once, of the largest size a step can need, and filled in place
each step (a step uses a prefix of each), from pinned memory on a GPU. That saves an allocation per tensor per
step, and it is what a CUDA graph needs: the same addresses every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch

from .. import hooks
from ..core.request import PLACEHOLDER_TOKEN_ID
from ..core.scheduler_output import ScheduledRequest, SchedulerOutput
from ..model import AttentionMetadata
from .block_table import make_block_table_tensor, slot_mapping
from .input_batch import InputBatch, InputBuffers, StepArrays

if TYPE_CHECKING:
    from .sampled_output import SampledOutput

# The pieces of a step's inputs a learner may write in the runner's place (``minipaged.classroom.parts``).
SEAM = hooks.Seam(
    "model_runner",
    step_inputs="ModelRunner.prepare_inputs: the flat inputs of a mixed prefill + decode step",
    slot_mapping="ModelRunner.prepare_inputs: the slot of every new token",
)

# input_ids, positions, the attention metadata (a list: one per KV cache group), the sampled rows
StepTensors: TypeAlias = tuple[torch.Tensor, torch.Tensor, AttentionMetadata | list[AttentionMetadata], torch.Tensor]


def step_inputs(scheduled: list[ScheduledRequest]) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """The flat inputs of one step, from the scheduler's plain-data decisions: every scheduled token in one row,
    request after request, whatever mix of prefill chunks and decodes the step holds::

        scheduled   A: last chunk of a 20-token prompt    B: decode at 7    C: a 3-token prompt, n = 2
        input_ids   [a16 a17 a18 a19 | b7 | c0 c1 c2]      (the tokens at positions 16..19, 7, 0..2)
        positions   [16  17  18  19  | 7  | 0  1  2 ]      (RoPE needs the true positions, not 0..n-1)
        cu_seqlens_q [0, 4, 5, 8]                          (where each request's rows start; the last: total)
        seq_lens    [20, 8, 3]                              (tokens each attends to: cached context + new)
        sample_rows [3, 4, 7, 7]                            (the row of each sampled token: a request's last
                                                             row, once per sample, none mid-prompt)

    A decode with drafts (speculative decoding) is sampled at its last real token's row and at every draft's
    row: B decoding at 7 with drafts d0 d1 feeds ``[b7 d0 d1]`` at positions 7..9 and adds rows ``[4, 5, 6]``.

    Returns ``(input_ids, positions, cu_seqlens_q, seq_lens, sample_rows)`` as lists; ``prepare_inputs``
    copies them into the runner's reused buffers. vLLM's ``GPUModelRunner._prepare_inputs`` builds the same
    arrays (its ``query_start_loc`` is our ``cu_seqlens_q``).
    """
    ids: list[int] = []
    positions: list[int] = []
    cu = [0]
    seq_lens: list[int] = []
    sample_rows: list[int] = []
    for s in scheduled:
        end = s.start + s.num_new_tokens
        ids += s.token_ids
        positions += range(s.start, end)
        cu.append(cu[-1] + s.num_new_tokens)
        seq_lens.append(end)
        if s.spec_token_ids:  # verification: one row per draft and one for the last real token
            sample_rows += range(cu[-1] - 1 - len(s.spec_token_ids), cu[-1])
        else:
            sample_rows += [cu[-1] - 1] * s.num_samples
    return ids, positions, cu, seq_lens, sample_rows


class InputPreparer:
    """Fills the runner's reused device buffers with a step's inputs (vLLM: ``GPUModelRunner._prepare_inputs``),
    and, under async scheduling, feeds a step the tokens the last one left on the device (``last``)."""

    def __init__(self, input_batch: InputBatch, buffers: InputBuffers, num_groups: int) -> None:
        self.input_batch, self.buffers, self.num_groups = input_batch, buffers, num_groups
        self.last: SampledOutput | None = None  # the last step's tokens, still on the device

    def prepare(self, out: SchedulerOutput) -> StepTensors:
        """The step's tensors in the reused device buffers: ``input_ids``, ``positions``, the attention metadata
        (one per KV cache group) and the sampled rows. Built with array operations from the persistent input
        batch (``input_batch.py``); a learner's plugged-in ``step_inputs`` or ``slot_mapping`` is called as the
        one-token-at-a-time specification instead."""
        arrays = self._arrays_by_parts(out) if SEAM.replaced() else self.input_batch.step_arrays(out)
        buf = self.buffers
        buf.next_step()
        seq_lens, cu = buf.fill("seq_lens", arrays.seq_lens), buf.fill("cu_seqlens_q", arrays.cu_seqlens_q)
        metas = [
            AttentionMetadata(
                slot_mapping=buf.fill("slot_mapping" + suffix, slots),
                block_tables=buf.fill("block_tables" + suffix, table),
                seq_lens=seq_lens,
                cu_seqlens_q=cu,
                max_query_len=arrays.max_query_len,
            )
            for suffix, slots, table in zip(
                ["", *(f"_{g}" for g in range(1, len(arrays.slot_mappings)))], arrays.slot_mappings, arrays.block_tables
            )
        ]
        input_ids = buf.fill("input_ids", arrays.input_ids)
        if len(arrays.placeholders):
            self._fill_placeholders(input_ids, arrays)
        sample_rows = buf.fill("sample_rows", arrays.sample_rows)
        return input_ids, buf.fill("positions", arrays.positions), metas[0] if len(metas) == 1 else metas, sample_rows

    def _arrays_by_parts(self, out: SchedulerOutput) -> StepArrays:
        """The step's arrays from ``step_inputs`` and ``slot_mapping``, a learner's if plugged in (exercises 04
        and 09b), the package's otherwise: the lists a Python loop builds, token by token."""
        build = SEAM.pick("step_inputs", step_inputs)
        slots = SEAM.pick("slot_mapping", slot_mapping)
        ids, positions, cu, seq_lens, sample_rows = build(out.scheduled)
        groups = [self.input_batch.table(s.request_id) for s in out.scheduled]
        per_group = [[g[i] for g in groups] for i in range(self.num_groups)]
        input_ids = np.array(ids, dtype=np.int64)
        placeholders = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN_ID)
        owner = np.repeat(np.arange(len(out.scheduled)), [s.num_new_tokens for s in out.scheduled])
        return StepArrays(
            input_ids,
            np.array(positions, dtype=np.int64),
            np.array(cu, dtype=np.int32),
            np.array(seq_lens, dtype=np.int32),
            np.array(sample_rows, dtype=np.int64),
            [np.asarray(slots(t, out.positions(), out.block_size), dtype=np.int64) for t in per_group],
            [make_block_table_tensor(t).numpy() for t in per_group],
            max((s.num_new_tokens for s in out.scheduled), default=0),
            placeholders,
            [out.scheduled[i].request_id for i in owner[placeholders].tolist()],
        )

    def _fill_placeholders(self, input_ids: torch.Tensor, arrays: StepArrays) -> None:
        """Async scheduling: the tokens the last step sampled are still on the device, and this step was
        scheduled before they came back. Copy each into the row that waits for it, on the device."""
        last = self.last
        first_rows = {} if last is None else last.first_rows
        try:
            rows = [first_rows[rid] for rid in arrays.placeholder_owners]
        except KeyError as e:
            raise RuntimeError(
                f"request {e.args[0]!r} feeds a token of the last step, but it sampled nothing in it: the step was "
                "scheduled ahead of a step this runner did not run"
            ) from None
        assert last is not None  # a step sampled: its rows are known
        dst = self.buffers.fill("placeholder_dst", arrays.placeholders)
        src = self.buffers.fill("placeholder_src", np.array(rows, dtype=np.int64))
        input_ids.index_copy_(0, dst, last.drawn.tokens.index_select(0, src))
