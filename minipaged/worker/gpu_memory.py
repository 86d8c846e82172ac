"""Device memory, as the engine's start-up and its error messages see it (vLLM: ``gpu_worker.py``'s memory
profiling, ``Worker.determine_available_memory``).

- ``GPUMemoryError``: an engine does not fit in what the card has free.
- ``track`` / ``untrack``: the runners of this process that hold device memory, so that a report can name them.
- ``free_device_memory``: hand PyTorch's caches back to the driver.
- ``gpu_memory_report``: what is free, what an engine needs, and which engines hold the rest, in words.
- ``profile_activation_peak``: one dummy full-budget prefill on a throw-away cache, its memory peak measured.
- ``num_gpu_blocks``: the KV pool that ``gpu_memory_utilization`` of the card leaves after the weights and that
  peak (chapter 01's start-up formula), refused by name if that memory is not free now.

Why a report that names engines: a learner who re-runs a notebook cell builds a second engine while the first
still holds the card; a traceback from deep inside the allocator tells them nothing, the line that says which
cell built the engine holding the memory does.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import TYPE_CHECKING, Protocol

import torch

from ..kv_math import format_bytes, num_blocks_at_startup
from ..model import AttentionMetadata
from ..utils import cdiv
from .cache_engine import CacheEngine

if TYPE_CHECKING:
    from ..config import Config
    from ..kv_math import KVSpec
    from ..model import LlamaForCausalLM


class GPUMemoryError(RuntimeError):
    """An engine does not fit in the GPU memory that this process's other engines (or other processes) leave."""


class HoldsDeviceMemory(Protocol):
    """What a report reads of a runner: where it was built, its device, and what it holds there."""

    device: torch.device
    released: bool
    created_at: str

    def held(self) -> str: ...


_LIVE: weakref.WeakSet[HoldsDeviceMemory] = weakref.WeakSet()  # runners holding device memory: named when one won't fit


def track(holder: HoldsDeviceMemory) -> None:
    """Name ``holder`` in reports from now on (until it is collected or ``untrack``-ed)."""
    _LIVE.add(holder)


def untrack(holder: HoldsDeviceMemory) -> None:
    """``holder`` gave its memory back: reports leave it out."""
    _LIVE.discard(holder)


def caller_site() -> str:
    """Where the user's code built the engine: the first frame outside this package (a notebook cell, a script)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # minipaged/
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def free_device_memory(device: torch.device) -> None:
    """Hand what PyTorch caches on ``device`` back to the driver: unreachable cycles collected, cuBLAS's
    per-stream workspaces (one per stream that ran a GEMM, a graph capture's side streams included) dropped,
    the caching allocator's free blocks released. A no-op on a CPU."""
    gc.collect()
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private, so looked up, not assumed
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def gpu_memory_report(device: torch.device, need: int | None = None) -> str:
    """What is free on ``device``, what this engine needs, and which engines of this process hold the rest."""
    free, total = torch.cuda.mem_get_info(device)
    lines = [f"{device} has {format_bytes(free)} free of {format_bytes(total)}"]
    if need is not None:
        lines[0] += f", and this engine needs {format_bytes(need)}"
    held = [r for r in list(_LIVE) if r.device == device and not r.released]
    for r in held:
        lines.append(f"  held by the engine built at {r.created_at}: {r.held()}")
    if held:
        lines.append(
            "Free one with llm.shutdown() (or drop every reference to it: del llm), or ask this one for less: "
            "kv_cache_memory='1GiB', a smaller gpu_memory_utilization, or num_gpu_blocks_override"
        )
    else:
        lines.append(
            "No engine of this process holds it: another process does (nvidia-smi lists them), or tensors of "
            "your own; ask this engine for less with kv_cache_memory='1GiB' or a smaller gpu_memory_utilization"
        )
    return "\n".join(lines)


@torch.inference_mode()
def profile_activation_peak(
    model: LlamaForCausalLM, num_tokens: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Run one dummy prefill of ``num_tokens`` tokens on a throw-away cache; measure the memory peak (vLLM's
    ``profile_run``): what a full-budget step needs beside the weights and the pool."""
    nb = cdiv(num_tokens, block_size) + 1
    cfg = model.config
    cache = CacheEngine(cfg.num_hidden_layers, nb, block_size, model.num_kv_heads, model.head_dim, dtype, device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    pos = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata(
        slot_mapping=pos + block_size,
        block_tables=torch.arange(1, nb, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens,
    )
    model.compute_logits(model(ids, pos, cache.gpu_cache, meta)[-1:])
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def num_gpu_blocks(
    config: Config, model: LlamaForCausalLM, page_spec: KVSpec, dtype: torch.dtype, device: torch.device
) -> int:
    """The blocks that ``gpu_memory_utilization`` of the card holds once the weights and the activation peak of
    one full-budget prefill are counted (vLLM: ``determine_available_memory``). That fraction is of the whole
    card, so it must be free now: a second engine in one process (a re-run notebook cell) meets the first one's
    pool here, and is told whose it is, rather than running out mid-allocation."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    activation_peak = profile_activation_peak(model, config.max_num_batched_tokens, config.block_size, dtype, device)
    total = torch.cuda.get_device_properties(device).total_memory
    num = num_blocks_at_startup(
        total, config.gpu_memory_utilization, weights, activation_peak, page_spec, config.block_size
    )
    need = num * page_spec.bytes_per_block(config.block_size) + activation_peak
    free_device_memory(device)  # an engine dropped in a reference cycle gives its memory back first
    if need > torch.cuda.mem_get_info(device)[0]:
        raise GPUMemoryError(
            f"gpu_memory_utilization={config.gpu_memory_utilization} sizes this engine's KV pool to "
            f"{num:,} blocks of the card's {format_bytes(total)}, but that memory is not free.\n"
            + gpu_memory_report(device, need)
        )
    return num
