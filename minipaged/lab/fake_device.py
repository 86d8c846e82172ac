"""A device without a model: the engine's host work per step, measured and tested on a CPU.

``FakeDeviceExecutor`` does everything the runner does on the host for a step (the persistent input batch
brought up to the step, the step's arrays, the copies into the input buffers) and nothing of the model: each
step "runs" for ``step_s`` seconds on a virtual device that runs one step at a time in launch order, as a GPU
stream does. Its tokens are a function of the request and the position, so a run with async scheduling must
give every request the same tokens as a run without. ``benchmarks/bench_host_step.py`` times the engine's
steps with it; ``tests/test_overlap.py`` checks the overlap loop's order with it.

A step scheduled ahead feeds placeholders; the fake device fills them with what it sampled for that request
in the step before (what ``InputPreparer._fill_placeholders`` does on a GPU) and checks there was such a token.
"""

from __future__ import annotations

import time
import zlib

import torch

from ..core.request import PLACEHOLDER_TOKEN_ID
from ..core.scheduler_output import RunnerOutput, SchedulerOutput
from ..worker.input_batch import InputBatch, InputBuffers


def wait_until(deadline: float) -> None:
    """Spin until ``deadline`` (perf_counter seconds), as a CUDA event's synchronize does by default: a sleep
    on a shared virtual machine overshoots by a millisecond or more and leaves the caches cold."""
    while time.perf_counter() < deadline:
        pass


class FakeDeviceExecutor:
    """The step driver's executor with a virtual device (see the module docstring). ``events`` records
    ``("launch", n)`` and ``("result", n)`` in the order they happen, for tests of the overlap loop."""

    def __init__(
        self,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        step_s: float = 0.0,
        prepare: bool = True,
        vocab: int = 1000,
    ) -> None:
        self.step_s, self.prepare, self.vocab = step_s, prepare, vocab
        self.input_batch = InputBatch(1, max_num_seqs, max_blocks_per_seq, block_size)
        self.buffers = InputBuffers(max_num_batched_tokens, max_num_seqs, max_blocks_per_seq, torch.device("cpu"))
        self.free_at = 0.0  # when the virtual device finishes the last step launched
        self.num_launched = 0
        self.num_device_steps = 0  # launched steps with work in them (an empty one only hands back finished ids)
        self.idle_launches = 0  # steps launched after the device had finished the one before
        self.events: list[tuple[str, int]] = []
        self.last_sampled: dict[str, int] = {}  # the "device's" tokens of the last step, by request
        self._keys: dict[str, int] = {}

    def token_at(self, request_id: str, position: int) -> int:
        """The fake model's token at ``position``: the same whatever the batch or the schedule."""
        key = self._keys.get(request_id)
        if key is None:  # a stable number per request (str hashes change from one process to the next)
            key = self._keys[request_id] = zlib.crc32(request_id.encode())
        return 1 + (key * 1_000_003 + position * 7_919) % (self.vocab - 1)  # cheap: a GPU samples, not the host

    def launch(self, out: SchedulerOutput) -> _FakePending:
        self.num_launched += 1
        n = self.num_launched
        self.events.append(("launch", n))
        if self.prepare and out.scheduled:  # the runner's host work: tables, arrays, buffer copies
            self.input_batch.apply(out)
            arrays = self.input_batch.step_arrays(out)
            buf = self.buffers
            buf.next_step()
            for name, values in (("input_ids", arrays.input_ids), ("positions", arrays.positions),
                                 ("slot_mapping", arrays.slot_mappings[0]), ("block_tables", arrays.block_tables[0]),
                                 ("seq_lens", arrays.seq_lens), ("cu_seqlens_q", arrays.cu_seqlens_q)):  # fmt: skip
                buf.fill(name, values)
        else:
            self.input_batch.drop([*out.finished_req_ids, *out.preempted])
        sampled: dict[str, list[int]] = {}
        for s in out.scheduled:
            if s.token_ids and s.token_ids[-1] == PLACEHOLDER_TOKEN_ID:
                assert s.request_id in self.last_sampled, f"{s.request_id} feeds a token it never sampled"
            if s.num_samples:
                sampled[s.request_id] = [self.token_at(s.request_id, s.start + s.num_new_tokens)] * s.num_samples
        self.last_sampled = {rid: tokens[0] for rid, tokens in sampled.items()}
        now = time.perf_counter()
        start = max(now, self.free_at)
        if out.scheduled:
            self.num_device_steps += 1
            self.idle_launches += now >= self.free_at  # the device had finished the last step: it sat idle
            self.free_at = start + self.step_s
        return _FakePending(self, n, self.free_at, RunnerOutput(sampled))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.launch(out).result()

    def release(self, request_ids: list[str], sample_keys: list[tuple[str, int]]) -> None:
        self.input_batch.drop(request_ids)
        for rid in request_ids:
            self._keys.pop(rid, None)


class _FakePending:
    """A fake step's output: ready once the virtual device has run the step."""

    def __init__(self, executor: FakeDeviceExecutor, n: int, ready_at: float, output: RunnerOutput) -> None:
        self.executor, self.n, self.ready_at, self.output = executor, n, ready_at, output

    def result(self) -> RunnerOutput:
        self.executor.events.append(("result", self.n))
        wait_until(self.ready_at)
        return self.output
