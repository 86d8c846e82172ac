"""Exercise 13 — speculative decoding by prompt lookup: drafters and acceptance rules a learner gets wrong.

``propose_by_index`` is a right drafter written differently from the solution notebook's (which tries each n from
the longest down): it indexes every earlier end position by how far back it agrees with the suffix, then takes the
earliest of the longest. ``accept_by_zip`` is a right rule written with ``zip``. Both are graded for full marks as
the mutants' helpers; each mutant below is one mistake away from one of them.
"""

from __future__ import annotations

from . import mutant

CHECKS = {
    "propose": ["check_propose", "check_draft_twin"],
    "accept": ["check_accept", "check_accept_twin"],
}


def _agreement(token_ids: list[int], end: int, max_n: int) -> int:
    """How many tokens, up to max_n, the n-gram ending at ``end`` shares with the suffix."""
    n = 0
    while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[len(token_ids) - 1 - n]:
        n += 1
    return n


def propose_by_index(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(token_ids)
    ends = [(_agreement(token_ids, e, min(max_n, num - 1)), -e) for e in range(num - 1)]
    if not ends:
        return []
    n, neg_end = max(ends)
    return token_ids[-neg_end + 1 : -neg_end + 1 + k] if n >= min_n else []


def accept_by_zip(drafts: list[int], model_tokens: list[int]) -> list[int]:
    out = []
    for draft, token in zip([*drafts, None], model_tokens):
        out.append(token)
        if token != draft:
            break
    return out


HELPERS: dict = {"propose": propose_by_index, "accept": accept_by_zip}


@mutant("propose", "the shortest matching n wins, not the longest: drafts follow a weaker match")
def shortest_n(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(token_ids)
    for n in range(min_n, min(max_n, num - 1) + 1):  # MISTAKE: from max_n down
        for end in range(n - 1, num - 1):
            if token_ids[end - n + 1 : end + 1] == token_ids[num - n :]:
                return token_ids[end + 1 : end + 1 + k]
    return []


@mutant("propose", "the latest occurrence wins; the rule (vLLM's too) takes the earliest")
def latest_occurrence(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(token_ids)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for end in range(num - 2, n - 2, -1):  # MISTAKE: from the earliest end
            if token_ids[end - n + 1 : end + 1] == token_ids[num - n :]:
                return token_ids[end + 1 : end + 1 + k]
    return []


@mutant("propose", "the suffix matches itself: the search runs up to the last position, which nothing follows")
def matches_itself(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(token_ids)
    for n in range(min(max_n, num), min_n - 1, -1):
        for end in range(n - 1, num):  # MISTAKE: an occurrence must end before the last position
            if token_ids[end - n + 1 : end + 1] == token_ids[num - n :]:
                return token_ids[end + 1 : end + 1 + k]
    return []


@mutant("propose", "every token after the match is proposed: k is not a cap")
def no_cap(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    num = len(token_ids)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for end in range(n - 1, num - 1):
            if token_ids[end - n + 1 : end + 1] == token_ids[num - n :]:
                return token_ids[end + 1 :]  # MISTAKE: [end + 1 : end + 1 + k]
    return []


@mutant("accept", "the drafts after the first wrong one are kept too")
def keeps_later_drafts(drafts: list[int], model_tokens: list[int]) -> list[int]:
    return [t for i, t in enumerate(model_tokens) if i == len(drafts) or t == drafts[i]]  # MISTAKE: stop at a miss


@mutant("accept", "no bonus token: when every draft is right, the model's last token is dropped")
def no_bonus(drafts: list[int], model_tokens: list[int]) -> list[int]:
    out = []
    for draft, token in zip(drafts, model_tokens):  # MISTAKE: the row after the last draft emits a token too
        out.append(token)
        if token != draft:
            break
    return out or model_tokens[:1]


@mutant("accept", "the wrong draft emitted instead of the model's token at the first disagreement")
def emits_the_draft(drafts: list[int], model_tokens: list[int]) -> list[int]:
    out = []
    for i, token in enumerate(model_tokens):
        if i < len(drafts) and token != drafts[i]:
            out.append(drafts[i])  # MISTAKE: the model's token
            break
        out.append(token)
    return out
