"""minipaged: a paged-KV-cache inference engine, built chapter by chapter.

One module per concept, in layers (``site/guide/layout.md``): the base modules here (``config``, ``kv_math``,
``hooks``, ...), then ``core/`` (block pool, requests, KV cache managers, scheduler), ``kernels/``, ``model/``,
``worker/`` (model runner, cache engine, executors), ``engine/`` (``LLM``), ``serving/`` and ``lab/``, and
``classroom/`` (parts, grading, widgets). A module's old flat path still imports it, with a warning naming its
new home (``old_paths``).

``LLM`` and ``SamplingParams`` are imported lazily so that ``import minipaged`` stays light.
"""

import os
import sys
from typing import Any

from . import old_paths

# PyTorch's OpenMP threads spin about 6 ms between parallel regions instead of sleeping at once: a step runs 1.6x
# faster on a VM, and an idle engine still sleeps (worker/cpu_threads.py, with the measurements). It only takes
# effect before torch loads its OpenMP runtime; set OMP_WAIT_POLICY or GOMP_SPINCOUNT yourself and this leaves
# both alone. The engine says once if torch came first; `python -m minipaged serve` keeps them sleeping.
_SPIN_SET = _SPIN_AFTER_TORCH = False
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000000"
    _SPIN_SET, _SPIN_AFTER_TORCH = True, "torch" in sys.modules

old_paths.install()

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'minipaged' has no attribute {name!r}")
