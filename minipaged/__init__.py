"""minipaged: a paged-KV-cache inference engine, built chapter by chapter.

One module per concept, in layers (``site/guide/layout.md``): the base modules here (``config``, ``kv_math``,
``hooks``, ...), then ``core/`` (block pool, requests, KV cache managers, scheduler), ``kernels/``, ``model/``,
``worker/`` (model runner, cache engine, executors), ``engine/`` (``LLM``), ``serving/`` and ``lab/``, and
``classroom/`` (parts, grading, widgets). A module's old flat path still imports it, with a warning naming its
new home (``old_paths``).

``LLM`` and ``SamplingParams`` are imported lazily so that ``import minipaged`` stays light.
"""

import os
from typing import Any

# OpenMP threads that spin while they wait make PyTorch 10-20x slower on a laptop whose cores are busy with
# something else (measured: a 16-request engine run took 5.5 s alone and 50-105 s beside another job, 5.8 s
# with passive waiting). It only takes effect if set before torch starts its OpenMP runtime; set it yourself
# (e.g. OMP_WAIT_POLICY=ACTIVE for a benchmark on an idle machine) and this leaves it alone.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from . import old_paths

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
