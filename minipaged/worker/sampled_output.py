"""A step's sampling, as the runner queues it (vLLM: ``GPUModelRunner._sample`` and
``AsyncGPUModelRunnerOutput``).

- ``SampledOutput``: a step's tokens, drawn on the device from its sampling rows (``draw``), drafts verified
  (``verify_drafts``), and brought back in one copy when the step's result is asked for (``result``).

Why the tokens stay on the device until asked for: the engine schedules the next step while this one runs
(``engine/overlap.py``), and that step's inputs read this step's tokens where they are (``first_rows``: the row
of each request's first sample, ``step_inputs.InputPreparer`` copies them on the device). The row bookkeeping
(which logit row is whose, its random stream, its drafts) is here; turning one row of logits into a token is ``sampler.py``'s.
"""

from __future__ import annotations

import time

import torch

from ..core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from ..profiling import span
from .sampler import DeviceSamples, Sampler, verify


class SampledOutput:
    """A step's tokens on their way back from the device (``PendingOutput``): ``result()`` waits for the one copy
    of every row, then hands each request its tokens or why it has none."""

    def __init__(self, drawn: DeviceSamples, owners: list[str], timers: dict[str, float]) -> None:
        self.drawn, self.owners, self.timers = drawn, owners, timers
        self.verified: dict[str, list[int]] = {}  # requests with drafts: the tokens they emit (waited for)
        self.errors: dict[str, str] = {}
        self.first_rows: dict[str, int] = {}  # request id -> the row of its first sample in ``drawn.tokens``
        for i, rid in enumerate(owners):
            self.first_rows.setdefault(rid, i)
        self.drafting: list[tuple[ScheduledRequest, int]] = []  # requests with drafts, and their first logit row

    @classmethod
    def draw(
        cls, sampler: Sampler, out: SchedulerOutput, logits: torch.Tensor, timers: dict[str, float]
    ) -> SampledOutput:
        """The step's plain rows drawn on the device, not waited for: a request's j-th sample draws from its
        seed + j; a request with drafts is left to ``verify_drafts``."""
        keys, params, offsets, owners, rows = [], [], [], [], []
        drafting: list[tuple[ScheduledRequest, int]] = []
        row = 0
        for s in out.scheduled:
            if s.spec_token_ids:
                drafting.append((s, row))
                row += len(s.spec_token_ids) + 1
                continue
            root, first = s.sample_key
            for j in range(s.num_samples):  # the j-th sample of a request draws from seed + j
                keys.append((root, first + j))
                offsets.append(first + j)
                params.append(s.sampling_params)
                owners.append(s.request_id)
                rows.append(row)
                row += 1
        if row != logits.shape[0]:
            raise RuntimeError(
                f"the step has {logits.shape[0]} sampling rows but its requests need {row} (with speculative "
                "decoding, a row per draft: a plugged-in step_inputs must add them)"
            )
        plain = logits if not drafting else logits[rows]
        pending = cls(sampler.sample_on_device(plain, keys, params, offsets), owners, timers)
        pending.drafting = drafting
        return pending

    def verify_drafts(self, sampler: Sampler, logits: torch.Tensor) -> None:
        """The tokens each request with drafts emits (``sampler.verify``), or why it has none. Waits for the
        device: verification reads the tokens one by one."""
        for s, first_row in self.drafting:
            verified, why = verify(
                sampler, logits[first_row : first_row + len(s.spec_token_ids) + 1], s.spec_token_ids,
                s.sample_key, s.sampling_params, s.sample_key[1],
            )  # fmt: skip
            if why is not None:
                self.errors[s.request_id] = why
            else:
                self.verified[s.request_id] = verified

    def result(self) -> RunnerOutput:
        t0 = time.perf_counter()
        with span("gpu_wait"):  # the CPU waits for the GPU's kernels: neither glue nor a launch
            tokens, errors = self.drawn.to_host()
        self.timers["model"] += time.perf_counter() - t0  # the model's time the launch did not see
        result = RunnerOutput(sampled=dict(self.verified), errors=dict(self.errors))
        for row, (rid, token) in enumerate(zip(self.owners, tokens)):
            if row in errors:
                result.errors.setdefault(rid, errors[row])
            else:
                assert token is not None  # a row without an error has its token
                result.sampled.setdefault(rid, []).append(token)
        for rid in result.errors:  # a request with a failed row samples nothing this step
            result.sampled.pop(rid, None)
        return result
