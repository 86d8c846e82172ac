"""``SamplingParams``: how one request wants its tokens chosen and when it stops.

Named and shaped like vLLM's, so code written against minipaged reads the same there.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from .utils import check_int


def _real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    * ``temperature == 0`` means greedy (argmax), whatever top_k/top_p say.
    * ``top_k <= 0`` (or ``-1``) and ``top_p == 1`` switch those filters off.
    * ``seed`` makes one request's random draws reproducible whatever else is in the batch.
    * ``n > 1`` asks for several samples of the same prompt; they share the prompt's KV blocks.
    * a request stops at ``max_tokens``, at EOS unless ``ignore_eos``, or at any of ``stop_token_ids``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # Refuse bad values here, by name: a NaN temperature or a float seed would otherwise fail
        # deep inside the sampler, in the middle of a step, with the request still scheduled.
        check_int("max_tokens", self.max_tokens, 1)
        _real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        check_int("top_k", self.top_k, -1)
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)  # 0 means "off", as -1 does
        _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_int("n", self.n, 1)
        if self.seed is not None:  # sample i of n draws from seed + i: torch takes -2**63 .. 2**64 - 1
            check_int("seed", self.seed, -(2**63), 2**64 - self.n)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {stops!r}")
        stops = tuple(stops)
        for t in stops:
            check_int("stop_token_ids entry", t, 0)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
