"""Paged-attention kernels (chapter 05): PyTorch references and their Triton twins.

Three operations, each in three implementations with the same signature::

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)                        # in place
    paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale)        -> out
    paged_prefill_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale) -> out

``reference`` defines what they compute in plain PyTorch, one sequence at a time;
``torch_backend`` computes the same, batched and planned once per step (the engine's CPU
path); the modules ``cache_write``, ``paged_decode`` and ``paged_prefill`` hold the Triton kernels, whose
wrappers this package exports under the operations' names (a module is never named as a function it exports:
``minipaged.kernels.reshape_and_cache`` is the function, whichever import ran first). Pick a family with
:func:`get_attention_backend`.

Triton without a GPU: Triton decides, when a ``@triton.jit`` function is *defined*,
whether it will be compiled for the GPU or run by the interpreter (``TRITON_INTERPRET=1``:
numpy, one program after another), and ``triton.language`` defines its own helpers
(``tl.zeros``, ``tl.sum``, ...) when ``triton`` is first imported. So the variable must
be set before anything imports triton. On a machine without CUDA, compiling is
impossible, and this package sets ``TRITON_INTERPRET=1`` on import, before importing
triton, unless the variable is already set (``TRITON_INTERPRET=0`` opts out) or triton
was imported first (then the Triton wrappers raise an error saying so). Import
``minipaged.kernels`` first, and your own ``@triton.jit`` kernels are interpreted too.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ..config import ATTENTION_BACKENDS
from . import reference, torch_backend
from .cache_write import reshape_and_cache
from .paged_decode import paged_decode_attention
from .paged_prefill import paged_prefill_attention
from .validation import triton_interpreter_ready as triton_interpreting


def triton_available() -> bool:
    """True when the Triton kernels can run here: compiled on a CUDA GPU, or in the interpreter."""
    return torch.cuda.is_available() or triton_interpreting()


class AttentionBackend(NamedTuple):
    """The three paged operations of one implementation family."""

    name: str
    reshape_and_cache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]


BACKENDS = ATTENTION_BACKENDS


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """``"torch"`` (``torch_backend``, the tuned PyTorch path), ``"triton"`` (the kernels) or ``"auto"``:
    Triton on a CUDA GPU, else torch.

    The interpreter makes Triton correct but slow on a CPU (every program runs one
    after another in numpy), so ``"auto"`` only picks it where it is compiled.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if torch.cuda.is_available() and not triton_interpreting() else "torch"
    if name == "triton":
        if not triton_available():
            raise ValueError(
                "the Triton backend needs a CUDA GPU, or the interpreter: TRITON_INTERPRET=1 set "
                "before triton is first imported (importing minipaged.kernels first does it)"
            )
        return AttentionBackend("triton", reshape_and_cache, paged_decode_attention, paged_prefill_attention)
    return AttentionBackend(
        "torch",
        torch_backend.reshape_and_cache,
        torch_backend.paged_decode_attention,
        torch_backend.paged_prefill_attention,
    )


__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "get_attention_backend",
    "paged_decode_attention",
    "paged_prefill_attention",
    "reference",
    "reshape_and_cache",
    "torch_backend",
    "triton_available",
    "triton_interpreting",
]
