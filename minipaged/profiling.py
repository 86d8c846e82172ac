"""Named spans for PyTorch's profiler, at the lowest cost it offers.

The engine names a few spans so that a profile can tell its kernels from its glue (``benchmarks/bench_engine.py``
splits the model's time with them): ``model`` (a step's forward pass and LM head, ``ModelRunner.forward_step``),
``paged_attention`` and, under a profiler only, ``rms_norm`` (the compiled calls are ctypes calls, which the
profiler does not see). ``torch.profiler.record_function`` costs about 5 µs a span, 3 of them inside the span;
with some 90 spans a step, a profile would show kernel time that is the profiler's own. The profiler's fast span,
``torch._C._profiler._RecordFunctionFast`` (what torch.compile's generated code uses), costs about 0.5 µs, 0.1
inside. It is private: where a PyTorch release lacks it, ``span`` is the public ``record_function``
(``tests/test_private_api_fallbacks.py`` takes it away).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch


def _fast_span() -> Callable[[str], AbstractContextManager[Any]] | None:
    """The private fast span, if this PyTorch has it and it works as a context manager."""
    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    if fast is None:
        return None
    try:
        with fast("minipaged.probe"):
            pass
    except Exception:  # a changed signature: the public span instead
        return None
    return fast


_FAST = _fast_span()


def span(name: str) -> AbstractContextManager[Any]:
    """A profiler span called ``name`` (nothing is recorded when no profiler runs)."""
    return _FAST(name) if _FAST is not None else torch.profiler.record_function(name)


def profiling() -> bool:
    """True while a PyTorch profiler records this thread: spans that cost µs are opened only then."""
    return bool(torch.autograd.profiler._is_profiler_enabled)
