"""What one step will do, as plain data: what the scheduler hands the model runner (vLLM v1: ``sched/output.py``).

Only ids, numbers, token ids and the requests' sampling settings, never a live ``Request``: the output can be
pickled and sent to another process (a tensor-parallel worker, a server's engine loop) as it is, and the runner
needs nothing else to build the step's tensors::

    SchedulerOutput
      scheduled = [ScheduledRequest("a", start=32, num_new_tokens=16, token_ids=[...16 ids],
                                    block_updates=[(2, [9])]),          # a: one block more, at index 2
                   ScheduledRequest("b", start=40, num_new_tokens=1,  token_ids=[last id],
                                    block_updates=[(3, [])]),           # b: its table as the runner has it
                   ScheduledRequest("c", start=0,  num_new_tokens=9,  token_ids=[...9 ids],
                                    block_updates=[(0, [3])])]          # c: new, its whole table
      swap_out / swap_in / copy_blocks      block copies to do before the forward
      kv_connector_metadata                 saves to and loads from a KV connector's store (kv_connector.py)
      preempted                             ids taken off the device this step
      finished_req_ids, finished_sample_keys   ids that left since the last step, and their random streams:
                                            the runner drops what it keeps for them

Block tables travel once: a request's whole table in its first step (and after it was preempted, or a step
failed), then only what changed (``KVCacheManager.take_block_updates``; vLLM's ``NewRequestData`` and
``CachedRequestData``). The runner keeps the tables (``apply_block_updates``; the engine's runner, in numpy rows:
``worker/input_batch.py``) and turns the step into tensors,
the slot mapping included (``block_table.slot_mapping``), as vLLM's runner-side ``BlockTable`` does; a
tensor-parallel step pickles a few ids per request, not every table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..sampling_params import SamplingParams
from .kv_connector import KVConnectorMetadata


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    num_new_tokens: int  # a prefill chunk, or 1 for a decode
    start: int  # position of its first new token (= tokens already computed)
    num_samples: int  # tokens to sample after this step: 0 mid-prompt, n on an n > 1 request's first, else 1
    #                   (with drafts: 1 verification, which emits 1 to len(spec_token_ids) + 1 tokens)
    token_ids: list[int] = field(default_factory=list)  # the tokens at positions start .. start + num_new_tokens - 1
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    sample_key: tuple[str, int] = ("", 0)  # its random stream: (the request it samples for, which sample)
    num_prompt_tokens: int = 0
    # Speculative decoding: the drafts among token_ids (its last len(spec_token_ids) tokens). The runner then
    # samples every row from the last real token on and keeps the drafts the model agrees with.
    spec_token_ids: list[int] = field(default_factory=list)
    # Per KV cache group (one, or several for sliding-window layers beside full ones: kv_cache_coordinator.py),
    # what the runner lacks of its block table after this step's allocation: (first index, the ids from there).
    block_updates: list[tuple[int, list[int]]] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.num_samples > 0


@dataclass
class SchedulerOutput:
    """What one step will do (see the module docstring)."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, device block)
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (source, destination)
    preempted: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    finished_sample_keys: list[tuple[str, int]] = field(default_factory=list)  # their random streams, to drop
    block_size: int = 16
    kv_connector_metadata: KVConnectorMetadata | None = None  # copies to and from a KV connector's store

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def positions(self) -> list[list[int]]:
        return [list(range(s.start, s.start + s.num_new_tokens)) for s in self.scheduled]


def apply_block_updates(tables: dict[str, list[list[int]]], out: SchedulerOutput) -> None:
    """Bring a runner's copy of the block tables (request id -> one table per KV cache group) up to a step: the
    requests that left or were preempted go, then each scheduled request's updates are written from their index
    on. Applying a step again gives the same tables (a failed step's updates are sent again)."""
    for rid in (*out.finished_req_ids, *out.preempted):
        tables.pop(rid, None)
    for s in out.scheduled:
        groups = tables.setdefault(s.request_id, [[] for _ in s.block_updates])
        for table, (start, ids) in zip(groups, s.block_updates):
            del table[start:]
            table.extend(ids)


@dataclass
class RunnerOutput:
    """What the executor hands back (vLLM: ``ModelRunnerOutput``): the sampled token ids of each request that
    samples, or why it could not. Plain data too."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


class PendingOutput(Protocol):
    """A step's output that may still be on its way (the device runs the step while the host goes on):
    ``result()`` waits for it. vLLM: ``AsyncModelRunnerOutput.get_output()``."""

    def result(self) -> RunnerOutput: ...


@dataclass
class Ready:
    """An output that is there already: what an executor that waits for its step returns from ``launch``."""

    output: RunnerOutput

    def result(self) -> RunnerOutput:
        return self.output
