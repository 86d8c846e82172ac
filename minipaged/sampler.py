"""Turn one row of logits per sequence into one token per sequence.

Greedy rows take the argmax. Sampled rows divide by the temperature, keep the
``top_k`` highest logits and the smallest set whose probability reaches
``top_p``, then draw. A request with a ``seed`` draws from its own generator, so
its tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) every logit of one row outside the top-k and the top-p nucleus."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


class Sampler:
    """Keeps one ``torch.Generator`` per seeded request, created on its first draw."""

    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator | None:
        if params.seed is None:
            return None
        g = self._generators.get(request_id)
        if g is None:
            seed = params.seed
            if "#" in request_id:  # the j-th extra sample of an n > 1 request ("id#j") draws its own stream
                seed += int(request_id.rsplit("#", 1)[1])
            g = self._generators[request_id] = torch.Generator(device=device).manual_seed(seed)
        return g

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        tokens, errors = self.sample(logits, request_ids, params)
        if errors:
            row, why = next(iter(errors.items()))
            raise ValueError(f"request {request_ids[row]!r}: {why}")
        return tokens  # type: ignore[return-value]

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
               ) -> tuple[list[int | None], dict[int, str]]:
        """One token per row, and ``{row: why}`` for the rows that cannot be sampled (their token is None).

        A row with NaN or +inf logits has no meaningful answer, greedy or not (argmax of NaN is
        the NaN): it is reported, not sampled, so the engine can finish that request alone.
        """
        if logits.shape[0] != len(params) or len(params) != len(request_ids):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        tokens: list[int | None] = logits.argmax(-1).tolist()  # greedy rows are done
        errors: dict[int, str] = {}
        bad_rows = (torch.isnan(logits) | (logits == float("inf"))).any(-1) | torch.isneginf(logits).all(-1)
        for i in bad_rows.nonzero().flatten().tolist():
            errors[i], tokens[i] = "the model produced NaN or infinite logits", None
        for i, (rid, p) in enumerate(zip(request_ids, params)):
            if p.greedy or i in errors:
                continue
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            try:
                tokens[i] = int(torch.multinomial(probs, 1, generator=self.generator(rid, p, logits.device)))
            except RuntimeError as e:   # e.g. an all-zero distribution after an extreme temperature
                errors[i], tokens[i] = f"sampling failed: {e}", None
        return tokens, errors
