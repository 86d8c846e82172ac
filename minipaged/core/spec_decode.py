"""Speculative decoding by prompt lookup: guess a request's next tokens from its own text, check them all in one
forward pass, keep the ones the model agrees with.

Why it can pay: a decode step reads every weight of the model to produce one token per request. While the batch
is small, that read, not the arithmetic, sets the step's time, so a step that feeds a request ``k + 1`` rows
costs about what a step with one row costs. If some of the ``k`` guessed tokens are right, one step yields
several tokens. When the batch is large the step is bound by arithmetic and the extra rows cost their full
price: speculation then loses whatever it guessed wrong (``benchmarks/bench_spec_decode.py`` measures both).

Where the guesses come from (prompt lookup, vLLM's ``vllm/v1/spec_decode/ngram_proposer.py``): the last ``n``
tokens are looked up earlier in the request's own context, and what followed them there is proposed::

    context   The cat sat on the mat . Repeat : The cat sat  [?]
    suffix    "The cat sat" (n = 3) occurred at position 0
    drafts    "on the mat ." (up to k tokens that followed it)

Copying, editing, summarising or answering questions about a given text repeat long stretches of it: that is
where lookup pays. vLLM's rule picks the longest ``n`` in ``[prompt_lookup_min, prompt_lookup_max]`` that
matches, at its earliest occurrence; so does ``NgramProposer`` here.

How one step checks them (the verification pass, ``verify`` in ``worker/sampler.py``: drafting is the
scheduler's side, checking the runner's)::

    rows        x      d0     d1     d2        x: the request's last real token; d: its drafts
    positions   p      p+1    p+2    p+3       K/V written for all four (slots allocated like any token)
    model says  y0     y1     y2     y3        yi: the token the model picks after row i

    y0 == d0, y1 != d1   ->  emit y0 (= d0) and y1; d1 and d2 are rejected
                             K/V of x and d0 stay; the slots of d1, d2 are given back
    every yi == di       ->  emit d0 d1 d2 and y3, the bonus token: 4 tokens from one step

Every emitted token is the model's own choice at its position given the tokens before it, which are the tokens
emitted: greedy decoding gives exactly the tokens it gives without speculation. With sampling, row ``i`` is
sampled as it would be without speculation, one row at a time, stopping at the first row whose token is not the
draft: each emitted token costs exactly one draw from its request's random stream, so a seeded request gets the
same tokens too, and any request the same distribution. (For drafts without probabilities of their own, that is
what the rejection sampler of Leviathan et al. 2023 reduces to: accept ``d`` with probability ``p(d)``, else
draw from ``p`` without ``d``; vLLM's ``vllm/v1/sample/rejection_sampler.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..config import SpeculativeConfig


class NgramProposer:
    """Draft tokens by prompt lookup (vLLM's ``NgramProposer``): no model, only the request's own tokens.

    The cost is a scan of each decoding request's context every step. Two things keep it small at hundreds of
    requests: ``propose_for`` keeps each running request's tokens as a numpy array that only grows (a request's
    tokens are only ever appended), so a step converts its new tokens, not the whole context; and the search is one
    vectorised comparison with the last token, then a few steps back from each place it occurs, not one scan per
    n-gram length.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None  # set by the config
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        # request id -> (the request, its tokens so far in a buffer that doubles, how many are filled)
        self._tokens: dict[str, tuple[object, np.ndarray, int]] = {}

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Up to ``min(k, max_drafts)`` tokens that followed the longest matching suffix (``min_n <= n <=
        max_n``) at its earliest earlier occurrence; ``[]`` when no suffix matches::

            token_ids [1, 2, 3, 4, 2, 3], n from 3 down to 2, k = 4
            n = 3: [4, 2, 3] occurs nowhere earlier
            n = 2: [2, 3] occurs at 1  ->  what followed: [4, 2, 3] (only three tokens follow)
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # Where an earlier n-gram could end: wherever the last token occurs before the end.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        ends = ends[ends >= self.min_n - 1]
        if not ends.size:
            return []
        # How far back each occurrence agrees with the suffix, up to max_n tokens (1: the last token itself).
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, num - 1)):
            before = ends - back
            alive &= before >= 0
            alive[alive] = tokens[before[alive]] == tokens[num - 1 - back]
            length += alive
            if not alive.any():
                break
        best = int(length.max())
        if best < self.min_n:
            return []
        start = int(ends[np.argmax(length == best)]) + 1  # the earliest of the longest
        return tokens[start : start + k].tolist()

    def propose_for(
        self, request_id: str, owner: object, token_ids: Sequence[int], max_drafts: int | None
    ) -> list[int]:
        """``propose`` for a running request, reading only the tokens it gained since its last call."""
        num = len(token_ids)
        entry = self._tokens.get(request_id)
        if entry is None or entry[0] is not owner or entry[2] > num:  # new, or another request with this id
            entry = (owner, np.empty(max(64, 2 * num), dtype=np.int64), 0)
        _, buf, filled = entry
        if num > buf.size:
            buf = np.concatenate([buf[:filled], np.empty(2 * num - filled, dtype=np.int64)])
        if num > filled:
            buf[filled:num] = token_ids[filled:num]
        self._tokens[request_id] = (owner, buf, num)
        return self.propose(buf[:num], max_drafts)

    def keep_only(self, request_ids: set[str]) -> None:
        """Forget the arrays of requests no longer running (bounded: the running requests' only)."""
        if len(self._tokens) > len(request_ids):
            self._tokens = {rid: e for rid, e in self._tokens.items() if rid in request_ids}


@dataclass
class SpecDecodingStats:
    """How speculation went so far (vLLM's ``SpecDecodingStats``, ``vllm/v1/spec_decode/metrics.py``).

    ``num_drafts`` counts verification passes (a request with at least one draft in a step), ``num_draft_tokens``
    the drafts checked, ``num_accepted_tokens`` those the model agreed with, ``num_accepted_tokens_per_pos[i]``
    how often draft ``i`` was accepted (each needs all before it accepted, so the counts fall with ``i``).
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts per draft checked (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification pass emits on average: the accepted drafts plus the model's own token (vLLM's
        "mean acceptance length"; 1.0 before any pass, and for a pass that accepts nothing)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict[str, float | int | list[int]]:
        return dict(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
        )
