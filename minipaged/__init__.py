"""minipaged: a paged-KV-cache inference engine, built chapter by chapter.

Each module is one concept of the course (see README.md): ``kv_math`` (chapter 01), ``workloads`` and
``contiguous`` (02), ``block_pool`` (03), ``block_table`` and ``kv_cache_manager`` (04), ``kernels`` (05),
``request`` and ``scheduler`` (06-08), ``cache_engine`` (07), ``model``, ``model_runner`` and ``engine`` (09);
``viz`` holds the widgets and ``grading`` the exercise checks.

``LLM`` and ``SamplingParams`` are imported lazily so that ``import minipaged`` stays light.
"""

import os
from typing import Any

# OpenMP threads that spin while they wait make PyTorch 10-20x slower on a laptop whose cores are busy with
# something else (measured: a 16-request engine run took 5.5 s alone and 50-105 s beside another job, 5.8 s
# with passive waiting). It only takes effect if set before torch starts its OpenMP runtime; set it yourself
# (e.g. OMP_WAIT_POLICY=ACTIVE for a benchmark on an idle machine) and this leaves it alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from .engine import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'minipaged' has no attribute {name!r}")
