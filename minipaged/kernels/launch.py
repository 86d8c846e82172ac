"""What a Triton wrapper decides before it launches: tiles, warps, grid, arguments.

Each wrapper (``reshape_and_cache``, ``paged_decode_attention``,
``paged_prefill_attention``) is split in two: a *planner* that checks nothing and
launches nothing but returns the list of ``Launch`` it would make, and the wrapper,
which validates its arguments and runs that list. The compile report
(``minipaged.classroom.kernel_report``) calls the same planners on example tensors and
compiles each ``Launch`` for an NVIDIA GPU instead of running it, so what it reports
is exactly what the wrapper launches: the same constexprs, the same ``num_warps``, the
same argument specialisation.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .validation import _TRUTHY


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of one kernel configuration (one row of a kernel's table)."""

    tile_n: int  # keys per K/V tile (attention), or 0 where the kernel has no key loop
    num_warps: int
    num_stages: int
    block_m: int = 0  # prefill: new tokens per query tile


@dataclass(frozen=True)
class Launch:
    """One kernel launch, fully decided."""

    kernel: Any  # a triton JITFunction (or the interpreter's wrapper of one)
    grid: tuple[int, ...]
    args: tuple
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


def is_half(dtype: torch.dtype) -> bool:
    """fp16 and bf16 share a tile table: same bytes per element, same tensor-core path."""
    return dtype in (torch.float16, torch.bfloat16)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs are multiplied in full fp32 ("ieee"): no silent TF32 rounding of the engine's default dtype."""
    return "ieee" if dtype == torch.float32 else "tf32"


@contextlib.contextmanager
def learner_dots(device: torch.device) -> Iterator[dict[str, str]]:
    """Launch a learner's kernel on ``device`` inside this, with the options it yields: fp32 ``tl.dot`` in fp32.

    On an NVIDIA GPU Triton multiplies fp32 tiles in TF32 unless told otherwise (10 bits of mantissa: errors near
    1e-3, ten times a puzzle's tolerance); the interpreter on a CPU multiplies in fp32, and the package's kernels pass
    ``input_precision`` (:func:`dot_precision`). A learner's plain ``tl.dot(q, k)`` reads ``TRITON_F32_DEFAULT`` when
    it is compiled (Triton 3.x; the variable is in Triton's compile-cache key), and the launch option gives the
    launch its own entry in the kernel's in-memory cache, so a copy compiled earlier in TF32 is not reused. One
    answer is then graded the same on both machines."""
    if device.type != "cuda" or torch.version.hip:
        yield {}
        return
    before = os.environ.get("TRITON_F32_DEFAULT")
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    try:
        yield {"default_dot_input_precision": "ieee"}
    finally:
        if before is None:
            os.environ.pop("TRITON_F32_DEFAULT", None)
        else:
            os.environ["TRITON_F32_DEFAULT"] = before


def check_tile_n(tile_n: int, block_size: int) -> int:
    """An explicit key tile (experiments, chapter 05): a power of two >= 16 that divides the block or is a
    whole number of blocks."""
    if isinstance(tile_n, bool) or not isinstance(tile_n, int) or tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n!r}")
    if block_size % tile_n and tile_n % block_size:
        raise ValueError(f"tile_n={tile_n} must divide block_size={block_size} or be a multiple of it")
    return tile_n


def kv_tile_n(block_size: int, cap: int, *, span_blocks: bool = True) -> int:
    """Keys per K/V tile: the kernel table's ``cap`` (a power of two >= 16, ``tl.dot``'s minimum on a GPU).

    A tile is either a slice of one block or a run of whole blocks, so that it reads each block's table entry
    once. With a power-of-two block size every power-of-two tile is one of the two: at block 16 a tile of 32
    keys spans two blocks (two lookups), at block 64 it is half of one. A block size that is a multiple of 16
    but not a power of two (48, 80, ...) takes the largest power of two <= cap that divides it.
    ``span_blocks=False`` keeps the tile inside one block (blocks under 16 tokens aside).
    """
    if block_size < 1 or (block_size % 16 and 16 % block_size):
        raise ValueError(
            f"the Triton attention kernels need a block_size that divides 16 or is a multiple of 16, got {block_size}"
        )
    if not span_blocks:
        cap = min(cap, max(16, block_size))
    if block_size & (block_size - 1) == 0:
        return cap
    tile = 16
    while tile * 2 <= cap and block_size % (tile * 2) == 0:
        tile *= 2
    return tile


@functools.lru_cache(maxsize=16)  # planned once a step: ask the driver once per device
def cuda_arch(device: torch.device) -> str | None:
    """``sm_XY`` of a CUDA device; None elsewhere (Triton's interpreter runs the kernels on the CPU)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def has_tensor_cores(arch: str | None) -> bool:
    """Whether Triton compiles a half-precision ``tl.dot`` to tensor-core instructions there: sm_80 and later
    (below, and for fp32 "ieee" products everywhere, it emits FMA instructions). None (no GPU) counts as yes:
    the tables describe the GPUs the engine is tuned for."""
    return arch is None or int(arch.removeprefix("sm_").rstrip("a")) >= 80


def kernel_device() -> torch.device:
    """Where the tensors a Triton kernel is launched on must live: ``cuda`` where kernels are compiled (a CUDA GPU
    and ``TRITON_INTERPRET`` not on), else ``cpu``, where Triton's interpreter runs them. A compiled kernel reads
    GPU memory only, so the exercises' checks and demo cells build every tensor on this device."""
    interpreting = os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY
    return torch.device("cuda") if torch.cuda.is_available() and not interpreting else torch.device("cpu")


# What a launch says when a tensor lives where the kernel cannot read it: Triton's compiled launcher on a CPU
# tensor ("Pointer argument cannot be accessed from Triton (cpu tensor?)"), PyTorch mixing devices.
_DEVICE_ERRORS = ("cannot be accessed from Triton", "(cpu tensor?)", "Expected all tensors to be on the same device")
DEVICE_PROBLEM = "a tensor on the wrong device reached the kernel"  # how device_problem's sentence starts


def device_problem(exc: BaseException) -> str | None:
    """The sentence for a launch error about *where* a tensor lives, else None. Such an error says nothing about a
    kernel's addressing, so it is reported as itself, never followed by hints about padding or strides."""
    text = f"{type(exc).__name__}: {exc}"
    if not any(marker in text for marker in _DEVICE_ERRORS):
        return None
    return (
        f"{DEVICE_PROBLEM} ({text}): here kernels run on {kernel_device()} "
        "and every tensor the checks pass is there; a tensor your code creates must be too (device=key.device)"
    )
