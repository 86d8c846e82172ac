"""The runner's persistent input batch: what it keeps of the requests between steps, and a step's inputs built
from it with array operations instead of a Python loop per token (vLLM v1: ``gpu_input_batch.py``,
``block_table.py``).

Block tables travel once (``scheduler_output.apply_block_updates``): a request's first step sends its whole table,
later steps only what changed. ``InputBatch`` keeps every table as one row of a numpy array, so a step writes
its new block ids into the rows and reads the batch's table by fancy indexing, never rebuilding a list of lists::

    rows        "a" -> 0   "b" -> 2   ("c" left: row 1 free again, zeroed)
    tables[0]   row 0  [ 7  2  9  0  0 ]     a: 3 blocks
                row 1  [ 0  0  0  0  0 ]
                row 2  [ 4  0  0  0  0 ]     b: 1 block
    a step of b (decode at 5) then a (chunk 32..35), block_size 16:
      req_of_token  [0 | 1 1 1 1]           which scheduled request each new token belongs to
      positions     [5 | 32 33 34 35]        start + (token index - the request's first token index)
      slot_mapping  tables[rows[req], pos // 16] * 16 + pos % 16  =  [4·16+5 | 9·16+0 ...]

The slot mapping and positions are the same numbers ``block_table.slot_mapping`` and
``step_inputs.step_inputs`` compute one token at a time (they stay the readable specification, and the path a
learner's plugged-in part takes); ``tests/test_input_batch.py`` holds the two to each other.

``InputBuffers`` holds the device tensors a step fills, allocated once (a CUDA graph replays the same addresses).
On a GPU each is filled from pinned host memory with an asynchronous copy; two staging sets alternate, so the
host can write step N+1's inputs while step N's copies may still be queued.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.request import PLACEHOLDER_TOKEN_ID
from ..core.scheduler_output import SchedulerOutput


@dataclass
class StepArrays:
    """One step's flat inputs as numpy arrays (what ``InputBuffers`` copies to the device)."""

    input_ids: np.ndarray  # int64 [tokens]
    positions: np.ndarray  # int64 [tokens]
    cu_seqlens_q: np.ndarray  # int32 [requests + 1]
    seq_lens: np.ndarray  # int32 [requests]
    sample_rows: np.ndarray  # int64 [sampled tokens]
    slot_mappings: list[np.ndarray]  # int64 [tokens], one per KV cache group
    block_tables: list[np.ndarray]  # int32 [requests, width], one per KV cache group
    max_query_len: int
    placeholders: np.ndarray  # int64: indices into input_ids that hold PLACEHOLDER_TOKEN_ID
    placeholder_owners: list[str]  # the request each placeholder belongs to


class InputBatch:
    """The block tables of the requests the runner serves, one row each, per KV cache group."""

    def __init__(self, num_groups: int, max_num_reqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.rows: dict[str, int] = {}  # request id -> its row
        self.tables = np.zeros((num_groups, max(max_num_reqs, 1), max(max_blocks_per_seq, 1)), dtype=np.int32)
        self.lengths = np.zeros((num_groups, max(max_num_reqs, 1)), dtype=np.int64)  # blocks in each row
        self._free = list(range(self.tables.shape[1] - 1, -1, -1))  # a stack: the lowest row first

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.rows

    def table(self, request_id: str) -> list[list[int]]:
        """A request's block ids per group, as plain lists (what ``apply_block_updates`` keeps)."""
        row = self.rows[request_id]
        return [self.tables[g, row, : self.lengths[g, row]].tolist() for g in range(self.tables.shape[0])]

    def as_dict(self) -> dict[str, list[list[int]]]:
        return {rid: self.table(rid) for rid in self.rows}

    def drop(self, request_ids: list[str]) -> None:
        """Forget requests that left: their rows are zeroed (a stale id must never be read) and reused."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.tables[:, row] = 0
                self.lengths[:, row] = 0
                self._free.append(row)

    def clear(self) -> None:
        self.drop(list(self.rows))

    def apply(self, out: SchedulerOutput) -> None:
        """Bring the tables up to a step, as ``apply_block_updates`` does to a dict of lists: the requests that
        left or were preempted go, then each scheduled request's updates are written from their index on."""
        self.drop([*out.finished_req_ids, *out.preempted])
        for s in out.scheduled:
            row = self.rows.get(s.request_id)
            if row is None:
                row = self.rows[s.request_id] = self._take_row()
            for g, (start, ids) in enumerate(s.block_updates):
                end = start + len(ids)
                if end > self.tables.shape[2]:
                    self._grow(cols=end)
                old = int(self.lengths[g, row])
                if ids:
                    self.tables[g, row, start:end] = ids
                if old > end:  # a table that shrank (blocks of rejected drafts went back): zero what it lost
                    self.tables[g, row, end:old] = 0
                self.lengths[g, row] = end

    def _take_row(self) -> int:
        if not self._free:
            self._grow(rows=2 * self.tables.shape[1])
        return self._free.pop()

    def _grow(self, rows: int | None = None, cols: int | None = None) -> None:
        """More rows or columns than planned (it cannot happen under the scheduler's limits): grow, keep going."""
        g, r, c = self.tables.shape
        nr, nc = max(rows or r, r), max(cols or c, c)
        tables = np.zeros((g, nr, nc), dtype=np.int32)
        tables[:, :r, :c] = self.tables
        lengths = np.zeros((g, nr), dtype=np.int64)
        lengths[:, :r] = self.lengths
        self.tables, self.lengths = tables, lengths
        self._free = list(range(nr - 1, r - 1, -1)) + self._free

    def step_arrays(self, out: SchedulerOutput) -> StepArrays:
        """The step's flat inputs (``step_inputs.step_inputs``'s five lists, the slot mappings and the block
        tables), computed with array operations. ``apply(out)`` must have run."""
        scheduled, bs = out.scheduled, self.block_size
        n = len(scheduled)
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        starts = np.fromiter((s.start for s in scheduled), np.int64, n)
        rows = np.fromiter((self.rows[s.request_id] for s in scheduled), np.int64, n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        total = int(cu[-1])
        req_of_token = np.repeat(np.arange(n), num_new)
        positions = np.arange(total, dtype=np.int64) + np.repeat(starts - cu[:-1], num_new)
        seq_lens = starts + num_new
        if total == n:  # all decodes: one token each (the usual step), no list to flatten
            input_ids = np.fromiter((s.token_ids[0] for s in scheduled), np.int64, n)
        else:
            input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), np.int64, total)
        width = int((seq_lens.max() + bs - 1) // bs) if n else 0
        slot_mappings, tables = [], []
        token_rows, logical = rows[req_of_token], positions // bs
        for g in range(self.tables.shape[0]):
            past = np.flatnonzero(logical >= self.lengths[g, token_rows])
            if len(past):  # the scheduler's allocation and this step disagree: say where, not a wrong slot
                i = int(past[0])
                s = scheduled[int(req_of_token[i])]
                raise IndexError(
                    f"request {s.request_id!r}: position {int(positions[i])} is past its block table "
                    f"({int(self.lengths[g, token_rows[i]])} blocks x {bs} slots)"
                )
            group = self.tables[g]
            slot_mappings.append(group[token_rows, logical].astype(np.int64) * bs + positions % bs)
            tables.append(group[rows, :width])
        sample_rows = self._sample_rows(out, cu)
        placeholders = np.flatnonzero(input_ids == PLACEHOLDER_TOKEN_ID)
        owners = [scheduled[i].request_id for i in req_of_token[placeholders].tolist()]
        return StepArrays(
            input_ids, positions, cu.astype(np.int32), seq_lens.astype(np.int32), sample_rows, slot_mappings,
            tables, int(num_new.max()) if n else 0, placeholders, owners,
        )  # fmt: skip

    @staticmethod
    def _sample_rows(out: SchedulerOutput, cu: np.ndarray) -> np.ndarray:
        """The row of each sampled token: a request's last row once per sample, or (with drafts) the rows from
        its last real token to its last draft; none mid-prompt."""
        rows: list[int] = []
        for i, s in enumerate(out.scheduled):
            last = int(cu[i + 1]) - 1
            if s.spec_token_ids:
                rows += range(last - len(s.spec_token_ids), last + 1)
            elif s.num_samples:
                rows += [last] * s.num_samples
        return np.array(rows, dtype=np.int64)


class InputBuffers:
    """A step's input tensors, allocated once on the device and reused: each step fills a prefix.

    Sized for the scheduler's limits (``max_num_batched_tokens`` tokens, ``max_num_seqs``
    sequences, ``max_blocks_per_seq`` table columns); a step that needs more (it cannot,
    under those limits) gets a bigger buffer rather than an error.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"  # staged through page-locked memory: the copy does not block
        self._staging: list[dict[str, torch.Tensor]] = [{}, {}]  # two sets, alternating step by step
        self._set = 0
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.sample_rows = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.placeholder_dst = torch.zeros(max_seqs, dtype=torch.long, device=device)  # async scheduling's
        self.placeholder_src = torch.zeros(max_seqs, dtype=torch.long, device=device)

    def next_step(self) -> None:
        """Use the other staging set: the last step's copies may still be queued on the device."""
        self._set ^= 1

    def fill(self, name: str, values: torch.Tensor | np.ndarray) -> torch.Tensor:
        """Copy ``values`` (a CPU tensor or numpy array) into the front of buffer ``name``; return that view."""
        src = torch.from_numpy(np.ascontiguousarray(values)) if isinstance(values, np.ndarray) else values
        buf = getattr(self, name, None)
        if buf is None:  # a second KV cache group's slot mapping or block tables: made at its first step
            buf = torch.zeros(src.shape, dtype=src.dtype, device=self.device)
            setattr(self, name, buf)
        if any(v > b for v, b in zip(src.shape, buf.shape)):  # larger than planned: grow, keep going
            buf = torch.zeros([max(v, b) for v, b in zip(src.shape, buf.shape)], dtype=buf.dtype, device=self.device)
            setattr(self, name, buf)
        view = buf[tuple(slice(0, n) for n in src.shape)]
        if self.pinned:
            src = self._stage(name, src.to(buf.dtype), buf.shape)
        view.copy_(src, non_blocking=self.pinned)
        return view

    def _stage(self, name: str, src: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``src`` copied into this step's pinned staging tensor for ``name`` (made at first use, buffer-sized)."""
        staging = self._staging[self._set]
        host = staging.get(name)
        if host is None or host.shape != shape:
            host = staging[name] = torch.empty(shape, dtype=src.dtype, pin_memory=True)
        view = host[tuple(slice(0, n) for n in src.shape)]
        view.copy_(src)
        return view
