"""``SamplingParams``: how one request wants its tokens chosen and when it stops.

Named and shaped like vLLM's, so code written against minipaged reads the same there.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or (self.top_k < -1):
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
