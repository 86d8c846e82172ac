"""Checks for exercise 13: speculative decoding by prompt lookup — the n-gram drafter and the acceptance rule.

The learner writes two functions:

* ``propose(token_ids, k, min_n, max_n) -> list[int]``: the drafts of prompt lookup (vLLM's ``NgramProposer``):
  the longest suffix of ``n`` tokens (``min_n <= n <= max_n``) that occurred earlier in ``token_ids``, at its
  earliest occurrence, and up to ``k`` of the tokens that followed it there.
* ``accept(drafts, model_tokens) -> list[int]``: what one verification step emits under greedy decoding, given
  the drafts and the model's token after each of the ``len(drafts) + 1`` rows it ran: the drafts the model
  agreed with, then the model's own token (at the first disagreement, or the bonus token after the last draft).

``draft_twin`` and ``accept_twin`` compare them with the package's ``NgramProposer.propose`` and
``worker.sampler.verify`` on seeded random cases: short vocabularies, so that n-grams repeat, overlap and nest.
``speculate_smollm2`` runs a greedy generation loop on SmolLM2 that drafts with the learner's ``propose``, checks
the drafts with one forward pass, and emits what the learner's ``accept`` says: its tokens must be those of plain
greedy decoding, in fewer forward passes than tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from ...config import SpeculativeConfig
from ...core.spec_decode import NgramProposer
from ...sampling_params import SamplingParams
from ...worker.sampler import Sampler, verify
from .core import Check, CheckOutcome, report

Propose = Callable[[list[int], int, int, int], list[int]]
Accept = Callable[[list[int], list[int]], list[int]]


def package_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The package's drafter with these settings (vLLM's ``prompt_lookup_min`` / ``_max``)."""
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n)
    return NgramProposer(config).propose(token_ids)


def package_accept(drafts: list[int], model_tokens: list[int]) -> list[int]:
    """The package's greedy verification, given the model's token at each row (as one-hot logits)."""
    logits = torch.full((len(model_tokens), max([*model_tokens, *drafts, 0]) + 2), -1.0)
    logits[torch.arange(len(model_tokens)), torch.tensor(model_tokens)] = 1.0
    tokens, why = verify(Sampler(), logits, drafts, "request", SamplingParams(temperature=0))
    assert why is None
    return tokens


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    """``fn(*args)`` as a list of ints, or the error it raised."""
    return _safe(lambda: fn(*args))


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return [int(t) for t in fn()]
    except Exception as exc:  # a learner's error is an answer too
        return f"{type(exc).__name__}: {exc}"


# ---- propose ---------------------------------------------------------------------------------------------------
PROPOSE_CASES: list[tuple[str, list[int], int, int, int]] = [
    ("the docstring's example: [1, 2, 3, 4, 2, 3], n 2..3, k 4", [1, 2, 3, 4, 2, 3], 4, 2, 3),
    (
        "the longest n wins: [5, 1, 2, 9, 7, 1, 2, 3, 8, 1, 2, 3], n 1..3, k 2",
        [5, 1, 2, 9, 7, 1, 2, 3, 8, 1, 2, 3], 2, 1, 3,
    ),
    ("the earliest occurrence wins: [1, 2, 7, 1, 2, 8, 1, 2], n 2..2, k 1", [1, 2, 7, 1, 2, 8, 1, 2], 1, 2, 2),
    ("no suffix of length >= min_n repeats: [1, 2, 3, 1, 4], n 2..3", [1, 2, 3, 1, 4], 3, 2, 3),
    ("too short to hold an earlier n-gram: [7, 7], n 2..2", [7, 7], 3, 2, 2),
    ("an occurrence overlapping the suffix: [4, 4, 4, 4], n 2..3, k 3", [4, 4, 4, 4], 3, 2, 3),
    ("fewer than k tokens follow: [1, 2, 3, 1, 2], n 2..2, k 5", [1, 2, 3, 1, 2], 5, 2, 2),
    ("n capped by max_n: [1, 2, 3, 4, 9, 1, 2, 3, 4], n 1..2, k 1", [1, 2, 3, 4, 9, 1, 2, 3, 4], 1, 1, 2),
]  # fmt: skip


def check_propose(propose: Propose) -> list[CheckOutcome]:
    """Prompt lookup, case by case; each expected list is the package's ``NgramProposer.propose``."""
    hint = (
        "the case's label names its trap: which n wins, which occurrence, where an occurrence may end, how many "
        "tokens follow it; replay the spec's rule and its example by hand on that case"
    )
    checks = [
        Check(
            f"propose: {label}",
            lambda t=t, k=k, lo=lo, hi=hi: _safe(lambda: propose(list(t), k, lo, hi)),
            package_propose(t, k, lo, hi),
            hint=hint,
        )
        for label, t, k, lo, hi in PROPOSE_CASES
    ]
    return report("propose", checks)


def _draft_twin(propose: Propose, seed: int) -> str:
    rng = random.Random(seed)
    for case in range(400):
        vocab = rng.choice((2, 3, 5, 9))
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        args = (list(tokens), k, lo, hi)
        got, want = _call(propose, args), package_propose(tokens, k, lo, hi)
        if got != want:
            return f"case {case}: propose({tokens}, k={k}, min_n={lo}, max_n={hi}) gave {got}, the package's {want}"
    return "same"


def check_draft_twin(propose: Propose) -> list[CheckOutcome]:
    """400 random contexts per seed, beside the package's drafter."""
    return report(
        "draft_twin",
        [
            Check(
                f"seed {seed}: 400 random contexts (vocabularies of 2 to 9 tokens), yours and the package's",
                lambda seed=seed: _draft_twin(propose, seed),
                "same",
                hint="the first case that differs is named: work it by hand with the rule",
            )
            for seed in (1, 2, 3)
        ],
    )


# ---- accept ----------------------------------------------------------------------------------------------------
ACCEPT_CASES: list[tuple[str, list[int], list[int]]] = [
    ("every draft right: drafts [5, 6, 7], the model [5, 6, 7, 8]", [5, 6, 7], [5, 6, 7, 8]),
    ("the second draft wrong: drafts [5, 6, 7], the model [5, 9, 7, 8]", [5, 6, 7], [5, 9, 7, 8]),
    ("the first draft wrong: drafts [5, 6], the model [4, 6, 1]", [5, 6], [4, 6, 1]),
    ("no drafts: the model [3]", [], [3]),
    ("a draft right again after a wrong one: drafts [1, 2, 3], the model [1, 4, 3, 5]", [1, 2, 3], [1, 4, 3, 5]),
]


def check_accept(accept: Accept) -> list[CheckOutcome]:
    """The greedy acceptance rule, case by case; each expected list is the package's ``verify``."""
    hint = (
        "every emitted token is the model's, right draft or wrong; the first wrong draft's row is the last one "
        "emitted, and the bonus token comes only when every draft was right (the spec's two examples)"
    )
    return report(
        "accept",
        [
            Check(
                f"accept: {label}",
                lambda d=d, m=m: _safe(lambda: accept(list(d), list(m))),
                package_accept(d, m),
                hint=hint,
            )
            for label, d, m in ACCEPT_CASES
        ],
    )


def _accept_twin(accept: Accept, seed: int) -> str:
    rng = random.Random(seed)
    for case in range(300):
        drafts = [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        model = [d if rng.random() < 0.7 else rng.randrange(4) for d in drafts] + [rng.randrange(4)]
        got, want = _call(accept, (list(drafts), list(model))), package_accept(drafts, model)
        if got != want:
            return f"case {case}: accept({drafts}, {model}) gave {got}, the package's {want}"
    return "same"


def check_accept_twin(accept: Accept) -> list[CheckOutcome]:
    return report(
        "accept_twin",
        [
            Check(
                "300 random verification steps (drafts right 70 % of the time), yours and the package's",
                lambda: _accept_twin(accept, 7),
                "same",
                hint="the first case that differs is named",
            )
        ],
    )


# ---- speculate_smollm2 -------------------------------------------------------------------------------------------
TEXT = (
    "Repeat the list exactly.\nList: red apple, green pear, yellow banana, purple plum, orange peach.\n"
    "Repeat: red apple, green pear,"
)
SPEC_K, SPEC_MIN, SPEC_MAX, SPEC_TOKENS = 4, 2, 4, 24
_HF: dict[str, Any] = {}


def _smollm2() -> tuple[Any, list[int], list[int]]:
    if "model" not in _HF:
        from ...model_loader import hf_greedy_token_ids, load_hf_model, load_tokenizer

        model = load_hf_model()
        ids = load_tokenizer()(TEXT)["input_ids"]
        _HF.update(model=model, ids=ids, greedy=hf_greedy_token_ids(model, [ids], SPEC_TOKENS)[0])
    return _HF["model"], _HF["ids"], _HF["greedy"]


def speculative_generate(model: Any, prompt: list[int], propose: Propose, accept: Accept) -> tuple[list[int], int]:
    """Greedy generation with drafts: one forward pass over the context and the drafts per step; the tokens it
    emitted (``SPEC_TOKENS`` of them) and the number of forward passes."""
    out: list[int] = []
    passes = 0
    while len(out) < SPEC_TOKENS:
        context = prompt + out
        drafts = [int(t) for t in propose(list(context), SPEC_K, SPEC_MIN, SPEC_MAX)][: SPEC_TOKENS - len(out) - 1]
        with torch.no_grad():
            logits = model(torch.tensor([context + drafts])).logits[0]
        passes += 1
        model_tokens = logits[len(context) - 1 :].argmax(-1).tolist()  # the model's token after each row
        emitted = [int(t) for t in accept(list(drafts), model_tokens)]
        if not emitted:
            raise ValueError("accept emitted no token: a verification step always emits at least one")
        out += emitted
    return out[:SPEC_TOKENS], passes


def check_speculate_smollm2(propose: Propose, accept: Accept) -> list[CheckOutcome]:
    """SmolLM2 repeating a list: your drafter and your rule in a greedy loop, against plain greedy decoding."""
    cache: dict[str, Any] = {}

    def run() -> Any:
        if "r" not in cache:
            model, ids, greedy = _smollm2()
            try:
                cache["r"] = (*speculative_generate(model, ids, propose, accept), greedy)
            except Exception as exc:
                cache["r"] = f"{type(exc).__name__}: {exc}"
        return cache["r"]

    def tokens() -> str:
        r = run()
        if isinstance(r, str):
            return r
        got, _passes, greedy = r
        return "greedy's tokens" if got == greedy else f"{got} where greedy decoding gives {greedy}"

    def fewer() -> Any:
        r = run()
        return r if isinstance(r, str) else r[1] < SPEC_TOKENS

    return report(
        "speculate_smollm2",
        [
            Check(f"SmolLM2 repeats a list: {SPEC_TOKENS} greedy tokens drafted by your propose (k {SPEC_K}, "
                  f"n {SPEC_MIN}..{SPEC_MAX}) and kept by your accept", tokens, "greedy's tokens",
                  hint="every emitted token must be the model's own choice after the tokens before it"),
            Check(f"... in fewer forward passes than {SPEC_TOKENS} tokens (the drafts paid)", fewer, True,
                  hint="a drafter that never finds the repeated list, or a rule that drops right drafts, saves "
                  "nothing"),
        ],
    )  # fmt: skip
