"""Decode steps on a GPU replayed from CUDA graphs, one graph per batch-size bucket.

Why: a decode step of SmolLM2 on an H100 is about 400 small kernels (30 layers of projections, norms, RoPE,
the K/V write and attention), each a few microseconds of GPU work behind tens of microseconds of Python and
launch overhead: the first GPU run measured 58 % of the model's time in Python and glue. A CUDA graph records
the launches of one step once and replays them with one call, so the GPU runs back to back while Python waits
(vLLM's ``CUDAGraphRunner``; nano-vllm's ``capture_cudagraph``). The CPU has its own version of the idea, the
step program (``model/step_program.py``); both take the same bounded set of shapes::

    batch of n decodes -> bucket b = packed_rows(n)     (1..16, then 8 sizes an octave: 18, 20, ..., 256)
    static inputs [b]  <- this step's n rows, then b - n padding rows
                          (token 0, position 0, slot -1: nothing written, seq_len 1 over block table row 0s)
    graph[b].replay()  -> static hidden states [b, hidden]; the step keeps rows [:n]

A graph replays exactly what it recorded: the same kernels, the same grid, the same memory. So everything that
changes from step to step is copied into tensors that live as long as the runner (``StaticInputs``), the block
tables keep their full width (``max_blocks_per_seq`` columns: the decode kernel's split count depends on it),
and only decode-only steps go through a graph; prefill chunks (their row counts and causal masks vary) run
eagerly, as in vLLM. Every bucket is captured when the engine starts (``capture_all``, largest first, within
``CAPTURE_BUDGET_S``; vLLM's ``capture_model``), so the first requests do not pay for it; a bucket left out
is captured the first time a step needs it (at most ``len(capture_sizes)`` graphs, sharing one memory pool).
Capture is an optimisation: if it fails (an operation that cannot be captured, say), the runner logs one
line, turns itself off and the steps run eagerly.

Not used: on a CPU, under tensor parallelism, with a learner's attention kernel plugged in, or with
``enforce_eager=True`` (vLLM's name for the same switch).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from .attention import SEAM as ATTENTION_SEAM
from .attention import AttentionMetadata
from .layers import packed_rows

if TYPE_CHECKING:
    from .llama import LlamaForCausalLM

log = logging.getLogger("minipaged")
CAPTURE_BUDGET_S = 120.0  # start-up capture stops here; a bucket left out is captured on its first step


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode step is padded to (``packed_rows`` of 1 .. ``max_num_seqs``): one graph each."""
    return sorted({packed_rows(n) for n in range(1, max_num_seqs + 1)})


class StaticInputs:
    """The tensors a graph reads, sized for the largest bucket; a step copies its rows in and pads the rest."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one row each, always
        self.block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, rows: int) -> None:
        """This step's n rows, then padding up to ``rows``: nothing is written for them, and they read block 0
        (the null block) for one token, so their outputs are finite and thrown away."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()  # an earlier, wider step's blocks must not stay behind
        self.input_ids[n:rows].zero_()
        self.positions[n:rows].zero_()
        self.slot_mapping[n:rows].fill_(-1)
        self.seq_lens[n:rows].fill_(1)
        self.block_tables[n:rows].zero_()

    def metadata(self, rows: int) -> AttentionMetadata:
        """A decode step of ``rows`` sequences over these tensors (what a graph of that bucket records)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self.block_tables[:rows],
            seq_lens=self.seq_lens[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: rows + 1],
            max_query_len=1,
        )


class CUDAGraphRunner:
    """Runs a model's decode steps from captured CUDA graphs (see the module docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.inputs = StaticInputs(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> (graph, its output)
        self.pool: Any = None  # the memory pool every graph shares (a handle from the first graph)
        self.replays = 0
        self.off_reason: str | None = None

    def bucket(self, num_rows: int) -> int | None:
        """The captured size a step of ``num_rows`` decodes runs at, or None when it is too big for any."""
        rows = packed_rows(num_rows)
        return rows if rows <= self.sizes[-1] else None

    def why_not(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> str | None:
        """None when this step can replay a graph; else why it runs eagerly."""
        if self.off_reason is not None:
            return self.off_reason
        if not meta.is_decode_only:
            return "not a decode-only step"
        if self.bucket(input_ids.shape[0]) is None:
            return f"{input_ids.shape[0]} decodes: more than the largest captured batch ({self.sizes[-1]})"
        if meta.block_tables.shape[1] > self.max_blocks_per_seq:
            return "a block table wider than max_blocks_per_seq"
        if ATTENTION_SEAM.replaced():
            return "a learner's attention kernel is plugged in"
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states ``[n, hidden]``, from a graph (captured now if this is its bucket's first
        step). The caller has checked ``why_not``; on a failed capture the step runs eagerly."""
        n = input_ids.shape[0]
        rows = self.bucket(n)
        assert rows is not None
        self.inputs.fill(input_ids, positions, meta, rows)
        if rows not in self.graphs:
            try:
                self._capture(rows)
            except Exception as e:  # an op that cannot be captured: this engine runs eagerly from now on
                self.off_reason = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                log.warning("minipaged: CUDA graphs off: %s; decode steps run eagerly", self.off_reason)
                torch.cuda.synchronize()
                return self.model(input_ids, positions, self.kv_caches, meta)
        graph, out = self.graphs[rows]
        graph.replay()
        self.replays += 1
        return out[:n]

    def capture_all(self, budget_s: float = CAPTURE_BUDGET_S) -> tuple[int, float]:
        """Capture every bucket now, largest first (the shared pool is sized by the largest), on padding rows
        only: slot -1, so nothing is written to the cache. Stops at a failed capture (the runner is then off, as
        when a step's capture fails) or when ``budget_s`` has run out. Returns (graphs captured, seconds)."""
        t0 = time.perf_counter()
        for rows in reversed(self.sizes):
            if self.off_reason is not None or time.perf_counter() - t0 > budget_s:
                break
            if rows in self.graphs:
                continue
            self.inputs.fill(self.inputs.input_ids[:0], self.inputs.positions[:0], self.inputs.metadata(0), rows)
            try:
                self._capture(rows)
            except Exception as e:
                self.off_reason = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
                log.warning("minipaged: CUDA graphs off: %s; decode steps run eagerly", self.off_reason)
        return len(self.graphs), time.perf_counter() - t0

    def _capture(self, rows: int) -> None:
        """Record the model's forward pass on the static inputs of ``rows`` sequences.

        The inputs already hold this step's rows, so the warm-up pass (on a side stream, as PyTorch asks: it
        compiles the Triton kernels and settles the allocator) computes this step for real, and the replay that
        follows computes it again: the same K/V to the same slots, the same hidden states."""
        ids, pos = self.inputs.input_ids[:rows], self.inputs.positions[:rows]
        meta = self.inputs.metadata(rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(ids, pos, self.kv_caches, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(ids, pos, self.kv_caches, meta)
        self.pool = graph.pool()
        self.graphs[rows] = (graph, out)
