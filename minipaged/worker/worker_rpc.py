"""What an executor may ask every rank by name (``ExecutorBase.collective_rpc``; vLLM's ``collective_rpc`` calls
a worker's method by its name on every rank).

- ``WorkerRPC``: one rank's answers (its runner's): forget block tables, read K/V blocks, what it holds, its time
  in collectives, the cost of one all-reduce.

Why by name, and why so few: under tensor parallelism the question travels to the worker processes as a message
(``("call", method, args)``), and the answer comes back by pickle; a short list of named questions is what a
message can carry and what a rank can refuse cleanly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .model_runner import ModelRunner


class WorkerRPC:
    """One rank's answers to the executor's questions, by name: ``WorkerRPC(runner)("comm")``."""

    METHODS = frozenset({"drop_tables", "kv_blocks", "rank_info", "comm", "time_all_reduce"})

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def __call__(self, method: str, *args: Any) -> Any:
        """This rank's answer to ``method(*args)``: one of ``METHODS``."""
        if method not in self.METHODS:
            raise AttributeError(f"no rank answers {method!r}: they answer {', '.join(sorted(self.METHODS))}")
        return getattr(self, method)(*args)

    def drop_tables(self, request_ids: list[str]) -> None:
        """Forget the block tables of requests that left (every rank keeps its own copy)."""
        self.runner.input_batch.drop(request_ids)

    def kv_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V of ``block_ids`` in ``layer``, copied to the CPU."""
        k, v = self.runner.cache.gpu_cache[layer]
        ids = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return k[ids].cpu(), v[ids].cpu()

    def rank_info(self) -> dict[str, Any]:
        """What this rank holds: its device, KV heads, bytes per block, its own pool and the agreed one."""
        return self.runner.rank_info

    def comm(self) -> dict[str, float]:
        """This rank's forward time and time in collectives so far (the benchmark's split of a step)."""
        tp = self.runner.tp
        return {
            "model_s": self.runner.timers["model"],
            "comm_s": 0.0 if tp is None else tp.comm_s,
            "num_all_reduces": 0 if tp is None else tp.num_all_reduces,
            "bytes_all_reduced": 0 if tp is None else tp.bytes_all_reduced,
        }

    def time_all_reduce(self, shape: tuple[int, ...], repeats: int) -> float:
        """Seconds per all-reduce of a ``shape`` tensor in the model's dtype, every rank taking part at once: the
        collective's own cost, without a slow rank to wait for (0 without tensor parallelism)."""
        runner, tp = self.runner, self.runner.tp
        if tp is None:
            return 0.0
        x = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        tp.all_reduce(x)  # the first one may set up buffers
        t0 = time.perf_counter()
        for _ in range(repeats):
            tp.all_reduce(x)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats
