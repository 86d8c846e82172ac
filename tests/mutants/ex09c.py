"""Exercise 09c — the sampler beyond greedy: masks and samplers a learner gets wrong, each one mistake from a right one.

``mask_ascending`` is a right mask written differently from the solution notebook's (which ranks the row largest
first and drops a token when the probability before it reaches top_p): it ranks smallest first, as vLLM's
``topk_topp_sampler.py`` does, and drops the tokens whose cumulative probability from the bottom stays within
``1 - top_p``. ``RowSampler`` is a right sampler that refuses bad rows for the whole batch up front and keeps its
streams in a ``dict`` filled with ``setdefault``-style lookups. Both are graded for full marks as the mutants'
helpers; each sampler mutant below changes one method of ``RowSampler``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from minipaged.sampling_params import SamplingParams

from . import mutant

CHECKS = {
    "apply_top_k_top_p": ["check_mask"],
    "Sampler": ["check_streams", "check_distribution", "check_sample_smollm2"],
}
NEG = float("-inf")


def mask_ascending(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    ranked, order = logits.sort()  # smallest first
    drop = torch.zeros_like(logits, dtype=torch.bool)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        drop |= ranked < ranked[vocab - top_k]  # below the k-th largest value: ties with it stay
    if top_p < 1.0:
        from_bottom = ranked.masked_fill(drop, NEG).softmax(-1).cumsum(-1)
        drop |= from_bottom <= 1 - top_p  # what the tokens at or below it hold leaves at least top_p above them
        drop[-1] = False  # the largest always stays
    return logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), NEG)


class RowSampler:
    """A right sampler: bad rows refused before any draw, one generator per key made on its first draw."""

    def __init__(self) -> None:
        self.streams: dict[Hashable, torch.Generator] = {}

    def forget(self, key: Hashable) -> None:
        if key in self.streams:
            del self.streams[key]

    def refuse(self, logits: torch.Tensor, keys: Sequence[Hashable]) -> None:
        bad = logits.isnan().any(-1) | logits.isposinf().any(-1) | logits.isneginf().all(-1)
        for i in bad.nonzero().flatten().tolist():
            raise ValueError(f"row {i} ({keys[i]!r}) has no finite largest logit")

    def stream(self, key: Hashable, row: int, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        if p.seed is None:
            return None
        g = self.streams.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(p.seed)
            self.streams[key] = g
        return g

    def probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return torch.softmax(mask_ascending(row.float() / p.temperature, p.top_k, p.top_p), dim=-1)

    def __call__(self, logits: torch.Tensor, keys: Sequence[Hashable], params: Sequence[SamplingParams]) -> list[int]:
        self.refuse(logits, keys)
        out = []
        for i, p in enumerate(params):
            if p.temperature == 0:
                out.append(int(torch.argmax(logits[i])))
            else:
                g = self.stream(keys[i], i, p, logits.device)
                out.append(int(torch.multinomial(self.probs(logits[i], p), 1, generator=g).item()))
        return out


HELPERS: dict = {"apply_top_k_top_p": mask_ascending, "Sampler": RowSampler}


# ---- apply_top_k_top_p -----------------------------------------------------------------------------------------
def _top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        return logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], NEG)
    return logits


@mutant("apply_top_k_top_p", "top-p drops the token that crosses top_p: the kept set holds less than top_p")
def drops_the_crossing_token(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    logits = _top_k(logits, top_k)
    if top_p < 1.0:
        ranked, order = torch.sort(logits, descending=True)
        drop = ranked.softmax(-1).cumsum(-1) > top_p  # MISTAKE: the probability held *before* the token
        drop[0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), NEG)
    return logits


@mutant("apply_top_k_top_p", "top-k keeps exactly k indices from torch.topk: logits tied with the k-th are dropped")
def top_k_drops_ties(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.topk(logits, top_k).indices] = True  # MISTAKE: every logit >= the k-th value stays
        logits = logits.masked_fill(~keep, NEG)
    return mask_ascending(logits, -1, top_p)


@mutant("apply_top_k_top_p", "top-p measured on the original row, not renormalised over what top-k left")
def top_p_before_top_k(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    nucleus = mask_ascending(logits, -1, top_p)  # MISTAKE: top-k first, then top-p on the survivors
    return _top_k(nucleus, top_k)


@mutant("apply_top_k_top_p", "the input row is masked in place (masked_fill_): the caller's logits change")
def masks_in_place(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    masked = mask_ascending(logits, top_k, top_p)
    return logits.masked_fill_(masked == NEG, NEG)  # MISTAKE: masked_fill, a new tensor


@mutant("apply_top_k_top_p", "top_p 1.0 is not switched off: rounding drops a tail whose probability sums to 1.0")
def top_p_one_still_on(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    logits = _top_k(logits, top_k)
    ranked, order = torch.sort(logits, descending=True)  # MISTAKE: only when top_p < 1.0
    probs = ranked.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p
    drop[0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), NEG)


@mutant("apply_top_k_top_p", "top_k above the vocabulary is passed to torch.topk, which refuses it")
def top_k_above_vocab(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:  # MISTAKE: and top_k < the vocabulary
        logits = logits.masked_fill(logits < torch.topk(logits, top_k).values[-1], NEG)
    return mask_ascending(logits, -1, top_p)


@mutant("apply_top_k_top_p", "vLLM's rule without its last line: a tiny top_p masks every token, the largest too")
def largest_can_go(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    logits = _top_k(logits, top_k)
    if top_p < 1.0:
        ranked, order = logits.sort()
        drop = ranked.softmax(-1).cumsum(-1) <= 1 - top_p  # MISTAKE: then drop[-1] = False, the largest stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), NEG)
    return logits


# ---- Sampler ---------------------------------------------------------------------------------------------------
@mutant("Sampler", "temperature after the mask: top-p is measured on the untempered distribution")
class TemperatureAfterMask(RowSampler):
    def probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return torch.softmax(mask_ascending(row, p.top_k, p.top_p) / p.temperature, -1)  # MISTAKE: divide first


@mutant("Sampler", "the logits multiplied by the temperature: 0.5 flattens instead of sharpening")
class TemperatureMultiplied(RowSampler):
    def probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return torch.softmax(mask_ascending(row * p.temperature, p.top_k, p.top_p), -1)  # MISTAKE: row / t


@mutant("Sampler", "softmax without the temperature: every sampled row drawn at temperature 1")
class NoTemperature(RowSampler):
    def probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        return torch.softmax(mask_ascending(row, p.top_k, p.top_p), -1)  # MISTAKE: row / p.temperature


@mutant("Sampler", "one generator for every seeded key: a request's tokens depend on the rows drawn before it")
class OneGeneratorForAll(RowSampler):
    def stream(self, key: Hashable, row: int, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        if p.seed is None:
            return None
        return super().stream("every key", row, p, device)  # MISTAKE: the key's own generator


@mutant("Sampler", "a new generator at every draw: the stream never advances, it repeats its first number")
class NewGeneratorEachDraw(RowSampler):
    def stream(self, key: Hashable, row: int, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        if p.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(p.seed)  # MISTAKE: made once per key, then kept


@mutant("Sampler", "generators kept by row number: a request that moves to another row draws from another stream")
class StreamPerRow(RowSampler):
    def stream(self, key: Hashable, row: int, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        return super().stream(row, row, p, device)  # MISTAKE: by key; rows change from step to step


@mutant("Sampler", "generators kept in the class: a fresh Sampler goes on with the old streams")
class StreamsInTheClass(RowSampler):
    shared: ClassVar[dict[Hashable, torch.Generator]] = {}

    def __init__(self) -> None:
        self.streams = StreamsInTheClass.shared  # MISTAKE: a dict of the instance's own


@mutant("Sampler", "forget does nothing: a forgotten key's next draw goes on with its old stream")
class ForgetKeepsTheStream(RowSampler):
    def forget(self, key: Hashable) -> None:
        pass  # MISTAKE: drop the key's generator


@mutant("Sampler", "unseeded rows get a fresh default torch.Generator(): every unseeded draw is the same")
class UnseededFixedGenerator(RowSampler):
    def stream(self, key: Hashable, row: int, p: SamplingParams, device: torch.device) -> torch.Generator | None:
        if p.seed is None:
            return torch.Generator(device=device)  # MISTAKE: None, torch's global generator
        return super().stream(key, row, p, device)


@mutant("Sampler", "any -inf refuses the row: a masked vocabulary counts as a model failure")
class RefusesMaskedTokens(RowSampler):
    def refuse(self, logits: torch.Tensor, keys: Sequence[Hashable]) -> None:
        for i, row in enumerate(logits):
            if not torch.isfinite(row).all():  # MISTAKE: only the row's largest logit must be finite
                raise ValueError(f"row {i} ({keys[i]!r}) is not finite")


@mutant("Sampler", "no check for bad rows: NaN reaches multinomial (RuntimeError) and argmax (a token)")
class NoBadRowCheck(RowSampler):
    def refuse(self, logits: torch.Tensor, keys: Sequence[Hashable]) -> None:
        pass  # MISTAKE: a row whose largest logit is NaN, +inf or -inf raises ValueError naming its key


@mutant("Sampler", "the temperature divides a view of the caller's logits in place")
class DividesInPlace(RowSampler):
    def probs(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        row /= p.temperature  # MISTAKE: row / p.temperature, a new tensor
        return torch.softmax(mask_ascending(row, p.top_k, p.top_p), -1)
