"""Turn one row of logits per sequence into one token per sequence.

Greedy rows take the argmax. Sampled rows divide by the temperature, keep the
``top_k`` highest logits and the smallest set whose probability reaches
``top_p``, then draw. A request with a ``seed`` draws from its own generator, so
its tokens do not depend on which other requests share the batch.

``verify`` turns a request's verification rows into the tokens it emits when it speculated (the drafts come
from ``core/spec_decode.py``; the idea and its proof are in that module's docstring).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..sampling_params import SamplingParams


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
        drop_sorted[..., 0] = False  # rounding can leave the first above a tiny top_p: it stays whatever top_p is
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


class Sampler:
    """Keeps one ``torch.Generator`` per seeded sample stream, created on its first draw.

    A stream is named by a key: ``Request.sample_key``, ``(request id, sample index)``. The j-th
    sample of an ``n > 1`` request draws from ``seed + j``: its first token comes from the parent's
    step (row j of its first sample), the rest from the forked request with the same key.
    """

    def __init__(self) -> None:
        self._generators: dict[Hashable, torch.Generator] = {}

    def generator(
        self, key: Hashable, params: SamplingParams, device: torch.device, seed_offset: int = 0
    ) -> torch.Generator | None:
        if params.seed is None:
            return None
        g = self._generators.get(key)
        if g is None:
            g = self._generators[key] = torch.Generator(device=device).manual_seed(params.seed + seed_offset)
        return g

    def forget(self, key: Hashable) -> None:
        self._generators.pop(key, None)

    def __call__(
        self,
        logits: torch.Tensor,
        keys: Sequence[Hashable],
        params: Sequence[SamplingParams],
        seed_offsets: Sequence[int] | None = None,
    ) -> list[int]:
        tokens, errors = self.sample(logits, keys, params, seed_offsets)
        if errors:
            row, why = next(iter(errors.items()))
            raise ValueError(f"sample stream {keys[row]!r}: {why}")
        return tokens  # type: ignore[return-value]

    def sample(
        self,
        logits: torch.Tensor,
        keys: Sequence[Hashable],
        params: Sequence[SamplingParams],
        seed_offsets: Sequence[int] | None = None,
    ) -> tuple[list[int | None], dict[int, str]]:
        """One token per row, and ``{row: why}`` for the rows that cannot be sampled (their token is None).

        A row with NaN or +inf logits has no meaningful answer, greedy or not (argmax of NaN is
        the NaN): it is reported, not sampled, so the engine can finish that request alone.
        """
        return self.sample_on_device(logits, keys, params, seed_offsets).to_host()

    def sample_on_device(
        self,
        logits: torch.Tensor,
        keys: Sequence[Hashable],
        params: Sequence[SamplingParams],
        seed_offsets: Sequence[int] | None = None,
    ) -> DeviceSamples:
        """``sample`` without waiting for the device: every row's token stays on it (the next step may read them
        there, async scheduling), with two flags per row; ``to_host()`` brings all of it back in one copy."""
        if logits.shape[0] != len(params) or len(params) != len(keys):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(params)} requests")
        offsets = seed_offsets if seed_offsets is not None else [0] * len(keys)
        # One pass gives the greedy tokens and finds the bad rows: a row's max is NaN if it holds a NaN
        # (max propagates NaN), +inf if it holds +inf, -inf if every logit is -inf.
        top, tokens = logits.max(-1)
        finite = torch.isfinite(top)
        drawn_ok = torch.ones_like(finite)
        errors: dict[int, str] = {}
        for i, (key, p) in enumerate(zip(keys, params)):
            if p.greedy:
                continue
            row = apply_top_k_top_p(logits[i].float() / p.temperature, p.top_k, p.top_p)
            probs = row.softmax(-1)
            # A distribution multinomial cannot draw from (NaN logits, an extreme temperature) is flagged here and
            # replaced, so the draw itself never fails on the device; the flag reports the row after the copy.
            valid = torch.isfinite(probs).all() & (probs.sum() > 0)
            drawn_ok[i] = valid
            probs = torch.where(valid, probs, torch.ones_like(probs))
            try:
                g = self.generator(key, p, logits.device, offsets[i])
                tokens[i] = torch.multinomial(probs, 1, generator=g)[0]
            except RuntimeError as e:  # what the device refuses at once
                errors[i] = f"sampling failed: {e}"
        return DeviceSamples(tokens, torch.stack([finite, drawn_ok]), errors)


class DeviceSamples:
    """A step's sampled tokens, still on the device: ``tokens`` (one per row), and per row whether its logits
    were finite and whether its draw had a distribution to draw from. The copy back starts at once (into
    page-locked memory on a GPU); ``to_host()`` waits for it: the step's one host-device synchronisation."""

    def __init__(self, tokens: torch.Tensor, flags: torch.Tensor, errors: dict[int, str]) -> None:
        self.tokens, self.errors = tokens, errors
        packed = torch.cat([tokens[None], flags.to(tokens.dtype)])  # [3, rows]: one copy brings all of it
        if tokens.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._ready: torch.cuda.Event | None = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = packed, None

    def to_host(self) -> tuple[list[int | None], dict[int, str]]:
        if self._ready is not None:
            self._ready.synchronize()
        values, finite, drawn_ok = self._host.tolist()
        tokens: list[int | None] = list(values)
        errors = dict(self.errors)
        for i in range(len(tokens)):
            if not finite[i]:
                errors[i] = "the model produced NaN or infinite logits"
            elif not drawn_ok[i]:
                errors.setdefault(i, "sampling failed: the probabilities hold inf, NaN or only zeros")
            if i in errors:
                tokens[i] = None
        return tokens, errors


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    drafts: Sequence[int],
    key: Hashable,
    params: SamplingParams,
    seed_offset: int = 0,
) -> tuple[list[int], str | None]:
    """The tokens one request emits from its verification rows (``logits``: ``len(drafts) + 1`` rows, the
    last real token's and each draft's): the accepted drafts, then the model's token at the first mismatch or
    the bonus token. Returns ``(tokens, None)``, or ``([], why)`` when a row it needed cannot be sampled (NaN
    logits, say): the request then fails alone, as it would without speculation."""
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{logits.shape[0]} verification rows for {len(drafts)} drafts: need one more row")
    tokens: list[int] = []
    if params.greedy:  # no stream to spare: every row's argmax at once
        top, argmax = logits.max(-1)
        finite, targets = torch.isfinite(top).tolist(), argmax.tolist()
    for i in range(len(drafts) + 1):
        if params.greedy:
            if not finite[i]:
                return [], "the model produced NaN or infinite logits"
            token = targets[i]
        else:  # one draw per emitted token, in order: the stream advances as it does without speculation
            (drawn,), errors = sampler.sample(logits[i : i + 1], [key], [params], [seed_offset])
            if errors:
                return [], errors[0]
            assert drawn is not None  # a row without an error has its token
            token = drawn
        tokens.append(token)
        if i == len(drafts) or token != drafts[i]:
            break
    return tokens, None
